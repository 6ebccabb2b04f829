"""The statements that keep the history of finished messages and count the
outcomes per minute (models.FinishedMessage, models.OutcomeCount).

Whatever finishes a message records it in the same statement or the same
transaction, so the history never says "done" for a message that was
rolled back, nor misses one that was acknowledged:

- an acknowledgement is the ack's own DELETE wrapped in data-modifying CTEs
  (``ack_statement``): one statement, one round trip, the rows copied from
  what the DELETE returns, not read again;
- a dead letter and a cancellation insert from the message row, in their
  transaction (``record``);
- a retry only counts (``count_retry``).

With ``PGQUEUE["KEEP_FINISHED"]`` 0 none of this runs: ``ack_statement``
returns ``acks.ack_statement``'s text unchanged.

The counts are an upsert per (minute, queue, outcome) and connection
(``shard``, the server process: no two connections share a row, so no
commit waits for another's, see models.OutcomeCount); the maintenance round
folds past minutes into one row each (``fold_counts``). The overview reads
at most a day of these rows instead of aggregating the history.
"""

from __future__ import annotations

import datetime
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from django.db import connections
from django.db.backends.base.base import BaseDatabaseWrapper

from django_pgqueue import conf
from django_pgqueue.models import FinishedMessage, Message, Outcome, OutcomeCount
from django_pgqueue.sql import acks as acks_sql
from django_pgqueue.sql import table

# The history's columns, in the order every INSERT below gives them.
_HISTORY_COLUMNS = (
    "message_id, queue, topic, payload, headers, outcome, attempts, dedup_key, "
    "dead_letter_id, enqueued_at, started_at, finished_at, worker"
)

# Add each queue's count of ``{rows}`` (a CTE's name) to its row of the
# minute: one row per (minute, queue, outcome) in the table, whatever the
# number of batches.
_COUNT_SQL = """
INSERT INTO {counts} (minute, queue, outcome, shard, count)
SELECT date_trunc('minute', {finished}), queue, '{outcome}', pg_backend_pid(), count(*)
FROM {rows} GROUP BY queue ORDER BY queue
ON CONFLICT (minute, queue, outcome, shard) DO UPDATE SET count = {counts}.count + excluded.count
"""

# The acknowledgement (acks.ACK_SQL or ACK_UNLOCKED_SQL, its DELETE as
# {delete}) with the history: the deleted rows go on into the history and
# the counts, and the statement still returns the ids deleted. Started =
# when the run was claimed (the claim's updated_at, which nothing changes
# while the message is processing); finished = this statement's time
# (statement_timestamp(): in an atomic batch's transaction, now() would be
# the transaction's start, before the handlers ran).
ACK_HISTORY_SQL = """
WITH acked AS (
    {delete}
    RETURNING id, queue, topic, payload, headers, attempts, dedup_key, created_at, updated_at,
        locked_by
), kept AS (
    INSERT INTO {history} ({columns})
    SELECT id, queue, topic, payload, headers, 'done', attempts, dedup_key, NULL, created_at,
        updated_at, statement_timestamp(), locked_by
    FROM acked
), counted AS ({count})
SELECT id FROM acked
"""

# A message that ends another way (dead-lettered, cancelled): copied from
# its row, in the transaction that ends it, before its row goes (a dead
# letter) or after it changed (a cancellation). Parameters: the finish time
# (None: the statement's), the dead letter's id, the started time (None:
# the claim's, if the row is still processing), the worker ('' : the
# row's), the ids.
RECORD_SQL = """
WITH clock AS (SELECT COALESCE(%s::timestamptz, statement_timestamp()) AS now),
finished AS (
    SELECT m.id, m.queue, m.topic, m.payload, m.headers, m.attempts, m.dedup_key, m.created_at,
        %s::bigint AS dead_letter_id,
        COALESCE(%s::timestamptz,
            CASE WHEN m.status = 'processing' THEN m.updated_at END) AS started_at,
        COALESCE(NULLIF(%s, ''), m.locked_by) AS worker
    FROM {message} AS m WHERE m.id = ANY(%s::bigint[])
), kept AS (
    INSERT INTO {history} ({columns})
    SELECT id, queue, topic, payload, headers, '{outcome}', attempts, dedup_key, dead_letter_id,
        created_at, started_at, (SELECT now FROM clock), worker
    FROM finished
)
{count}
"""

# A failed run that goes back to wait: counted, not kept.
RETRY_COUNT_SQL = """
INSERT INTO {counts} (minute, queue, outcome, shard, count)
VALUES (date_trunc('minute', COALESCE(%s::timestamptz, statement_timestamp())), %s, 'retried',
    pg_backend_pid(), 1)
ON CONFLICT (minute, queue, outcome, shard) DO UPDATE SET count = {counts}.count + 1
"""


def keeping() -> bool:
    """Whether finished messages are kept (KEEP_FINISHED > 0)."""
    return bool(conf.get("KEEP_FINISHED"))


