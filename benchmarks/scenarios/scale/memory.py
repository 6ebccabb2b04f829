"""One worker's memory over a million messages, and the claim after them."""

from __future__ import annotations

import time
from typing import Any

from benchmarks.harness import db
from benchmarks.harness.machine import proc_status
from benchmarks.harness.worker import TOPIC_NONATOMIC, Bench
from benchmarks.scenarios.scale.claims import claim_statements, insert_ready
from benchmarks.scenarios.scale.drain import delete_bench_rows
from benchmarks.scenarios.scale.fill import chunked, insert_messages
from benchmarks.scenarios.scale.plans import buffers, execution_ms, explain, indexes


def claim_after_churn(limit: int) -> dict[str, Any]:
    """The claim of one new message right after the run (every handled message
    left a dead entry at the head of the claim index), then after VACUUM
    ANALYZE (what autovacuum would have done meanwhile)."""
    insert_ready(1)
    out: dict[str, Any] = {}
    for when in ("before_vacuum", "after_vacuum"):
        if when == "after_vacuum":
            started = time.perf_counter()
            db.execute(f"VACUUM ANALYZE {db.MESSAGE_TABLE}")
            out["vacuum_s"] = time.perf_counter() - started
        statements, _ = claim_statements(limit)
        summaries = explain(statements)
        out[when] = {
            "buffers": buffers(summaries),
            "execution_ms": execution_ms(summaries),
            "indexes": indexes(summaries),
        }
    delete_bench_rows()
    return out


def sample_run(bench: Bench, n: int, interval: float) -> tuple[list[tuple[Any, ...]], int]:
    """One worker (the bench's options, not --burst) handles the ``n``
    messages in the table; its RSS and the number handled are sampled every
    ``interval`` seconds. Returns ([(seconds since start, handled, rss KiB,
    hwm KiB)], the warnings it logged). Handled = the lowest id left - the
    first id (the claim takes messages in id order; off by at most the
    messages in flight)."""
    first_id = db.scalar(f"SELECT min(id) FROM {db.MESSAGE_TABLE}")
    worker = bench.worker("memory", [])
    conn = db.connect(bench.url)
    samples = []
    deadline = time.monotonic() + max(600.0, n / 200.0)
    try:
        while True:
            status = proc_status(worker.pid)
            (low,) = conn.execute(f"SELECT min(id) FROM {db.MESSAGE_TABLE}").fetchone() or (None,)
            if status is None or worker.poll() is not None:
                raise db.CheckFailed(f"memory run: the worker exited early\n{worker.log_tail()}")
            handled = n if low is None else low - first_id
            samples.append((time.perf_counter() - worker.started, handled, *status))
            if low is None:
                break
            if time.monotonic() > deadline:
                raise db.CheckFailed(f"memory run: {n - handled} messages left after the deadline")
            time.sleep(interval)
    finally:
        conn.close()
    worker.stop()
    warnings = worker.check_clean("memory run (SIGTERM)")
    if db.count(db.DEADLETTER_TABLE):
        raise db.CheckFailed("memory run: dead letters exist")
    return samples, warnings


def memory_run(
    bench: Bench, n: int, interval: float, claim_limit: int, chunk: int = 100_000
) -> dict[str, Any]:
    """``n`` bench.noop_nonatomic messages enqueued beforehand, handled by one
    worker while its RSS is sampled; then the claim after the churn."""
    db.truncate()
    started = time.perf_counter()
    chunked(lambda a, b: insert_messages(a, b, TOPIC_NONATOMIC), n, chunk, "memory run messages")
    fill_s = time.perf_counter() - started
    db.execute(f"VACUUM ANALYZE {db.MESSAGE_TABLE}")
    db.execute("CHECKPOINT")
    samples, warnings = sample_run(bench, n, interval)
    after = claim_after_churn(claim_limit)

    def at(k: int) -> tuple[Any, ...] | None:
        """The first sample with at least k handled."""
        return next((s for s in samples if s[1] >= k), None)

    first_work = next((s for s in samples if s[1] > 0), samples[-1])
    marks = sorted({10_000, 100_000, n // 4, n // 2, (3 * n) // 4, n} - {0})
    rss_at = {}
    for k in marks:
        s = at(k)
        if s:
            rss_at[k] = {"handled": s[1], "seconds": s[0], "rss_mib": s[2] / 1024.0}
    after_10k = [s for s in samples if s[1] >= 10_000]
    # throughput over consecutive tenths of the run
    rates = []
    step = max(1, n // 10)
    prev = first_work
    for k in range(step, n + 1, step):
        s = at(k)
        if s and s[0] > prev[0]:
            rates.append({"upto": k, "jobs_per_s": (s[1] - prev[1]) / (s[0] - prev[0])})
            prev = s
    end = samples[-1]
    return {
        "messages": n,
        "fill_s": fill_s,
        "sample_interval_s": interval,
        "samples": len(samples),
        "seconds": end[0],
        "drain_s": end[0] - first_work[0],
        "jobs_per_s": n / (end[0] - first_work[0]) if end[0] > first_work[0] else None,
        "rss_at": {str(k): v for k, v in rss_at.items()},
        "rss_10k_mib": rss_at.get(10_000, {}).get("rss_mib"),
        "rss_end_mib": end[2] / 1024.0,
        "rss_max_after_10k_mib": max(s[2] for s in after_10k) / 1024.0 if after_10k else None,
        "rss_min_after_10k_mib": min(s[2] for s in after_10k) / 1024.0 if after_10k else None,
        "hwm_mib": max(s[3] for s in samples) / 1024.0,
        "rates": rates,
        "claim_after_run": after,
        "worker_warnings": warnings,
        "series": [
            {"t": round(s[0], 2), "handled": s[1], "rss_kib": s[2]}
            for s in samples[:: max(1, len(samples) // 400)]
        ],
    }
