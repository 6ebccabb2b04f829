"""The claim of a fixed backlog, timed in this process: the same probe at the
start of the soak (a new table) and at its end (after the churn)."""

from __future__ import annotations

import statistics
import time
from typing import Any

from benchmarks.harness import db, internals
from benchmarks.harness.numbers import percentile
from benchmarks.harness.worker import TOPIC_NONATOMIC
from benchmarks.scenarios.scale.claims import backend_pid, cpu_ns
from benchmarks.scenarios.scale.fill import insert_messages
from benchmarks.scenarios.scale.plans import buffers, execution_ms, explain, indexes
from benchmarks.scenarios.soak import QUEUE

WORKER_ID = "bench-soak-probe"
LEASE_SECONDS = 60


# Background work of the server that competes with the probe for the two
# cores: an autovacuum worker, or the checkpointer writing dirty buffers.
AUTOVACUUM_ACTIVE_SQL = (
    "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'autovacuum worker'"
    " AND state = 'active'"
)


def quiesce(timeout: float = 300.0) -> float:
    """Wait until no autovacuum worker runs (at most ``timeout`` s), then
    CHECKPOINT: the probe's claims then share the cores with no
    maintenance of the server's. Returns the seconds waited."""
    started = time.monotonic()
    while db.scalar(AUTOVACUUM_ACTIVE_SQL) and time.monotonic() - started < timeout:
        time.sleep(0.5)
    db.execute("CHECKPOINT")
    return time.monotonic() - started


def claim_probe(calls: int, batch: int, quiet: bool = False) -> dict[str, Any]:
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
    waited = quiesce() if quiet else None
    times, cpu, wal = [], [], []
    with_autovacuum = 0
    pid = backend_pid()
    redo_before = db.scalar("SELECT redo_lsn::text FROM pg_control_checkpoint()")
    for _ in range(calls):
        with_autovacuum += db.scalar(AUTOVACUUM_ACTIVE_SQL) > 0
        lsn = db.scalar("SELECT pg_current_wal_insert_lsn()::text")
        cpu_before = cpu_ns(pid)
        started = time.perf_counter()
        messages = internals.claim([QUEUE], batch, WORKER_ID, LEASE_SECONDS)
        times.append(1000.0 * (time.perf_counter() - started))
        cpu.append((cpu_ns(pid) - cpu_before) / 1e6)
        # The WAL the claim wrote (the worker is stopped; an autovacuum
        # running meanwhile would add its own): a page's first change after
        # a checkpoint writes the whole page (full_page_writes).
        wal.append(
            float(db.scalar("SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), %s)", [lsn]))
        )
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
        "wal_kib_p50": percentile(wal, 50) / 1024,
        "wal_kib_mean": statistics.fmean(wal) / 1024,
        # A checkpoint began during the probe: the pages changed after it
        # cost their first change a full-page image.
        "checkpoint_during": redo_before
        != db.scalar("SELECT redo_lsn::text FROM pg_control_checkpoint()"),
        # Claims that started while an autovacuum worker was running.
        "claims_beside_autovacuum": with_autovacuum,
        "quiesced_s": waited,
        "cpu_ms": [round(c, 4) for c in cpu],
        "wal_kib": [round(w / 1024, 1) for w in wal],
        "plan_buffers": buffers(summaries),
        "plan_execution_ms": execution_ms(summaries),
        "plan_indexes": indexes(summaries),
        "plan_text": [s["text"] for s in summaries],
        "times_ms": [round(t, 4) for t in times],
    }
