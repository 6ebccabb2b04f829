"""The claim of a queue with limits (``PGQUEUE["QUEUES"]``'s concurrency
and rate, or their run-time overrides, and those of its partitions):
``claim``'s UPDATE with the free slots of the queue as its limit, and of
each partition as its share, under the queue's advisory lock, and the
queue's state after it.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from django.db import connections

from django_pgqueue.conf.limits import LONGEST_PERIOD
from django_pgqueue.models import Message, PartitionLimit, PartitionStart, QueueStart
from django_pgqueue.sql import table
from django_pgqueue.sql.claim import (
    ASYNC_COMMIT_COLUMN,
    CLAIM_CLOCK,
    CLAIM_SET,
    FAIR_ORDER,
    RANKED_SQL,
    RANKED_STRICT_SQL,
    STRICT_ORDER,
    claim_columns,
    pick_params,
    pick_sql,
)

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

# The limited claim: CLAIM_SQL's UPDATE of the pick (sql.claim.PICK_SQL),
# with the limit the free slots: the smaller of the size asked, the
# concurrency less the queue's processing rows (all workers'; a rescued
# lease stops counting), and the rate less the starts in its window
# (QueueStart). "lease_expires_at IS NOT NULL" (always true of a processing
# row, a constraint says so) lets the count read the lease index. With a
# rate, the claim records its starts (one row per claim, with their count)
# and deletes the queue's starts older than the longest window
# (LONGEST_PERIOD: a rate changed to a longer period still finds its window
# whole).
#
# With limits per partition ({slots}: PARTITION_SLOTS), the free slots of
# each partition that has any running, started or limits of its own
# (PartitionLimit: they replace the settings' for it), as above per
# partition ("" is the default partition); a partition with none free is
# left out of the pick's streams (so a full partition's rows do not fill
# the candidates), and of the candidates each partition gives no more than
# its free slots, in claim order (the others: the settings' limits). The
# starts of each partition are recorded per claim ({record_partitions}) and
# pruned as the queue's.
#
# Parameters: the clock (CLAIM_CLOCK's), the queue (running), [the
# partitions' (PARTITION_SLOTS_PARAMS),] [the rate's count, the queue and
# the rate's seconds (window),] the size asked, the concurrency (NULL:
# none), the size asked again, the pick's (the window each time), [the
# partitions' default free slots,] [the queue (starts), the queue and the
# longest period (prune),] [the queue, the queue and the longest period
# (the partitions' starts and their prune)]. The clock is the statement's
# time, not the transaction's (now()): the transaction began before the
# wait for the lock, and a start recorded that much early would leave its
# window that much early.
LIMITED_CLAIM_SQL = (
    """
WITH """
    + CLAIM_CLOCK
    + """,
running AS (
    SELECT COALESCE(partition_key, '') AS k, count(*) AS n FROM {table}
    WHERE queue = %s AND status = 'processing' AND lease_expires_at IS NOT NULL
    GROUP BY 1),{slots}
window_ AS ({window}),
allowed AS (
    SELECT GREATEST(0, LEAST(%s::bigint,
        COALESCE(%s::bigint - (SELECT COALESCE(sum(n), 0) FROM running), %s::bigint),
        window_.most - window_.n)) AS n
    FROM window_),{pick},
chosen AS MATERIALIZED ({chosen}){ranked},
claimed AS (
    UPDATE {table} AS m """
    + CLAIM_SET
    + """
    FROM clock
    WHERE m.ctid = ANY(ARRAY(SELECT ctid FROM chosen))
    RETURNING {columns}){record}{record_partitions}
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
_CHOSEN = "SELECT ctid FROM candidates ORDER BY {order} LIMIT (SELECT n FROM allowed)"

# The free slots of the partitions that have any running, started or limits
# of their own, from the starts in the longest of their rates' windows.
# Parameters: the queue (overrides), the queue and the partitions' rate's
# seconds (starts), the partitions' rate's seconds again (NULL: none), the
# partitions' concurrency (NULL: none), the default partition rate's count
# (NULL: none). A named partition's rate is "N/s|m|h" (PartitionLimit's
# check constraint).
PARTITION_SLOTS = """
named AS (
    SELECT partition_key AS k, concurrency,
        NULLIF(split_part(rate, '/', 1), '')::bigint AS rate_count,
        CASE split_part(rate, '/', 2) WHEN 's' THEN 1 WHEN 'm' THEN 60 WHEN 'h' THEN 3600 END
            AS rate_seconds
    FROM {limits} WHERE queue = %s),
recent AS (
    SELECT partition_key AS k, started_at, count FROM {partition_starts}
    WHERE queue = %s AND started_at > (SELECT now FROM clock) - make_interval(
        secs => GREATEST(%s::bigint, (SELECT max(rate_seconds) FROM named)))),
started_by_partition AS (
    SELECT r.k, sum(r.count) AS n FROM recent AS r LEFT JOIN named AS o ON o.k = r.k
    WHERE r.started_at > (SELECT now FROM clock) - make_interval(
        secs => CASE WHEN o.k IS NULL THEN %s::bigint ELSE o.rate_seconds END)
    GROUP BY r.k),
slots AS (
    SELECT keys.k, LEAST(
        COALESCE(CASE WHEN o.k IS NULL THEN %s::bigint ELSE o.concurrency END
            - COALESCE(r.n, 0), 2147483647),
        COALESCE(CASE WHEN o.k IS NULL THEN %s::bigint ELSE o.rate_count END
            - COALESCE(s.n, 0), 2147483647)) AS free
    FROM (SELECT k FROM running UNION SELECT k FROM named UNION SELECT k FROM recent) AS keys
    LEFT JOIN named AS o ON o.k = keys.k LEFT JOIN running AS r ON r.k = keys.k
    LEFT JOIN started_by_partition AS s ON s.k = keys.k),
full_ AS (
    SELECT COALESCE(array_agg(k), '{{}}')::varchar[] AS keys,
        COALESCE(bool_or(k = ''), false) AS default_full
    FROM slots WHERE free <= 0),"""
