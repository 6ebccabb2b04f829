#!/usr/bin/env python
"""A fair queue of messages in partitions beside plain messages: drain messages/s.

One bench database (``--database-url``; its ``_other`` companion is
created and migrated too, for the testproject's second alias), one queue,
``tenants``, set up as docs/howto/tenants.rst does: nothing configured
(every queue is claimed fair, round-robin between the partitions with
ready messages), the messages given a partition key by ``enqueue_many``.
The run refuses a ``PGQUEUE_JSON`` that gives the queue ``"fair": False``.
In each round, in turn (the order alternating from round to round), two
sides on that same queue, the tables emptied before each: ``plain``,
``--messages`` messages of ``--topic`` (a no-op handler of the
testproject) without a key; ``partitioned``, as many with keys spread over
``--partitions`` tenants (message i's key ``tenant-<i % partitions>``,
interleaved as if many tenants enqueued at once). Each side's messages are
enqueued with one ``enqueue_many(queue="tenants")`` (timed; checked: the
keyed ones all have their round, the plain ones none), the queue table
vacuumed, then drained by one ``manage.py pgqueue_worker --burst --queues
tenants --subscriptions none --no-schedules`` with the same options for
both: messages/s, first claim to queue empty, watched from a connection of
its own. Reported: each round's figures, their medians and ranges, and the
partitioned/plain ratio (median and range over the rounds) against
``--target`` (issue 41, target 6: 0.8).

    .venv/bin/python -m benchmarks partitioned                 # 20,000 messages, 3 rounds
    .venv/bin/python -m benchmarks partitioned --messages 5000 --rounds 2   # a quick look
    .venv/bin/python -m benchmarks partitioned --partitions 10000   # more tenants
    .venv/bin/python -m benchmarks partitioned --topic bench.noop_nonatomic   # atomic=False
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

DEFAULT_URL = "postgres://postgres@127.0.0.1:5432/pgqueue_bench_partitioned"
# Both sides' queue: one name, so that they differ in their keys alone.
QUEUE = "tenants"
SIDES = ("plain", "partitioned")

NUMBERS = (  # (option, type, default, help)
    ("--messages", int, 20_000, "messages enqueued and drained per side and round"),
    ("--partitions", int, 100, "tenants the partitioned side's keys are spread over"),
    ("--rounds", int, 3, "rounds; the two sides take turns within each"),
    ("--target", float, 0.8, "the partitioned side's messages/s as a share of plain's to reach"),
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
        help=f"pgqueue_worker options for both drains, beside --burst --queues {QUEUE}"
        " --subscriptions none --no-schedules ('': the command's defaults)",
    )
    cli.add_database_url(parser, "BENCH_PARTITIONED_DATABASE_URL", DEFAULT_URL)
    cli.add_results(parser, "also write every round's figures as JSON")
    args = parser.parse_args(argv)
    if args.messages < 1 or args.rounds < 1 or args.partitions < 1:
        parser.error("--messages, --partitions and --rounds must be at least 1")
    cli.require_bench_database(parser, args.database_url)
    problem = unfair_problem(os.environ.get("PGQUEUE_JSON"))
    if problem:
        parser.error(problem)
    return args


def unfair_problem(settings_json):
    """Why the environment's ``PGQUEUE_JSON`` would not let the queue be
    claimed fair (tenants.rst: ``"fair": False`` turns the rotation off), or None."""
    try:
        settings = json.loads(settings_json or "{}")
    except ValueError as exc:
        return f"PGQUEUE_JSON is not JSON: {exc}"
    queues = settings.get("QUEUES") if isinstance(settings, dict) else None
    options = (queues or {}).get(QUEUE) if isinstance(queues, dict) else None
    if isinstance(options, dict) and options.get("fair") is False:
        return f'PGQUEUE_JSON gives the queue {QUEUE!r} "fair": False: it would not be fair'
    return None


def partition_key(i, partitions):
    """Message i's key: the tenants in turn, as if many enqueued at once."""
    return f"tenant-{i % partitions}"


def empty_tables():
    """The tables a drain writes, emptied: each drain starts from the same
    state (a queue's rounds live in its messages' rows)."""
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
    db.truncate(tables)


def vacuum(url):
    """The queue table vacuumed and analysed before the drain (as the other
    scenarios do)."""
    with db.connect(url) as conn:
        conn.execute("VACUUM ANALYZE django_pgqueue_message")


def enqueue(side, topic, count, partitions):
    """(seconds of one enqueue_many() of ``count`` messages, the first one's
    id): without a key (plain), or each with its tenant's (partitioned)."""
    from django_pgqueue import enqueue_many

    if side == "partitioned":
        items = [
            {"payload": {"n": i}, "partition_key": partition_key(i, partitions)}
            for i in range(count)
        ]
    else:
        items = [{"payload": {"n": i}} for i in range(count)]
    began = time.perf_counter()
    messages = enqueue_many(items, topic=topic, queue=QUEUE)
    return time.perf_counter() - began, messages[0].pk


