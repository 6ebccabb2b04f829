#!/usr/bin/env python
"""CPU instructions per message of one burst worker, counted by valgrind:
the figure wall-clock runs on a shared, noisy machine cannot settle.

    .venv/bin/python -m benchmarks instructions --tree . --tree /tmp/before
    .venv/bin/python -m benchmarks instructions --tree . --messages 500 --scenarios bench.noop

For each tree (a checkout with its own ``.venv``; default: this one) and
each topic (``bench.noop``, atomic=True, and ``bench.noop_nonatomic``,
atomic=False: the testproject's no-op handlers), a database of its own is
filled with ``--messages`` and then twice as many messages, and
``manage.py pgqueue_worker --burst --log-level WARNING`` drains each under
``valgrind --tool=callgrind``. Start-up and exit cost the same in both, so
the difference of the two totals over ``--messages`` is what one message
costs the worker: claim, load, handler call, acknowledgement, and the
threads' bookkeeping. ``enqueue-single`` and ``enqueue-bulk`` do the same
for the client side (benchmarks/peers/bench_pgqueue.py: ``enqueue()`` one
per transaction, one ``enqueue_many()``); they count the client process
only, not the server's work. Counts are instructions, not time: the same on a
busy machine as on an idle one (to within the worker's timed loops, which
run a little longer under valgrind; repeat runs agree to about 1%).

Needs valgrind (apt-get install valgrind). About a minute per drain.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import tempfile
from pathlib import Path

from benchmarks.harness import db
from benchmarks.harness.cli import require_bench_database
from benchmarks.harness.processes import die_with_parent
from benchmarks.harness.tree import Tree
from benchmarks.harness.worker import TOPIC_ATOMIC, TOPIC_NONATOMIC
from benchmarks.scenarios.compare import PEERS

DEFAULT_URL = "postgres://postgres@127.0.0.1:5432/pgqueue_bench_instructions"
CLIENT = PEERS / "bench_pgqueue.py"
ENQUEUE_OPS = ("enqueue-single", "enqueue-bulk")
TOTALS = re.compile(r"^(?:summary|totals):\s+(\d+)", re.MULTILINE)


def instructions(argv: list[str], cwd: Path, env: dict[str, str], out: Path) -> int:
    """Instructions of the process ``argv`` from start to exit (valgrind's total)."""
    valgrind = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}"]
    done = subprocess.run(
        [*valgrind, *argv],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        preexec_fn=die_with_parent(),
    )
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed:\n{done.stderr[-3000:]}")
    match = TOTALS.search(out.read_text(errors="replace"))
    if match is None:
        raise SystemExit(f"no totals in {out}")
    return int(match.group(1))


def fresh_database(tree: Tree, url: str) -> dict[str, str]:
    env = db.pgqueue_env(url)
    db.recreate_database(url)
    db.recreate_database(db.other_url(url))
    db.migrate(env, tree)
    return env


def drain(tree: Tree, url: str, topic: str, messages: int, workdir: Path) -> float:
    """Per message of a burst worker draining ``topic``."""
    env = tree.env(fresh_database(tree, url))
    argv = tree.manage("pgqueue_worker", "--burst", "--log-level", "WARNING")
    totals = []
    for count in (messages, 2 * messages):
        db.fill_ready(url, topic, count)
        totals.append(instructions(argv, tree.testproject, env, workdir / f"{topic}-{count}"))
        left = db.fetch_row(url, "SELECT count(*) FROM django_pgqueue_message")[0]
        if left:
            raise SystemExit(f"{topic}: {left} messages left after the drain")
    return (totals[1] - totals[0]) / messages


def enqueue(tree: Tree, url: str, op: str, messages: int, workdir: Path) -> float:
    """Per message of the client (benchmarks/peers/bench_pgqueue.py, the
    public API) enqueuing with ``op``: enqueue-single, one enqueue() per
    transaction, or enqueue-bulk, one enqueue_many()."""
    env = tree.env(dict(fresh_database(tree, url), BENCH_TESTPROJECT=str(tree.testproject)))
    totals = []
    for count in (messages, 2 * messages):
        with db.connect(url) as conn:
            conn.execute("TRUNCATE django_pgqueue_message")
        argv = [str(tree.python), str(CLIENT), op, "--n", str(count), "--variant", "atomic"]
        totals.append(instructions(argv, tree.testproject, env, workdir / f"{op}-{count}"))
    return (totals[1] - totals[0]) / messages


def measure(tree: Tree, url: str, scenario: str, messages: int, workdir: Path) -> float:
    if scenario in ENQUEUE_OPS:
        return enqueue(tree, url, scenario, messages, workdir)
    return drain(tree, url, scenario, messages, workdir)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tree", action="append", help="a checkout with its .venv (repeatable)")
    p.add_argument("--messages", type=int, default=1000, help="the smaller drain (default 1000)")
    p.add_argument(
        "--scenarios",
        nargs="+",
        default=[TOPIC_ATOMIC, TOPIC_NONATOMIC, *ENQUEUE_OPS],
        help="handler topics to drain, and enqueue-single, enqueue-bulk (default: all four)",
    )
    p.add_argument(
        "--rounds", type=int, default=1, help="rounds, trees in turn, order alternating (default 1)"
    )
    p.add_argument("--database-url", default=DEFAULT_URL, help=f"default {DEFAULT_URL}")
    args = p.parse_args(argv)
    if args.messages < 1:
        p.error("--messages must be at least 1")
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    require_bench_database(p, args.database_url)
    trees = [Tree.named(root) for root in (args.tree or ["."])]
    figures: dict[tuple[str, str], list[float]] = {}
    print(f"{'round':<6} {'tree':<40} {'scenario':<22} instructions per message")
    with tempfile.TemporaryDirectory(prefix="pgqueue-instructions-") as tmp:
        for round_number in range(1, args.rounds + 1):
            # The trees in turn, the order alternating: a drift of the
            # machine over the run weighs on each tree alike.
            for tree in trees if round_number % 2 else trees[::-1]:
                for scenario in args.scenarios:
                    count = measure(tree, args.database_url, scenario, args.messages, Path(tmp))
                    figures.setdefault((str(tree.root), scenario), []).append(count)
                    print(
                        f"{round_number:<6} {str(tree.root):<40} {scenario:<22} {count:,.0f}",
                        flush=True,
                    )
    print(f"\n{'median of ' + str(args.rounds):<47} {'scenario':<22} instructions per message")
    for (root, scenario), counts in figures.items():
        spread = f"  (range {min(counts):,.0f} .. {max(counts):,.0f})" if len(counts) > 1 else ""
        print(f"{root:<47} {scenario:<22} {statistics.median(counts):,.0f}{spread}")
    return 0
