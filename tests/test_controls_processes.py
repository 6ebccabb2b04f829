"""Run-time control with four real ``manage.py pgqueue_worker`` processes:
pause and resume take effect within a second on every worker, a global
concurrency limit is never exceeded and is reached, a global rate holds,
and a running message cancelled mid-handler ends cancelled and never runs
again.

Times are measured from the state change (the commit of pause_queue,
resume_queue or cancel: the call has returned) to the effect seen in the
database: handler starts (``test.started`` commits its ledger row as it
starts: atomic=False) and rows sampled every 50 ms from a connection of
this process. The workers run with --prefetch 0, so a claim is a start:
a message claimed just before a pause may still start, one claimed after
may not.
"""

import threading
import time

import pytest
from demo.models import Handled
from django.utils import timezone

from django_pgqueue import cancel, enqueue_many, pause_queue, resume_queue
from django_pgqueue.models import Message, Status

from .conftest import raw_connection, wait_until

pytestmark = pytest.mark.slow

WORKERS = 4
SAMPLE_EVERY = 0.05  # seconds
BOUND = 1.0  # seconds: the "within one second"


def start_four(start_worker, *args, pgqueue=None, count=WORKERS):
    options = ["--prefetch", "0", "--poll-interval", "5", "--log-level", "WARNING"]
    return [start_worker(*args, *options, pgqueue=pgqueue) for _ in range(count)]


def starts(ids):
    """{message id: when its handler started} of ``ids``."""
    return dict(Handled.objects.filter(message_id__in=ids).values_list("message_id", "handled_at"))


class Sampler:
    """Counts a queue's processing rows every 50 ms from its own connection,
    and notes when each message was first seen processing."""

    def __init__(self, queue):
        self.queue = queue
        self.counts = []  # (time, processing)
        self.first_seen = {}  # message id -> time first seen processing
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        with raw_connection(autocommit=True) as conn:
            while not self._stop.is_set():
                at = timezone.now()
                ids = [
                    row[0]
                    for row in conn.execute(
                        "SELECT id FROM django_pgqueue_message WHERE queue = %s "
                        "AND status = 'processing'",
                        [self.queue],
                    )
                ]
                self.counts.append((at, len(ids)))
                for pk in ids:
                    self.first_seen.setdefault(pk, at)
                self._stop.wait(SAMPLE_EVERY)

    def stop(self):
        self._stop.set()
        self._thread.join(timeout=10)
        return self


