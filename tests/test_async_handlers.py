"""Async handlers (``async def``, atomic=False) on the worker's event loop,
against the real database: many at once in one worker, a timeout that
cancels the coroutine, a cancellation asked, kill -9 and SIGTERM of real
``manage.py pgqueue_worker`` processes. The handler is the demo's
``test.async_wait``: it awaits ``asyncio.sleep``, counted while it waits."""

import signal

import pytest
from demo import handlers as demo_handlers
from demo.models import Handled

from django_pgqueue import cancel, enqueue, enqueue_many, handler, registry
from django_pgqueue.models import DeadLetter, Message, Status
from django_pgqueue.worker import Worker
from django_pgqueue.worker.config import WorkerConfig

from .conftest import running_worker, wait_until

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def counted():
    demo_handlers.ASYNC_RUNNING.update(now=0, most=0)
    yield demo_handlers.ASYNC_RUNNING


def waiting(count, seconds, **payload):
    return enqueue_many(
        [{"payload": {"seconds": seconds, "n": i, **payload}} for i in range(count)],
        topic="test.async_wait",
    )


def test_a_worker_runs_hundreds_of_async_handlers_at_once(counted):
    """600 handlers that each wait a second: one worker with two threads
    runs at least 500 at once (counted by the handlers) and finishes them
    all, each once."""
    messages = waiting(600, 1.0)
    worker = Worker(concurrency=2, async_concurrency=1000, burst=True, batch_size=200)
    assert worker.run() == 600
    assert counted["most"] >= 500, counted
    assert Handled.objects.count() == 600
    assert set(Handled.objects.values_list("message_id", flat=True)) == {m.pk for m in messages}
    assert not Message.objects.exists() and not DeadLetter.objects.exists()


def test_async_concurrency_bounds_the_coroutines(counted):
    waiting(30, 0.2)
    Worker(concurrency=1, async_concurrency=5, burst=True).run()
    assert counted["most"] == 5
    assert Handled.objects.count() == 30


def test_sync_handlers_run_beside_the_event_loop():
    waiting(20, 0.1)
    enqueue_many([{"payload": {"n": i}} for i in range(20)], topic="test.record")
    Worker(concurrency=2, async_concurrency=10, burst=True).run()
    assert Handled.objects.filter(topic="test.async_wait").count() == 20
    assert Handled.objects.filter(topic="test.record").count() == 20


def test_a_failed_async_handler_is_retried(counted):
    message = enqueue("test.async_wait", {"seconds": 0, "fail_times": 1})
    with running_worker(concurrency=1, async_concurrency=10, poll_interval=0.2):
        wait_until(lambda: not Message.objects.exists(), message="the retry to finish")
    assert list(Handled.objects.values_list("message_id", "attempt")) == [(message.pk, 2)]


@pytest.fixture
def async_policy_handler():
    """An async handler (atomic=False) that raises Retry(after=0) on its first
    attempt, then Permanent when its payload says so."""
    from django_pgqueue import Permanent, Retry

    @handler("test.async_policy", atomic=False)
    async def policy(message):
        if message.attempts == 1:
            raise Retry("not yet", after=0)
        if message.payload.get("refuse"):
            raise Permanent("never")
        return "fine"

    yield
    registry.unregister("test.async_policy")


def test_retry_and_permanent_from_an_async_handler(async_policy_handler):
    fine = enqueue("test.async_policy", {})
    refused = enqueue("test.async_policy", {"refuse": True})
    with running_worker(concurrency=1, async_concurrency=10, poll_interval=0.2):
        wait_until(lambda: not Message.objects.exists(), message="both messages to end")
    dead = DeadLetter.objects.get()
    assert (dead.message_id, dead.category, dead.attempts) == (refused.pk, "permanent", 2)
    assert "Permanent: never" in dead.reason
    assert not DeadLetter.objects.filter(message_id=fine.pk).exists()


@pytest.fixture
def slow_async_with_timeout():
    """An async handler (atomic=False) with a timeout of 0.5 s that waits as
    long as its payload says."""
    import asyncio

    @handler("test.async_timeout", atomic=False, timeout=0.5, backoff_base=0.05, backoff_cap=0.1)
    async def slow(message):
        try:
            await asyncio.sleep(message.payload["seconds"][message.attempts - 1])
        except asyncio.CancelledError:
            Handled_cancelled.append(message.attempts)
            raise
        return "done"

    Handled_cancelled = []
    yield Handled_cancelled
    registry.unregister("test.async_timeout")


