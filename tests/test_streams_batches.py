"""Stream delivery in large batches: a subscriber's savepoint is opened just
before its first query (none for one that runs no query), a batch takes up
to PGQUEUE["STREAM_BATCH_SIZE"] events but opens at most BATCH_SAVEPOINTS
savepoints, a failure in the middle of a large batch undoes that event alone
(its writes and its on_commit callbacks), and the worker's thread delivers a
subscription's next batch at once while the last was full.

As in test_streams.py, deliveries run in this process outside any
transaction, and one that must happen is polled for (``deliver``).
"""

import pytest
from demo.models import Handled
from django.db import connection, transaction
from django.test import override_settings

from django_pgqueue import conf, publish
from django_pgqueue.models import Subscription, SubscriptionState
from django_pgqueue.streams import delivery, subscribers
from django_pgqueue.worker.streams import StreamWorker

from .test_streams import deliver, settle, spec

pytestmark = pytest.mark.django_db(transaction=True)

STREAM = "test.batches"
NAME = "test.batches"


@pytest.fixture
def temporary_subscriber():
    """Register subscribers for one test; forgotten at teardown."""
    names = []

    def register(stream, name, func, **options):
        subscribers.subscriber(stream, name=name, **options)(func)
        names.append(name)
        return spec(name)

    yield register
    for name in names:
        subscribers.unregister(name)


def publish_many(count, **payload):
    positions = [publish(STREAM, {"n": n, **payload}).position for n in range(count)]
    settle(STREAM, positions[-1])
    return positions


def statements_during(func):
    """The statements ``func`` sends through Django's connection, and its result."""
    sent = []

    def record(execute, sql, params, many, context):
        sent.append(sql)
        return execute(sql, params, many, context)

    with connection.execute_wrapper(record):
        result = func()
    return sent, result


def test_a_subscriber_that_runs_no_query_gets_a_large_batch_in_one_transaction(
    temporary_subscriber, monkeypatch
):
    monkeypatch.setattr(delivery, "BATCH_SECONDS", 60.0)  # a loaded machine
    seen = []
    temporary_subscriber(STREAM, NAME, lambda event: seen.append(event.position))
    positions = publish_many(120)
    result = deliver(NAME)
    assert (result.outcome, result.delivered, result.more) == (delivery.DELIVERED, 120, False)
    assert seen == positions
    row = Subscription.objects.get(name=NAME)
    assert (row.checkpoint_position, row.delivered) == (positions[-1], 120)
    assert conf.get("STREAM_BATCH_SIZE") >= 120


def test_no_savepoint_is_opened_for_a_subscriber_that_runs_no_query(temporary_subscriber):
    temporary_subscriber(STREAM, NAME, lambda event: None)
    publish_many(3)
    sent, result = statements_during(lambda: deliver(NAME))
    assert result.delivered == 3
    # The savepoints would go past Django's cursor, but before the next
    # statement through it: none was opened, or the one after it would say.
    assert not any("SAVEPOINT" in sql for sql in sent)


def test_the_batch_size_setting_and_the_subscribers_own(temporary_subscriber):
    temporary_subscriber(STREAM, NAME, lambda event: None)
    temporary_subscriber(STREAM, "test.batches_own", lambda event: None, batch_size=3)
    positions = publish_many(10)
    with override_settings(PGQUEUE={"STREAM_BATCH_SIZE": 7}):
        first = deliver(NAME)
        own = deliver("test.batches_own")
    assert (first.delivered, first.more) == (7, True)
    assert (own.delivered, own.more) == (3, True)
    assert Subscription.objects.get(name=NAME).checkpoint_position == positions[6]


def test_a_batch_opens_at_most_batch_savepoints(temporary_subscriber, monkeypatch):
    monkeypatch.setattr(delivery, "BATCH_SECONDS", 60.0)
    monkeypatch.setattr(delivery, "BATCH_SAVEPOINTS", 4)

    def every_third_writes(event):
        if event.payload["n"] % 3 == 0:
            Handled.objects.create(message_id=event.position, topic=NAME, attempt=1, pid=0)

    temporary_subscriber(STREAM, NAME, every_third_writes)
    positions = publish_many(20)
    result = deliver(NAME)
    # Events 0, 3, 6 and 9 opened the four savepoints: the batch ends there.
    assert (result.delivered, result.more) == (10, True)
    assert Subscription.objects.get(name=NAME).checkpoint_position == positions[9]
    assert sorted(Handled.objects.values_list("message_id", flat=True)) == positions[0:10:3]


