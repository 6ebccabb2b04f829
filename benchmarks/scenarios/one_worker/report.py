"""The throughput scenario's summary, goals and printed report."""

from __future__ import annotations

import statistics
from typing import Any

from benchmarks.harness.output import fmt_seconds, print_warnings, table
from benchmarks.harness.worker import Combo
from benchmarks.scenarios.one_worker.burst import ThroughputRun
from benchmarks.scenarios.one_worker.idle import GOAL_QUERIES_PER_POLL

# The design goals of the issue, for this machine.
GOAL_JOBS_PER_S = 3000.0  # atomic=False, one worker process
GOAL_P50_MS = 10.0  # enqueue-to-start, idle worker

# A --burst worker should exit within a few tenths of a second of the queue
# becoming empty (start-up and exit vary by about that much).
EXIT_LAG_NOTE_S = 0.5


def fmt_batch(batch: int | None) -> str:
    return "=conc" if batch is None else str(batch)


def config_text(concurrency: int, batch_size: int | None) -> str:
    return f"--concurrency {concurrency}" + (
        "" if batch_size is None else f" --batch-size {batch_size}"
    )


def summarize(runs: list[ThroughputRun], default_combo: Combo) -> dict[str, Any]:
    """Per handler kind: the default configuration's figure and the best one."""
    summary = {}
    for key, atomic in (("atomic", True), ("nonatomic", False)):
        mine = [r for r in runs if r.atomic == atomic]
        if not mine:
            continue
        best = max(mine, key=lambda r: r.jobs_per_s)
        default = [r for r in mine if (r.concurrency, r.batch_size) == default_combo]
        summary[key] = {
            "best_config": config_text(best.concurrency, best.batch_size),
            "best_jobs_per_s": best.jobs_per_s,
            "default_config": config_text(*default_combo),
            "default_jobs_per_s": statistics.median(r.jobs_per_s for r in default)
            if default
            else None,
        }
    return summary


