"""django_pgqueue.testing, as a project's tests use it: in Django's TestCase
(everything in the test's transaction) and TransactionTestCase (every step
commits), and through the pytest plugin's ``pgqueue`` fixture.

The handlers below are a project's: one sends mail when its transaction
commits, one asks to be retried, one refuses for good, one enqueues the
next step."""

import datetime

import pytest
from demo.models import Handled
from django.core import mail
from django.db import transaction
from django.test import TestCase, TransactionTestCase, override_settings

from django_pgqueue import Permanent, Retry, enqueue, handler, signals, testing
from django_pgqueue.models import DeadLetter, Message, Status

from .conftest import raw_connection


def record(message):
    Handled.objects.create(
        message_id=message.pk, topic=message.topic, attempt=message.attempts, pid=0
    )


@handler("testing.confirm")
def send_confirmation(message):
    record(message)
    order = message.payload["order"]
    # Mail only once the work is committed: a rolled-back run sends nothing.
    transaction.on_commit(
        lambda: mail.send_mail(f"Order {order}", "Thanks!", "shop@example.com", ["a@b.c"])
    )


@handler("testing.flaky")
def flaky(message):
    if message.attempts < message.payload.get("succeed_on", 2):
        raise Retry("the mail server is busy", after=60)
    record(message)


@handler("testing.refuse")
def refuse(message):
    raise Permanent(f"cannot handle {message.payload!r}")


@handler("testing.place_order", atomic=False)
def place_order(message):
    record(message)
    enqueue("testing.confirm", {"order": message.payload["order"]})


