#!/usr/bin/env python
"""enqueue_many() of a large list at several chunk sizes, in turn.

``enqueue_many`` sends more than ``django_pgqueue.enqueuing.STREAM_CHUNK``
messages as several INSERTs of that many rows, pipelined in one
transaction: the server inserts one chunk while Python checks the next.
This times one ``enqueue_many(items, topic=...)`` of ``--messages``
(20,000) no-op messages, as ``compare.py`` fills its queue, in a fresh
process per call (the figure includes what a first call costs), with
``STREAM_CHUNK`` set to each of ``--chunks`` in turn, ``--rounds`` (8)
rounds in rotating order; per chunk size: the median and every round's
rate. The table is truncated before each call.

It runs on a database of its own, ``--database-url`` (default
``postgres://postgres@127.0.0.1:5432/pgqueue_bench_enqueue``, created and
migrated through the testproject if missing; its name must contain
"bench").

    .venv/bin/python benchmarks/enqueue_many_chunks.py
    .venv/bin/python benchmarks/enqueue_many_chunks.py --chunks 500,1000,2000,4000 --rounds 12
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from harness import db
from harness.cli import positive_ints, require_bench_database
from harness.machine import git_commit

DEFAULT_URL = "postgres://postgres@127.0.0.1:5432/pgqueue_bench_enqueue"


def child(chunk, messages):
    """One timed enqueue_many in this (fresh) process; prints its rate."""
    db.setup_django(dict(os.environ, DJANGO_SETTINGS_MODULE="testproject.settings"))
    from django.db import connection
    from harness import internals

    from django_pgqueue import enqueue_many

    internals.set_enqueue_many_chunk(chunk)
    with connection.cursor() as cursor:
        cursor.execute("TRUNCATE django_pgqueue_message")
    items = [{"payload": {"n": i}} for i in range(messages)]
    started = time.perf_counter()
    done = enqueue_many(items, topic="bench.noop")
    seconds = time.perf_counter() - started
    if len(done) != messages or any(m.pk is None for m in done):
        raise SystemExit(f"enqueue_many returned {len(done)} messages, not {messages} saved")
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM django_pgqueue_message")
        stored = cursor.fetchone()[0]
        cursor.execute("TRUNCATE django_pgqueue_message")
    if stored != messages:
        raise SystemExit(f"{stored} rows stored, not {messages}")
    print(json.dumps({"per_s": messages / seconds}))


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--chunks", type=positive_ints, default=[500, 1000, 2000])
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument(
        "--database-url",
        default=os.environ.get("BENCH_ENQUEUE_DATABASE_URL", DEFAULT_URL),
        help="its name must contain 'bench' (created and migrated if missing, emptied)",
    )
    parser.add_argument("--child", nargs=2, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(*args.child)
        return 0
    require_bench_database(parser, args.database_url)
    if args.messages < 1 or args.rounds < 1:
        parser.error("--messages and --rounds must be at least 1")
    env = db.pgqueue_env(args.database_url)
    db.prepare([args.database_url, db.other_url(args.database_url)], env)
    rates = {chunk: [] for chunk in args.chunks}
    for n in range(args.rounds):
        order = args.chunks[n % len(args.chunks) :] + args.chunks[: n % len(args.chunks)]
        for chunk in order:
            done = subprocess.run(
                [sys.executable, __file__, "--child", str(chunk), str(args.messages)],
                env=env,
                capture_output=True,
                text=True,
                check=False,
            )
            if done.returncode != 0:
                print(done.stdout + done.stderr, file=sys.stderr)
                return 1
            rates[chunk].append(json.loads(done.stdout.splitlines()[-1])["per_s"])
        print(f"  round {n + 1}/{args.rounds} done", file=sys.stderr)
    commit = git_commit()
    print(f"enqueue_many() of {args.messages:,} messages, a fresh process per call, at {commit}")
    for chunk, values in rates.items():
        shown = ", ".join(f"{v:,.0f}" for v in values)
        print(f"  STREAM_CHUNK {chunk:6,}: median {statistics.median(values):9,.0f}/s  ({shown})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
