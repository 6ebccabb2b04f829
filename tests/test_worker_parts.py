"""The worker's parts through their own public methods, without a running
worker: the claim-size rule, the wake-up's reasons to claim, the backoff
after database errors, and the handler call shared with stream subscribers."""

import dataclasses
import threading
import time

import pytest

from django_pgqueue import registry
from django_pgqueue.db import RECONNECT_DELAY, RECONNECT_DELAY_CAP, Backoff
from django_pgqueue.exceptions import DuplicateHandler
from django_pgqueue.sql import claim as claim_sql
from django_pgqueue.worker.config import WorkerConfig
from django_pgqueue.worker.job import ACK_PENDING, DONE, FAILED, LOST, Job
from django_pgqueue.worker.ledger import Ledger
from django_pgqueue.worker.wakeup import Wakeup


def config(concurrency=4, batch_size=8, prefetch=8, async_concurrency=0):
    return WorkerConfig(
        worker_id="w1",
        hostname="host",
        queues=["default"],
        concurrency=concurrency,
        batch_size=batch_size,
        prefetch=prefetch,
        burst=False,
        max_messages=None,
        shutdown_timeout=1.0,
        poll_interval=1.0,
        lease_seconds=60.0,
        listen=False,
        heartbeat_interval=10.0,
        async_concurrency=async_concurrency,
    )


class FakeMessage:
    def __init__(self, pk, group_key=None):
        self.pk = self.id = pk
        self.group_key = group_key


class BuiltJob(Job):
    """A claimed job whose message is given, not decoded from a claim row."""

    def __init__(self, message, spec=None):
        row = [None] * (claim_sql.ROW_ID + 1)
        row[claim_sql.ROW_ID] = message.pk
        super().__init__(row=tuple(row), spec=spec)
        self.given = message

    @property
    def message(self):
        return self.given


def job(pk, group_key=None):
    return BuiltJob(FakeMessage(pk, group_key))


def held(ledger, count):
    jobs = [job(pk) for pk in range(1, count + 1)]
    ledger.add(jobs)
    return jobs


# --- the claim size ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("holding", "started", "expected"),
    [
        (0, 0, 8),  # capacity 12: a batch
        (4, 4, 8),  # every thread busy, nothing queued: a whole batch is free
        (5, 4, 7),  # one queued, fewer than the threads: what is free
        (8, 4, 0),  # four queued (the threads' worth) and less than a batch free: wait
        (12, 4, 0),  # full
    ],
)
def test_the_claim_size_waits_for_a_whole_batch_while_the_threads_have_queued_work(
    holding, started, expected
):
    ledger = Ledger(config(concurrency=4, batch_size=8, prefetch=8), stuck=lambda: 0)
    for held_job in held(ledger, holding)[:started]:
        assert ledger.start(held_job)
    assert ledger.claim_size() == expected


def test_threads_stuck_in_timed_out_handlers_take_capacity_away():
    stuck = [0]
    ledger = Ledger(config(concurrency=2, batch_size=4, prefetch=0), stuck=lambda: stuck[0])
    assert ledger.claim_size() == 2
    stuck[0] = 2
    assert ledger.claim_size() == 0, "a stuck thread's slot was given out"


def test_the_event_loops_room_counts_while_async_handlers_messages_come(monkeypatch):
    """The loop's room (async_concurrency) is claimed for only while claims
    bring messages of async handlers (atomic=False): a worker whose queues
    hold sync messages alone claims for its threads, as without the loop."""
    from django_pgqueue.worker import ledger as ledger_module

    def spec(is_async, atomic=False):
        return registry.HandlerSpec(
            topic="t", func=lambda m: None, max_attempts=None, timeout=None, atomic=atomic,
            backoff_base=None, backoff_cap=None, backoff_jitter=None, is_async=is_async,
            location="here",
        )  # fmt: skip

    ledger = Ledger(
        config(concurrency=2, batch_size=100, prefetch=0, async_concurrency=50), stuck=lambda: 0
    )
    assert ledger.claim_size() == 2  # no async message yet: the threads' room
    sync_jobs = [BuiltJob(FakeMessage(pk), spec(False)) for pk in (1, 2)]
    atomic_async = BuiltJob(FakeMessage(3), spec(True, atomic=True))  # runs in a thread
    ledger.add([*sync_jobs, atomic_async])
    assert not any(j.on_loop for j in [*sync_jobs, atomic_async])
    assert ledger.claim_size() == 0
    on_loop = [BuiltJob(FakeMessage(pk), spec(True)) for pk in range(10, 20)]
    ledger.add(on_loop)
    assert all(j.on_loop for j in on_loop)
    for started in on_loop:  # (the loop starts each at once)
        assert ledger.start(started)
    assert ledger.claim_size() == 40  # the loop's room: 50 less the 10 it holds
    for done in on_loop[:5]:
        ledger.finish(done, ACK_PENDING)
    assert ledger.claim_size() == 45
    # No async message for ASYNC_ROOM_SECONDS: the threads' room alone again.
    clock = time.monotonic() + ledger_module.ASYNC_ROOM_SECONDS + 1
    monkeypatch.setattr(ledger_module.time, "monotonic", lambda: clock)
    assert ledger.claim_size() == 0


