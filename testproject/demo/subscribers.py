"""Subscribers of the demo project, found by the same autodiscovery as the
handlers. The test.* subscriptions are driven by the test suite's worker
processes; each writes a ledger row (demo.Handled: message_id is the
event's position, topic the subscription's name) in the delivery's
transaction, so the ledger shows exactly-once delivery and its order."""

import atexit
import os
import sys
import time

from django.dispatch import receiver

from django_pgqueue import signals, subscriber
from django_pgqueue.models import StreamEvent

from .handlers import FAILURES
from .models import Handled


def record(event):
    Handled.objects.create(
        message_id=event.position, topic=event.subscription, attempt=event.attempts, pid=os.getpid()
    )


def act(event):
    """Writes the ledger row, then does what the payload asks: "sleep"
    seconds, the first time only (the first process to create the file
    "once" sleeps; a delivery that is redone after a crash does not),
    "raise" (the name of one of handlers.FAILURES) on the first "times"
    attempts (all if absent), or "exit": calls sys.exit() (a failure like
    any other: SystemExit is no Exception, but the delivery records it)."""
    record(event)
    payload = event.payload if isinstance(event.payload, dict) else {}
    if payload.get("sleep"):
        try:
            with open(payload["once"], "x"):
                pass
        except FileExistsError:
            pass
        else:
            time.sleep(payload["sleep"])
    if payload.get("exit"):
        sys.exit(payload["exit"])
    times = payload.get("times")
    if "raise" in payload and (times is None or event.attempts <= times):
        raise FAILURES[payload["raise"]]()


@receiver(signals.subscription_blocked)
def exit_when_asked(sender, position, **kwargs):
    """A receiver of subscription_blocked that calls sys.exit() when the
    event that blocked asks for it ({"receiver_exit": status}): SystemExit
    is no Exception, so it ends the worker's delivery thread (the tests of a
    dead delivery thread). Reads that one key only: the event's payload may
    be more than Python can load."""
    status = (
        StreamEvent.objects.filter(pk=position, payload__has_key="receiver_exit")
        .values_list("payload__receiver_exit", flat=True)
        .first()
    )
    if status is not None:
        sys.exit(status)


@subscriber("test.events", name="test.ledger", backoff_base=0.05, backoff_cap=0.1)
def test_ledger(event):
    act(event)


@subscriber(
    "test.failing", name="test.blocking", max_attempts=2, backoff_base=0.05, backoff_cap=0.05
)
def test_blocking(event):
    act(event)


@subscriber(
    "test.failing",
    name="test.dead_lettering",
    on_failure="dead_letter",
    max_attempts=2,
    backoff_base=0.05,
    backoff_cap=0.05,
)
def test_dead_lettering(event):
    act(event)


# --- for python -m benchmarks streams -------------------------------------------------
# With PGQUEUE_BENCH_STREAM_LOG set, the positions delivered are kept in a
# list (an append per event) and written to that file, one a line, when the
# process exits: the benchmark checks that every event came once, in order.
BENCH_STREAM_LOG = os.environ.get("PGQUEUE_BENCH_STREAM_LOG")
bench_stream_seen: list[int] = []


@subscriber("bench.stream", name="bench.stream_noop")
def bench_stream_noop(event):
    """Does nothing with the event (beyond noting its position for the check)."""
    if BENCH_STREAM_LOG:
        bench_stream_seen.append(event.position)


def _write_bench_stream_log():
    with open(BENCH_STREAM_LOG, "w") as log:
        log.write("".join(f"{position}\n" for position in bench_stream_seen))


if BENCH_STREAM_LOG:
    atexit.register(_write_bench_stream_log)
