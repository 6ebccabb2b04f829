#!/usr/bin/env python
"""django-pgqueue's side of benchmarks/compare.py. Runs in the repo's .venv,
in the testproject (settings from DATABASE_URL / OTHER_DATABASE_URL, DEBUG
off), like benchmarks/throughput.py.

The worker is ``testproject/manage.py pgqueue_worker`` (compare.py starts it).
Handlers (testproject/demo/handlers.py): ``bench.noop`` (atomic=True),
``bench.noop_nonatomic`` (atomic=False), ``bench.latency`` (atomic=False:
appends "id start" to BENCH_LATENCY_FILE, as the peers' handlers do). Enqueue:
``enqueue(topic, payload)`` in autocommit (one transaction each); bulk:
``enqueue_many(items, topic=...)``, one statement.
"""

import os
import sys
from pathlib import Path

import _common

# The testproject of the tree under test: this checkout's, or another's
# (benchmarks/ab.py runs this client against two trees).
TESTPROJECT = Path(
    os.environ.get("BENCH_TESTPROJECT") or Path(__file__).resolve().parents[2] / "testproject"
)
TOPICS = {"atomic": "bench.noop", "nonatomic": "bench.noop_nonatomic", "latency": "bench.latency"}


def main(argv=None):
    args = _common.parser(__doc__.split("\n\n")[0]).parse_args(argv)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "testproject.settings")
    sys.path.insert(0, str(TESTPROJECT))
    import django

    django.setup()
    from django.db import connection

    import django_pgqueue
    from django_pgqueue import conf, enqueue, enqueue_many

    topic = TOPICS.get(args.variant or "atomic", args.variant)
    if args.op == "info":
        _common.answer_info(
            ("django-pgqueue", "django", "psycopg"),
            poll_interval=conf.get("POLL_INTERVAL"),
            heartbeat_interval=conf.get("HEARTBEAT_INTERVAL"),
            keep_finished=conf.get("KEEP_FINISHED"),  # the history: on unless 0
            location=str(Path(django_pgqueue.__file__).resolve().parent),
        )
    elif args.op == "enqueue-single":
        enqueue(topic, {"n": -1})  # warm up, not timed
        with connection.cursor() as cursor:
            cursor.execute("DELETE FROM django_pgqueue_message")

        def run():
            for i in range(args.n):
                enqueue(topic, {"n": i})

        _common.emit({"seconds": _common.timed(run), "n": args.n})
    elif args.op == "enqueue-bulk":
        items = [{"payload": {"n": i}} for i in range(args.n)]
        _common.emit(
            {"seconds": _common.timed(lambda: enqueue_many(items, topic=topic)), "n": args.n}
        )
    elif args.op == "latency-enqueue":
        connection.ensure_connection()
        if connection.in_atomic_block:
            raise SystemExit("the connection is inside a transaction")

        def one(key):
            # autocommit: committed on return; the handler records the message's id
            return enqueue(TOPICS["latency"], {"i": key}).pk

        def batch(keys):  # one INSERT, one transaction
            items = [{"payload": {"i": key}} for key in keys]
            return [m.pk for m in enqueue_many(items, topic=TOPICS["latency"])]

        _common.emit(_common.latency_loop(one, args, batch))
    else:
        raise SystemExit(f"unknown op {args.op!r}")


if __name__ == "__main__":
    main()