# --- finishing and acknowledging ----------------------------------------------------


def test_processed_counts_settled_jobs_and_confirmed_acknowledgements_only():
    ledger = Ledger(config(batch_size=8), stuck=lambda: 0)
    done, failed, lost, pending = held(ledger, 4)
    for each in (done, failed, lost, pending):
        ledger.start(each)
    ledger.finish(done, DONE)
    ledger.finish(failed, FAILED)
    ledger.finish(lost, LOST)
    ledger.finish(pending, ACK_PENDING)
    assert ledger.processed == 2, "only done and failed jobs count before their ack"
    assert ledger.busy(), "an unacknowledged job keeps the worker busy"
    assert ledger.take_unacked() == [pending]
    ledger.acked(1)
    assert ledger.processed == 3
    assert not ledger.busy()


def test_a_batch_of_unacked_jobs_goes_to_the_finishing_thread_once():
    ledger = Ledger(config(batch_size=2), stuck=lambda: 0)
    first, second, third = held(ledger, 3)
    for each in (first, second, third):
        ledger.start(each)
    assert ledger.finish(first, ACK_PENDING)[0] == []
    acks, has_work = ledger.finish(second, ACK_PENDING)
    assert acks == [first, second] and has_work
    assert ledger.finish(third, ACK_PENDING)[0] == [], "another thread already sends a batch"
    ledger.sent()
    assert ledger.take_unacked() == [third]


def test_a_grouped_jobs_acknowledgement_is_due_at_once():
    ledger = Ledger(config(), stuck=lambda: 0)
    grouped = job(1, group_key="g")
    ledger.add([grouped])
    ledger.start(grouped)
    ledger.finish(grouped, ACK_PENDING)
    assert ledger.ack_due is not None and ledger.ack_due <= time.monotonic()


def test_put_back_keeps_the_earliest_due_time():
    ledger = Ledger(config(), stuck=lambda: 0)
    jobs = held(ledger, 2)
    ledger.put_back(jobs[:1], 10.0)
    later = ledger.ack_due
    ledger.put_back(jobs[1:], 0.0)
    assert ledger.ack_due < later
    ledger.put_back(jobs[:1], 10.0)
    assert ledger.ack_due < later, "a later due time replaced an earlier one"


def test_shutdown_takes_back_the_unstarted_jobs_then_abandons_the_rest():
    ledger = Ledger(config(), stuck=lambda: 0)
    running, queued = held(ledger, 2)
    ledger.start(running)
    assert ledger.unstarted() == [queued] and queued.abandoned
    assert not ledger.start(queued), "a handed-back job was started"
    assert ledger.leftover() == [running] and running.abandoned


# --- the wake-up ----------------------------------------------------------------------


def test_a_handler_due_to_time_out_before_the_loop_wakes_asks_for_a_wake_up():
    """The loop reckons its wake-up before a handler starts; a handler whose
    deadline comes first must have it look again (Executor.start wakes it)."""
    ledger = Ledger(config(), stuck=lambda: 0)
    spec = registry.HandlerSpec(
        topic="t",
        func=lambda message: None,
        max_attempts=None,
        timeout=1.0,
        atomic=False,
        backoff_base=None,
        backoff_cap=None,
        backoff_jitter=None,
        is_async=False,
        location="here",
    )
    timed, also_timed = BuiltJob(FakeMessage(1), spec), BuiltJob(FakeMessage(2), spec)
    untimed = job(3)
    ledger.add([timed, also_timed, untimed])
    ledger.loop_wakes_at = time.monotonic() + 10  # asleep until its next poll
    assert ledger.start(untimed) and not ledger.wakes_the_loop(untimed)
    assert ledger.start(timed) and ledger.wakes_the_loop(timed)
    ledger.loop_wakes_at = ledger.next_deadline()  # the loop looked again
    assert ledger.start(also_timed) and not ledger.wakes_the_loop(also_timed)


def test_a_wakeup_says_whether_to_claim():
    wakeup = Wakeup()
    wakeup.set()
    assert wakeup.wait(1) is False, "a plain wake-up is no reason to claim"
    wakeup.notify()
    assert wakeup.wait(1) is True
    assert wakeup.wait(0) is False, "a notification is taken once"


