#!/usr/bin/env python
"""A queue routed to a second database beside a queue on the first: drain messages/s.

Two bench databases on one server: the first (``--database-url``, the
testproject's ``default`` alias) and a second (``--other-database-url``,
its ``other`` alias). The testproject runs with ``PGQUEUE_JSON`` naming two
queues, ``first`` on ``default`` and ``routed`` with ``{"database":
"other"}`` (docs/howto/databases.rst), and ``DATABASE_ROUTERS`` set to
``django_pgqueue.routers.QueueRouter``; both databases are dropped,
created and migrated (``migrate`` and ``migrate --database other``). In
each round, in turn (the order alternating from round to round), for each
queue: ``--messages`` plain messages of ``--topic`` (a no-op handler of the
testproject) enqueued with one ``enqueue_many(queue=...)`` (timed), the
queue's tables vacuumed, then drained by one ``manage.py pgqueue_worker
--burst --queues <queue>`` with the same options for both (the worker
serves the database of its queues): messages/s, first claim to queue empty,
watched from a connection of its own on that queue's database. Reported:
each round's figures, their medians and ranges, and the routed/first ratio
(median and range over the rounds) against ``--target`` (issue 41, target
6: 0.95).

    .venv/bin/python -m benchmarks routed                          # 20,000 messages, 3 rounds
    .venv/bin/python -m benchmarks routed --messages 5000 --rounds 2   # a quick look
    .venv/bin/python -m benchmarks routed --topic bench.noop_nonatomic  # atomic=False
"""

from __future__ import annotations

import json
import os
import shlex
import time

from benchmarks.harness import cli, db, sides
from benchmarks.harness.cli import run_with_logs
from benchmarks.harness.db import CheckFailed
from benchmarks.harness.monitor import DrainMonitor
from benchmarks.harness.numbers import round_ratios
from benchmarks.harness.sides import figure
from benchmarks.harness.worker import CLAIMED_SQL, EMPTY_SQL, TOPIC_ATOMIC, TOPIC_NONATOMIC, Bench

DEFAULT_URL = "postgres://postgres@127.0.0.1:5432/pgqueue_bench_routed"
OTHER_ENV = "BENCH_ROUTED_OTHER_DATABASE_URL"
ROUTER = "django_pgqueue.routers.QueueRouter"
# side -> (its queue, the testproject's alias of its database)
SIDES = {"first": ("first", "default"), "routed": ("routed", "other")}

NUMBERS = (  # (option, type, default, help)
    ("--messages", int, 20_000, "messages enqueued and drained per queue and round"),
    ("--rounds", int, 3, "rounds; the two queues take turns within each"),
    ("--target", float, 0.95, "the routed queue's messages/s as a share of the first's to reach"),
    ("--timeout", float, 900.0, "seconds a worker may run"),
)  # fmt: skip


def parse_args(argv):
    parser = cli.parser(__doc__, NUMBERS)
    parser.add_argument(
        "--topic",
        default=TOPIC_ATOMIC,
        help=f"the messages' topic ({TOPIC_ATOMIC}: atomic=True, {TOPIC_NONATOMIC}: atomic=False)",
    )
    parser.add_argument(
        "--worker-args",
        default="",
        help="pgqueue_worker options for both drains, beside --burst --queues QUEUE"
        " --subscriptions none --no-schedules ('': the command's defaults)",
    )
    cli.add_database_url(parser, "BENCH_ROUTED_DATABASE_URL", DEFAULT_URL)
    parser.add_argument(
        "--other-database-url",
        default=os.environ.get(OTHER_ENV),
        help="the second bench database, of the routed queue (its name must contain 'bench';"
        f" dropped and created by every run); default: --database-url's name + _other; env"
        f" {OTHER_ENV}",
    )
    cli.add_results(parser, "also write every round's figures as JSON")
    args = parser.parse_args(argv)
    if args.messages < 1 or args.rounds < 1:
        parser.error("--messages and --rounds must be at least 1")
    args.other_database_url = args.other_database_url or db.other_url(args.database_url)
    cli.require_bench_database(parser, args.database_url)
    cli.require_bench_database(parser, args.other_database_url)
    if db.database_name(args.database_url) == db.database_name(args.other_database_url):
        parser.error("--database-url and --other-database-url name the same database")
    return args


def bench_env(args):
    """The testproject's environment: both aliases, the two queues, the router."""
    settings = json.loads(os.environ.get("PGQUEUE_JSON") or "{}")
    queues = {"default": {}, "first": {}, "routed": {"database": "other"}}
    return dict(
        db.pgqueue_env(args.database_url),
        OTHER_DATABASE_URL=args.other_database_url,
        PGQUEUE_JSON=json.dumps({**settings, "QUEUES": queues}),
        DATABASE_ROUTERS=ROUTER,
    )


def empty_tables(urls):
    """The tables a drain writes, emptied on both databases: each drain
    starts from the same state."""
    from demo.models import Handled

    from django_pgqueue import models

    tables = [
        model._meta.db_table
        for model in (
            models.Message,
            models.DeadLetter,
            models.FinishedMessage,
            models.OutcomeCount,
            Handled,
        )
    ]
    for url in urls:
        with db.connect(url) as conn:
            conn.execute(f"TRUNCATE {', '.join(tables)} RESTART IDENTITY")


