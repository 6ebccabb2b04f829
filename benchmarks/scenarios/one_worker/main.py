#!/usr/bin/env python
"""Throughput, latency and idle-cost benchmark of one django-pgqueue worker.

Runs everything against a database of its own (default ``pgqueue_bench``,
created and migrated if missing), never the developer's. See
benchmarks/README.md for what is measured and how to read the output.

    .venv/bin/python -m benchmarks throughput [--messages 20000] [--json out.json]

The measurements are in benchmarks/scenarios/one_worker/.
"""

import argparse
import re
import shlex
import sys

from benchmarks.harness import cli, db
from benchmarks.harness.cli import run_with_logs
from benchmarks.harness.machine import description, git_commit
from benchmarks.harness.output import command_line, now_iso, write_json
from benchmarks.harness.pgstats import Stats
from benchmarks.harness.worker import TOPIC_ATOMIC, TOPIC_NONATOMIC, Bench
from benchmarks.scenarios.one_worker import report
from benchmarks.scenarios.one_worker.burst import Burst, measure_startup, throughput_run
from benchmarks.scenarios.one_worker.idle import idle_cost
from benchmarks.scenarios.one_worker.latency import latency

DEFAULT_URL = "postgres://postgres@127.0.0.1:5432/pgqueue_bench"
# Always: the testproject's stream subscribers are the test suite's; a
# project without any runs no stream thread.
ALWAYS_WORKER_ARGS = ["--subscriptions", "none"]

NUMBERS = (  # (option, type, default, help)
    ("--messages", int, 20000, "messages per throughput run"),
    ("--concurrency", int, 4, "worker --concurrency of the default configuration (the"
     " command's default is 4), also used for the latency and idle measurements"),
    ("--batch-size", int, None, "worker --batch-size of the default configuration (default:"
     " the command's own)"),
    ("--repeat", int, 1, "throughput runs per configuration"),
    ("--startup-runs", int, 3, "empty-queue runs, median"),
    ("--idle-seconds", float, 10.0, None),
    ("--idle-poll-interval", float, 1.0, None),
)  # fmt: skip


def parse_combo(text):
    match = re.fullmatch(r"(\d+)x(\d+|default)", text.strip())
    if not match:
        raise argparse.ArgumentTypeError(
            f"{text!r}: write CONCURRENCYxBATCH, e.g. 8x8 or 8xdefault"
        )
    concurrency = int(match.group(1))
    batch = None if match.group(2) == "default" else int(match.group(2))
    if concurrency < 1 or (batch is not None and batch < 1):
        raise argparse.ArgumentTypeError(f"{text!r}: both numbers must be at least 1")
    return concurrency, batch


def combo_list(text):
    if text.strip().lower() in ("", "none"):
        return []
    return [parse_combo(part) for part in text.split(",")]


def parse_args(argv):
    parser = cli.parser(__doc__, NUMBERS)
    parser.add_argument(
        "--sweep",
        type=combo_list,
        default="8xdefault,16xdefault,32xdefault,16x100",
        help="more CONCURRENCYxBATCH configurations for the throughput runs "
        "('default' = the command's own batch size), or 'none'",
    )
    cli.add_latency(parser)
    parser.add_argument(
        "--skip",
        action="append",
        default=[],
        choices=["atomic", "nonatomic", "latency", "idle"],
        help="leave out a part (repeatable)",
    )
    cli.add_database_url(parser, "BENCH_DATABASE_URL", DEFAULT_URL)
    parser.add_argument(
        "--django-debug",
        action="store_true",
        help="run the worker with DEBUG=True (the testproject's default, which logs every query"
        " in memory); the benchmark uses DEBUG=False unless this is given",
    )
    parser.add_argument(
        "--enforce-goals",
        action="store_true",
        help="exit 3 when a design goal is missed (checks always exit 1 on failure)",
    )
    cli.add_results(parser, "also write the results here as JSON")
    parser.add_argument(
        "--worker-args",
        default="",
        help="more pgqueue_worker options for every worker, e.g. '--metrics-port 0'",
    )
    args = parser.parse_args(argv)
    if args.messages < 1 or args.repeat < 1 or args.startup_runs < 1:
        parser.error("--messages, --repeat and --startup-runs must be at least 1")
    cli.require_bench_database(parser, args.database_url)
    return args