def test_released_groups_stay_a_reason_to_claim_until_a_claim_takes_them():
    wakeup = Wakeup()
    wakeup.release_groups()
    assert wakeup.wait(1) is True and wakeup.wait(0) is True
    assert wakeup.take_groups() is True
    assert wakeup.take_groups() is False and wakeup.wait(0) is False


def test_a_wakeup_from_another_thread_ends_the_wait():
    wakeup = Wakeup()
    threading.Timer(0.05, wakeup.notify).start()
    assert wakeup.wait(30) is True


# --- the backoff ------------------------------------------------------------------------


def test_the_backoff_doubles_up_to_its_cap_with_jitter_and_resets():
    backoff = Backoff()
    waits = []
    for _ in range(12):
        delay = backoff.delay
        wait = backoff.next()
        assert 0.8 * delay <= wait <= 1.2 * delay
        waits.append(delay)
    assert waits[:3] == [RECONNECT_DELAY, 2 * RECONNECT_DELAY, 4 * RECONNECT_DELAY]
    assert waits[-1] == RECONNECT_DELAY_CAP
    backoff.reset()
    assert backoff.delay == RECONNECT_DELAY


# --- calling a handler -------------------------------------------------------------------


@pytest.fixture
def clean_topic():
    yield "test.parts.topic"
    registry.unregister("test.parts.topic")


def test_a_handler_that_returns_a_coroutine_instead_of_running_is_an_error(clean_topic):
    @registry.handler(clean_topic)
    def forgot_async(message):
        async def body():
            pass

        return body()

    with pytest.raises(TypeError, match="the handler returned a coroutine instead of running"):
        registry.call(registry.lookup(clean_topic), object())


def test_an_async_handler_runs_to_completion(clean_topic):
    seen = []

    @registry.handler(clean_topic)
    async def handle(message):
        seen.append(message)
        return "ran"

    assert registry.call(registry.lookup(clean_topic), "m") == "ran"
    assert seen == ["m"]


def test_the_same_function_registered_again_replaces_itself(clean_topic):
    def handle(message):
        pass

    registry.handler(clean_topic)(handle)
    registry.handler(clean_topic)(handle)  # its module imported twice
    with pytest.raises(DuplicateHandler):
        registry.handler(clean_topic)(lambda message: None)


# --- --prefetch auto ------------------------------------------------------------


def auto_config(concurrency=4, batch_size=100):
    return dataclasses.replace(
        config(concurrency, batch_size, prefetch=2 * batch_size), prefetch_auto=True
    )


def run_for(ledger, pk, seconds):
    """A job that ran ``seconds`` and finished (its duration is what the
    automatic prefetch follows)."""
    finished = job(pk)
    ledger.add([finished])
    assert ledger.start(finished)
    finished.duration = seconds
    ledger.finish(finished, DONE)


def test_auto_prefetch_claims_for_the_threads_alone_until_a_handler_has_run():
    ledger = Ledger(auto_config(concurrency=4), stuck=lambda: 0)
    assert ledger.claim_size() == 4


def test_auto_prefetch_holds_up_to_two_batches_ahead_of_short_handlers():
    ledger = Ledger(auto_config(concurrency=4, batch_size=100), stuck=lambda: 0)
    for pk in range(1, 21):
        run_for(ledger, pk, 0.0001)  # 4 threads x 0.1 s / 0.1 ms: 4,000 would fit
    assert ledger.claim_size() == 100
    held(ledger, 100)
    assert ledger.claim_size() == 100, "the second batch ahead was refused"
    ledger.add([job(pk) for pk in range(1000, 1100)])
    assert ledger.claim_size() == 0, "more than concurrency + two batches is held"


def test_auto_prefetch_holds_what_the_threads_finish_in_a_tenth_of_a_second():
    ledger = Ledger(auto_config(concurrency=4, batch_size=100), stuck=lambda: 0)
    for pk in range(1, 100):
        run_for(ledger, pk, 0.01)  # 10 ms each: 4 threads finish 40 in 0.1 s
    assert ledger.claim_size() == 44


def test_auto_prefetch_holds_nothing_ahead_of_slow_handlers():
    ledger = Ledger(auto_config(concurrency=4, batch_size=100), stuck=lambda: 0)
    for pk in range(1, 5):
        run_for(ledger, pk, 0.0001)
    assert ledger.claim_size() == 100
    for pk in range(5, 200):
        run_for(ledger, pk, 5.0)  # slow now: the average follows within a few dozen runs
    assert ledger.claim_size() == 4
    held(ledger, 3)
    assert ledger.claim_size() == 1, "a message was claimed ahead of a slow handler"


def test_a_fixed_prefetch_ignores_the_durations():
    ledger = Ledger(config(concurrency=4, batch_size=8, prefetch=8), stuck=lambda: 0)
    for pk in range(1, 50):
        run_for(ledger, pk, 5.0)
    assert ledger.claim_size() == 8