def ack_statement(
    connection: BaseDatabaseWrapper,
    ids: Mapping[uuid.UUID | None, Sequence[int]],
    skip_locked: bool = False,
) -> tuple[str, list[Any]]:
    """acks.ack_statement's acknowledgement (same parameters, same result:
    the ids deleted), which also keeps the deleted messages in the history
    and counts them, when KEEP_FINISHED is not 0; else its text unchanged."""
    statement, params = acks_sql.ack_statement(connection, ids, skip_locked)
    if not keeping():
        return statement, params
    delete, _ = statement.rsplit("RETURNING id", 1)
    counts = table(connection, OutcomeCount)
    count = _COUNT_SQL.format(
        counts=counts, finished="statement_timestamp()", outcome="done", rows="acked"
    )
    wrapped = ACK_HISTORY_SQL.format(
        delete=delete.strip(),
        history=table(connection, FinishedMessage),
        columns=_HISTORY_COLUMNS,
        count=count.strip(),
    )
    return wrapped, params


def record(
    ids: Sequence[int],
    outcome: str,
    *,
    now: datetime.datetime | None = None,
    dead_letter_id: int | None = None,
    started_at: datetime.datetime | None = None,
    worker: str = "",
    using: str | None = None,
) -> None:
    """Keep the messages ``ids`` (their rows still in the queue table) in
    the history as ``outcome`` and count them, in the caller's transaction;
    nothing when KEEP_FINISHED is 0."""
    if not ids or not keeping():
        return
    outcome = Outcome(outcome).value  # written into the text: one of the known values only
    connection = connections[using or conf.database_alias()]
    counts = table(connection, OutcomeCount)
    statement = RECORD_SQL.format(
        message=table(connection, Message),
        history=table(connection, FinishedMessage),
        columns=_HISTORY_COLUMNS,
        outcome=outcome,
        count=_COUNT_SQL.format(
            counts=counts, finished="(SELECT now FROM clock)", outcome=outcome, rows="finished"
        ),
    )
    id_array = "{" + ",".join(str(int(pk)) for pk in ids) + "}"
    with connection.cursor() as cursor:
        cursor.execute(statement, [now, dead_letter_id, started_at, worker, id_array])


def count_retry(queue: str, now: datetime.datetime | None = None, using: str | None = None) -> None:
    """Count one retried run of ``queue``, in the caller's transaction;
    nothing when KEEP_FINISHED is 0."""
    if not keeping():
        return
    connection = connections[using or conf.database_alias()]
    statement = RETRY_COUNT_SQL.format(counts=table(connection, OutcomeCount))
    with connection.cursor() as cursor:
        cursor.execute(statement, [now, queue])


# Fold the rows of each connection (shard) of past minutes into shard 0, one
# row per (minute, queue, outcome): the overview then reads one row per
# minute whatever the number of connections. A minute's rows are folded
# once it is more than a minute old (a statement of that minute may still
# be committing); a late one that comes after is folded by a later round.
FOLD_COUNTS_SQL = """
WITH folded AS (
    DELETE FROM {counts}
    WHERE shard <> 0
        AND minute < date_trunc('minute', COALESCE(%s::timestamptz, now())) - interval '1 minute'
    RETURNING minute, queue, outcome, count
)
INSERT INTO {counts} (minute, queue, outcome, shard, count)
SELECT minute, queue, outcome, 0, sum(count) FROM folded
GROUP BY minute, queue, outcome ORDER BY minute, queue, outcome
ON CONFLICT (minute, queue, outcome, shard) DO UPDATE SET count = {counts}.count + excluded.count
"""


def fold_counts(now: datetime.datetime | None = None, using: str | None = None) -> int:
    """Fold the per-connection counts of past minutes (FOLD_COUNTS_SQL), in
    the caller's transaction (the maintenance round's: one at a time).
    Returns the number of folded rows written."""
    connection = connections[using or conf.database_alias()]
    statement = FOLD_COUNTS_SQL.format(counts=table(connection, OutcomeCount))
    with connection.cursor() as cursor:
        cursor.execute(statement, [now])
        return cursor.rowcount


# The history's BRIN indexes summarize a range of pages when VACUUM (or
# autovacuum) passes; until then a query reads the whole unsummarized tail.
# The maintenance's prune summarizes the new ranges itself, so lookups stay
# cheap where autovacuum is off or slow to come.
SUMMARIZE_SQL = "SELECT brin_summarize_new_values(%s::regclass)"
BRIN_INDEXES = ("pgqueue_hist_finished_brin", "pgqueue_hist_message_brin")


def summarize_history_indexes(using: str | None = None) -> int:
    """Summarize the new page ranges of the history's BRIN indexes; returns
    how many ranges were summarized."""
    connection = connections[using or conf.database_alias()]
    total = 0
    with connection.cursor() as cursor:
        for name in BRIN_INDEXES:
            cursor.execute(SUMMARIZE_SQL, [name])
            total += cursor.fetchone()[0]
    return total
