#!/usr/bin/env python
"""One burst worker draining no-op messages, for each set of worker options
in turn: what an option costs or buys, measured beside the others in the
same rounds. How the defaults of batch size, prefetch, concurrency and the
log level were chosen (docs/howto/sizing.rst).

    .venv/bin/python -m benchmarks worker-options
    .venv/bin/python -m benchmarks worker-options --topic bench.noop --rounds 5 \\
        --options "" "--log-level DEBUG" "--concurrency 8"

Each ``--options`` entry is a string of ``pgqueue_worker`` options added to
``--burst --subscriptions none`` ("" is the command's defaults; the
worker's log goes to a file, at the level the options give, INFO unless
they say otherwise). Per round and entry: fill the queue with
``--messages`` messages of ``--topic`` (the testproject's no-op handlers:
``bench.noop_nonatomic``, ``bench.noop`` for atomic=True), then time the
worker from its first claim to the queue's end (the same monitor as
the compare scenario) and take its CPU time (``wait4``) less its start-up's
(a burst worker with the same options on an empty queue, median of 3).
Reported per entry: the median jobs/s and CPU per message, and the median
of the rounds' ratios to the first entry.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import tempfile
from pathlib import Path

from benchmarks.harness import db
from benchmarks.harness.cli import require_bench_database
from benchmarks.harness.monitor import DrainMonitor
from benchmarks.harness.processes import Process
from benchmarks.harness.tree import Tree
from benchmarks.harness.worker import CLAIMED_SQL, EMPTY_SQL, TOPIC_NONATOMIC

DEFAULT_URL = "postgres://postgres@127.0.0.1:5432/pgqueue_bench_worker_options"
DEFAULT_OPTIONS = [
    "",
    "--log-level DEBUG",
    "--batch-size 100 --prefetch 200",
    "--batch-size 16 --prefetch 16",
    "--concurrency 2",
    "--concurrency 8",
]


def run_worker(tree: Tree, env: dict[str, str], options: str, log: Path) -> Process:
    argv = tree.manage("pgqueue_worker", "--burst", "--subscriptions", "none")
    return Process([*argv, *shlex.split(options)], env=env, cwd=tree.testproject, log_path=log)


def startup_cpu(tree: Tree, env: dict[str, str], url: str, options: str, log_dir: Path) -> float:
    """CPU seconds of a burst worker with ``options`` on an empty queue."""
    runs = []
    for i in range(3):
        db.fill_ready(url, TOPIC_NONATOMIC, 0)
        worker = run_worker(tree, env, options, log_dir / f"startup-{i}.log")
        if worker.wait(120) != 0:
            raise SystemExit(f"{options!r}: the worker exited {worker.returncode}")
        runs.append(worker.cpu_seconds)
    return statistics.median(runs)


def drain(tree, env, url, topic, messages, options, log_path) -> tuple[float, float]:
    """(jobs/s from the first claim to the queue's end, worker CPU seconds)."""
    db.fill_ready(url, topic, messages)
    (first,) = db.fetch_row(url, "SELECT min(id) FROM django_pgqueue_message")
    monitor = DrainMonitor(url, (CLAIMED_SQL, [first]), (EMPTY_SQL, []), adaptive=True)
    monitor.start()
    worker = run_worker(tree, env, options, log_path)
    code = worker.wait(600)
    monitor.stop()
    left = db.fetch_row(url, "SELECT count(*) FROM django_pgqueue_message")[0]
    if code != 0 or left or monitor.drain_s is None:
        raise SystemExit(f"{options!r}: exit {code}, {left} left ({log_path})")
    return messages / monitor.drain_s, worker.cpu_seconds


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--database-url", default=DEFAULT_URL)
    p.add_argument("--messages", type=int, default=50_000)
    p.add_argument("--topic", default=TOPIC_NONATOMIC)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--options", nargs="+", default=DEFAULT_OPTIONS)
    opts = p.parse_args(argv)
    require_bench_database(p, opts.database_url)
    url, tree = opts.database_url, Tree.here()
    # The handler passes what the worker's --log-level lets through, so
    # that a DEBUG line costs what it costs (formatted and written).
    env = tree.env(dict(db.pgqueue_env(url), PGQUEUE_LOG_LEVEL="DEBUG"))
    db.recreate_database(url)
    db.recreate_database(db.other_url(url))
    db.migrate(env, tree)
    log_dir = Path(tempfile.mkdtemp(prefix="bench-worker-options-"))
    startup = {o: startup_cpu(tree, env, url, o, log_dir) for o in opts.options}
    results: dict[str, list[tuple[float, float]]] = {o: [] for o in opts.options}
    for i in range(opts.rounds):
        for n, options in enumerate(opts.options):
            log = log_dir / f"r{i}-{n}.log"
            rate, cpu = drain(tree, env, url, opts.topic, opts.messages, options, log)
            per_message = (cpu - startup[options]) / opts.messages * 1e6
            results[options].append((rate, per_message))
            label = options or "(defaults)"
            print(f"round {i + 1} {label:40} {rate:9,.0f}/s {per_message:6.1f} us")
    base = results[opts.options[0]]
    print(f"\n{opts.messages:,} messages of {opts.topic}, median of {opts.rounds} rounds in turn")
    print(f"{'options':40} {'jobs/s':>9} {'x first':>8} {'CPU us/msg':>11}")
    for options, runs in results.items():
        rate = statistics.median(r for r, _ in runs)
        ratio = statistics.median(r / b for (r, _), (b, _) in zip(runs, base, strict=True))
        cpu = statistics.median(c for _, c in runs)
        print(f"{options or '(defaults)':40} {rate:9,.0f} {ratio:8.2f} {cpu:11.1f}")
    print(f"(logs in {log_dir})")
    return 0