def test_a_timeout_cancels_the_coroutine_and_the_message_is_retried(slow_async_with_timeout):
    message = enqueue("test.async_timeout", {"seconds": [30, 0]})
    with running_worker(concurrency=1, async_concurrency=10, poll_interval=0.2):
        wait_until(lambda: not Message.objects.exists(), message="the second attempt to finish")
    assert slow_async_with_timeout == [1], "the first run's coroutine was cancelled"
    assert not DeadLetter.objects.filter(message_id=message.pk).exists()


def test_a_cancellation_asked_reaches_the_coroutine(counted):
    message = enqueue("test.async_wait", {"seconds": 60, "catch_cancel": True})
    other = enqueue("test.async_wait", {"seconds": 60})
    with running_worker(concurrency=1, async_concurrency=10, poll_interval=0.2):
        wait_until(lambda: counted["now"] == 2, message="both handlers waiting")
        cancel([message.pk, other.pk])
        # The first catches CancelledError and returns: its run finished.
        wait_until(lambda: Handled.objects.filter(topic="cancel seen").exists())
        # The second lets it propagate: its message ends cancelled.
        wait_until(
            lambda: Message.objects.filter(pk=other.pk, status=Status.CANCELLED).exists(),
            message="the second message cancelled",
        )
        wait_until(lambda: not Message.objects.filter(pk=message.pk).exists())
    assert list(Handled.objects.values_list("message_id", "topic")) == [(message.pk, "cancel seen")]


def test_the_heartbeat_extends_a_coroutines_lease():
    """A run longer than its lease (2 s) keeps it: never rescued, run once."""
    message = enqueue("test.async_wait", {"seconds": 5})
    with running_worker(concurrency=1, async_concurrency=10, poll_interval=0.2, lease_seconds=2):
        wait_until(lambda: not Message.objects.exists(), message="the run to finish")
    assert list(Handled.objects.values_list("message_id", "attempt")) == [(message.pk, 1)]


def test_async_concurrency_is_checked():
    with pytest.raises(ValueError, match="async_concurrency must be a whole number from 1"):
        Worker(async_concurrency=0)
    with pytest.raises(ValueError, match="async_concurrency"):
        Worker(async_concurrency="many")


def test_without_an_async_handler_there_is_no_event_loop():
    """The event loop and its capacity exist only for a project with an
    async atomic=False handler (an atomic one runs in a thread)."""
    from django_pgqueue.worker.config import on_event_loop

    specs = registry.all_handlers()
    assert on_event_loop(specs)
    sync_only = [s for s in specs if not s.is_async]
    atomic_async = [s for s in specs if s.is_async and s.atomic]
    assert atomic_async and not on_event_loop(sync_only + atomic_async)
    config = WorkerConfig.resolve(
        queues=None, concurrency=4, batch_size=None, prefetch=None, burst=True,
        max_messages=None, shutdown_timeout=1, poll_interval=None, lease_seconds=None,
        worker_id=None, async_concurrency=50,
    )  # fmt: skip
    assert (config.async_concurrency, config.capacity) == (50, 4 + config.prefetch)


# --- real worker processes -------------------------------------------------------


def test_kill_9_mid_run_brings_the_messages_back_through_the_rescue(start_worker, counted):
    messages = waiting(50, 60)
    victim = start_worker("--lease", "2", "--concurrency", "1", "--async-concurrency", "100")
    wait_until(
        lambda: Message.objects.filter(status=Status.PROCESSING).count() == 50,
        message="the first worker to take every message",
    )
    victim.signal(signal.SIGKILL)
    victim.wait(timeout=10)
    assert not Handled.objects.exists()
    Message.objects.update(payload={"seconds": 0})  # the rescuer's runs finish at once
    rescuer = start_worker("--lease", "2", "--poll-interval", "0.5", "--async-concurrency", "100")
    wait_until(lambda: not Message.objects.exists(), message="the rescued messages handled")
    assert sorted(Handled.objects.values_list("message_id", flat=True)) == [m.pk for m in messages]
    assert set(Handled.objects.values_list("attempt", flat=True)) == {2}
    assert "rescued: worker lost" in rescuer.log()