def goals(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    out = {}
    nonatomic = result["summary"].get("nonatomic")
    if nonatomic:
        out["jobs/s, atomic=False, best configuration"] = {
            "value": f"{nonatomic['best_jobs_per_s']:,.0f}",
            "goal": f">= {GOAL_JOBS_PER_S:,.0f}",
            "met": nonatomic["best_jobs_per_s"] >= GOAL_JOBS_PER_S,
        }
        if nonatomic["default_jobs_per_s"] is not None:
            out["jobs/s, atomic=False, default options"] = {
                "value": f"{nonatomic['default_jobs_per_s']:,.0f}",
                "goal": f">= {GOAL_JOBS_PER_S:,.0f}",
                "met": nonatomic["default_jobs_per_s"] >= GOAL_JOBS_PER_S,
            }
    if result.get("latency"):
        p50 = result["latency"]["p50_ms"]
        out["p50 enqueue-to-start latency, idle (ms)"] = {
            "value": f"{p50:.2f}",
            "goal": f"< {GOAL_P50_MS:g}",
            "met": p50 < GOAL_P50_MS,
        }
    if result.get("idle"):
        idle = result["idle"]
        total = idle["main_loop_statements"] + idle["other_statements"]
        out["idle worker statements in the window"] = {
            # the poll interval is jittered by +-10%: allow one per shortest interval
            "value": str(total),
            "goal": f"<= {idle['allowed_statements']} ({GOAL_QUERIES_PER_POLL} per poll)",
            "met": total <= idle["allowed_statements"],
        }
    return out


THROUGHPUT_HEADERS = (
    "topic atomic conc batch enqueue/s wall_s startup_s drain_s jobs/s db_jobs/s exit_lag"
    " xact/job cpu% box% RSS_MiB warn"
)


def throughput_row(r: ThroughputRun) -> list[Any]:
    return [
        r.topic,
        str(r.atomic),
        r.concurrency,
        fmt_batch(r.batch_size),
        f"{r.enqueue_per_s:,.0f}",
        f"{r.wall_s:.2f}",
        f"{r.startup_s:.2f}",
        f"{r.drain_s:.2f}",
        f"{r.jobs_per_s:,.0f}",
        "-" if r.db_jobs_per_s is None else f"{r.db_jobs_per_s:,.0f}",
        f"{r.exit_lag_s:.2f}",
        f"{r.transactions_per_job:.2f}",
        f"{r.worker_cpu_percent:.0f}",
        "-" if r.machine_busy_percent is None else f"{r.machine_busy_percent:.0f}",
        f"{r.peak_rss_mib:.0f}",
        r.worker_warnings,
    ]


def print_throughput(result: dict[str, Any]) -> None:
    runs = [ThroughputRun.from_json(r) for r in result["throughput"]]
    if not runs:
        return
    print(f"\nThroughput: one worker --burst, {runs[0].messages} no-op messages per run")
    headers = [h.replace("_", " ") for h in THROUGHPUT_HEADERS.split()]
    print(table(headers, [throughput_row(r) for r in runs]))
    print(
        "  jobs/s = messages / (wall - startup). db jobs/s = messages / (first claim to queue"
        " empty, watched in the\n  database); exit lag = (wall - startup) - that drain"
        " time: how late the worker exited. cpu% = worker CPU\n  time / wall (one core = 100);"
        " box% = all cores busy; xact/job = bench database transactions per message."
    )
    late = [r for r in runs if r.exit_lag_s > EXIT_LAG_NOTE_S]
    if late:
        print(
            f"  NOTE: {len(late)} run(s) exited more than {EXIT_LAG_NOTE_S:g} s after the queue"
            " was empty; their jobs/s understates the drain rate (see db jobs/s)."
        )
    for label, key in (("atomic=True", "atomic"), ("atomic=False", "nonatomic")):
        summary = result["summary"].get(key)
        if summary:
            print(
                f"  {label:13} default ({summary['default_config']}): "
                f"{summary['default_jobs_per_s']:,.0f} jobs/s; best ({summary['best_config']}):"
                f" {summary['best_jobs_per_s']:,.0f} jobs/s"
            )


def print_latency(lat: dict[str, Any]) -> None:
    print(
        f"\nLatency, enqueue commit to handler start, idle listening worker "
        f"(concurrency {lat['concurrency']}, {lat['samples']} messages "
        f"{lat['spacing_ms']:.0f} ms apart):"
    )
    print(
        f"  p50 {lat['p50_ms']:.2f} ms   p95 {lat['p95_ms']:.2f} ms   "
        f"p99 {lat['p99_ms']:.2f} ms   min {lat['min_ms']:.2f}   max {lat['max_ms']:.2f}   "
        f"(enqueue() call itself: p50 {lat['enqueue_call_p50_ms']:.2f} ms)"
    )


def print_idle(idle: dict[str, Any]) -> None:
    print(
        f"\nIdle listening worker, --poll-interval {idle['poll_interval_s']:g}, "
        f"{idle['window_s']:g} s window (pg_stat_activity sampled every "
        f"{idle['sample_every_ms']:.1f} ms):"
    )
    for role, queries in sorted(idle["window_statements"].items()):
        for query, n in sorted(queries.items(), key=lambda item: -item[1]):
            print(f"  {role:10} {n:4}  {query}")
    if not idle["window_statements"]:
        print("  no statement at all")
    print(
        f"  main loop: {idle['main_loop_statements_per_poll']:.2f} statements per poll "
        f"interval (mean gap {fmt_seconds(idle['main_loop_mean_gap_s'])}); "
        f"heartbeat and listener: {idle['other_statements']}"
    )
    print(
        f"  cross-check: {idle['lifetime_transactions']} transactions in the bench database "
        f"over the worker's {idle['lifetime_s']:.1f} s life; "
        f"{idle['startup_statements']} statements sampled before the window"
    )


def print_report(result: dict[str, Any]) -> None:
    print_throughput(result)
    if result.get("latency"):
        print_latency(result["latency"])
    if result.get("idle"):
        print_idle(result["idle"])
    print_warnings(result.get("worker_warnings", {}), "; the figures stand, the checks passed")
    if result.get("peak_rss_mib") is not None:
        print(f"\nPeak RSS of a worker process: {result['peak_rss_mib']:.0f} MiB")
    print("\nGoals:")
    for name, info in result["goals"].items():
        verdict = "met" if info["met"] else "MISSED"
        print(f"  {name:40} {info['value']:>10} (goal {info['goal']}): {verdict}")
