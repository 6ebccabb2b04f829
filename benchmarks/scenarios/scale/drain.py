"""A worker (not --burst) draining bench messages, watched in the database."""

from __future__ import annotations

import time
from dataclasses import dataclass

from benchmarks.harness import db
from benchmarks.harness.machine import free_port
from benchmarks.harness.monitor import DrainMonitor
from benchmarks.harness.worker import CLAIMED_SQL, Bench
from benchmarks.scenarios.scale import QUEUE
from benchmarks.scenarios.scale.metrics import scrape, worker_metrics

# The bench messages are an id range: read through the primary key,
# whatever else the table holds.
RANGE_EMPTY_SQL = f"SELECT NOT EXISTS (SELECT 1 FROM {db.MESSAGE_TABLE} WHERE id BETWEEN %s AND %s)"


@dataclass
class DrainRun:
    state: str
    topic: str
    atomic: bool
    messages: int
    enqueue_per_s: float  # enqueue_many(), one statement
    drain_s: float  # first message claimed to the last one acknowledged, seen in the database
    jobs_per_s: float  # messages / drain_s
    start_to_empty_s: float  # worker process start to the queue empty (start-up included)
    worker_cpu_percent: float | None  # during the drain, of one core
    machine_busy_percent: float | None  # all cores, during the drain
    claims: int | None  # the worker's claim histogram, scraped once the queue was empty
    claim_mean_ms: float | None
    claim_p50_ms: float | None  # estimated from the histogram buckets
    claim_p99_ms: float | None
    claim_batch_mean: float | None
    handled_by_metrics: float | None  # pgqueue_worker_messages_total, outcome done
    peak_rss_mib: float
    worker_warnings: int
    round: int | None = None  # --in-turn: the round (its baseline and loaded pass are a pair)


def delete_bench_rows() -> None:
    db.execute(f"DELETE FROM {db.MESSAGE_TABLE} WHERE topic LIKE 'bench.%%'")


def drain_run(
    bench: Bench, metrics: bool, state: str, topic: str, atomic: bool, n: int, index: int
) -> DrainRun:
    """enqueue_many() ``n`` messages, VACUUM ANALYZE, start a worker (with
    ``--metrics-port`` when ``metrics``) and watch the bench messages' id
    range every 5 ms: jobs/s = n / (first claimed to none left). Then scrape
    its metrics (the handled count must be ``n``) and stop it with SIGTERM;
    no dead letter may appear."""
    from django_pgqueue import enqueue_many

    delete_bench_rows()
    before = db.scalar(f"SELECT coalesce(max(id), 0) FROM {db.MESSAGE_TABLE}")
    dead_before = db.scalar(f"SELECT coalesce(max(id), 0) FROM {db.DEADLETTER_TABLE}")
    items = [{"payload": {"n": i}} for i in range(n)]
    started = time.perf_counter()
    enqueue_many(items, topic=topic, queue=QUEUE)
    enqueue_s = time.perf_counter() - started
    first_id, last_id, written = db.rows(
        f"SELECT min(id), max(id), count(*) FROM {db.MESSAGE_TABLE} WHERE id > %s", [before]
    )[0]
    if written != n:
        raise db.CheckFailed(f"enqueue_many wrote {written} rows, not {n}")
    db.execute(f"VACUUM ANALYZE {db.MESSAGE_TABLE}")

    name = f"{state}-{topic}-{index}"
    port = free_port() if metrics else None
    options = ["--metrics-port", str(port), "--http-host", "127.0.0.1"] if port else []
    worker = bench.worker(name, options)
    watch = DrainMonitor(
        bench.url, (CLAIMED_SQL, [first_id]), (RANGE_EMPTY_SQL, [first_id, last_id]), pid=worker.pid
    )
    watch.start()
    scraped = {}
    try:
        deadline = time.monotonic() + max(120.0, n / 200.0)
        while watch.empty is None:
            if worker.poll() is not None:
                raise db.CheckFailed(
                    f"{name}: the worker exited {worker.returncode} before the queue was"
                    f" empty\n{worker.log_tail()}"
                )
            if time.monotonic() > deadline:
                raise db.CheckFailed(f"{name}: the queue was not empty after {n / 200.0:.0f} s")
            time.sleep(0.02)
        if port:
            # A handler's count follows its commit, which the watch may see
            # first: scrape until every message is counted (or 30 s passed).
            counted = time.monotonic() + 30.0
            while True:
                scraped = worker_metrics(scrape(port))
                done = scraped.get("messages_total", {}).get(f"{topic}/done")
                if done == n or time.monotonic() > counted:
                    break
                time.sleep(0.05)
    finally:
        watch.stop()
    worker.stop()
    warnings = worker.check_clean(f"{name} (SIGTERM)")
    dead_after = db.scalar(f"SELECT coalesce(max(id), 0) FROM {db.DEADLETTER_TABLE}")
    if dead_after != dead_before:
        raise db.CheckFailed(f"{name}: {dead_after - dead_before} new dead letter(s)")
    drain_s = watch.drain_s
    if drain_s is None or watch.empty is None:
        raise db.CheckFailed(f"{name}: the watch did not see the first claim")
    handled = scraped.get("messages_total", {}).get(f"{topic}/done")
    if port and handled != n:
        raise db.CheckFailed(f"{name}: the worker's metrics count {handled} handled, not {n}")
    return DrainRun(
        state=state,
        topic=topic,
        atomic=atomic,
        messages=n,
        enqueue_per_s=n / enqueue_s,
        drain_s=drain_s,
        jobs_per_s=n / drain_s,
        start_to_empty_s=watch.empty - worker.started,
        worker_cpu_percent=watch.process_cpu_percent(),
        machine_busy_percent=watch.machine_busy_percent(),
        claims=scraped.get("claims"),
        claim_mean_ms=scraped.get("claim_mean_ms"),
        claim_p50_ms=scraped.get("claim_p50_ms"),
        claim_p99_ms=scraped.get("claim_p99_ms"),
        claim_batch_mean=scraped.get("claim_batch_mean"),
        handled_by_metrics=handled,
        peak_rss_mib=worker.peak_rss_mib,
        worker_warnings=warnings,
    )
