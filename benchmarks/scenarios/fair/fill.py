"""The two queues, written with INSERT ... SELECT FROM generate_series
(every column not named is its db_default: ready now, priority 0), and
the delayed keyed messages of the variant.

The queue in partitions: message ``i`` (1, 2, ...) is in partition
``tenant-0`` when ``i`` is a multiple of BIG_EVERY (a tenth of the
queue), else the ``j``-th (0-based) of the others, ``j = i - i/10 - 1``,
in ``tenant-<1 + j mod (partitions - 1)>``: with a million messages in
10,000 partitions, tenant-0 has 100,000 and the 9,999 others 90 or 91
each, interleaved in id order as enqueued by many tenants at once.

Its rounds (fair_tag) are those enqueue() gives (sql/insert.py, _FAIR: a
keyed message due at once takes its partition's last waiting round + 1,
or the queue's current round, the lowest waiting one, if later; the
first round is 0). While the queue fills nothing is claimed, so the
current round stays 0 and every partition joins at round 0: a
partition's n-th message (from 0) has round n, which is ``i/10 - 1`` in
tenant-0 and ``j div (partitions - 1)`` in the others. ``check_rounds``
compares that with the rounds ``enqueue_many()`` gives the same layout.
"""

from __future__ import annotations

import sys
import time
from itertools import zip_longest
from typing import Any

from benchmarks.harness import db
from benchmarks.harness.worker import TOPIC_NONATOMIC
from benchmarks.scenarios.fair import BIG_EVERY, FAIR, PLAIN

CHUNK = 250_000
CHECK_QUEUES = ("fair-check-enqueue", "fair-check-sql")


def big_partition_size(messages: int) -> int:
    return messages // BIG_EVERY


def layout_sql(partitions: int) -> str:
    """The partition key and round of message ``i`` (columns ``key``,
    ``tag``), a LATERAL subquery of the generate_series row ``i``; its
    ``%`` doubled, for a statement with parameters."""
    others = int(partitions) - 1
    return f"""LATERAL (SELECT i - i / {BIG_EVERY} - 1 AS j) AS o,
        LATERAL (SELECT
            CASE WHEN i %% {BIG_EVERY} = 0 THEN 'tenant-0'
                 ELSE 'tenant-' || (1 + o.j %% {others}) END AS key,
            CASE WHEN i %% {BIG_EVERY} = 0 THEN i / {BIG_EVERY} - 1
                 ELSE o.j / {others} END AS tag) AS l"""


def insert_plain(queue: str, first: int, last: int) -> None:
    db.execute(
        f"INSERT INTO {db.MESSAGE_TABLE} (queue, topic, payload)"
        " SELECT %s, %s, jsonb_build_object('n', i) FROM generate_series(%s, %s) AS i",
        [queue, TOPIC_NONATOMIC, first, last],
    )


def insert_partitioned(queue: str, first: int, last: int, partitions: int) -> None:
    db.execute(
        f"INSERT INTO {db.MESSAGE_TABLE} (queue, topic, payload, partition_key, fair_tag)"
        " SELECT %s, %s, jsonb_build_object('n', i), l.key, l.tag"
        f" FROM generate_series(%s, %s) AS i, {layout_sql(partitions)}",
        [queue, TOPIC_NONATOMIC, first, last],
    )


def insert_delayed(queue: str, count: int, partitions: int) -> None:
    """``count`` keyed messages without a round, due in 1 minute to 1 hour,
    one partition each in turn: half of them delayed at enqueue (which
    gives a delayed message no round), half retried (a claim clears the
    round, the retry puts the message back to waiting later)."""
    db.execute(
        f"""
        INSERT INTO {db.MESSAGE_TABLE} (queue, topic, payload, partition_key, run_at,
            attempts, last_error, last_error_category, first_failed_at)
        SELECT %s, %s, jsonb_build_object('n', i), 'tenant-' || (i %% %s),
            now() + interval '1 minute' + (i %% 3540) * interval '1 second',
            i %% 2,
            CASE WHEN i %% 2 = 1 THEN 'ConnectionError: payment service unreachable'
                 ELSE '' END,
            CASE WHEN i %% 2 = 1 THEN 'transient' ELSE '' END,
            CASE WHEN i %% 2 = 1 THEN now() - interval '1 minute' END
        FROM generate_series(1, %s) AS i
        """,
        [queue, TOPIC_NONATOMIC, partitions, count],
    )