def test_sigterm_waits_for_the_coroutines_then_cancels_them_and_hands_them_back(start_worker):
    quick = waiting(5, 2.0, mark_start=True)
    slow = waiting(5, 300, mark_start=True)
    worker = start_worker(
        "--concurrency", "1", "--async-concurrency", "100", "--shutdown-timeout", "4",
    )  # fmt: skip
    wait_until(
        lambda: Handled.objects.filter(topic="started").count() == 10,
        message="the worker to run every handler",
    )
    worker.signal(signal.SIGTERM)
    assert worker.wait(timeout=60) == 0, worker.log()
    # The quick ones finished within the grace; the slow ones were handed
    # back, their attempt not counted, and wait in the queue.
    done = Handled.objects.filter(topic="test.async_wait")
    assert sorted(done.values_list("message_id", flat=True)) == [m.pk for m in quick]
    left = Message.objects.order_by("pk")
    assert [m.pk for m in left] == [m.pk for m in slow]
    assert {(m.status, m.attempts) for m in left} == {(Status.WAITING, 0)}
    assert "handed back 5 unfinished message(s)" in worker.log()


# --- what surrounds a run: signals, history, tracing ----------------------------------


def test_an_async_run_sends_the_signals_and_is_kept_in_the_history():
    from django_pgqueue.models import FinishedMessage
    from django_pgqueue.signals import message_done, message_retried

    done, retried = [], []

    def on_done(sender, message, **kwargs):
        done.append(message.pk)

    def on_retried(sender, message, **kwargs):
        retried.append(message.pk)

    message_done.connect(on_done)
    message_retried.connect(on_retried)
    try:
        message = enqueue("test.async_wait", {"seconds": 0, "fail_times": 1})
        with running_worker(concurrency=1, async_concurrency=10, poll_interval=0.2):
            wait_until(lambda: not Message.objects.exists(), message="the retry to finish")
            wait_until(lambda: done == [message.pk], message="message_done sent")
    finally:
        message_done.disconnect(on_done)
        message_retried.disconnect(on_retried)
    assert retried == [message.pk]
    assert list(FinishedMessage.objects.values_list("message_id", "outcome", "attempts")) == [
        (message.pk, "done", 2)
    ]


@pytest.fixture
def traced_async_handler(monkeypatch):
    """Tracing on (the SDK's in-memory exporter), and an async handler that
    keeps the span current in its coroutine."""
    import asyncio

    from opentelemetry import trace

    from django_pgqueue import tracing

    from .test_tracing import Spans

    spans = Spans()
    monkeypatch.setattr(tracing, "_tracer", spans.pgqueue_tracer)
    seen = []

    @handler("test.async_traced", atomic=False)
    async def traced(message):
        await asyncio.sleep(0)
        seen.append(trace.get_current_span().get_span_context().span_id)

    yield spans, seen
    registry.unregister("test.async_traced")


def test_an_async_run_has_its_span_current_in_its_task(traced_async_handler):
    from opentelemetry.trace import SpanKind

    spans, seen = traced_async_handler
    enqueue_many([{"payload": {"n": i}} for i in range(3)], topic="test.async_traced")
    Worker(concurrency=1, async_concurrency=10, burst=True).run()
    producer = spans.one(SpanKind.PRODUCER)
    consumers = spans.finished(SpanKind.CONSUMER)
    assert len(consumers) == 3
    assert {c.context.trace_id for c in consumers} == {producer.context.trace_id}
    assert sorted(seen) == sorted(c.context.span_id for c in consumers)
    # (atomic=False: its acknowledgement is flushed after the run, as for a thread.)
    assert {c.attributes["pgqueue.outcome"] for c in consumers} == {"ack_pending"}


def test_an_end_that_cannot_be_recorded_leaves_the_message_to_its_lease(monkeypatch, caplog):
    """A settling thread that fails to record how a run ended (an error the
    failure policy does not catch) logs it, lets go of the message (its
    slot and the shutdown wait no more) and goes on: the message stays
    leased, for the rescue to bring back once its lease expires."""
    from django_pgqueue.worker.outcomes import Outcomes

    real = Outcomes.record_failure
    refused = []

    def fail_once(self, job, exc, category=None):
        if not refused:
            refused.append(job.message.pk)
            raise RuntimeError("the record could not be written")
        return real(self, job, exc, category)

    monkeypatch.setattr(Outcomes, "record_failure", fail_once)
    failing = enqueue("test.async_wait", {"seconds": 0, "fail_times": 1})
    fine = enqueue("test.async_wait", {"seconds": 0})
    worker = Worker(concurrency=1, async_concurrency=10, burst=True, shutdown_timeout=60)
    assert worker.run() == 1  # the other one; the burst worker did not wait for the first
    assert "could not be recorded" in caplog.text
    assert refused == [failing.pk]
    assert Handled.objects.filter(message_id=fine.pk).exists()
    row = Message.objects.get(pk=failing.pk)
    assert (row.status, row.attempts) == (Status.PROCESSING, 1), "left to its lease"
