#!/usr/bin/env python
"""django-pgqueue side by side with a raw psycopg loop, pgqueuer, graphile-worker
(Node.js), procrastinate and Django's django.tasks (django-tasks-db backend), in
one run.

    .venv/bin/python -m benchmarks compare [--messages 20000] [--systems raw,pgqueue,...]

Every system gets a database of its own on the same server (bench_compare_<system>,
or --database-prefix, dropped and created again by every run), its own virtualenv under
benchmarks/.venvs/<system> (created with pinned versions unless --skip-install;
django-pgqueue and the raw loop run from the repo's .venv; graphile-worker from
benchmarks/peers/graphile/node_modules, installed by npm ci), and the same
measurements: enqueue rate (one message per transaction, and the system's bulk
API), drain throughput of a --messages backlog with 1 and 2 worker processes,
enqueue-commit-to-handler-start latency with an idle listening worker, the
statements per second of an idle worker, the workers' CPU per job (start-up
subtracted) and peak RSS. django-pgqueue runs tuned (--pgqueue-worker-args) and
with the worker's defaults, atomic=True and atomic=False handlers. The results
go to a JSON file and a Markdown table (also printed), with the ratios to the
raw loop and the PASS/FAIL list of django-pgqueue's targets. See
benchmarks/COMPARE.md for the methods; the code is in benchmarks/scenarios/compare/.
"""

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

import psycopg

from benchmarks.harness import cli, db
from benchmarks.harness.cli import run_guarded
from benchmarks.harness.machine import description, git_commit
from benchmarks.harness.output import command_line, now_iso, write_json
from benchmarks.harness.pgstats import Stats
from benchmarks.scenarios.compare import (
    DEFAULT_PGQUEUE_WORKER_ARGS,
    PGQUEUE_VARIANTS,
    REPEAT_MAX_DRAIN_S,
    RESULTS,
)
from benchmarks.scenarios.compare.issue41 import issue41_targets
from benchmarks.scenarios.compare.load import parse_rates
from benchmarks.scenarios.compare.markdown import markdown
from benchmarks.scenarios.compare.run import paired_drains, paired_enqueue, run_system
from benchmarks.scenarios.compare.systems import SYSTEMS
from benchmarks.scenarios.compare.targets import build_targets

DEFAULT_LOG_DIR = RESULTS / "logs"

NUMBERS = (  # (option, type, default, help)
    ("--messages", int, 20000, "backlog of every drain run"),
    ("--enqueue-messages", int, 2000, "one-per-transaction enqueue run"),
    ("--repeat", int, 3, "runs of each drain configuration, the median counts (a drain longer"
     f" than {REPEAT_MAX_DRAIN_S:g} s is not repeated)"),
    ("--run-timeout", float, 180.0, "seconds a drain run may take; then the rate over the part"
     " drained is reported"),
    ("--idle-seconds", float, 10.0, "0: no idle run"),
    ("--idle-settle", float, 11.0, "idle seconds before the window (PostgreSQL 15 backends may"
     " hold their statistics back for up to 10 s)"),
    ("--load-seconds", float, 5.0, "latency at load: seconds of the offered schedule (rate x"
     " seconds messages); 0: no load run"),
    ("--load-senders", int, 4, "latency at load: sender processes sharing the schedule"),
)  # fmt: skip


def parse_worker_args(values):
    out = {}
    for value in values:
        name, sep, args = value.partition("=")
        if not sep or name not in SYSTEMS:
            raise argparse.ArgumentTypeError(
                f"--worker-args {value!r}: write SYSTEM=ARGS, SYSTEM one of {', '.join(SYSTEMS)}"
            )
        out[name] = args
    return out