_PLAIN_FILTER = "\n        AND NOT (SELECT default_full FROM full_)"
_KEYED_FILTER = (
    "\n        AND COALESCE(partition_key, '') <> ALL((SELECT keys FROM full_)::varchar[])"
)
# Of the candidates, each partition's first ones, up to its free slots (a
# partition without a row in slots: the default free slots, parameter).
_CHOSEN_PARTITIONED = """
    SELECT c.ctid FROM (
        SELECT ctid, priority, run_at, id, tag, COALESCE(partition_key, '') AS k,
            row_number() OVER (PARTITION BY COALESCE(partition_key, '') ORDER BY {order}) AS rn
        FROM candidates) AS c
    LEFT JOIN slots AS s ON s.k = c.k
    WHERE c.rn <= COALESCE(s.free, %s::bigint)
    ORDER BY {order} LIMIT (SELECT n FROM allowed)"""
_RECORD_PARTITIONS = """,
partition_started AS (
    INSERT INTO {partition_starts} (queue, partition_key, started_at, count)
    SELECT %s, COALESCE(partition_key, ''), (SELECT now FROM clock), count(*)
    FROM claimed GROUP BY 2),
partition_pruned AS (
    DELETE FROM {partition_starts}
    WHERE queue = %s AND started_at <= (SELECT now FROM clock) - make_interval(secs => %s))"""
# The candidates' window of a claim that counts per partition: wider than
# the size asked, as partitions may give fewer than they have.
PARTITIONED_WINDOW_FACTOR = 4

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
    fair: bool = True,
    partitioned: bool = False,
    partition_concurrency: int | None = None,
    partition_rate: tuple[int, int] | None = None,
    partition_starts: bool = False,
) -> tuple[list[str], list[Any]]:
    """The statements of a limited claim of ``queue`` (LIMITED_LOCK_SQL,
    LIMITED_CLAIM_SQL, LIMITED_STATE_SQL), to send in one round trip, and
    their parameters. ``rate``: (count, seconds), or None. ``partitioned``:
    count per partition, each with ``partition_concurrency`` and
    ``partition_rate`` unless it has limits of its own (PartitionLimit);
    ``partition_starts``: record each partition's starts (a rate may apply:
    ``partition_rate``, or one of its own)."""
    connection = connections[using]
    starts = table(connection, QueueStart)
    starts_by_partition = table(connection, PartitionStart)
    order = FAIR_ORDER if fair else STRICT_ORDER
    window = limit * PARTITIONED_WINDOW_FACTOR if partitioned else limit
    message_table = table(connection, Message)
    claim = LIMITED_CLAIM_SQL.format(
        now="statement_timestamp()",
        async_commit=ASYNC_COMMIT_COLUMN if async_commit else "",
        table=message_table,
        slots=(
            PARTITION_SLOTS.format(
                limits=table(connection, PartitionLimit), partition_starts=starts_by_partition
            )
            if partitioned
            else ""
        ),
        window=_NO_WINDOW if rate is None else _WINDOW.format(starts=starts),
        pick=pick_sql(
            message_table,
            "(SELECT now FROM clock)",
            "%s",
            plain_filter=_PLAIN_FILTER if partitioned else "",
            keyed_filter=_KEYED_FILTER if partitioned else "",
            fair=fair,
        ),
        chosen=(_CHOSEN_PARTITIONED if partitioned else _CHOSEN).format(order=order),
        ranked=(RANKED_SQL if fair else RANKED_STRICT_SQL).format(table=message_table),
        record="" if rate is None else _RECORD.format(starts=starts),
        record_partitions=(
            _RECORD_PARTITIONS.format(partition_starts=starts_by_partition)
            if partitioned and partition_starts
            else ""
        ),
        columns=claim_columns(connection),
    )
    params: list[Any] = [now, token or uuid.uuid4(), lease_seconds, worker_id, queue]
    each_count, each_seconds = partition_rate if partition_rate is not None else (None, None)
    if partitioned:
        params += [queue, queue, each_seconds, each_seconds, partition_concurrency, each_count]
    if rate is not None:
        params += [rate[0], queue, rate[1]]
    params += [limit, concurrency, limit, *pick_params(queue, window)]
    if partitioned:
        free = [n for n in (partition_concurrency, each_count) if n is not None]
        params.append(min(free, default=2147483647))
    if rate is not None:
        params += [queue, queue, LONGEST_PERIOD]
    if partitioned and partition_starts:
        params += [queue, queue, LONGEST_PERIOD]
    period = 0 if rate is None else rate[1]
    state = LIMITED_STATE_SQL.format(table=message_table, starts=starts)
    return (
        [LIMITED_LOCK_SQL, claim, state],
        [queue, *params, now, queue, period, queue, period],
    )
