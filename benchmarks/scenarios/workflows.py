#!/usr/bin/env python
"""A fan-out/fan-in workflow beside plain messages: enqueue seconds and drain steps/s.

One workflow of 1 + ``--steps`` + 1 steps (fetch, then ``--steps`` parts
after it, then a report after every part; all of ``--topic``, a no-op
handler of the testproject) is built (``Workflow.add``, timed) and
written (``Workflow.enqueue()`` and its commit, timed), then drained by one
``manage.py pgqueue_worker --burst``: steps/s = its steps / (first claim
of fetch to the workflow done, watched from a connection of its own). In
the same round, in turn (the order alternating from round to round), the
same number of plain messages of the same topic are enqueued with one
``enqueue_many()`` (timed) and drained by the same worker command with the
same options: messages/s, first claim to queue empty. Reported: each
round's figures, their medians and ranges, and the workflow/plain ratio
(median and range over the rounds) against ``--target`` (issue 37: 0.5).

    .venv/bin/python -m benchmarks workflows                     # 10,000 steps, 3 rounds
    .venv/bin/python -m benchmarks workflows --steps 2000 --rounds 1   # a quick look
"""

from __future__ import annotations

import shlex
import time

from benchmarks.harness import cli, db, sides
from benchmarks.harness.cli import run_with_logs
from benchmarks.harness.db import CheckFailed
from benchmarks.harness.monitor import DrainMonitor
from benchmarks.harness.numbers import round_ratios
from benchmarks.harness.sides import figure
from benchmarks.harness.worker import CLAIMED_SQL, EMPTY_SQL, TOPIC_ATOMIC, Bench

DEFAULT_URL = "postgres://postgres@127.0.0.1:5432/pgqueue_bench_workflows"
SIDES = ("workflow", "plain")

NUMBERS = (  # (option, type, default, help)
    ("--steps", int, 10_000, "parts of the fan-out (the workflow has 2 more: fetch, report);"
     " also the number of plain messages"),
    ("--rounds", int, 3, "rounds; the workflow and the plain messages take turns within each"),
    ("--target", float, 0.5, "the workflow's steps/s as a share of plain messages/s to reach"),
    ("--timeout", float, 900.0, "seconds a worker may run"),
)  # fmt: skip

# The workflow is done (its last step's acknowledgement moved it), seen
# from the monitor's connection.
DONE_SQL = (
    "SELECT coalesce((SELECT status = 'done' FROM django_pgqueue_workflow WHERE id = %s), false)"
)


def parse_args(argv):
    parser = cli.parser(__doc__, NUMBERS)
    parser.add_argument("--topic", default=TOPIC_ATOMIC, help="the steps' and messages' topic")
    parser.add_argument(
        "--worker-args",
        default="",
        help="pgqueue_worker options for both drains, beside --burst --subscriptions none"
        " --no-schedules ('': the command's defaults)",
    )
    cli.add_database_url(parser, "BENCH_WORKFLOWS_DATABASE_URL", DEFAULT_URL)
    cli.add_results(parser, "also write every round's figures as JSON")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.rounds < 1:
        parser.error("--steps and --rounds must be at least 1")
    cli.require_bench_database(parser, args.database_url)
    return args


def empty_tables():
    """Every table a run writes, emptied: each drain starts from the same state."""
    from demo.models import Handled

    from django_pgqueue import models

    tables = [
        model._meta.db_table
        for model in (
            models.Message,
            models.DeadLetter,
            models.FinishedMessage,
            models.OutcomeCount,
            models.Workflow,
            models.WorkflowStep,
            models.WorkflowDependency,
            Handled,
        )
    ]
    db.truncate(tables)


def vacuum(url):
    """The tables the drain reads, vacuumed and analysed (as the other
    scenarios do their queue before a drain)."""
    with db.connect(url) as conn:
        for table_name in (
            "django_pgqueue_message",
            "django_pgqueue_workflow",
            "django_pgqueue_workflowstep",
            "django_pgqueue_workflowdependency",
        ):
            conn.execute(f"VACUUM ANALYZE {table_name}")


def enqueue_workflow(topic, steps):
    """(seconds to build it, seconds to write it, its id, the fetch step's message id)."""
    from django.db import transaction

    from django_pgqueue import Workflow
    from django_pgqueue.models import Message

    began = time.perf_counter()
    wf = Workflow(name="bench fan-out/fan-in")
    fetch = wf.add(topic, {"step": "fetch"}, name="fetch")
    parts = [wf.add(topic, {"part": i}, name=f"part-{i}", after=[fetch]) for i in range(steps)]
    wf.add(topic, {"step": "report"}, name="report", after=parts)
    built = time.perf_counter()
    with transaction.atomic():
        run = wf.enqueue()
    written = time.perf_counter()
    first = Message.objects.values_list("pk", flat=True).get()  # fetch, the only one released
    return built - began, written - built, run.pk, first