def parse_args(argv):
    p = cli.parser(__doc__, NUMBERS)
    p.add_argument(
        "--systems",
        default=",".join(SYSTEMS),
        help=f"comma-separated subset of {','.join(SYSTEMS)}",
    )
    p.add_argument("--json", type=Path, default=RESULTS / "compare.json", help="results file")
    p.add_argument("--markdown", type=Path, default=RESULTS / "compare.md", help="table file")
    p.add_argument(
        "--log-dir",
        type=Path,
        default=DEFAULT_LOG_DIR,
        help="the workers' logs (the default is emptied first: give another one beside a"
        " running the compare scenario)",
    )
    p.add_argument(
        "--skip-install",
        action="store_true",
        help="use benchmarks/.venvs as they are (a missing one: that system is not run)",
    )
    p.add_argument(
        "--pgqueue-worker-args",
        default=DEFAULT_PGQUEUE_WORKER_ARGS,
        help="pgqueue_worker options of the tuned django-pgqueue workers (the variants"
        " atomic and nonatomic, the latency and idle workers)",
    )
    p.add_argument(
        "--pgqueue-variants",
        default=",".join(PGQUEUE_VARIANTS),
        help="comma-separated subset of django-pgqueue's variants: atomic,nonatomic (tuned,"
        " --pgqueue-worker-args), atomic-defaults,nonatomic-defaults (pgqueue_worker with no"
        " option but --subscriptions none, INFO log level)",
    )
    p.add_argument(
        "--worker-args",
        action="append",
        default=[],
        metavar="SYSTEM=ARGS",
        help="worker options of a peer instead of the default, e.g."
        " 'procrastinate=--concurrency 16' (repeatable; defaults: procrastinate"
        " '--concurrency 4', django-tasks-db '--no-startup-delay')",
    )
    p.add_argument("--processes", default="1,2", help="worker processes of the drain runs")
    p.add_argument(
        "--load-rates",
        default="1000,50%",
        help="latency at load: the offered rates, messages/s, or a percentage of the system's"
        " own fastest one-process drain; 0: no load run",
    )
    p.add_argument(
        "--load-batch",
        action="store_true",
        help="latency at load: a sender that is late sends every message due by then in one"
        " transaction (the system's bulk API), so that a rate beyond one commit per message"
        " can be offered; without it, one transaction per message",
    )
    cli.add_latency(p, "0: no latency run")
    cli.add_server(p, "bench_compare", "each system's database is PREFIX_<system>")
    args = p.parse_args(argv)
    cli.check_server(p, args)
    try:
        args.worker_args = parse_worker_args(args.worker_args)
    except argparse.ArgumentTypeError as exc:
        p.error(str(exc))
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in args.systems if s not in SYSTEMS]
    if unknown:
        p.error(f"unknown system(s) {', '.join(unknown)}; choose from {', '.join(SYSTEMS)}")
    args.pgqueue_variants = [v.strip() for v in args.pgqueue_variants.split(",") if v.strip()]
    unknown = [v for v in args.pgqueue_variants if v not in PGQUEUE_VARIANTS]
    if unknown or not args.pgqueue_variants:
        p.error(f"--pgqueue-variants: choose from {', '.join(PGQUEUE_VARIANTS)}")
    args.processes = [int(x) for x in args.processes.split(",")]
    try:
        args.load_rates = parse_rates(args.load_rates)
    except ValueError:
        p.error(f"--load-rates {args.load_rates!r}: numbers or percentages, e.g. 1000,50%")
    if args.load_senders < 1:
        p.error("--load-senders must be at least 1")
    if min(args.messages, args.enqueue_messages, args.repeat, *args.processes) < 1:
        p.error("--messages, --enqueue-messages, --processes and --repeat must be at least 1")
    return args


def new_report(opts):
    with db.connect(db.with_database(opts.server, "postgres")) as conn:
        postgres = conn.execute("SHOW server_version").fetchone()[0]
        sync_commit = conn.execute("SHOW synchronous_commit").fetchone()[0]
    return {
        "started_at": now_iso(),
        "command": command_line(quote=True),
        "environment": {
            "commit": git_commit(),
            **description(),
            "postgres": postgres,
            "synchronous_commit": sync_commit,
            "load_average_at_start": os.getloadavg(),
        },
        "options": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(opts).items()},
        "systems": [],
    }


def run(opts):
    started = time.monotonic()
    RESULTS.mkdir(parents=True, exist_ok=True)
    if opts.log_dir == DEFAULT_LOG_DIR:  # the last run's logs only; another is the user's
        shutil.rmtree(opts.log_dir, ignore_errors=True)
    opts.log_dir.mkdir(parents=True, exist_ok=True)
    try:
        stats = Stats(opts.server)
    except psycopg.OperationalError as exc:
        print(f"cannot connect to {opts.server}/postgres: {exc}", file=sys.stderr)
        return 2
    with stats:
        report = new_report(opts)
        load = os.getloadavg()[0]
        if load > 0.5:
            print(
                f"note: the load average is {load:.1f} before the run: something else is busy,"
                " the figures will be noisy",
                file=sys.stderr,
            )
        ran = {}
        for name in opts.systems:
            system = SYSTEMS[name](opts)
            report["systems"].append(run_system(system, stats))
            ran[name] = (system, report["systems"][-1])
        if {"raw", "pgqueue"} <= ran.keys():
            paired_enqueue(ran["raw"], ran["pgqueue"], opts)
        report["paired_drains"] = paired_drains(ran, stats, opts)
    report["targets"] = build_targets(report["systems"], opts, report["paired_drains"])
    report["issue41_targets"] = issue41_targets(report["systems"], report["paired_drains"])
    report["environment"]["load_average_at_end"] = os.getloadavg()
    report["elapsed_s"] = time.monotonic() - started
    text = markdown(report)
    write_json(opts.json, report)
    opts.markdown.parent.mkdir(parents=True, exist_ok=True)
    opts.markdown.write_text(text)
    print()
    print(text)
    print(
        f"wrote {opts.json} and {opts.markdown} in {report['elapsed_s'] / 60:.1f} min"
        f" (worker logs in {opts.log_dir})"
    )
    return 0


def main(argv=None):
    return run_guarded(lambda: run(parse_args(argv)), failures=())
