#!/usr/bin/env python
"""Prefetch against slow handlers: two workers share a backlog of handlers
that sleep, the second starting a moment after the first. A worker that
claims far ahead of its threads takes the backlog for itself and the other
one idles; the drain then takes as long as one worker's. This is what
chose ``--prefetch auto`` as the default (docs/howto/sizing.rst).

    .venv/bin/python benchmarks/prefetch.py
    .venv/bin/python benchmarks/prefetch.py --messages 200 --seconds 0.05 --rounds 3

For each setting in turn (``--settings``: worker options; by default the
automatic prefetch, a fixed prefetch of two batches, the earlier defaults of
batch 16 and prefetch 16, and no prefetch), ``--rounds`` times: fill the
queue with ``--messages`` messages of the testproject's ``test.sleep``
handler (atomic, it records a ``demo.Handled`` row with its process id, then
sleeps ``--seconds``), start a burst worker (``--concurrency 4``), another
one ``--stagger`` seconds later, and wait for both to exit. Reported per
setting (median of the rounds): the drain time, from the first handler's
start to the last one's end, that time against one worker's alone (0.5:
two workers shared it evenly; 1.0: one did it all), and the share the
second worker ran.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from harness import db
from harness.cli import require_bench_database
from harness.tree import Tree
from harness.worker import Bench

DEFAULT_URL = "postgres://postgres@127.0.0.1:5432/pgqueue_bench_prefetch"
SETTINGS = {
    "auto (default)": [],
    "fixed 200": ["--prefetch", "200"],
    "batch 16, prefetch 16 (earlier default)": ["--batch-size", "16", "--prefetch", "16"],
    "none": ["--prefetch", "0"],
}
CONCURRENCY = 4


def fill(url: str, count: int, seconds: float) -> None:
    with db.connect(url) as conn:
        conn.execute("TRUNCATE django_pgqueue_message, demo_handled")
        conn.execute(
            "INSERT INTO django_pgqueue_message (topic, payload)"
            " SELECT 'test.sleep', jsonb_build_object('seconds', %s::float8)"
            " FROM generate_series(1, %s)",
            [seconds, count],
        )
        conn.execute("ANALYZE django_pgqueue_message")


def one_round(bench: Bench, url: str, options: list[str], opts: argparse.Namespace, tag: str):
    """(drain seconds, share of the second worker) of one round."""
    fill(url, opts.messages, opts.seconds)
    worker_options = ["--burst", "--concurrency", str(CONCURRENCY), "--subscriptions", "none"]
    first = bench.worker(f"{tag}-first", [*worker_options, *options])
    time.sleep(opts.stagger)
    second = bench.worker(f"{tag}-second", [*worker_options, *options])
    limit = opts.messages * opts.seconds + 120
    for worker in (first, second):
        worker.finish(limit)
        worker.check_clean(tag)
    with db.connect(url) as conn:
        (left,) = conn.execute("SELECT count(*) FROM django_pgqueue_message").fetchone()
        rows = conn.execute(
            "SELECT pid, count(*), extract(epoch FROM min(handled_at))::float8,"
            " extract(epoch FROM max(handled_at))::float8 FROM demo_handled GROUP BY pid"
        ).fetchall()
    counts = {pid: count for pid, count, _, _ in rows}
    if left or sum(counts.values()) != opts.messages:
        raise SystemExit(f"{tag}: {left} message(s) left, handled {counts}")
    # From the first handler's start to the last one's end (a row is written
    # as its handler starts: add the sleep); the workers' start-up is left out.
    drain = max(r[3] for r in rows) + opts.seconds - min(r[2] for r in rows)
    return drain, counts.get(second.pid, 0) / opts.messages


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--database-url", default=DEFAULT_URL)
    p.add_argument("--messages", type=int, default=200)
    p.add_argument("--seconds", type=float, default=0.05, help="each handler's sleep")
    p.add_argument("--stagger", type=float, default=0.3, help="the second worker starts later")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS))
    opts = p.parse_args(argv)
    require_bench_database(p, opts.database_url)
    url = opts.database_url
    tree = Tree.here()
    env = db.pgqueue_env(url)
    db.recreate_database(url)
    db.recreate_database(db.other_url(url))
    db.migrate(env, tree)
    log_dir = Path(tempfile.mkdtemp(prefix="bench-prefetch-"))
    bench = Bench(url=url, env=env, log_dir=log_dir, tree=tree)
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in opts.settings}
    for i in range(opts.rounds):
        for name in opts.settings:  # in turn: each round sees the same machine
            drain, share = one_round(bench, url, SETTINGS[name], opts, f"r{i}-{len(results[name])}")
            results[name].append((drain, share))
            print(f"round {i + 1} {name:38} {drain:6.2f} s, second worker ran {share:.0%}")
    alone = opts.messages * opts.seconds / CONCURRENCY
    print(
        f"\n{opts.messages} messages of {opts.seconds:g} s, two workers of {CONCURRENCY} "
        f"threads, the second {opts.stagger:g} s later; one worker alone needs {alone:.2f} s"
    )
    print(f"{'setting':38} {'drain s':>8} {'x alone':>8} {'2nd worker':>10}")
    for name, runs in results.items():
        drain = statistics.median(d for d, _ in runs)
        share = statistics.median(s for _, s in runs)
        print(f"{name:38} {drain:8.2f} {drain / alone:8.2f} {share:10.0%}")
    print(f"(logs in {log_dir})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
