"""One system's measurements: a drain of a backlog by burst workers, the
latency of a listening worker, what an idle worker asks the database."""

from __future__ import annotations

import datetime
import os
import time
from typing import Any

from benchmarks.harness import db
from benchmarks.harness.machine import busy_percent, cpu_times
from benchmarks.harness.monitor import DrainMonitor, wait_until
from benchmarks.harness.numbers import distribution, median
from benchmarks.harness.pgstats import Statements, Stats, one_line, record_statements
from benchmarks.harness.processes import Process
from benchmarks.harness.servercost import ServerCost
from benchmarks.scenarios.compare import StepFailed
from benchmarks.scenarios.compare.system import System, Variant


def enqueue_bulk(system: System, variant: Variant, n: int) -> float:
    """Empty the tables, enqueue ``n`` messages with the bulk API; returns the rate."""
    system.reset()
    answer = system.client("enqueue-bulk", "--n", n, "--variant", variant.client)
    return n / answer["seconds"]


def fill(system: System, variant: Variant, n: int) -> float:
    """``enqueue_bulk``, then VACUUM ANALYZE (as autovacuum would have: without
    it django-tasks-db's claim sorts the whole backlog on every job)."""
    rate = enqueue_bulk(system, variant, n)
    system.vacuum()
    return rate


def enqueue_single(system: System, variant: Variant, n: int) -> float:
    """Empty the tables, enqueue ``n`` messages one per transaction; returns the rate."""
    system.reset()
    answer = system.client("enqueue-single", "--n", n, "--variant", variant.client)
    return n / answer["seconds"]


