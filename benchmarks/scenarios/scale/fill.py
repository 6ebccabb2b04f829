"""The loaded state: a million delayed messages and a million dead letters,
written with INSERT ... SELECT FROM generate_series (every other column is
its db_default)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

from benchmarks.harness import db
from benchmarks.scenarios.scale import QUEUE

TRACEBACK = (
    "Traceback (most recent call last):\\n"
    '  File "/srv/app/.venv/lib/python3.11/site-packages/django_pgqueue/worker.py",'
    " line 312, in _run\\n    result = spec.func(message)\\n"
    '  File "/srv/app/orders/handlers.py", line 42, in import_row\\n'
    "    row = parse_row(message.payload)\\n"
    '  File "/srv/app/orders/parsing.py", line 17, in parse_row\\n'
    '    raise ValueError(f"cannot process item {n}")\\n'
    "ValueError: cannot process item "
)


def fill_delayed(first: int, last: int, priorities: list[int]) -> None:
    """Messages first..last, due in one to two days: half in QUEUE, a quarter each
    in two other queues; ten topics; every fourth a retry (attempts, last error)
    and every fourth with a dedup key."""
    db.execute(
        f"""
        INSERT INTO {db.MESSAGE_TABLE} (queue, topic, payload, headers, priority, run_at,
            attempts, last_error, last_error_category, first_failed_at, dedup_key)
        SELECT (ARRAY[%s, %s, 'reports', 'emails'])[1 + i %% 4],
            'scale.delayed.' || (i %% 10),
            jsonb_build_object('n', i, 'customer_id', 100000 + i %% 50000,
                               'note', 'scheduled reminder ' || i),
            jsonb_build_object('correlation_id', md5(i::text)),
            (%s::int[])[1 + i %% cardinality(%s::int[])],
            now() + interval '1 day' + (i %% 86400) * interval '1 second',
            CASE WHEN i %% 4 = 0 THEN 2 ELSE 0 END,
            CASE WHEN i %% 4 = 0 THEN 'ConnectionError: payment service unreachable'
                 ELSE '' END,
            CASE WHEN i %% 4 = 0 THEN 'transient' ELSE '' END,
            CASE WHEN i %% 4 = 0 THEN now() - interval '5 minutes' END,
            CASE WHEN i %% 4 = 1 THEN 'reminder-' || i END
        FROM generate_series(%s, %s) AS i
        """,
        [QUEUE, QUEUE, priorities, priorities, first, last],
    )


def fill_dead_letters(first: int, last: int) -> None:
    """Dead letters first..last: three queues, twenty topics, the five categories,
    60% new / 10% revived / 30% resolved, dead-lettered over the last 30 days,
    each with a reason and a traceback of about 500 bytes."""
    db.execute(
        f"""
        INSERT INTO {db.DEADLETTER_TABLE} (message_id, queue, topic, payload, headers, priority,
            category, reason, traceback, attempts, max_attempts, first_failed_at,
            last_failed_at, dead_lettered_at, worker, state, revived_at, revive_count,
            revived_by, resolved_at, resolved_by, notes)
        SELECT 100000000 + i,
            (ARRAY[%s, 'reports', 'emails'])[1 + i %% 3],
            'scale.dead.' || (i %% 20),
            jsonb_build_object('n', i, 'order_id', 1000000 + i, 'sku', 'SKU-' || (i %% 9973)),
            jsonb_build_object('correlation_id', md5(i::text)),
            0,
            (ARRAY['transient', 'dependency', 'permanent', 'business', 'unknown'])[1 + i %% 5],
            'ValueError: cannot process item ' || i,
            E'{TRACEBACK}' || i,
            5, 5,
            t - interval '1 hour', t, t,
            'worker-' || (i %% 8) || ':4242:0f0f0f0f',
            CASE WHEN i %% 10 < 6 THEN 'new' WHEN i %% 10 = 6 THEN 'revived' ELSE 'resolved' END,
            CASE WHEN i %% 10 = 6 THEN t + interval '1 hour' END,
            CASE WHEN i %% 10 = 6 THEN 1 ELSE 0 END,
            CASE WHEN i %% 10 = 6 THEN 'admin' ELSE '' END,
            CASE WHEN i %% 10 >= 7 THEN t + interval '2 hours' END,
            CASE WHEN i %% 10 >= 7 THEN 'admin' ELSE '' END,
            CASE WHEN i %% 10 >= 7 THEN 'duplicate order, refunded by hand' ELSE '' END
        FROM generate_series(%s, %s) AS i,
            LATERAL (SELECT now() - (i %% 2592000) * interval '1 second' AS t) AS ts
        """,
        [QUEUE, first, last],
    )


def insert_messages(first: int, last: int, topic: str) -> None:
    """Ready messages first..last of ``topic`` in QUEUE."""
    db.execute(
        f"INSERT INTO {db.MESSAGE_TABLE} (queue, topic, payload)"
        " SELECT %s, %s, jsonb_build_object('n', i) FROM generate_series(%s, %s) AS i",
        [QUEUE, topic, first, last],
    )


def chunked(fill: Callable[[int, int], None], total: int, chunk: int, what: str) -> None:
    done = 0
    while done < total:
        upto = min(total, done + chunk)
        fill(done + 1, upto)
        done = upto
        print(f"  {what}: {done:,} / {total:,}", file=sys.stderr)


def table_sizes() -> dict[str, Any]:
    out = {}
    for table in (db.MESSAGE_TABLE, db.DEADLETTER_TABLE):
        total, heap, indexes = db.rows(
            "SELECT pg_total_relation_size(%s::regclass), pg_relation_size(%s::regclass),"
            " pg_indexes_size(%s::regclass)",
            [table, table, table],
        )[0]
        out[table] = {
            "rows": db.count(table),
            "total_bytes": total,
            "heap_bytes": heap,
            "indexes_bytes": indexes,
            "index_bytes": dict(
                db.rows(
                    "SELECT indexrelid::regclass::text, pg_relation_size(indexrelid)"
                    " FROM pg_index WHERE indrelid = %s::regclass ORDER BY 1",
                    [table],
                )
            ),
        }
    return out


def fill_loaded(
    delayed: int, dead: int, priorities: list[int], chunk: int = 250_000
) -> dict[str, Any]:
    started = time.perf_counter()
    chunked(lambda a, b: fill_delayed(a, b, priorities), delayed, chunk, "delayed messages")
    messages_s = time.perf_counter() - started
    t = time.perf_counter()
    chunked(fill_dead_letters, dead, chunk, "dead letters")
    dead_s = time.perf_counter() - t
    t = time.perf_counter()
    db.execute(f"VACUUM ANALYZE {db.MESSAGE_TABLE}")
    db.execute(f"VACUUM ANALYZE {db.DEADLETTER_TABLE}")
    vacuum_s = time.perf_counter() - t
    return {
        "delayed_messages": delayed,
        "dead_letters": dead,
        "delayed_priorities": priorities,
        "messages_s": messages_s,
        "dead_letters_s": dead_s,
        "vacuum_analyze_s": vacuum_s,
        "total_s": time.perf_counter() - started,
        "sizes": table_sizes(),
    }