def measure_throughput(bench, stats, args, combos):
    """Each configuration's start-up, then its drains of each topic."""
    topics = [
        (topic, atomic)
        for topic, atomic, part in (
            (TOPIC_ATOMIC, True, "atomic"),
            (TOPIC_NONATOMIC, False, "nonatomic"),
        )
        if part not in args.skip
    ]
    runs = []
    for concurrency, batch in combos:
        if not topics:
            break
        startup = measure_startup(bench, concurrency, batch, args.startup_runs)
        for topic, atomic in topics:
            for _ in range(args.repeat):
                burst = Burst(topic, atomic, concurrency, batch, args.messages)
                run = throughput_run(bench, stats, burst, startup)
                runs.append(run)
                print(
                    f"  {topic:22} conc {concurrency:3} batch {report.fmt_batch(batch):>5}: "
                    f"{run.jobs_per_s:8,.0f} jobs/s (drain {run.drain_s:.2f} s, "
                    f"start-up {run.startup_s:.2f} s, exit lag {run.exit_lag_s:.2f} s)",
                    file=sys.stderr,
                )
    return runs


def measure(bench, stats, args):
    default_combo = (args.concurrency, args.batch_size)
    combos = [default_combo] + [c for c in args.sweep if c != default_combo]
    result = {
        "started_at": now_iso(),
        "command": command_line(),
        "commit": git_commit(),
        "machine": {
            **description(),
            "postgres": db.scalar("SHOW server_version"),
            "synchronous_commit": db.scalar("SHOW synchronous_commit"),
        },
        "options": {k: v for k, v in vars(args).items() if k not in ("json",)},
    }
    runs = measure_throughput(bench, stats, args, combos)
    result["throughput"] = [vars(r) for r in runs]
    result["summary"] = report.summarize(runs, default_combo)
    rss = [r.peak_rss_mib for r in runs]
    if "latency" not in args.skip:
        spacing = args.latency_spacing_ms / 1000.0
        lat = latency(bench, stats, default_combo, args.latency_samples, spacing)
        result["latency"] = vars(lat)
        rss.append(lat.peak_rss_mib)
        print(f"  latency p50 {lat.p50_ms:.2f} ms", file=sys.stderr)
    if "idle" not in args.skip:
        poll, window = args.idle_poll_interval, args.idle_seconds
        idle = idle_cost(bench, stats, default_combo, poll, window, settle=2.0)
        result["idle"] = vars(idle)
        rss.append(idle.peak_rss_mib)
    result["peak_rss_mib"] = max(rss) if rss else None
    result["worker_warnings"] = dict(bench.warnings)
    result["goals"] = report.goals(result)
    return result


def run(args, logs):
    url = args.database_url
    env = db.pgqueue_env(url, debug=args.django_debug)
    db.prepare([url, db.other_url(url)], env)
    db.setup_django(env)
    worker_args = [*ALWAYS_WORKER_ARGS, *shlex.split(args.worker_args)]
    bench = Bench(url, env, logs.path, worker_args=worker_args)
    with Stats(url) as stats:
        result = measure(bench, stats, args)
    db.truncate()
    report.print_report(result)
    if args.json:
        write_json(args.json, result)
        print(f"\nwrote {args.json}")
    if args.enforce_goals and not all(g["met"] for g in result["goals"].values()):
        return 3
    return 0


def main(argv=None):
    args = parse_args(argv)
    return run_with_logs("pgqueue-bench-", args.keep_logs, lambda logs: run(args, logs))
