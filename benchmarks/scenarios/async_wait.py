#!/usr/bin/env python
"""Handlers that wait on the network, on the worker's event loop beside the
same wait in handler threads: seconds to drain and the worker's peak memory.

``--messages`` messages whose handler waits ``--seconds`` (the testproject's
``bench.async_wait``: ``await asyncio.sleep()``, atomic=False) are drained
by one ``manage.py pgqueue_worker --burst --async-concurrency N``; then as
many of ``bench.thread_wait`` (``time.sleep()`` in a sync handler,
atomic=False) by one worker with ``--concurrency --threads``. Each drain is
timed from the first claim to the queue empty, watched from a connection
of its own; the worker's peak RSS is sampled while it runs. Issue 39's
target: 2,000 messages of one second, ``--async-concurrency 1000``, all
done within 5 s.

    .venv/bin/python -m benchmarks async
    .venv/bin/python -m benchmarks async --messages 200 --rounds 1   # a quick look
"""

from __future__ import annotations

import sys

from benchmarks.harness import cli, db
from benchmarks.harness.cli import run_with_logs
from benchmarks.harness.db import CheckFailed
from benchmarks.harness.machine import load_average
from benchmarks.harness.monitor import DrainMonitor
from benchmarks.harness.numbers import in_turn, median, spread
from benchmarks.harness.output import command_line, fmt, table
from benchmarks.harness.worker import CLAIMED_SQL, EMPTY_SQL, Bench

DEFAULT_URL = "postgres://postgres@127.0.0.1:5432/pgqueue_bench_async"
ASYNC_TOPIC = "bench.async_wait"
THREAD_TOPIC = "bench.thread_wait"
SIDES = ("event loop", "threads")

NUMBERS = (  # (option, type, default, help)
    ("--messages", int, 2000, "messages per drain"),
    ("--seconds", float, 1.0, "how long each handler waits"),
    ("--async-concurrency", int, 1000, "the event loop's worker: --async-concurrency"),
    ("--threads", int, 50, "the thread-based worker: --concurrency (a database connection each)"),
    ("--rounds", int, 3, "rounds; the two workers take turns within each"),
    ("--target", float, 5.0, "seconds the event loop's drain may take at most"),
    ("--timeout", float, 900.0, "seconds a worker may run"),
)  # fmt: skip


def parse_args(argv):
    parser = cli.parser(__doc__, NUMBERS)
    cli.add_database_url(parser, "BENCH_ASYNC_DATABASE_URL", DEFAULT_URL)
    cli.add_results(parser, "also write every round's figures as JSON")
    args = parser.parse_args(argv)
    if min(args.messages, args.async_concurrency, args.threads, args.rounds) < 1:
        parser.error("--messages, --async-concurrency, --threads and --rounds must be at least 1")
    if args.seconds < 0:
        parser.error("--seconds must not be negative")
    cli.require_bench_database(parser, args.database_url)
    return args


def fill(url, topic, count, seconds):
    """``count`` messages of ``topic`` waiting ``seconds``; the first one's id."""
    from django_pgqueue import enqueue_many

    db.truncate()
    messages = enqueue_many([{"payload": {"seconds": seconds}} for _ in range(count)], topic=topic)
    with db.connect(url) as conn:
        conn.execute("VACUUM ANALYZE django_pgqueue_message")
    return messages[0].pk


def drain(bench, args, name, options):
    """(seconds from the first claim to the queue empty, the worker's peak RSS in MiB)."""
    from django_pgqueue.models import DeadLetter, Message

    first = fill(
        bench.url, ASYNC_TOPIC if name.endswith("loop") else THREAD_TOPIC, args.messages,
        args.seconds,
    )  # fmt: skip
    monitor = DrainMonitor(bench.url, (CLAIMED_SQL, [first]), (EMPTY_SQL, []), adaptive=True)
    monitor.start()
    worker = bench.worker(
        name.replace(" ", "-"), ["--burst", "--subscriptions", "none", "--no-schedules", *options]
    )
    try:
        worker.finish(args.timeout)
    finally:
        monitor.stop()
    worker.check_clean(name)
    if monitor.drain_s is None:
        raise CheckFailed(f"{name}: the drain's start or end was not seen ({worker.log_path})")
    left, dead = Message.objects.count(), DeadLetter.objects.count()
    if left or dead:
        raise CheckFailed(f"{name}: {left} message(s) left, {dead} dead letter(s)")
    return {"drain_s": monitor.drain_s, "peak_rss_mib": worker.peak_rss_mib}


def report(args, rounds):
    def figure(side, key, spec):
        values = [r[side][key] for r in rounds]
        low, high = spread(values) or (None, None)
        return [fmt(median(values), spec), f"{fmt(low, spec)}-{fmt(high, spec)}"]

    rows = []
    for side, how in (
        ("event loop", f"--async-concurrency {args.async_concurrency}"),
        ("threads", f"--concurrency {args.threads}"),
    ):
        rows.append([f"{side} ({how}): drain, s", *figure(side, "drain_s", ".2f")])
        rows.append([f"{side}: worker's peak RSS, MiB", *figure(side, "peak_rss_mib", ".0f")])
    print(
        f"\n{args.messages:,} messages whose handler waits {args.seconds:g} s, one burst worker"
        f" each, {args.rounds} round(s) in turn"
    )
    print(table(["", "median", "range"], rows))
    loop_s = median([r["event loop"]["drain_s"] for r in rounds])
    verdict = "met" if loop_s is not None and loop_s <= args.target else "MISSED"
    print(f"target: the event loop's drain within {args.target:g} s: {verdict}")
    load = load_average()
    if load:
        print(f"load average at the end: {' '.join(f'{x:.2f}' for x in load)}")
    return {"event_loop_drain_s": loop_s, "target": args.target, "met": verdict == "met"}


def run(args, logs):
    url = args.database_url
    env = db.pgqueue_env(url)
    db.recreate_database(url)
    db.recreate_database(db.other_url(url))
    db.migrate(env)
    db.setup_django(env)
    bench = Bench(url, env, logs.path)
    options = {
        "event loop": ["--concurrency", "4", "--async-concurrency", str(args.async_concurrency)],
        "threads": ["--concurrency", str(args.threads)],
    }
    rounds = []
    for index in range(args.rounds):
        figures = {}
        for side in in_turn(index, SIDES):
            figures[side] = drain(bench, args, f"r{index + 1} {side}", options[side])
            print(
                f"  round {index + 1} {side:10}: {figures[side]['drain_s']:.2f} s,"
                f" peak RSS {figures[side]['peak_rss_mib']:.0f} MiB",
                file=sys.stderr,
            )
        rounds.append(figures)
    summary = report(args, rounds)
    if args.json:
        from benchmarks.harness.output import write_json

        write_json(args.json, {"command": command_line(), "options": vars(args),
                               "rounds": rounds, "summary": summary})  # fmt: skip
        print(f"wrote {args.json}")
    return 0


def main(argv=None):
    args = parse_args(argv)
    return run_with_logs("pgqueue-bench-async-", args.keep_logs, lambda logs: run(args, logs))
