"""The worker's own VACUUM of the queue table, when its dead rows pile up.

Every handled message leaves two dead row versions in the queue table (the
claim's update, the acknowledgement's delete). Autovacuum visits a database
at most once per ``autovacuum_naptime`` (a minute by default) whatever the
table's thresholds (migration 0005), and a busy worker leaves hundreds of
thousands of dead rows in a minute: the table and its indexes grow to hold
them, and claims slow down (benchmarks/soak.py: 228 MiB for 20,000 live
rows, the worker from 9,364 to 3,333 jobs/s). So the maintenance round,
after its transaction, and a busy worker's heartbeat every CHECK_SECONDS
between rounds, read
the table's dead and live rows from ``pg_stat_user_tables`` (one cheap
query) and vacuum it when more than ``max(VACUUM_DEAD_ROWS, live rows)``
are dead.

``VACUUM (SKIP_LOCKED)``: when autovacuum or another worker is vacuuming the
table, this one skips it instead of waiting. VACUUM cannot run inside a
transaction block, so it runs on the connection in autocommit, outside any
``atomic``; called inside one (a test's, a caller's) it does nothing.
A role that may not vacuum the table (PostgreSQL 15 and 16: neither its owner
nor the database's; 17: without the MAINTAIN privilege) never tries: it logs
that once per process and leaves the table to autovacuum.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from django.db import DatabaseError, connections

from django_pgqueue import conf
from django_pgqueue.models import Message

logger = logging.getLogger(__name__)

# How often a busy worker's heartbeat thread reads the table's dead rows
# (one statistics query): at 25,000 messages a second a worker leaves 50,000
# dead row versions a second, and PostgreSQL's statistics lag by about a
# second, so a slower check lets several times VACUUM_DEAD_ROWS pile up.
CHECK_SECONDS = 1.0

# The dead rows this process's last VACUUM left behind (it could not remove
# them: a long transaction's snapshot still sees them). They do not count
# towards the next one, which would remove none of them either; once the
# count falls below it, something else removed them and it is forgotten.
_left_dead_rows = 0

# The table's statistics and whether this role may vacuum it. ``{maintain}``: the
# MAINTAIN privilege's test on PostgreSQL 17 and later, else FALSE.
_STATS_SQL = """
SELECT s.n_dead_tup, s.n_live_tup, s.vacuum_count + s.autovacuum_count,
       pg_has_role(c.relowner, 'USAGE')
       OR pg_has_role((SELECT datdba FROM pg_database
                       WHERE datname = current_database()), 'USAGE')
       OR {maintain}
  FROM pg_stat_user_tables s JOIN pg_class c ON c.oid = s.relid
 WHERE s.relid = %s::regclass
"""
_MAINTAIN = "has_table_privilege(c.oid, 'MAINTAIN')"

_warned_permission = False  # the "may not vacuum" line was logged by this process


@dataclass(frozen=True)
class VacuumResult:
    dead_rows: int  # the table's dead rows before (pg_stat_user_tables)
    dead_rows_after: int  # those it could not remove, and any counted since
    seconds: float
    skipped: bool = False  # another vacuum held the table (SKIP_LOCKED): nothing done


def vacuum_if_due(using: str | None = None) -> VacuumResult | None:
    """Vacuum the queue table if more than ``max(VACUUM_DEAD_ROWS, its live
    rows)`` of its rows are dead, not counting those that this process's last
    vacuum could not remove. None when it did not try. (Any vacuum, an
    autovacuum's too, resets the server's count of dead rows: right after
    one, the count is low and none follows.)"""
    global _left_dead_rows
    threshold = conf.get("VACUUM_DEAD_ROWS")
    if threshold is None:
        return None
    using = using or conf.database_alias()
    connection = connections[using]
    if connection.in_atomic_block:
        return None  # VACUUM cannot run inside a transaction block
    table = Message._meta.db_table
    stats = _stats(using, table)
    if stats is None:
        return None
    dead, live, vacuums, allowed = stats
    if dead < _left_dead_rows:
        _left_dead_rows = 0
    if dead - _left_dead_rows <= max(threshold, live):
        return None
    if not allowed:
        _warn_permission(table)
        return None
    began = time.monotonic()
    try:
        with connection.cursor() as cursor:
            cursor.execute(f"VACUUM (SKIP_LOCKED) {connection.ops.quote_name(table)}")
    except DatabaseError as exc:
        # A statement_timeout of the role or server, a cancellation: the
        # next round tries again; autovacuum remains.
        logger.warning("Maintenance: VACUUM of %s failed (%s)", table, exc)
        return None
    seconds = time.monotonic() - began
    after = _stats(using, table)
    dead_after = after[0] if after is not None else dead
    skipped = after is not None and after[2] == vacuums
    result = VacuumResult(dead, dead_after, seconds, skipped)
    if skipped:
        logger.info("Maintenance: VACUUM of %s skipped: another vacuum holds it", table)
    else:
        _left_dead_rows = dead_after
        logger.info(
            "Maintenance: vacuumed %s (%s dead rows, %s left) in %.2f s",
            table,
            dead,
            dead_after,
            seconds,
            extra={"vacuum_dead_rows": dead, "vacuum_seconds": seconds},
        )
    return result


def _stats(using: str, table: str) -> tuple[int, int, int, bool] | None:
    """(dead rows, live rows, vacuums so far, this role may vacuum it), as
    the server's statistics last saw them (each backend sends its counts
    about once a second); None when the table has none yet."""
    connection = connections[using]
    with connection.cursor() as cursor:
        pg_version: int = getattr(connection, "pg_version", 0)  # the PostgreSQL backend's
        maintain = _MAINTAIN if pg_version >= 170000 else "FALSE"
        cursor.execute(_STATS_SQL.format(maintain=maintain), [table])
        row = cursor.fetchone()
    if row is None:
        return None
    dead, live, vacuums, allowed = row
    return int(dead), int(live), int(vacuums), bool(allowed)


def _warn_permission(table: str) -> None:
    global _warned_permission
    if _warned_permission:
        return
    _warned_permission = True
    logger.warning(
        "Maintenance: the database role may not vacuum %s (it owns neither the table nor "
        "the database), so its dead rows wait for autovacuum (autovacuum_naptime); run the "
        "workers as the tables' owner, or set PGQUEUE['VACUUM_DEAD_ROWS'] = None",
        table,
    )