def vacuum(url):
    """The queue table vacuumed and analysed before the drain (as the other
    scenarios do)."""
    with db.connect(url) as conn:
        conn.execute("VACUUM ANALYZE django_pgqueue_message")


def enqueue(topic, queue, count):
    """(seconds of one enqueue_many() of ``count`` messages, the first one's id)."""
    from django_pgqueue import enqueue_many

    began = time.perf_counter()
    messages = enqueue_many([{"payload": {"n": i}} for i in range(count)], topic=topic, queue=queue)
    return time.perf_counter() - began, messages[0].pk


def drain(bench, url, name, queue, first, timeout):
    """Seconds from the first claim to the queue empty, one burst worker
    of ``queue`` draining, watched on its database ``url``."""
    monitor = DrainMonitor(url, (CLAIMED_SQL, [first]), (EMPTY_SQL, []), adaptive=True)
    monitor.start()
    options = ["--burst", "--queues", queue, "--subscriptions", "none", "--no-schedules"]
    worker = bench.worker(name, options)
    try:
        worker.finish(timeout)
    finally:
        monitor.stop()
    worker.check_clean(name)
    if monitor.drain_s is None:
        raise CheckFailed(f"{name}: the drain's start or end was not seen ({worker.log_path})")
    return monitor.drain_s


def check_placed(what, alias, queue, count):
    """The ``count`` messages just enqueued are all on ``alias`` (the
    monitor takes a missing first message for a claimed one)."""
    from django_pgqueue.models import Message

    for each in ("default", "other"):
        found = Message.objects.using(each).filter(queue=queue).count()
        expected = count if each == alias else 0
        if found != expected:
            raise CheckFailed(f"{what}: {found} message(s) of {queue} on {each}, not {expected}")


def check_drained(what):
    """Nothing left nor dead-lettered on either database."""
    from django_pgqueue.models import DeadLetter, Message

    for each in ("default", "other"):
        left = Message.objects.using(each).count()
        dead = DeadLetter.objects.using(each).count()
        if left or dead:
            raise CheckFailed(f"{what}: {left} message(s) left, {dead} dead letter(s) on {each}")


def run_side(bench, args, side, name):
    queue, alias = SIDES[side]
    url = args.database_url if alias == "default" else args.other_database_url
    empty_tables([args.database_url, args.other_database_url])
    enqueue_s, first = enqueue(args.topic, queue, args.messages)
    check_placed(name, alias, queue, args.messages)
    vacuum(url)
    drain_s = drain(bench, url, name, queue, first, args.timeout)
    check_drained(name)
    return {"enqueue_s": enqueue_s, "drain_s": drain_s, "per_s": args.messages / drain_s}


def report(args, rounds):
    first = [r["first"] for r in rounds]
    routed = [r["routed"] for r in rounds]
    ratios = round_ratios((r["per_s"], f["per_s"]) for r, f in zip(routed, first, strict=True))
    rows = [
        ["first: enqueue_many(), s", *figure([f["enqueue_s"] for f in first], ".2f")],
        ["routed: enqueue_many(), s", *figure([r["enqueue_s"] for r in routed], ".2f")],
        ["first: messages/s", *figure([f["per_s"] for f in first], ",.0f")],
        ["routed: messages/s", *figure([r["per_s"] for r in routed], ",.0f")],
        ["ratio routed/first", *figure(ratios, ".2f")],
    ]
    heading = (
        f"{args.messages:,} messages on a queue of the first database"
        f" ({db.database_name(args.database_url)}) beside as many on a queue routed to a"
        f" second ({db.database_name(args.other_database_url)}), topic {args.topic},"
        f" {args.rounds} round(s) in turn; worker: --burst {args.worker_args or '(defaults)'}"
    )
    claim = f"routed messages/s >= {args.target:g} x first messages/s"
    return sides.report(heading, rows, ratios, args.target, claim)


def run(args, logs):
    env = bench_env(args)
    db.recreate_database(args.database_url)
    db.recreate_database(args.other_database_url)
    db.migrate(env)
    # setup_django() copies only the databases' settings: the queues and
    # the router too, before Django reads its settings.
    os.environ["PGQUEUE_JSON"] = env["PGQUEUE_JSON"]
    os.environ["DATABASE_ROUTERS"] = env["DATABASE_ROUTERS"]
    db.setup_django(env)
    bench = Bench(args.database_url, env, logs.path, worker_args=shlex.split(args.worker_args))
    rounds = sides.run_rounds(
        args.rounds, list(SIDES), lambda side, name: run_side(bench, args, side, name)
    )
    empty_tables([args.database_url, args.other_database_url])
    sides.write_results(args, rounds, report(args, rounds))
    return 0


def main(argv=None):
    args = parse_args(argv)
    return run_with_logs("pgqueue-bench-routed-", args.keep_logs, lambda logs: run(args, logs))