def test_a_failure_in_the_middle_of_a_large_batch_undoes_that_event_alone(
    temporary_subscriber, monkeypatch
):
    monkeypatch.setattr(delivery, "BATCH_SECONDS", 60.0)
    committed = []

    def handle(event):
        n = event.payload["n"]
        if n % 10 == 0 or n == 75:  # a few write, so the batch stays under the savepoints
            Handled.objects.create(message_id=event.position, topic=NAME, attempt=1, pid=0)
            transaction.on_commit(lambda: committed.append(event.position))
        if n == 75:
            raise RuntimeError("after the write")

    temporary_subscriber(STREAM, NAME, handle)
    positions = publish_many(100)
    result = deliver(NAME)
    assert (result.outcome, result.delivered) == (delivery.RETRYING, 75)
    written = sorted(Handled.objects.values_list("message_id", flat=True))
    assert written == positions[0:75:10], "the failing event's write was committed"
    assert committed == positions[0:75:10], "the failing event's on_commit callback ran"
    row = Subscription.objects.get(name=NAME)
    assert (row.state, row.failing_position) == (SubscriptionState.RETRYING, positions[75])
    assert (row.checkpoint_position, row.delivered) == (positions[74], 75)


def test_a_failure_before_any_query_is_recorded_and_nothing_is_undone(temporary_subscriber):
    def fail_third(event):
        if event.payload["n"] == 2:
            raise RuntimeError("no query run")

    temporary_subscriber(STREAM, NAME, fail_third)
    positions = publish_many(5)
    sent, result = statements_during(lambda: deliver(NAME))
    assert (result.outcome, result.delivered) == (delivery.RETRYING, 2)
    assert not any("SAVEPOINT" in sql for sql in sent)
    row = Subscription.objects.get(name=NAME)
    assert (row.failing_position, row.checkpoint_position) == (positions[2], positions[1])


def test_a_subscriber_that_asks_for_a_rollback_fails_its_event(temporary_subscriber):
    def roll_back(event):
        if event.payload["n"] == 1:
            Handled.objects.create(message_id=event.position, topic=NAME, attempt=1, pid=0)
            transaction.set_rollback(True)

    temporary_subscriber(STREAM, NAME, roll_back)
    positions = publish_many(3)
    result = deliver(NAME)
    assert (result.outcome, result.delivered) == (delivery.RETRYING, 1)
    assert "BrokenTransaction" in Subscription.objects.get(name=NAME).last_error
    assert not Handled.objects.exists()
    assert Subscription.objects.get(name=NAME).checkpoint_position == positions[0]


def test_the_worker_delivers_the_next_batch_at_once_while_the_last_was_full(monkeypatch):
    results = [
        delivery.Delivery(delivery.DELIVERED, delivered=7, more=True),
        delivery.Delivery(delivery.DELIVERED, delivered=7, more=True),
        delivery.Delivery(delivery.DELIVERED, delivered=2),
    ]
    calls = []

    def fake_deliver(spec, subscription_id, worker, watch=None):
        calls.append(subscription_id)
        return results.pop(0)

    monkeypatch.setattr(delivery, "deliver", fake_deliver)
    worker = StreamWorker([spec("test.ledger")], "w", poll_interval=1.0, listen=False)
    last = worker._deliver(spec("test.ledger"), 42)
    assert (calls, last.more, worker.delivered) == ([42, 42, 42], False, 16)


def test_the_batch_size_setting_is_validated():
    for good in (1, 500, 10_000):
        with override_settings(PGQUEUE={"STREAM_BATCH_SIZE": good}):
            assert conf.validate() == []
    for bad in (0, 10_001, 2.5, "50", True, None):
        with override_settings(PGQUEUE={"STREAM_BATCH_SIZE": bad}):
            [(_, message, _)] = conf.validate()
            assert "STREAM_BATCH_SIZE" in message and "from 1 to 10,000" in message


def test_a_subscribers_batch_size_is_checked():
    for bad in (0, 10_001, 2.5):
        with pytest.raises(ValueError, match="batch_size must be a whole number from 1 to"):
            subscribers.subscriber(STREAM, name="test.bad_size", batch_size=bad)
