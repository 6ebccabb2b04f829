#!/usr/bin/env python
"""Ordered stream delivery: events/s of one subscription served by a burst worker.

Publishes ``--events`` (100,000) events to one stream, then runs one
``manage.py pgqueue_worker --burst --subscriptions bench.stream_noop``
(a no-op subscriber, testproject/demo/subscribers.py) and watches the
subscription's row from a connection of its own: events/s from the first
checkpoint move to the checkpoint at the last event, the worker's CPU time
per event, and a check that the subscriber saw every event once, in
``(xid, position)`` order. ``--trees`` measures several source trees in
turn, round after round (before and after a change). See benchmarks/README.md.

    .venv/bin/python -m benchmarks streams [--events 100000] [--rounds 3]
    .venv/bin/python -m benchmarks streams --trees /tmp/streams-before,. --rounds 5

The measurement is in benchmarks/scenarios/streams/.
"""

import shlex
import sys

from benchmarks.harness import cli, db
from benchmarks.harness.cli import run_with_logs
from benchmarks.harness.machine import description, git_commit, load_average
from benchmarks.harness.numbers import in_turn, median, round_ratios, spread
from benchmarks.harness.output import command_line, now_iso, table, write_json
from benchmarks.harness.pgstats import Stats
from benchmarks.harness.tree import Tree
from benchmarks.harness.worker import TOPIC_NONATOMIC, Bench
from benchmarks.scenarios.one_worker.burst import Burst, measure_startup, throughput_run
from benchmarks.scenarios.streams import delivery

DEFAULT_URL = "postgres://postgres@127.0.0.1:5432/pgqueue_bench_streams"
GOAL = 10_000  # events/s per subscription (issue 27)

NUMBERS = (  # (option, type, default, help)
    ("--events", int, 100_000, "events per run"),
    ("--per-transaction", int, 1000, "events per publishing transaction (interleaved in pairs)"),
    ("--rounds", int, 1, "runs per tree; the trees take turns within a round"),
    ("--queue-messages", int, 0, "also drain this many bench.noop_nonatomic messages per round"
     " (--concurrency 4 --batch-size 100), for comparison; 0: no"),
    ("--timeout", float, 600.0, "seconds a worker may run"),
)  # fmt: skip


def parse_args(argv):
    parser = cli.parser(__doc__, NUMBERS)
    parser.add_argument(
        "--trees",
        default=".",
        help="comma-separated source trees (checkouts with their testproject and .venv; '.':"
        " this one, with the Python running the benchmark) to"
        " measure in turn; each needs the bench.stream_noop subscriber of"
        " testproject/demo/subscribers.py",
    )
    parser.add_argument("--worker-args", default="", help="more pgqueue_worker options")
    cli.add_database_url(parser, "BENCH_STREAMS_DATABASE_URL", DEFAULT_URL)
    cli.add_results(parser, "also write every run's figures as JSON")
    args = parser.parse_args(argv)
    if args.events < 2 or args.per_transaction < 1 or args.rounds < 1:
        parser.error("--events must be at least 2, --per-transaction and --rounds at least 1")
    cli.require_bench_database(parser, args.database_url)
    return args


def summarize(runs, labels):
    """Per tree: the median and range of events/s and CPU per event; per
    later tree, the median of its rounds' ratios to the first tree."""
    rows, summary = [], {}
    for label in labels:
        mine = [r for r in runs if r.tree == label]
        rates = [r.events_per_s for r in mine]
        cpu = [r.cpu_us_per_event for r in mine if r.cpu_us_per_event is not None]
        low, high = spread(rates) or (None, None)
        summary[label] = {"events_per_s": median(rates), "cpu_us_per_event": median(cpu)}
        if label != labels[0]:
            base = [r.events_per_s for r in runs if r.tree == labels[0]]
            ratios = round_ratios(zip(rates, base, strict=False))
            summary[label]["ratio_to_first"] = median(ratios)
        rows.append(
            [
                label,
                len(mine),
                f"{median(rates):,.0f}",
                f"{low:,.0f}-{high:,.0f}" if low is not None else "",
                f"{median(cpu):.1f}" if cpu else "",
                f"{median([r.cpu_us_per_event_life for r in mine]):.1f}",
                f"{summary[label].get('ratio_to_first', 1.0):.2f}",
            ]
        )
    headers = ["tree", "runs", "events/s", "range", "cpu us/event", "life us/event", "x first"]
    print(table(headers, rows))
    return summary


def run(args, logs):
    url = args.database_url
    env = db.pgqueue_env(url)
    trees = [Tree.named(path.strip()) for path in args.trees.split(",")]
    labels = [str(tree.root) for tree in trees]
    for tree in trees:
        db.prepare([url, db.other_url(url)], env, tree)
    db.setup_django(env)
    worker_args = shlex.split(args.worker_args)
    runs, drains = [], []
    for round_index in range(args.rounds):
        for label in in_turn(round_index, labels):
            tree = trees[labels.index(label)]
            bench = Bench(url, env, logs.path, tree=tree, worker_args=worker_args)
            result = delivery.run(bench, f"r{round_index}-{len(runs)}", args.events,
                                  args.per_transaction, args.timeout)  # fmt: skip
            result.tree = label
            runs.append(result)
            print(
                f"  round {round_index + 1} {label}: {result.events_per_s:,.0f} events/s "
                f"({result.cpu_us_per_event or 0:.1f} us CPU/event, "
                f"box {result.machine_busy_percent or 0:.0f}%)",
                file=sys.stderr,
            )
        if args.queue_messages:
            drains.append(queue_drain(url, env, logs, args.queue_messages))
    delivery.reset(url)
    print(f"\n{args.events:,} events, {args.per_transaction} per transaction; goal {GOAL:,}/s")
    summary = summarize(runs, labels)
    if drains:
        rate = median([d.db_jobs_per_s for d in drains])
        print(f"queue drain, this tree, 4x100, atomic=False: {rate:,.0f} jobs/s (median)")
    if args.json:
        write_json(
            args.json,
            {
                "started_at": now_iso(),
                "command": command_line(),
                "commit": git_commit(),
                "machine": {**description(), "postgres": db.scalar("SHOW server_version")},
                "load_average": load_average(),
                "options": vars(args),
                "runs": [vars(r) for r in runs],
                "queue_drains": [vars(d) for d in drains],
                "summary": summary,
            },
        )
        print(f"wrote {args.json}")
    return 0


def queue_drain(url, env, logs, messages):
    """The message queue's drain in the same round, for comparison."""
    bench = Bench(url, env, logs.path, worker_args=["--subscriptions", "none"])
    with Stats(url) as stats:
        startup = measure_startup(bench, 4, 100, 1)
        return throughput_run(bench, stats, Burst(TOPIC_NONATOMIC, False, 4, 100, messages),
                              startup)  # fmt: skip


def main(argv=None):
    args = parse_args(argv)
    return run_with_logs("pgqueue-bench-streams-", args.keep_logs, lambda logs: run(args, logs))
