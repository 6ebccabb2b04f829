"""The claim of a fixed backlog, timed in this process: the same probe at the
start of the soak (a new table) and at its end (after the churn)."""

from __future__ import annotations

import statistics
import time
from typing import Any

from harness import db, internals
from harness.numbers import percentile
from harness.worker import TOPIC_NONATOMIC

from scenarios.scale.claims import backend_pid, cpu_ns
from scenarios.scale.fill import insert_messages
from scenarios.scale.plans import buffers, execution_ms, explain, indexes
from scenarios.soak import QUEUE

WORKER_ID = "bench-soak-probe"
LEASE_SECONDS = 60


def claim_probe(calls: int, batch: int) -> dict[str, Any]:
    """``calls`` claims of ``batch`` from a backlog of calls x batch ready
    messages, inserted first and ANALYZEd (not vacuumed: what autovacuum
    left of the table is what is measured); each claimed batch is deleted
    untimed. Returns the wall-clock times, the backend's CPU time per claim
    and the plan (EXPLAIN ANALYZE, BUFFERS) of the first claim."""
    backlog = calls * batch
    if db.scalar(f"SELECT count(*) FROM {db.MESSAGE_TABLE}"):
        raise db.CheckFailed("claim probe: the queue table is not empty")
    insert_messages(1, backlog, TOPIC_NONATOMIC)
    db.execute(f"ANALYZE {db.MESSAGE_TABLE}")
    statements, would = internals.claim_statements(QUEUE, batch, WORKER_ID, LEASE_SECONDS)
    if would != batch:
        raise db.CheckFailed(f"claim probe: the claim would take {would}, expected {batch}")
    summaries = explain(statements)
    times, cpu = [], []
    pid = backend_pid()
    for _ in range(calls):
        cpu_before = cpu_ns(pid)
        started = time.perf_counter()
        messages = internals.claim([QUEUE], batch, WORKER_ID, LEASE_SECONDS)
        times.append(1000.0 * (time.perf_counter() - started))
        cpu.append((cpu_ns(pid) - cpu_before) / 1e6)
        if len(messages) != batch:
            raise db.CheckFailed(f"claim probe: a claim returned {len(messages)}, expected {batch}")
        db.execute(f"DELETE FROM {db.MESSAGE_TABLE} WHERE id = ANY(%s)", [[m.pk for m in messages]])
    return {
        "calls": calls,
        "batch": batch,
        "backlog": backlog,
        "p50_ms": percentile(times, 50),
        "p99_ms": percentile(times, 99),
        "mean_ms": statistics.fmean(times),
        "server_cpu_p50_ms": percentile(cpu, 50),
        "server_cpu_mean_ms": statistics.fmean(cpu),
        "plan_buffers": buffers(summaries),
        "plan_execution_ms": execution_ms(summaries),
        "plan_indexes": indexes(summaries),
        "plan_text": [s["text"] for s in summaries],
        "times_ms": [round(t, 4) for t in times],
    }
