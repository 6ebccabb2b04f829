"""One queue's claims, timed: the worker's claim statement
(``sql.claim.claim_statement`` through harness.internals) on a
connection of the queue's own, as a worker's: autocommit, the claim
committed asynchronously, parameters bound by the server and the
statement prepared after psycopg's fifth run of it (the testproject's
``prepare_threshold``), so that each queue's prepared claim chooses its
own generic or custom plan. The claimed messages stay leased (they are
never acknowledged): each claim takes the next ones.

A claim's time is the wall clock around ``execute`` and ``fetchall`` in
this process (the round trip, the server's work, the rows' transfer and
decoding, which are the same for both queues); beside it, the CPU time
of the server's backend for the claim (/proc/<pid>/schedstat: the server
runs on this machine), less at the mercy of the machine's other work.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import psycopg

from benchmarks.harness import db, internals
from benchmarks.scenarios.fair import LEASE_SECONDS, PLAIN, WORKER_ID
from benchmarks.scenarios.scale.claims import cpu_ns

PREPARE_THRESHOLD = 5  # the testproject's (DATABASE_PREPARE_THRESHOLD)
CLAIM_TEXT = "%SET status = 'processing'%"  # the claim among pg_prepared_statements


@dataclass
class Side:
    """A queue and the connection its claims run on."""

    queue: str
    partitions: int  # 0: the queue without partitions
    conn: psycopg.Connection[Any]
    pid: int  # the connection's server backend
    claimed: int = 0


def open_side(url: str, queue: str, partitions: int) -> Side:
    conn = db.connect(url, prepare_threshold=PREPARE_THRESHOLD)
    return Side(queue, partitions, conn, conn.info.backend_pid)


@dataclass
class Timed:
    wall_ms: list[float]
    server_cpu_ms: list[float]


def claims(side: Side, limit: int, calls: int) -> Timed:
    """``calls`` claims of ``limit`` messages of ``side``'s queue, each
    checked (``check``); their times."""
    from django_pgqueue.sql.claim import split_plain_claim

    timed = Timed([], [])
    with side.conn.cursor() as cursor:
        for _ in range(calls):
            # The queue without partitions: the claim a worker sends for it
            # (the default partition's stream alone, PLAIN_CLAIM_SQL).
            plain = side.partitions == 0
            sql, params, columns = internals.claim_statement(
                side.queue, limit, WORKER_ID, LEASE_SECONDS, plain=plain
            )
            cpu_before = cpu_ns(side.pid)
            started = time.perf_counter()
            cursor.execute(sql, params)
            rows = cursor.fetchall()
            timed.wall_ms.append(1000.0 * (time.perf_counter() - started))
            if plain:
                rows, _ = split_plain_claim(rows)
            timed.server_cpu_ms.append((cpu_ns(side.pid) - cpu_before) / 1e6)
            check(side, limit, rows, columns)
            side.claimed += len(rows)
    return timed


def check(side: Side, limit: int, rows: list[Any], columns: dict[str, int]) -> None:
    """A claim leased ``limit`` messages of its queue; of the queue without
    partitions, none with a key; of the queue in partitions, no partition
    (the default one, without a key, counts as one) more than once per
    round: at most ceil(limit / partitions) + 1 (a claim may end one round
    and begin the next). In strict order the big partition would have a
    tenth of every claim."""
    queue, key = columns["queue"], columns["partition_key"]
    if len(rows) != limit or any(row[queue] != side.queue for row in rows):
        raise db.CheckFailed(
            f"{side.queue}: a claim of {limit} leased {len(rows)} message(s), of queues"
            f" {sorted({row[queue] for row in rows})}"
        )
    keys = Counter(row[key] for row in rows)
    if side.queue == PLAIN:
        if set(keys) != {None}:
            raise db.CheckFailed(f"{PLAIN}: a claim leased keyed messages: {keys}")
        return
    most = math.ceil(limit / side.partitions) + 1
    (partition, n), *_ = keys.most_common(1)
    if n > most:
        name = "the default partition" if partition is None else f"partition {partition!r}"
        raise db.CheckFailed(
            f"{side.queue}: a claim of {limit} leased {n} message(s) of {name}"
            f" (at most {most} in a fair claim)"
        )


def plan_counts(side: Side) -> tuple[int, int]:
    """(generic, custom): how often the side's prepared claim ran a cached
    generic plan and how often PostgreSQL planned it anew."""
    row = side.conn.execute(
        "SELECT coalesce(sum(generic_plans), 0), coalesce(sum(custom_plans), 0)"
        " FROM pg_prepared_statements WHERE statement LIKE %s",
        [CLAIM_TEXT],
    ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


def _nodes(node: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield node
    for child in node.get("Plans", ()):
        yield from _nodes(child)


def explain(conn: psycopg.Connection[Any], queue: str, limit: int, generic: bool) -> dict[str, Any]:
    """EXPLAIN (ANALYZE, BUFFERS) of one claim of ``limit`` of ``queue``, in
    a transaction rolled back, with the generic plan (what a prepared claim
    runs once PostgreSQL chose it) or a custom one. Its text, and per index
    scan the index, the rows it returned and the buffers it touched. On a
    connection other than the sides' (psycopg forgets a connection's
    prepared statements when it rolls back: the sides' must stay
    prepared); run twice, the first untimed, so that the planning time is
    not that of a connection's first statements (its caches cold)."""
    sql, params, _ = internals.claim_statement(queue, limit, WORKER_ID, LEASE_SECONDS)
    mode = "force_generic_plan" if generic else "force_custom_plan"
    out = {}
    for fmt in ("TEXT", "JSON", "TEXT"):
        with conn.transaction(force_rollback=True):
            conn.execute(f"SET LOCAL plan_cache_mode = {mode}")
            rows = conn.execute(f"EXPLAIN (ANALYZE, BUFFERS, FORMAT {fmt}) {sql}", params)
            out[fmt] = rows.fetchall()
    doc = out["JSON"][0][0]
    top = (json.loads(doc) if isinstance(doc, str) else doc)[0]
    scans = [
        {
            "index": n["Index Name"],
            "rows": n.get("Actual Rows"),
            "loops": n.get("Actual Loops"),
            "buffers": n.get("Shared Hit Blocks", 0) + n.get("Shared Read Blocks", 0),
        }
        for n in _nodes(top["Plan"])
        if "Index Name" in n
    ]
    return {
        "queue": queue,
        "limit": limit,
        "plan": "generic" if generic else "custom",
        "execution_ms": top.get("Execution Time"),
        "planning_ms": top.get("Planning Time"),
        "buffers": top["Plan"].get("Shared Hit Blocks", 0)
        + top["Plan"].get("Shared Read Blocks", 0),
        "seq_scans": sorted(
            {
                n.get("Relation Name", "?")
                for n in _nodes(top["Plan"])
                if n["Node Type"] == "Seq Scan"
            }
        ),
        "index_scans": scans,
        "text": "\n".join(row[0] for row in out["TEXT"]),
    }


def scan_summary(plan: dict[str, Any]) -> str:
    """``index rows/buffers`` of each index scan, short names."""
    return ", ".join(
        f"{re.sub(r'^pgqueue_msg_|_idx$', '', s['index'])} {s['rows']}r/{s['buffers']}b"
        for s in plan["index_scans"]
    )
