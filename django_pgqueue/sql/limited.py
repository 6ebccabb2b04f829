"""The claim of a queue with limits (``PGQUEUE["QUEUES"]``'s concurrency
and rate, or their run-time overrides): ``claim``'s UPDATE with the free
slots of the queue as its limit, under the queue's advisory lock, and the
queue's state after it.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from django.db import connections

from django_pgqueue.conf.limits import LONGEST_PERIOD
from django_pgqueue.models import Message, QueueStart
from django_pgqueue.sql import table
from django_pgqueue.sql.claim import ASYNC_COMMIT_COLUMN, CLAIM_SET, claim_columns

# A queue's limits (concurrency, rate) hold for every worker on every host
# together, so they are enforced where every claim meets: in the database.
# Only the queues that have limits take this path; every other claim is
# CLAIM_SQL as it is, and never reads QueueState or QueueStart.
#
# The claims of one limited queue are serialized by a transaction-scoped
# advisory lock (LIMITED_LOCK_SQL, its own key space), taken by a statement
# of its own before the claim: under READ COMMITTED the claim's statement
# then takes its snapshot after the lock, and sees what the previous
# holder's claim committed, so two workers never both take the last slot.
# (In one statement the snapshot would predate the wait for the lock.)
# Transaction-scoped: it works behind a transaction-pooling PgBouncer and
# ends with the claim's commit, never leaked.
LIMITED_LOCK_SQL = "SELECT pg_advisory_xact_lock(1885827432, hashtext(%s))"

# The limited claim: CLAIM_SQL's UPDATE, with the limit the free slots: the
# smaller of the size asked, the concurrency less the queue's processing
# rows (all workers'; a rescued lease stops counting), and the rate less
# the starts in its window (QueueStart). "lease_expires_at IS NOT NULL"
# (always true of a processing row, a constraint says so) lets the count
# read the lease index. With a rate, the claim records its starts (one row
# per claim, with their count) and deletes the queue's starts older than
# the longest window (LONGEST_PERIOD: a rate changed to a longer period
# still finds its window whole). Parameters: the clock, the queue (count),
# the concurrency (NULL: none), [the queue, the rate's seconds and count
# (window), ] the size asked, the lease (CLAIM_SQL's: token, seconds,
# worker), the queue (pick)[, the queue (starts), the queue and the longest
# period (prune)]. The clock is the statement's time, not the transaction's
# (now()): the transaction began before the wait for the lock, and a start
# recorded that much early would leave its window that much early.
LIMITED_CLAIM_SQL = (
    """
WITH clock AS (SELECT COALESCE(%s::timestamptz, statement_timestamp()) AS now{async_commit}),
running AS (
    SELECT count(*) AS n, %s::bigint AS most FROM {table}
    WHERE queue = %s AND status = 'processing' AND lease_expires_at IS NOT NULL),
window_ AS ({window}),
allowed AS (
    SELECT GREATEST(0, LEAST(%s::bigint, COALESCE(running.most - running.n, %s::bigint),
        window_.most - window_.n)) AS n
    FROM running, window_),
claimed AS (
    UPDATE {table} AS m """
    + CLAIM_SET
    + """
    FROM clock
    WHERE m.ctid = ANY(ARRAY(
        SELECT ctid FROM {table}
        WHERE queue = %s AND status = 'waiting' AND run_at <= (SELECT now FROM clock)
        ORDER BY priority DESC, run_at, id LIMIT (SELECT n FROM allowed) FOR UPDATE SKIP LOCKED))
    RETURNING {columns}){record}
SELECT * FROM claimed
"""
)
_NO_WINDOW = "SELECT 0 AS n, 2147483647::bigint AS most"
_WINDOW = """
    SELECT COALESCE(sum(s.count), 0) AS n, %s::bigint AS most FROM {starts} AS s
    WHERE s.queue = %s AND s.started_at > (SELECT now FROM clock) - make_interval(secs => %s)"""
_RECORD = """,
started AS (
    INSERT INTO {starts} (queue, started_at, count)
    SELECT %s, (SELECT now FROM clock), count(*) FROM claimed HAVING count(*) > 0),
pruned AS (
    DELETE FROM {starts}
    WHERE queue = %s AND started_at <= (SELECT now FROM clock) - make_interval(secs => %s))"""

# After a limited claim, in its transaction (it sees the claim's rows): how
# many of the queue's messages are processing, the starts in the rate's
# window, and the seconds until the oldest of them leaves it (when a slot
# of the rate frees). Parameters: the clock, the queue, the queue, the
# rate's seconds (0 without a rate).
LIMITED_STATE_SQL = """
WITH clock AS (SELECT COALESCE(%s::timestamptz, statement_timestamp()) AS now)
SELECT (SELECT count(*) FROM {table}
        WHERE queue = %s AND status = 'processing' AND lease_expires_at IS NOT NULL),
    w.n, GREATEST(0, EXTRACT(EPOCH FROM w.oldest + make_interval(secs => %s) - clock.now))
FROM clock, LATERAL (
    SELECT COALESCE(sum(count), 0) AS n, min(started_at) AS oldest FROM {starts}
    WHERE queue = %s AND started_at > clock.now - make_interval(secs => %s)) AS w
"""


def limited_claim_statements(
    using: str,
    queue: str,
    limit: int,
    worker_id: str,
    concurrency: int | None,
    rate: tuple[int, int] | None,
    now: datetime | None = None,
    lease_seconds: float = 60,
    *,
    async_commit: bool = False,
    token: uuid.UUID | None = None,
) -> tuple[list[str], list[Any]]:
    """The statements of a limited claim of ``queue`` (LIMITED_LOCK_SQL,
    LIMITED_CLAIM_SQL, LIMITED_STATE_SQL), to send in one round trip, and
    their parameters. ``rate``: (count, seconds), or None."""
    connection = connections[using]
    starts = table(connection, QueueStart)
    claim = LIMITED_CLAIM_SQL.format(
        async_commit=ASYNC_COMMIT_COLUMN if async_commit else "",
        table=table(connection, Message),
        window=_NO_WINDOW if rate is None else _WINDOW.format(starts=starts),
        record="" if rate is None else _RECORD.format(starts=starts),
        columns=claim_columns(connection),
    )
    params: list[Any] = [now, concurrency, queue]
    if rate is not None:
        params += [rate[0], queue, rate[1]]
    params += [limit, limit, token or uuid.uuid4(), lease_seconds, worker_id, queue]
    if rate is not None:
        params += [queue, queue, LONGEST_PERIOD]
    period = 0 if rate is None else rate[1]
    state = LIMITED_STATE_SQL.format(table=table(connection, Message), starts=starts)
    return (
        [LIMITED_LOCK_SQL, claim, state],
        [queue, *params, now, queue, period, queue, period],
    )