def delete_delayed(queue: str) -> None:
    """The messages of ``queue`` that are not due yet (insert_delayed's)."""
    db.execute(f"DELETE FROM {db.MESSAGE_TABLE} WHERE queue = %s AND run_at > now()", [queue])


def chunked(what: str, total: int, insert: Any) -> None:
    done = 0
    while done < total:
        upto = min(total, done + CHUNK)
        insert(done + 1, upto)
        done = upto
        print(f"  {what}: {done:,} / {total:,}", file=sys.stderr)


def vacuum_analyze() -> float:
    started = time.perf_counter()
    db.execute(f"VACUUM ANALYZE {db.MESSAGE_TABLE}")
    return time.perf_counter() - started


def fill(messages: int, partitions: int) -> dict[str, Any]:
    """Both queues, vacuumed and analysed; the seconds each step took and
    the partitions as written."""
    started = time.perf_counter()
    chunked(f"{PLAIN} (no key)", messages, lambda a, b: insert_plain(PLAIN, a, b))
    plain_s = time.perf_counter() - started
    t = time.perf_counter()
    chunked(
        f"{FAIR} ({partitions:,} partitions)",
        messages,
        lambda a, b: insert_partitioned(FAIR, a, b, partitions),
    )
    fair_s = time.perf_counter() - t
    vacuum_s = vacuum_analyze()
    return {
        "plain_s": plain_s,
        "fair_s": fair_s,
        "vacuum_analyze_s": vacuum_s,
        "partitions": partition_sizes(FAIR),
        "table_bytes": db.scalar("SELECT pg_total_relation_size(%s::regclass)", [db.MESSAGE_TABLE]),
    }


def partition_sizes(queue: str) -> dict[str, Any]:
    """The partitions of ``queue`` as written: how many, the biggest, the
    smallest and largest of the others, the highest round."""
    count, big, small, large, rounds = db.rows(
        f"""SELECT count(*), max(n) FILTER (WHERE k = 'tenant-0'),
            min(n) FILTER (WHERE k <> 'tenant-0'), max(n) FILTER (WHERE k <> 'tenant-0'),
            max(top)
        FROM (SELECT partition_key AS k, count(*) AS n, max(fair_tag) AS top
              FROM {db.MESSAGE_TABLE} WHERE queue = %s AND status = 'waiting'
              GROUP BY partition_key) AS p""",
        [queue],
    )[0]
    return {"partitions": count, "tenant-0": big, "others_min": small, "others_max": large,
            "last_round": rounds}  # fmt: skip


def check_rounds(messages: int, partitions: int, calls: int = 3) -> None:
    """The rounds written by the fill's SQL are those enqueue_many() gives:
    the same layout of ``messages`` in ``partitions`` enqueued in ``calls``
    calls (so that later calls continue the partitions' rounds), compared
    message by message in id order. Both sample queues are removed after."""
    from django_pgqueue import enqueue_many

    enqueued, written = CHECK_QUEUES
    rows = db.rows(
        f"SELECT l.key FROM generate_series(1, %s) AS i, {layout_sql(partitions)} ORDER BY i",
        [messages],
    )
    step = -(-messages // calls)
    for start in range(0, messages, step):
        batch = rows[start : start + step]
        enqueue_many(
            [{"payload": {"n": start + n + 1}, "partition_key": key} for n, (key,) in
             enumerate(batch)],
            topic=TOPIC_NONATOMIC, queue=enqueued,
        )  # fmt: skip
    insert_partitioned(written, 1, messages, partitions)
    got = {
        queue: db.rows(
            f"SELECT partition_key, fair_tag FROM {db.MESSAGE_TABLE} WHERE queue = %s ORDER BY id",
            [queue],
        )
        for queue in CHECK_QUEUES
    }
    db.execute(f"DELETE FROM {db.MESSAGE_TABLE} WHERE queue = ANY(%s)", [list(CHECK_QUEUES)])
    if got[enqueued] != got[written]:
        pairs = list(zip_longest(got[enqueued], got[written]))
        n = next(n for n, (a, b) in enumerate(pairs) if a != b)
        raise db.CheckFailed(
            f"the fill's rounds differ from enqueue_many()'s: message {n + 1} of {messages}"
            f" is (partition, round) {pairs[n][0]} by enqueue_many(), {pairs[n][1]} by the fill"
        )
    print(
        f"  the fill's rounds are enqueue_many()'s: {messages:,} messages in"
        f" {partitions} partitions, {calls} calls, compared one by one",
        file=sys.stderr,
    )
