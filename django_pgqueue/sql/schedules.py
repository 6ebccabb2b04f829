"""A scheduler round's statements: the limit on its idle transaction, its
clock and cursors, and the tick ledger that records each tick once."""

from __future__ import annotations

from django.db.backends.base.base import BaseDatabaseWrapper

from django_pgqueue.models import ScheduleTick
from django_pgqueue.sql import table

# A scheduler round holds its schedules' row locks until it commits, and the
# other schedulers skip what is locked. Should the round's client vanish
# while its connection stays open (a host cut off from the network, a
# process stopped), the server ends the transaction, and frees the locks,
# after it sat idle this long; a live round is idle for milliseconds.
SCHEDULE_IDLE_LIMIT_SQL = "SELECT set_config('idle_in_transaction_session_timeout', %s, true)"
SCHEDULE_IDLE_LIMIT = "30s"

# A scheduler round's clock and cursors, after it locked the schedules'
# state rows: the database's time (every host agrees on it, so no host's
# clock skew can double or skip a tick) and each schedule's latest tick in
# the ledger. A statement of its own after the lock: under READ COMMITTED it
# sees the ticks another scheduler committed just before the lock was
# granted. One row even for no names (the clock); the newest tick is read
# from the head of the (schedule, tick) unique index, which the ORM's
# GROUP BY max() would not do.
SCHEDULE_CURSORS_SQL = """
SELECT clock.now, s.name, (SELECT t.tick FROM {ticks} AS t WHERE t.schedule = s.name
    ORDER BY t.tick DESC LIMIT 1)
FROM (SELECT statement_timestamp()) AS clock(now)
LEFT JOIN unnest(%s::text[]) AS s(name) ON true
"""

# Record ticks of a schedule in the ledger, each once: the ticks that
# another scheduler recorded already are left out (ON CONFLICT DO NOTHING on
# the unique (schedule, tick)), and only the ticks this statement recorded
# come back, which the ORM's bulk_create(ignore_conflicts=True) cannot tell.
# The caller enqueues their messages in the same transaction.
SCHEDULE_TICKS_SQL = """
INSERT INTO {ticks} (schedule, tick)
SELECT %s, tick FROM unnest(%s::timestamptz[]) AS tick ORDER BY tick
ON CONFLICT (schedule, tick) DO NOTHING
RETURNING id, tick
"""


def schedule_statement(connection: BaseDatabaseWrapper, sql: str) -> str:
    """A SCHEDULE_*_SQL statement for ``connection``."""
    return sql.format(ticks=table(connection, ScheduleTick))