def representative(repeats: list[dict[str, Any]]) -> dict[str, Any]:
    """The median run of the repeats of one configuration (by jobs/s; the
    upper median of an even count), with every repeat's figures added."""
    measured = sorted((r for r in repeats if r.get("jobs_per_s")), key=lambda r: r["jobs_per_s"])
    run = dict(measured[len(measured) // 2] if measured else repeats[0])
    run["repeats"] = [r.get("jobs_per_s") for r in repeats]
    run["bulk_enqueue_all"] = [r["bulk_enqueue_per_s"] for r in repeats]
    run["peak_rss_mib"] = [max(x) for x in zip(*(r["peak_rss_mib"] for r in repeats), strict=True)]
    run["problems"] = [p for r in repeats for p in r["problems"]]
    run["timed_out"] = any(r["timed_out"] for r in repeats)
    for key in (
        "worker_cpu_us_per_job",
        "server_cpu_us_per_job",
        "backends_cpu_us_per_job",
        "wal_bytes_per_job",
    ):
        run[key] = median(r.get(key) for r in repeats)
    run["all"] = repeats
    return run


STARTUP_RUNS = 3


def startup_cpu(system: System, variant: Variant) -> list[float]:
    """CPU seconds (user + system, from wait4) of STARTUP_RUNS burst workers
    of ``variant`` on an empty queue: what a worker spends starting and
    stopping, whatever it drains (their median is taken off a drain's CPU).
    Measured once per worker command and environment of the system."""
    key = repr((system.command_text(variant, True), sorted(variant.env.items())))
    if key not in system.startup_cpu_runs:
        system.reset()
        runs = []
        for i in range(STARTUP_RUNS):
            worker = system.start_worker(variant, True, f"startup-{variant.key}-{i}")
            code = worker.wait(system.opts.run_timeout)
            if code != 0:
                raise StepFailed(
                    f"start-up run of {variant.key}: the worker exited {code}:\n"
                    + worker.log_tail(10)
                )
            runs.append(worker.cpu_seconds)
        system.startup_cpu_runs[key] = runs
    return system.startup_cpu_runs[key]


def worker_cpu(run: dict[str, Any], workers: list[Process], startup_s: float | None) -> None:
    """The workers' CPU time into ``run``, and per job with ``startup_s`` (a
    worker's start-up and exit, startup_cpu) subtracted once per process."""
    if any(w.rusage is None for w in workers):
        return
    total = sum(w.cpu_seconds for w in workers)
    run["worker_cpu_s"] = [round(w.cpu_seconds, 4) for w in workers]
    if startup_s is not None:
        run["startup_cpu_s"] = startup_s
        work = total - len(workers) * startup_s
        run["worker_cpu_us_per_job"] = 1e6 * work / run.get("processed", run["messages"])


def drain_run(
    system: System,
    stats: Stats,
    variant: Variant,
    processes: int,
    n: int,
    tag: str = "r0",
    startup_s: float | None = None,
) -> dict[str, Any]:
    """Fill the queue, start ``processes`` burst workers at once, and time the
    drain as the database sees it: jobs/s = n / (first claim to queue empty).
    The workers' CPU per job has ``startup_s`` (startup_cpu) taken off."""
    bulk_rate = fill(system, variant, n)
    (first_key,) = db.fetch_row(system.url, system.first_key_sql)
    stats.wait_no_clients(system.dbname)
    xacts_before = stats.transactions(system.dbname)
    cpu_before = cpu_times()
    load_before = os.getloadavg()[0]
    server_before = stats.server.read()  # before the monitor connects: its backend is left out
    monitor = DrainMonitor(
        system.url,
        (system.claimed_sql, [first_key]),
        (system.empty_sql, []),
        adaptive=True,
        backends=True,
    )
    monitor.start()
    started = time.perf_counter()
    workers = [
        system.start_worker(variant, True, f"drain-{variant.key}-{processes}p-{tag}-{i}")
        for i in range(processes)
    ]
    timeout = system.opts.run_timeout
    deadline = started + timeout
    timed_out = False
    try:
        while any(w.poll() is None for w in workers):
            if time.perf_counter() > deadline:
                timed_out = True
                break
            time.sleep(0.02)
        if not timed_out and monitor.empty is None:
            # Every worker exited: give the monitor a moment to see the end.
            wait_until(lambda: monitor.empty is not None, 2.0, poll=0.01)
    finally:
        stop_at = time.perf_counter()
        monitor.stop()
        for w in workers:
            if w.poll() is None:
                w.kill()
    cpu_after = cpu_times()
    ended = max((w.ended or stop_at) for w in workers)
    run: dict[str, Any] = {
        "variant": variant.key,
        "processes": processes,
        "messages": n,
        "bulk_enqueue_per_s": bulk_rate,
        "wall_s": ended - started,
        "exit_codes": [w.returncode for w in workers],
        "peak_rss_mib": [round(w.peak_rss_mib, 1) for w in workers],
        "machine_busy_percent": busy_percent(cpu_before, cpu_after),
        "load_average_1min_before": load_before,
        "monitor_queries": monitor.queries,
        "timed_out": timed_out,
        "problems": [],
    }
    if monitor.first_claim is None:
        run["problems"].append("the monitor never saw the first job claimed")
        run["jobs_per_s"] = None
    elif timed_out or monitor.empty is None:
        (left,) = db.fetch_row(system.url, system.remaining_sql)
        done = n - left
        elapsed = stop_at - monitor.first_claim
        run["processed"] = done
        run["drain_s"] = elapsed
        run["jobs_per_s"] = done / elapsed if elapsed > 0 else None
        run["problems"].append(
            f"timeout after {timeout:g} s: {done} of {n} done"
            if timed_out
            else f"the workers exited with {left} job(s) left"
        )
    else:
        run["drain_s"] = monitor.drain_s
        run["jobs_per_s"] = n / run["drain_s"]
        run["startup_s"] = monitor.first_claim - started  # start to the first claim
    worker_cpu(run, workers, startup_s)
    if not timed_out:
        stats.wait_no_clients(system.dbname)
        # The whole server's CPU and WAL over the drain (the workers' start-up
        # and exit included), the monitor's backend left out.
        run.update(
            ServerCost.per_message(
                server_before, stats.server.read(), n, monitor.backend_cpu_s or 0.0
            )
        )
        # Only the backends of the system's database (the workers'), whatever
        # else the server does: a lower bound (each backend's last sample).
        if (backends := monitor.backends_cpu_s) is not None:
            run["backends_cpu_s"] = round(backends, 4)
            run["backends_cpu_us_per_job"] = 1e6 * backends / n
        xacts = stats.transactions(system.dbname) - xacts_before - monitor.queries
        run["transactions_per_job"] = xacts / n
        if system.verify_sql:
            ok, failed = db.fetch_row(system.url, system.verify_sql)
            if not ok or failed:
                run["problems"].append(f"after the drain: finished ok={ok}, failed={failed}")
        bad = [w for w in workers if w.returncode not in (0, None)]
        for w in bad:
            run["problems"].append(f"worker exited {w.returncode}: {w.log_tail(5)}")
    return run


def start_listening_worker(
    system: System, name: str, latency_file: Any
) -> tuple[Process, set[str]]:
    """Start a (non-burst) worker, send one warm-up message and wait until it
    is handled: then the worker has started and listens (or polls)."""
    system.reset()
    worker = system.start_worker(None, False, name, latency_file)
    warm = system.client("latency-enqueue", "--n", "1", "--spacing", "0", "--prefix", "warm")[
        "sent"
    ]
    keys = {k for k, _ in warm}

    def handled() -> bool:
        if worker.poll() is not None:
            raise StepFailed(f"{name} worker exited {worker.returncode}:\n{worker.log_tail(15)}")
        return keys <= set(system.latency_results(latency_file))

    if not wait_until(handled, 60, poll=0.05):
        worker.kill()
        raise StepFailed(f"{name}: the warm-up message was not handled within 60 s")
    return worker, keys


def measure_latency(system: System, samples: int, spacing: float) -> dict[str, Any]:
    """Enqueue commit to handler start: ``samples`` messages one at a time,
    ``spacing`` seconds apart, to a warmed-up listening worker."""
    latency_file = system.opts.log_dir / f"{system.name}-latency.txt"
    latency_file.unlink(missing_ok=True)
    worker, _ = start_listening_worker(system, "latency", latency_file)
    try:
        time.sleep(1.0)  # let it go idle
        sent = system.client(
            "latency-enqueue", "--n", samples, "--spacing", spacing, timeout=samples * 5 + 60
        )["sent"]
        committed = {k: t for k, t in sent}

        def all_handled() -> bool:
            return set(committed) <= set(system.latency_results(latency_file))

        complete = wait_until(all_handled, 30 + (5 if system.name == "django-tasks-db" else 0), 0.1)
    finally:
        code = worker.terminate()
    found = system.latency_results(latency_file)
    values, missing, dupes = [], 0, 0
    for key, at in committed.items():
        starts = found.get(key)
        if not starts:
            missing += 1
            continue
        if len(starts) > 1:
            dupes += 1
        values.append(1000.0 * (min(starts) - at))
    result: dict[str, Any] = {
        "samples": samples,
        "spacing_ms": 1000.0 * spacing,
        "handled": len(values),
        "missing": missing,
        "duplicated": dupes,
        "complete": complete,
        "worker_exit": code,
        "peak_rss_mib": round(worker.peak_rss_mib, 1),
    }
    if values:
        result.update(distribution(values))
    return result


def measure_idle(system: System, stats: Stats, settle: float, window: float) -> dict[str, Any]:
    """What an idle listening worker asks the database, two ways, both lower
    bounds of the statements it sends:

    - transactions: the system database's xact_commit + xact_rollback
      (pg_stat_database) over the window. Exact, but a transaction of several
      statements counts once, and a backend may hold its counters back for up
      to 10 s (PostgreSQL 15), hence the long settle before the window;
    - statements: every new (backend, query_start) in pg_stat_activity,
      sampled every ~5 ms (two statements of one backend between two samples
      count once, e.g. BEGIN; SELECT; COMMIT).

    This script's own connections are to the ``postgres`` database, so they
    count in neither. queries = the larger of the two."""
    latency_file = system.opts.log_dir / f"{system.name}-idle.txt"
    latency_file.unlink(missing_ok=True)
    system.vacuum()
    worker, _ = start_listening_worker(system, "idle", latency_file)
    seen: Statements = {}
    samples = 0
    try:
        window_start = time.time() + settle
        while time.time() < window_start:
            record_statements(seen, stats.backends(system.dbname))
            time.sleep(0.005)
        before = set(seen)
        xacts_before = stats.transactions(system.dbname)
        window_end = time.time() + window
        while time.time() < window_end:
            record_statements(seen, stats.backends(system.dbname))
            samples += 1
            time.sleep(0.005)
        xacts = stats.transactions(system.dbname) - xacts_before
    finally:
        code = worker.terminate()
    lo = datetime.datetime.fromtimestamp(window_start, datetime.UTC)
    statements: dict[str, int] = {}
    count = 0
    for key, (_app, query) in seen.items():
        if key in before or key[1] < lo:
            continue
        count += 1
        text = one_line(query, 80)
        statements[text] = statements.get(text, 0) + 1
    queries = max(count, xacts)
    return {
        "window_s": window,
        "settle_s": settle,
        "queries": queries,
        "queries_per_s": queries / window,
        "statements": count,
        "statements_per_s": count / window,
        "by_query": dict(sorted(statements.items(), key=lambda kv: -kv[1])),
        "transactions": xacts,
        "transactions_per_s": xacts / window,
        "sample_every_ms": 1000.0 * window / max(samples, 1),
        "worker_exit": code,
        "peak_rss_mib": round(worker.peak_rss_mib, 1),
    }
