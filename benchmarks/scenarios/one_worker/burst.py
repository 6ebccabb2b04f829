"""One ``pgqueue_worker --burst`` draining a backlog of no-op messages."""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from benchmarks.harness import db
from benchmarks.harness.machine import busy_percent, cpu_times
from benchmarks.harness.monitor import DrainMonitor
from benchmarks.harness.pgstats import Stats
from benchmarks.harness.worker import CLAIMED_SQL, EMPTY_SQL, Bench, worker_options


@dataclass
class Burst:
    """What a drain runs: ``messages`` of ``topic`` (its handler ``atomic``
    or not), one worker with ``--concurrency`` and ``--batch-size`` (None:
    the command's default)."""

    topic: str
    atomic: bool
    concurrency: int
    batch_size: int | None
    messages: int


@dataclass
class ThroughputRun(Burst):
    """One drain: what ran, what was measured, and the figures derived from them."""

    enqueue_s: float  # the enqueue_many() of the backlog
    wall_s: float  # worker start to exit
    startup_s: float  # the same worker on an empty queue: start-up plus exit
    db_drain_s: float  # first claim seen in the database to the queue seen empty
    worker_cpu_s: float
    machine_busy_percent: float | None  # all cores, during the run
    transactions_per_job: float  # in the bench database, during the run
    peak_rss_mib: float
    worker_warnings: int  # lines the worker logged at WARNING
    # derived
    enqueue_per_s: float = field(init=False)
    drain_s: float = field(init=False)  # wall_s - startup_s
    jobs_per_s: float = field(init=False)  # messages / drain_s
    jobs_per_s_wall: float = field(init=False)  # messages / wall_s
    db_jobs_per_s: float | None = field(init=False)  # messages / db_drain_s
    exit_lag_s: float = field(init=False)  # drain_s - db_drain_s: how late the worker exited
    worker_cpu_percent: float = field(init=False)  # of one core, over the whole run

    def __post_init__(self) -> None:
        n = self.messages
        self.enqueue_per_s = n / self.enqueue_s
        self.drain_s = self.wall_s - self.startup_s
        self.jobs_per_s = n / self.drain_s
        self.jobs_per_s_wall = n / self.wall_s
        self.db_jobs_per_s = n / self.db_drain_s if self.db_drain_s > 0 else None
        self.exit_lag_s = self.drain_s - self.db_drain_s
        self.worker_cpu_percent = 100.0 * self.worker_cpu_s / self.wall_s

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ThroughputRun:
        return cls(**{f.name: data[f.name] for f in fields(cls) if f.init})


def measure_startup(bench: Bench, concurrency: int, batch_size: int | None, runs: int) -> float:
    """Median wall time of a --burst worker on an empty queue (start-up plus exit)."""
    db.truncate()
    times = []
    for i in range(runs):
        worker = bench.worker(
            f"startup-c{concurrency}-b{batch_size}-{i}",
            worker_options(concurrency, batch_size, "--burst"),
        )
        worker.finish(120)
        worker.check_clean("empty-queue run")
        times.append(worker.elapsed)
    return statistics.median(times)


def throughput_run(bench: Bench, stats: Stats, burst: Burst, startup_s: float) -> ThroughputRun:
    """Enqueue the messages with one enqueue_many(), VACUUM ANALYZE, and time
    one --burst worker from its start to its exit, the queue watched from a
    connection of its own meanwhile. The queue must be empty and no dead
    letter written when it exits. ``startup_s``: ``measure_startup``'s."""
    from django.db import connection

    from django_pgqueue import enqueue_many

    db.truncate()
    n = burst.messages
    items = [{"payload": {"n": i}} for i in range(n)]
    started = time.perf_counter()
    enqueue_many(items, topic=burst.topic)
    enqueue_s = time.perf_counter() - started
    db.execute(f"VACUUM ANALYZE {db.MESSAGE_TABLE}")
    written = db.count(db.MESSAGE_TABLE)
    if written != n:
        raise db.CheckFailed(f"enqueue_many wrote {written} rows, not {n}")

    name = f"{burst.topic}-c{burst.concurrency}-b{burst.batch_size}"
    first_id = db.scalar(f"SELECT min(id) FROM {db.MESSAGE_TABLE}")
    connection.close()  # its backend reports the enqueue's counters as it exits
    stats.wait_no_clients(bench.dbname, timeout=10.0, workers=False)
    xacts_before = stats.transactions(bench.dbname)
    cpu_before = cpu_times()
    monitor = DrainMonitor(bench.url, (CLAIMED_SQL, [first_id]), (EMPTY_SQL, []))
    worker = bench.worker(name, worker_options(burst.concurrency, burst.batch_size, "--burst"))
    monitor.start()
    try:
        worker.finish(max(600.0, n / 20))
    finally:
        monitor.stop()
    cpu_after = cpu_times()
    stats.wait_gone(bench.dbname, worker.pid)
    stats.wait_no_clients(bench.dbname, timeout=10.0, workers=False)  # the monitor's backend too
    # The worker's backends reported their counters when exiting; the
    # monitor's own queries are one transaction each.
    xacts = stats.transactions(bench.dbname) - xacts_before - monitor.queries
    warnings = worker.check_clean(name)
    left, dead = db.count(db.MESSAGE_TABLE), db.count(db.DEADLETTER_TABLE)
    if left or dead:
        raise db.CheckFailed(
            f"{name}: after the worker exited, {left} message(s) are left and {dead} "
            f"dead letter(s) exist (expected 0 and 0)\n{worker.log_tail()}"
        )
    if worker.elapsed <= startup_s:
        raise db.CheckFailed(f"{name}: drained faster than start-up; use more --messages")
    if monitor.drain_s is None:
        raise db.CheckFailed(f"{name}: the monitor did not see the queue start and end draining")
    return ThroughputRun(
        **asdict(burst),
        enqueue_s=enqueue_s,
        wall_s=worker.elapsed,
        startup_s=startup_s,
        db_drain_s=monitor.drain_s,
        worker_cpu_s=worker.cpu_seconds,
        machine_busy_percent=busy_percent(cpu_before, cpu_after),
        transactions_per_job=xacts / n,
        peak_rss_mib=worker.peak_rss_mib,
        worker_warnings=warnings,
    )
