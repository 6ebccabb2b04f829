"""manage.py pgqueue_demo: enqueue a mix of demo messages, work them off with an
in-process worker in burst mode, and print what happened (the quick start that
./rundemo runs); then run a small workflow (steps that wait for other steps,
passing their results along) and a periodic schedule for a few seconds, and
show them. The handlers are the demo.* topics of demo/handlers.py."""

import argparse
import logging
import threading
import time
from collections import Counter

from django.core.management.base import BaseCommand, CommandError
from django.db.models.functions import Now

from demo.models import Handled
from django_pgqueue import Workflow, enqueue_many
from django_pgqueue.models import DeadLetter, Message, Schedule, ScheduleTick, Status
from django_pgqueue.schedules.spec import parse
from django_pgqueue.worker import Worker

QUEUE = "demo"  # a queue of its own: the demo's worker touches nothing else
MAX_COUNT = 1000
TIME_LIMIT = 60.0  # seconds for all bursts together
RETRY_HORIZON = 10.0  # after a burst, wait for retries due within this many seconds
SHOWN_DEAD_LETTERS = 5
# The periodic schedule the demo shows, as an entry of PGQUEUE["SCHEDULES"]
# would declare it: a message for demo.clock every second, on the demo queue.
SCHEDULE_NAME = "demo.clock"
SCHEDULE = {"every": 1, "topic": "demo.clock", "queue": QUEUE}
SCHEDULE_SECONDS = 3.5  # how long the scheduling worker runs
# The workflow the demo shows: a fetch, then its parts side by side, then a
# report once every part is done.
WORKFLOW_NAME = "demo.import"
WORKFLOW_PARTS = 3