class Helpers:
    """The same tests in both kinds of test case."""

    def test_assert_enqueued_finds_by_topic_queue_and_payload(self):
        enqueue("testing.confirm", {"order": 7, "lines": [1, 2]}, queue="mail")
        enqueue("testing.confirm", {"order": 8})
        found = testing.assert_enqueued("testing.confirm", payload={"order": 7}, queue="mail")
        assert [m.payload["order"] for m in found] == [7]
        testing.assert_enqueued("testing.confirm", count=2)
        testing.assert_enqueued(payload={"lines": [2]}, count=1)  # a list contains its items
        testing.assert_not_enqueued("testing.confirm", payload={"order": 9})
        assert [m.payload["order"] for m in testing.enqueued("testing.confirm")] == [7, 8]

    def test_a_failed_assertion_lists_what_is_enqueued(self):
        enqueue("testing.confirm", {"order": 7}, queue="mail")
        with pytest.raises(AssertionError) as failed:
            testing.assert_enqueued("testing.confirm", payload={"order": 8})
        text = str(failed.value)
        assert "expected at least one enqueued message(s) matching topic='testing.confirm'" in text
        assert "found 0" in text
        assert "queue='mail' topic='testing.confirm' payload={\"order\": 7}" in text
        with pytest.raises(AssertionError, match=r"expected 2 .*found 1"):
            testing.assert_enqueued("testing.confirm", count=2)
        with pytest.raises(AssertionError, match=r"expected no enqueued .*found 1"):
            testing.assert_not_enqueued(queue="mail")

    def test_drain_runs_the_handler_and_its_on_commit_callbacks(self):
        message = enqueue("testing.confirm", {"order": 7})
        drained = testing.drain()
        assert (drained.done, drained.retried, drained.dead_lettered) == (1, 0, 0)
        assert [m.pk for m in drained.messages] == [message.pk]
        assert drained.messages[0].attempts == 1
        assert [m.subject for m in mail.outbox] == ["Order 7"]
        assert not Message.objects.exists()
        assert Handled.objects.get().message_id == message.pk
        testing.assert_not_enqueued()
        assert len(testing.drain()) == 0

    def test_what_a_handler_enqueues_runs_in_the_same_drain(self):
        enqueue("testing.place_order", {"order": 3})
        drained = testing.drain()
        assert [m.topic for m in drained.messages] == ["testing.place_order", "testing.confirm"]
        assert drained.done == 2 and [m.subject for m in mail.outbox] == ["Order 3"]

    def test_a_retried_message_runs_again_when_its_time_comes(self):
        retried = []

        def receive(sender, message, delay, **kwargs):
            retried.append((message.pk, delay))

        signals.message_retried.connect(receive)
        try:
            message = enqueue("testing.flaky", {"succeed_on": 2})
            first = testing.drain()
            assert (first.done, first.retried) == (0, 1)
            assert retried == [(message.pk, 60)]
            waiting = Message.objects.get()
            assert waiting.status == Status.WAITING and waiting.attempts == 1
            assert "the mail server is busy" in waiting.last_error
            assert len(testing.drain()) == 0  # not due yet
            second = testing.drain(now=waiting.run_at + datetime.timedelta(seconds=1))
            assert (second.done, second.retried) == (1, 0)
            assert second.messages[0].attempts == 2
        finally:
            signals.message_retried.disconnect(receive)

    def test_with_now_a_retry_is_scheduled_after_that_time(self):
        enqueue("testing.flaky", {"succeed_on": 3})
        later = _db_now() + datetime.timedelta(days=1)
        drained = testing.drain(now=later)
        assert drained.retried == 1, "the retry was due again within the same drain"
        assert Message.objects.get().run_at == later + datetime.timedelta(seconds=60)

    def test_a_refused_message_is_dead_lettered(self):
        letters = []

        def receive(sender, dead_letter, **kwargs):
            letters.append(dead_letter.message_id)

        signals.dead_lettered.connect(receive)
        try:
            message = enqueue("testing.refuse", {"order": 1})
            drained = testing.drain()
        finally:
            signals.dead_lettered.disconnect(receive)
        assert (drained.done, drained.retried, drained.dead_lettered) == (0, 0, 1)
        dead = DeadLetter.objects.get()
        assert dead.message_id == message.pk and dead.category == "permanent"
        assert "cannot handle" in dead.reason
        assert letters == [message.pk]  # sent on commit: the test's "commit" too
        assert not Message.objects.exists()

    def test_a_delayed_message_runs_at_its_time_without_sleeping(self):
        message = enqueue("testing.confirm", {"order": 5}, delay=3600)
        assert len(testing.drain()) == 0
        testing.assert_enqueued("testing.confirm", payload={"order": 5})
        drained = testing.drain(now=message.run_at)
        assert drained.done == 1 and [m.subject for m in mail.outbox] == ["Order 5"]

    def test_a_schedules_tick_runs_at_its_time(self):
        schedule = {"every": 86400, "topic": "testing.confirm", "payload": {"order": 99}}
        with override_settings(PGQUEUE={"SCHEDULES": {"nightly": schedule}}):
            now = _db_now()
            midnight = now.replace(hour=0, minute=0, second=0, microsecond=0)
            tick = midnight + datetime.timedelta(days=1)
            assert len(testing.drain(now=now)) == 0
            drained = testing.drain(now=tick)
            assert len(testing.drain(now=tick)) == 0, "one message per tick"
        assert drained.done == 1 and [m.subject for m in mail.outbox] == ["Order 99"]
        assert drained.messages[0].headers["pgqueue-schedule"] == "nightly"
        assert drained.messages[0].run_at == tick

    def test_a_group_hands_over_to_its_next_message(self):
        for order in (1, 2, 3):
            enqueue("testing.confirm", {"order": order}, group_key="customer-9")
        drained = testing.drain()
        assert [m.payload["order"] for m in drained.messages] == [1, 2, 3]
        assert [m.subject for m in mail.outbox] == ["Order 1", "Order 2", "Order 3"]

    def test_queue_and_topics_leave_the_others_as_they_were(self):
        enqueue("testing.confirm", {"order": 1}, queue="mail")
        enqueue("testing.refuse", {"order": 2})
        enqueue("testing.confirm", {"order": 3})
        assert [m.payload["order"] for m in testing.drain(queue="mail").messages] == [1]
        drained = testing.drain(topics=["testing.confirm"])
        assert [m.payload["order"] for m in drained.messages] == [3]
        left = Message.objects.get()
        assert left.topic == "testing.refuse" and left.attempts == 0
        assert left.status == Status.WAITING and left.lease_token is None

    def test_bad_arguments_are_refused(self):
        with pytest.raises(ValueError, match="aware datetime"):
            testing.drain(now=datetime.datetime(2030, 1, 1))
        with pytest.raises(TypeError, match="queue must be"):
            testing.drain(queue=["mail"])

    def test_max_messages_stops_the_drain(self):
        for order in range(3):
            enqueue("testing.confirm", {"order": order})
        assert testing.drain(max_messages=2).done == 2
        left = testing.assert_enqueued("testing.confirm", count=1)
        assert left[0].attempts == 0