def test_pause_stops_every_worker_within_a_second_and_resume_restarts_them(start_worker):
    paused_ids = [
        m.pk
        for m in enqueue_many(
            [{"payload": {"seconds": 0.2}}] * 600, topic="test.started", queue="a"
        )
    ]
    other_ids = [
        m.pk
        for m in enqueue_many(
            [{"payload": {"seconds": 0.2}}] * 600, topic="test.started", queue="b"
        )
    ]
    # A worker claims from its queues in their order: two workers put each
    # queue first, so that both run (neither waits for the other to drain).
    for order in ("a,b", "b,a"):
        start_four(start_worker, "--queues", order, "--concurrency", "2", count=WORKERS // 2)
    wait_until(
        lambda: len(starts(paused_ids)) >= 10 and len(starts(other_ids)) >= 10,
        timeout=60,
        message="every queue to be worked on",
    )
    sampler = Sampler("a")
    try:
        pause_queue("a")
        paused_at = timezone.now()  # committed by now: pause_queue returned
        time.sleep(3)
        resume_queue("a")
        resumed_at = timezone.now()
        wait_until(
            lambda: any(t > resumed_at for t in starts(paused_ids).values()),
            timeout=60,
            message="queue a to be claimed from again",
        )
    finally:
        sampler.stop()

    a_starts = sorted(starts(paused_ids).values())
    # The last start of queue a before the resume, from the pause's commit
    # (negative: the last one came before pause_queue returned).
    late = (max(t for t in a_starts if t <= resumed_at) - paused_at).total_seconds()
    seen_paused = [t for t in sampler.first_seen.values() if paused_at < t <= resumed_at]
    last_seen = (max(seen_paused, default=paused_at) - paused_at).total_seconds()
    first_after = min(t for t in a_starts if t > resumed_at)
    resumed_in = (first_after - resumed_at).total_seconds()
    b_while_paused = [t for t in starts(other_ids).values() if paused_at < t <= resumed_at]
    print(
        f"pause: last start of queue a {late:.3f}s after the pause (last first-seen "
        f"processing {last_seen:.3f}s); first start {resumed_in:.3f}s after the resume; "
        f"queue b started {len(b_while_paused)} meanwhile"
    )
    assert late <= BOUND, f"queue a still started a message {late:.3f}s after the pause"
    assert last_seen <= BOUND, f"a message of queue a was claimed {last_seen:.3f}s after"
    assert resumed_in <= BOUND, f"queue a started again only {resumed_in:.3f}s after the resume"
    assert len(b_while_paused) >= 20, "queue b did not keep running while a was paused"


def test_a_global_concurrency_limit_is_never_exceeded_and_is_reached(start_worker):
    ids = [m.pk for m in enqueue_many([{"payload": {"seconds": 0.3}}] * 40,
                                      topic="test.started", queue="pay")]  # fmt: skip
    sampler = Sampler("pay")
    start_four(
        start_worker, "--queues", "pay", "--concurrency", "4",
        pgqueue={"QUEUES": {"pay": {"concurrency": 3}}},
    )  # fmt: skip
    wait_until(lambda: len(starts(ids)) == 40, timeout=90, message="all 40 to start")
    wait_until(lambda: not Message.objects.filter(queue="pay").exists(), timeout=60)
    sampler.stop()
    most = max(count for _, count in sampler.counts)
    at_three = sum(count == 3 for _, count in sampler.counts)
    print(f"concurrency 3: {len(sampler.counts)} samples, most {most}, at 3 in {at_three}")
    assert most == 3, f"at most 3 processing at once, all workers together; saw {most}"
    assert at_three >= 10, "the limit of 3 was hardly reached"


def test_a_global_rate_starts_200_in_5_seconds_at_40_per_second(start_worker):
    ids = [m.pk for m in enqueue_many([{"payload": {}}] * 400,
                                      topic="test.started", queue="mail")]  # fmt: skip
    start_four(
        start_worker, "--queues", "mail", "--concurrency", "4",
        pgqueue={"QUEUES": {"mail": {"rate": "40/s"}}},
    )  # fmt: skip
    first = wait_until(lambda: min(starts(ids).values(), default=None), timeout=60)
    # The window is over once a start comes after it, or the clock passed it
    # (a loaded machine may start nothing for a while: that is a slower rate).
    wait_until(
        lambda: (timezone.now() - first).total_seconds() >= 5.5,
        interval=0.2,
        message="the end of the 5 s window",
    )
    window = [t for t in starts(ids).values() if (t - first).total_seconds() < 5]
    per_second = [
        sum(1 for t in window if second <= (t - first).total_seconds() < second + 1)
        for second in range(5)
    ]
    print(f"rate 40/s: {len(window)} started in the first 5 s; per second {per_second}")
    assert 180 <= len(window) <= 220, f"40/s for 5 s starts 200 +- 10%, not {len(window)}"


def test_a_running_message_cancelled_mid_handler_ends_cancelled_and_never_runs_again(
    start_worker,
):
    (message,) = enqueue_many([{"payload": {"seconds": 60}}], topic="test.cancellable")
    start_four(start_worker, "--concurrency", "2", "--lease", "5")
    wait_until(
        lambda: Message.objects.filter(pk=message.pk, status=Status.PROCESSING).exists(),
        timeout=60,
        message="a worker to start the handler",
    )
    time.sleep(0.5)  # well into the handler
    result = cancel([message])
    asked_at = time.monotonic()
    assert result.requested == 1
    wait_until(
        lambda: Message.objects.filter(pk=message.pk, status=Status.CANCELLED).exists(),
        timeout=60,
        interval=0.01,
        message="the run to end cancelled",
    )
    ended_in = time.monotonic() - asked_at
    # Longer than a lease (5 s) and a poll: a rescue or a retry would show by now.
    time.sleep(7)
    row = Message.objects.get(pk=message.pk)
    print(f"cancel: the running handler stopped and its message was cancelled {ended_in:.3f}s on")
    assert ended_in <= BOUND, f"the worker was told only after {ended_in:.3f}s"
    assert (row.status, row.attempts, row.lease_token) == (Status.CANCELLED, 1, None)
    assert "stopped early" in row.last_error
    assert not Handled.objects.filter(message_id=message.pk).exists(), "not rolled back"