def count_value(text):
    try:
        value = int(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if not 1 <= value <= MAX_COUNT:
        raise argparse.ArgumentTypeError(f"must be from 1 to {MAX_COUNT}, not {value}")
    return value


def demo_round(n):
    """The n-th round of the mix: 20 messages."""
    for i in range(8):  # handled at the first attempt
        yield {"topic": "demo.welcome_email", "payload": {"user_id": n * 8 + i}}
    for attempt in (2, 2, 3):  # ConnectionError until that attempt: retried, then handled
        yield {"topic": "demo.charge_card", "payload": {"order": n, "succeed_on_attempt": attempt}}
    # Never recovers: a dead letter (dependency) when its 3 attempts are used up.
    yield {
        "topic": "demo.charge_card",
        "payload": {"order": n, "succeed_on_attempt": 99},
        "max_attempts": 3,
    }
    for i in range(3):
        yield {"topic": "demo.import_row", "payload": {"sku": f"SKU-{n}-{i}", "row": i}}
    yield {"topic": "demo.import_row", "payload": {"row": 3}}  # no sku: Permanent, dead letter
    for quantity in (1, 5, 40):
        yield {
            "topic": "demo.reserve_stock",
            "payload": {"sku": f"SKU-{n}-0", "quantity": quantity},
        }
    # Over 100: ValidationError, a business rule said no: dead letter (business).
    yield {"topic": "demo.reserve_stock", "payload": {"sku": f"SKU-{n}-0", "quantity": 500}}


class Command(BaseCommand):
    help = (
        "Enqueue demo messages (some succeed, some are retried, some become dead letters), "
        "run a worker in burst mode until they are done, and print the outcome."
    )

    def add_arguments(self, parser):
        parser.add_argument(
            "--count",
            type=count_value,
            default=1,
            help=f"rounds of the 20-message mix to enqueue, 1 to {MAX_COUNT} (default: 1)",
        )

    def handle(self, *args, **options):
        try:  # call_command(count=...) skips argparse's type check
            count = count_value(options["count"])
        except argparse.ArgumentTypeError as exc:
            raise CommandError(f"--count: {exc}") from None
        verbose = options["verbosity"] >= 2
        started = time.monotonic()

        messages = enqueue_many([item for n in range(count) for item in demo_round(n)], queue=QUEUE)
        ids = [m.pk for m in messages]
        self.stdout.write(f"Enqueued {len(ids)} demo messages on queue {QUEUE!r}.")

        # The worker logs every claim and acknowledgement at INFO: only with -v 2.
        logger = logging.getLogger("django_pgqueue")
        level = logger.level
        if not verbose:
            logger.setLevel(logging.WARNING)
        try:
            self._work_off(ids, started + TIME_LIMIT)
            self.stdout.write(f"Done in {time.monotonic() - started:.1f}s.\n\n")
            self._report(ids)
            self._workflow()
            self._schedule()
        finally:
            logger.setLevel(level)
        self.stdout.write(
            "\nThe admin: run `python testproject/manage.py createsuperuser`, then\n"
            "`python testproject/manage.py runserver` and open http://127.0.0.1:8000/admin/"
        )

    def _work_off(self, ids, deadline):
        """Burst after burst. A burst ends when nothing is ready, but a failed
        message waits a moment (its backoff) before its retry is due: sleep
        until then and burst again, within the deadline."""
        for burst in range(1, 1000):
            # The project's own schedules are not the demo's business.
            worker = Worker(
                queues=[QUEUE], concurrency=4, burst=True, shutdown_timeout=5, schedules=False
            )
            timer = threading.Timer(max(0.0, deadline - time.monotonic()), worker.stop)
            timer.start()
            try:
                processed = worker.run()
            finally:
                timer.cancel()
            # The earliest waiting message of this run, and the database's clock.
            waiting = Message.objects.filter(pk__in=ids, status=Status.WAITING)
            nearest = waiting.annotate(db_now=Now()).order_by("run_at").first()
            line = f"Burst {burst}: {processed} attempt(s)"
            if nearest is None:
                self.stdout.write(line + ".")
                return
            due_in = max(0.0, (nearest.run_at - nearest.db_now).total_seconds())
            self.stdout.write(
                f"{line}; {waiting.count()} waiting to be retried, the next in {due_in:.1f}s."
            )
            if due_in > RETRY_HORIZON or time.monotonic() + due_in >= deadline:
                return
            time.sleep(due_in + 0.05)

    def _report(self, ids):
        handled = Handled.objects.filter(message_id__in=ids)
        handled_ids = set(handled.values_list("message_id", flat=True))
        handled_late = set(handled.filter(attempt__gt=1).values_list("message_id", flat=True))
        dead = DeadLetter.objects.filter(message_id__in=ids).order_by("message_id")
        dead_late = dead.filter(attempts__gt=1).count()
        categories = Counter(dead.values_list("category", flat=True))
        left = Counter(Message.objects.filter(pk__in=ids).values_list("status", flat=True))

        write = self.stdout.write
        write(f"Handled:       {len(handled_ids)} ({len(handled_late)} of them after retries)")
        write(f"Retried:       {len(handled_late) + dead_late} message(s) took more than 1 attempt")
        by_category = ", ".join(f"{name}: {n}" for name, n in sorted(categories.items()))
        write(f"Dead letters:  {sum(categories.values())} ({by_category or 'none'})")
        for letter in dead[:SHOWN_DEAD_LETTERS]:
            write(f"  #{letter.message_id} {letter.topic} [{letter.category}] {letter.reason}")
        if sum(categories.values()) > SHOWN_DEAD_LETTERS:
            write(f"  ... and {sum(categories.values()) - SHOWN_DEAD_LETTERS} more")
        still = ", ".join(f"{status}: {n}" for status, n in sorted(left.items()))
        write(f"Still queued:  {sum(left.values())}" + (f" ({still})" if still else ""))

    def _workflow(self):
        """One workflow: each step a message, held until the steps it follows
        are done, then handled by a burst worker like any other; the report
        step reads the parts' results."""
        write = self.stdout.write
        wf = Workflow(name=WORKFLOW_NAME)
        fetch = wf.add("demo.import_fetch", {"file": 42}, name="fetch", queue=QUEUE)
        parts = [
            wf.add("demo.import_part", {"part": i}, name=f"part-{i}", after=[fetch], queue=QUEUE)
            for i in range(1, WORKFLOW_PARTS + 1)
        ]
        wf.add("demo.import_report", {"file": 42}, name="report", after=parts, queue=QUEUE)
        run = wf.enqueue()
        write(
            f"\nA workflow ({WORKFLOW_NAME!r}, id {run.pk}): "
            f"fetch -> {WORKFLOW_PARTS} parts side by side -> report"
        )
        Worker(queues=[QUEUE], concurrency=4, burst=True, shutdown_timeout=5, schedules=False).run()
        write("  " + ", ".join(f"{name}: {state}" for name, state in run.steps().items()))
        status = run.status()
        shown = f"; the report's result: {run.result('report')}" if status == "done" else ""
        write(f"  status: {status}{shown}")
        write(
            "Each step is a message; a step is released in the transaction that acknowledges\n"
            "the last step it follows (the admin's Workflows page draws its graph)."
        )

    def _schedule(self):
        """A worker runs the schedule for a few seconds: one message per tick,
        each naming its schedule and tick, handled like any message."""
        write = self.stdout.write
        entry = {SCHEDULE_NAME: SCHEDULE}
        write(f"\nA periodic schedule: PGQUEUE['SCHEDULES'] = {entry!r}")
        spec = parse(SCHEDULE_NAME, SCHEDULE)
        ScheduleTick.objects.filter(schedule=SCHEDULE_NAME).delete()  # an earlier demo's
        worker = Worker(queues=[QUEUE], concurrency=2, schedules=[spec], shutdown_timeout=5)
        timer = threading.Timer(SCHEDULE_SECONDS, worker.stop)
        timer.start()
        try:
            worker.run()
        finally:
            timer.cancel()
        # A tick enqueued as the worker stopped is handled too, by a burst
        # worker without the scheduler: every tick shown is handled.
        Worker(queues=[QUEUE], concurrency=2, burst=True, shutdown_timeout=5, schedules=False).run()
        ticks = list(ScheduleTick.objects.filter(schedule=SCHEDULE_NAME).order_by("tick"))
        handled = Handled.objects.filter(message_id__in=[t.message_id for t in ticks])
        handled_ids = set(handled.values_list("message_id", flat=True))
        write(
            f"A worker ran for {SCHEDULE_SECONDS}s ({spec.describe().lower()}): "
            f"{len(ticks)} ticks, one message each, {len(handled_ids)} handled"
        )
        for tick in ticks:
            done = "handled" if tick.message_id in handled_ids else "waiting"
            write(
                f"  tick {tick.tick.time().isoformat('seconds')}: message #{tick.message_id} {done}"
            )
        write(
            "Each message carries the headers pgqueue-schedule and pgqueue-scheduled-at; with\n"
            "any number of workers each tick is one message (pgqueue_schedules list, the admin's\n"
            "Schedules page for the schedules of your settings)."
        )
        # Not a schedule of the project's settings: leave no row for the admin to list.
        Schedule.objects.filter(name=SCHEDULE_NAME).delete()