def _db_now():
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT statement_timestamp()")
        return cursor.fetchone()[0]


class TestInTestCase(Helpers, TestCase):
    def test_a_rolled_back_run_sends_no_mail(self):
        # The handler's savepoint is rolled back with its on_commit callback.
        @handler("testing.confirm_then_fail")
        def confirm_then_fail(message):
            send_confirmation(message)
            raise Permanent("changed my mind")

        from django_pgqueue import registry

        try:
            enqueue("testing.confirm_then_fail", {"order": 4})
            assert testing.drain().dead_lettered == 1
        finally:
            registry.unregister("testing.confirm_then_fail")
        assert mail.outbox == [] and not Handled.objects.exists()

    def test_nothing_is_committed(self):
        enqueue("testing.confirm", {"order": 1})
        testing.drain()
        with raw_connection() as other:  # another connection sees none of it
            assert other.execute("SELECT count(*) FROM demo_handled").fetchone()[0] == 0


class TestInTransactionTestCase(Helpers, TransactionTestCase):
    def test_every_step_is_committed(self):
        enqueue("testing.confirm", {"order": 1})
        testing.drain()
        with raw_connection() as other:
            assert other.execute("SELECT count(*) FROM demo_handled").fetchone()[0] == 1
            assert other.execute("SELECT count(*) FROM django_pgqueue_message").fetchone()[0] == 0


# --- the pytest plugin -----------------------------------------------------------------


@pytest.mark.django_db
def test_the_pgqueue_fixture_in_a_plain_pytest_test(pgqueue):
    assert pgqueue is testing
    enqueue("testing.place_order", {"order": 11})
    pgqueue.assert_enqueued("testing.place_order", payload={"order": 11})
    drained = pgqueue.drain()
    assert drained.done == 2
    pgqueue.assert_not_enqueued()
    assert [m.subject for m in mail.outbox] == ["Order 11"]


@pytest.mark.django_db(transaction=True)
def test_the_pgqueue_fixture_in_a_transactional_test(pgqueue):
    enqueue("testing.refuse", {"order": 12})
    assert pgqueue.drain().dead_lettered == 1
    assert DeadLetter.objects.get().payload == {"order": 12}


def test_the_plugin_is_loaded_through_its_entry_point(pytestconfig):
    plugin = pytestconfig.pluginmanager.get_plugin("django_pgqueue")
    assert plugin is not None and plugin.__name__ == "django_pgqueue.pytest_plugin"
    assert pytestconfig.pluginmanager.get_plugin("django_pgqueue.fixtures") is not None


# --- Django's Tasks framework (Django 6+) -----------------------------------------------

tasks_only = pytest.mark.skipif(
    __import__("django").VERSION < (6, 0), reason="django.tasks exists from Django 6.0 on"
)


@tasks_only
class TestTasksInTestCase(TestCase):
    def test_a_drained_task_has_its_result(self):
        from demo import tasks as demo
        from django.tasks import TaskResultStatus

        result = demo.add.enqueue(2, 3)
        testing.assert_enqueued(payload={"result_id": str(result.id)})
        assert testing.drain().done == 1
        result.refresh()
        assert result.status == TaskResultStatus.SUCCESSFUL and result.return_value == 5
        assert result.worker_ids and result.worker_ids[0].startswith("testing:")

    def test_a_failed_task_is_retried_then_fails(self):
        from demo import tasks as demo
        from django.tasks import TaskResultStatus

        # ConnectionError: transient; "retrying": MAX_ATTEMPTS 3, retried at once.
        result = demo.down.using(backend="retrying").enqueue()
        drained = testing.drain()
        assert (drained.retried, drained.dead_lettered) == (2, 1)
        result.refresh()
        assert result.status == TaskResultStatus.FAILED
        assert len(result.errors) == 3


@tasks_only
@pytest.mark.django_db(transaction=True)
def test_a_drained_task_has_its_result_in_a_transactional_test(pgqueue):
    from demo import tasks as demo

    result = demo.echo.enqueue(1, b=2)
    assert pgqueue.drain(queue="tasks").done == 1
    result.refresh()
    assert result.return_value == {"args": [1], "kwargs": {"b": 2}}
