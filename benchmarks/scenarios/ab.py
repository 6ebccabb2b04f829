#!/usr/bin/env python
"""A/B: two source trees of django-pgqueue measured in turn, on the same
machine and database server, in the same run.

    .venv/bin/python -m benchmarks ab --before /tmp/before --after .
    .venv/bin/python -m benchmarks ab --before /tmp/before --after . --rounds 2 --messages 2000

Each tree is a checkout with its own virtualenv (``<tree>/.venv``, or
``--before-python``/``--after-python``). Every measurement runs the same
client script (benchmarks/peers/bench_pgqueue.py of this checkout: the
public API, ``enqueue`` and ``enqueue_many``) and the tree's own worker
command (``<tree>/testproject/manage.py pgqueue_worker``, ``--burst`` for
the drains) with the tree's Python, package and testproject, so that two
trees whose benchmarks differ are measured alike. Each tree has a database
of its own on ``--server`` (``<prefix>_before``, ``<prefix>_after``, and
their ``_other``), dropped, created and migrated by the tree at the start.

Scenarios (``--scenarios``): throughput of a ``--messages`` backlog by one
burst worker, ``atomic=False`` and ``atomic=True`` (jobs/s, first claim to
queue empty, watched in the database); ``enqueue()`` one per transaction
(``--enqueue-messages``); one ``enqueue_many()`` of ``--messages``; and the
latency p50, enqueue commit to handler start, of a listening worker
(``--latency-samples`` messages). ``--rounds`` rounds: in each, every
scenario runs on both trees one after the other, the order alternating
from round to round. Printed per scenario: each tree's median and range,
the median and range of the rounds' after/before ratios, and whether that
is within ``--tolerance`` (5%), better or worse. See benchmarks/README.md.
"""

import argparse
import shlex
import sys

from benchmarks.harness import cli
from benchmarks.harness.cli import run_with_logs
from benchmarks.harness.machine import description, git_commit, load_average
from benchmarks.harness.output import command_line, now_iso, write_json
from benchmarks.harness.pgstats import Stats
from benchmarks.harness.tree import Tree
from benchmarks.scenarios.compare import DEFAULT_PGQUEUE_WORKER_ARGS, StepFailed
from benchmarks.scenarios.compare.ab import SCENARIOS, SIDES, print_summary, run_rounds, summarize
from benchmarks.scenarios.compare.systems import PgQueue


def scenario_list(text):
    keys = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [key for key in keys if key not in SCENARIOS]
    if unknown or not keys:
        raise argparse.ArgumentTypeError(
            f"{text!r}: a comma-separated list of {', '.join(SCENARIOS)}"
        )
    return keys


def parse_args(argv):
    p = cli.parser(__doc__)
    p.add_argument("--before", required=True, help="the checkout measured as 'before'")
    p.add_argument("--after", required=True, help="the checkout measured as 'after'")
    p.add_argument("--before-python", help="its Python (default: <before>/.venv/bin/python)")
    p.add_argument("--after-python", help="its Python (default: <after>/.venv/bin/python)")
    p.add_argument("--rounds", type=int, default=8, help="rounds, each measuring both trees")
    p.add_argument(
        "--scenarios",
        type=scenario_list,
        default=",".join(SCENARIOS),
        help=f"comma-separated subset of {','.join(SCENARIOS)}",
    )
    p.add_argument("--messages", type=int, default=20000, help="backlog of a drain, enqueue_many")
    p.add_argument(
        "--enqueue-messages", type=int, default=2000, help="enqueue(), one per transaction"
    )
    cli.add_latency(p)
    p.add_argument(
        "--worker-args",
        default=DEFAULT_PGQUEUE_WORKER_ARGS,
        help="pgqueue_worker options of every worker (both trees)",
    )
    p.add_argument("--run-timeout", type=float, default=180.0, help="seconds a drain may take")
    p.add_argument("--tolerance", type=float, default=0.05, help="what counts as within the noise")
    cli.add_server(p, "pgqueue_bench_ab", "the trees' databases are PREFIX_before and PREFIX_after")
    cli.add_results(p, "also write every figure here as JSON")
    args = p.parse_args(argv)
    cli.check_server(p, args)
    if min(args.rounds, args.messages, args.enqueue_messages, args.latency_samples) < 1:
        p.error("--rounds, --messages, --enqueue-messages and --latency-samples must be >= 1")
    args.trees = {
        "before": Tree.at(args.before, args.before_python),
        "after": Tree.at(args.after, args.after_python),
    }
    for side, tree in args.trees.items():
        if not (tree.testproject / "manage.py").exists():
            p.error(f"--{side} {tree.root}: no testproject/manage.py")
        if not tree.python.exists():
            p.error(f"--{side}: no Python at {tree.python} (give --{side}-python)")
    # What the shared System machinery reads (the compare scenario's options).
    args.pgqueue_worker_args = args.worker_args
    args.worker_args = {}
    args.skip_install = True
    return args


def set_up(opts):
    """One PgQueue system per tree, its database created and migrated by the
    tree; checks that the client imports the tree's own package."""
    systems = {}
    for side in SIDES:
        tree = opts.trees[side]
        system = PgQueue(opts, name=side, tree=tree)
        system.info = system.client("info")
        location = system.info.get("location", "")
        if not location.startswith(str(tree.root)):
            raise StepFailed(f"{side}: the client imported django_pgqueue from {location}")
        system.setup_database()
        print(
            f"{side:6} {tree.root} ({git_commit(tree.root)}), {tree.python},"
            f" django-pgqueue from {location}, database {system.dbname}",
            file=sys.stderr,
        )
        systems[side] = system
    return systems


def run(opts, logs):
    opts.log_dir = logs.path
    with Stats(opts.server) as stats:
        systems = set_up(opts)
        result = {
            "started_at": now_iso(),
            "command": command_line(quote=True),
            "machine": {**description(), "load_average_start": load_average()},
            "trees": {
                side: {"root": str(t.root), "python": str(t.python), "commit": git_commit(t.root)}
                for side, t in opts.trees.items()
            },
            "worker_args": shlex.split(opts.pgqueue_worker_args),
            "options": {
                k: v for k, v in vars(opts).items() if k not in ("trees", "log_dir", "worker_args")
            },
        }
        result["rounds"] = run_rounds(systems, stats, opts, opts.scenarios)
    result["summary"] = summarize(result["rounds"], opts.tolerance)
    result["machine"]["load_average_end"] = load_average()
    print(
        f"\nA/B, {opts.rounds} rounds in turn: before = {opts.trees['before'].root},"
        f" after = {opts.trees['after'].root}; worker {opts.pgqueue_worker_args}"
    )
    print_summary(result["summary"])
    if opts.json:
        write_json(opts.json, result)
        print(f"\nwrote {opts.json}")
    return 0


def main(argv=None):
    opts = parse_args(argv)
    return run_with_logs(
        "pgqueue-ab-", opts.keep_logs, lambda logs: run(opts, logs), (StepFailed,), "FAILED"
    )