def check_placed(what, side, count, partitions):
    """The ``count`` messages just enqueued are all in the queue, keyed
    over ``partitions`` tenants each with its round (partitioned), or
    without a key nor round (plain): the fair claim has rounds to take
    turns by, or the plain claim has none."""
    from django_pgqueue.models import Message

    mine = Message.objects.filter(queue=QUEUE)
    total = mine.count()
    if side == "partitioned":
        placed = mine.filter(partition_key__isnull=False, fair_tag__isnull=False).count()
        tenants = mine.values("partition_key").distinct().count()
        expected_tenants = min(partitions, count)
    else:
        placed = mine.filter(partition_key__isnull=True, fair_tag__isnull=True).count()
        tenants = expected_tenants = 0
    if (total, placed, tenants) != (count, count, expected_tenants):
        raise CheckFailed(
            f"{what}: {total} message(s) in {QUEUE}, {placed} as {side} expects"
            f" (not {count}), in {tenants} partition(s) (not {expected_tenants})"
        )


def drain(bench, url, name, first, timeout):
    """Seconds from the first claim to the queue empty, one burst worker
    of the queue draining, watched from a connection of its own."""
    monitor = DrainMonitor(url, (CLAIMED_SQL, [first]), (EMPTY_SQL, []), adaptive=True)
    monitor.start()
    options = ["--burst", "--queues", QUEUE, "--subscriptions", "none", "--no-schedules"]
    worker = bench.worker(name, options)
    try:
        worker.finish(timeout)
    finally:
        monitor.stop()
    worker.check_clean(name)
    if monitor.drain_s is None:
        raise CheckFailed(f"{name}: the drain's start or end was not seen ({worker.log_path})")
    return monitor.drain_s


def check_drained(what):
    """Nothing left nor dead-lettered."""
    from django_pgqueue.models import DeadLetter, Message

    left = Message.objects.count()
    dead = DeadLetter.objects.count()
    if left or dead:
        raise CheckFailed(f"{what}: {left} message(s) left, {dead} dead letter(s)")


def run_side(bench, args, side, name):
    empty_tables()
    enqueue_s, first = enqueue(side, args.topic, args.messages, args.partitions)
    check_placed(name, side, args.messages, args.partitions)
    vacuum(args.database_url)
    drain_s = drain(bench, args.database_url, name, first, args.timeout)
    check_drained(name)
    return {"enqueue_s": enqueue_s, "drain_s": drain_s, "per_s": args.messages / drain_s}


def report(args, rounds):
    plain = [r["plain"] for r in rounds]
    keyed = [r["partitioned"] for r in rounds]
    ratios = round_ratios((k["per_s"], p["per_s"]) for k, p in zip(keyed, plain, strict=True))
    rows = [
        ["plain: enqueue_many(), s", *figure([p["enqueue_s"] for p in plain], ".2f")],
        ["partitioned: enqueue_many(), s", *figure([k["enqueue_s"] for k in keyed], ".2f")],
        ["plain: messages/s", *figure([p["per_s"] for p in plain], ",.0f")],
        ["partitioned: messages/s", *figure([k["per_s"] for k in keyed], ",.0f")],
        ["ratio partitioned/plain", *figure(ratios, ".2f")],
    ]
    heading = (
        f"{args.messages:,} messages in {min(args.partitions, args.messages):,} partitions"
        f" beside as many without a key, on the fair queue {QUEUE!r}"
        f" ({db.database_name(args.database_url)}), topic {args.topic}, {args.rounds}"
        f" round(s) in turn; worker: --burst {args.worker_args or '(defaults)'}"
    )
    claim = f"partitioned messages/s >= {args.target:g} x plain messages/s"
    return sides.report(heading, rows, ratios, args.target, claim)


def run(args, logs):
    url = args.database_url
    env = db.pgqueue_env(url)  # OTHER_DATABASE_URL: the name + _other
    db.recreate_database(url)
    db.recreate_database(db.other_url(url))
    db.migrate(env)
    db.setup_django(env)
    from django_pgqueue import conf

    if QUEUE in conf.unfair_queues():  # (parse_args refused it already)
        raise CheckFailed(f'the queue {QUEUE!r} is configured "fair": False')
    bench = Bench(url, env, logs.path, worker_args=shlex.split(args.worker_args))
    rounds = sides.run_rounds(
        args.rounds, SIDES, lambda side, name: run_side(bench, args, side, name)
    )
    empty_tables()
    sides.write_results(args, rounds, report(args, rounds))
    return 0


def main(argv=None):
    args = parse_args(argv)
    return run_with_logs("pgqueue-bench-partitioned-", args.keep_logs, lambda logs: run(args, logs))
