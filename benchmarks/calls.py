#!/usr/bin/env python
"""Python function calls per message of one burst worker, every thread
counted by yappi: how much interpreter work a message costs, a figure that
neither the machine's load nor valgrind's slowness moves much (only the
batching of acknowledgements, which follows the threads' timing).

    .venv/bin/python benchmarks/calls.py --tree . --tree /tmp/before
    .venv/bin/python benchmarks/calls.py --tree . --messages 5000 --topics bench.noop

For each tree (a checkout with its own ``.venv``, with yappi installed:
``<tree>/.venv/bin/pip install yappi``) and topic, a database of its own
is filled with ``--messages`` and then twice as many messages, each drained
by ``manage.py pgqueue_worker --burst`` under yappi. Start-up and exit make
the same calls in both, so the difference over ``--messages`` is what one
message costs: printed per tree, with the functions whose count per message
differs most between the first tree and each other one.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from harness.cli import require_bench_database
from harness.tree import Tree
from harness.worker import TOPIC_ATOMIC, TOPIC_NONATOMIC
from instructions import fill, fresh_database

DEFAULT_URL = "postgres://postgres@127.0.0.1:5432/pgqueue_bench_calls"

# Run in the tree's Python, in its testproject: the worker under yappi,
# then {function: calls} as JSON on the last line of stdout.
RUNNER = """
import collections, json, re, runpy, sys, yappi
sys.argv = ["manage.py", "pgqueue_worker", "--burst", "--log-level", "WARNING"]
yappi.set_clock_type("cpu")
yappi.start(builtins=True)
try:
    runpy.run_path("manage.py", run_name="__main__")
except SystemExit:
    pass
yappi.stop()
calls = collections.Counter()
for stat in yappi.get_func_stats():
    module = stat.module.rsplit("site-packages/", 1)[-1].rsplit("/", 1)[-1]
    name = re.sub(r" at 0x[0-9a-f]+", "", stat.name)  # a type's address differs per run
    calls[f"{module}:{name}"] += stat.ncall
print(json.dumps(calls))
"""


def calls(tree: Tree, url: str, topic: str, messages: int) -> dict[str, float]:
    """{function: calls per message} of a burst worker draining ``topic``."""
    env = tree.env(fresh_database(tree, url))
    drains = []
    for count in (messages, 2 * messages):
        fill(url, topic, count)
        done = subprocess.run(
            [str(tree.python), "-c", RUNNER],
            cwd=tree.testproject,
            env=env,
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            raise SystemExit(f"{tree.root}: the worker under yappi failed:\n{done.stderr[-3000:]}")
        drains.append(json.loads(done.stdout.strip().splitlines()[-1]))
    small, large = drains
    return {
        name: (large.get(name, 0) - small.get(name, 0)) / messages
        for name in set(small) | set(large)
    }


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tree", action="append", help="a checkout with its .venv (repeatable)")
    p.add_argument("--messages", type=int, default=5000, help="the smaller drain (default 5000)")
    p.add_argument("--topics", nargs="+", default=[TOPIC_NONATOMIC, TOPIC_ATOMIC])
    p.add_argument("--top", type=int, default=15, help="functions listed per comparison")
    p.add_argument("--database-url", default=DEFAULT_URL, help=f"default {DEFAULT_URL}")
    args = p.parse_args(argv)
    if args.messages < 1:
        p.error("--messages must be at least 1")
    require_bench_database(p, args.database_url)
    trees = [Tree.here() if root in (None, ".") else Tree.at(root) for root in (args.tree or ["."])]
    for topic in args.topics:
        counted = [calls(tree, args.database_url, topic, args.messages) for tree in trees]
        first = counted[0]
        for tree, counts in zip(trees, counted, strict=True):
            per_message = sum(counts.values())
            print(f"{topic:<22} {str(tree.root):<40} {per_message:8.1f} calls per message")
        for tree, counts in zip(trees[1:], counted[1:], strict=True):
            print(f"  most different, {trees[0].root} against {tree.root}:")
            names = sorted(
                set(first) | set(counts),
                key=lambda name: -abs(first.get(name, 0) - counts.get(name, 0)),
            )
            for name in names[: args.top]:
                a, b = first.get(name, 0), counts.get(name, 0)
                print(f"    {name:<60} {a:8.2f} {b:8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