def enqueue_plain(topic, steps):
    """(seconds of one enqueue_many() of ``steps`` messages, the first one's id)."""
    from django_pgqueue import enqueue_many

    began = time.perf_counter()
    messages = enqueue_many([{"payload": {"part": i}} for i in range(steps)], topic=topic)
    return time.perf_counter() - began, messages[0].pk


def drain(bench, url, name, claimed, finished, timeout):
    """Seconds from the first claim to ``finished``, one burst worker draining."""
    monitor = DrainMonitor(url, claimed, finished, adaptive=True)
    monitor.start()
    worker = bench.worker(name, ["--burst", "--subscriptions", "none", "--no-schedules"])
    try:
        worker.finish(timeout)
    finally:
        monitor.stop()
    worker.check_clean(name)
    if monitor.drain_s is None:
        raise CheckFailed(f"{name}: the drain's start or end was not seen ({worker.log_path})")
    return monitor.drain_s


def check_drained(what, workflow_id=None):
    from django_pgqueue.models import DeadLetter, Message, Workflow

    left, dead = Message.objects.count(), DeadLetter.objects.count()
    if left or dead:
        raise CheckFailed(f"{what}: {left} message(s) left, {dead} dead letter(s)")
    if workflow_id is not None:
        status = Workflow.objects.values_list("status", flat=True).get(pk=workflow_id)
        if status != "done":
            raise CheckFailed(f"{what}: the workflow is {status}, not done")


def run_workflow(bench, args, name):
    empty_tables()
    build_s, enqueue_s, workflow_id, first = enqueue_workflow(args.topic, args.steps)
    vacuum(bench.url)
    drain_s = drain(
        bench, bench.url, name, (CLAIMED_SQL, [first]), (DONE_SQL, [workflow_id]), args.timeout
    )
    check_drained(name, workflow_id)
    return {"build_s": build_s, "enqueue_s": enqueue_s, "drain_s": drain_s,
            "per_s": (args.steps + 2) / drain_s}  # fmt: skip


def run_plain(bench, args, name):
    empty_tables()
    enqueue_s, first = enqueue_plain(args.topic, args.steps)
    vacuum(bench.url)
    drain_s = drain(bench, bench.url, name, (CLAIMED_SQL, [first]), (EMPTY_SQL, []), args.timeout)
    check_drained(name)
    return {"enqueue_s": enqueue_s, "drain_s": drain_s, "per_s": args.steps / drain_s}


def report(args, rounds):
    workflow = [r["workflow"] for r in rounds]
    plain = [r["plain"] for r in rounds]
    ratios = round_ratios((w["per_s"], p["per_s"]) for w, p in zip(workflow, plain, strict=True))
    rows = [
        ["workflow: build (add x steps), s", *figure([w["build_s"] for w in workflow], ".2f")],
        ["workflow: enqueue() + commit, s", *figure([w["enqueue_s"] for w in workflow], ".2f")],
        ["plain: enqueue_many(), s", *figure([p["enqueue_s"] for p in plain], ".2f")],
        ["workflow: steps/s", *figure([w["per_s"] for w in workflow], ",.0f")],
        ["plain: messages/s", *figure([p["per_s"] for p in plain], ",.0f")],
        ["ratio workflow/plain", *figure(ratios, ".2f")],
    ]
    heading = (
        f"one workflow of 1 + {args.steps:,} + 1 steps beside {args.steps:,} plain messages,"
        f" topic {args.topic}, {args.rounds} round(s) in turn;"
        f" worker: --burst {args.worker_args or '(defaults)'}"
    )
    claim = f"workflow steps/s >= {args.target:g} x plain messages/s"
    return sides.report(heading, rows, ratios, args.target, claim)


def run(args, logs):
    url = args.database_url
    env = db.pgqueue_env(url)
    db.recreate_database(url)
    db.recreate_database(db.other_url(url))
    db.migrate(env)
    db.setup_django(env)
    bench = Bench(url, env, logs.path, worker_args=shlex.split(args.worker_args))

    def measure(side, name):
        return (run_workflow if side == "workflow" else run_plain)(bench, args, name)

    rounds = sides.run_rounds(args.rounds, SIDES, measure)
    empty_tables()
    sides.write_results(args, rounds, report(args, rounds))
    return 0


def main(argv=None):
    args = parse_args(argv)
    return run_with_logs("pgqueue-bench-workflows-", args.keep_logs, lambda logs: run(args, logs))
