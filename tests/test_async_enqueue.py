"""aenqueue(), aenqueue_many(), acancel() and Workflow.aenqueue() against the
real PostgreSQL, and the demo's async views through Django's AsyncClient.

Each async form runs its sync form through ``sync_to_async(...,
thread_sensitive=True)``. A sync test awaits them through ``async_to_sync``,
as Django's own async tests do: the sync form then runs on the test's own
thread and connection, so it joins a transaction the test opened there and
otherwise commits at once. What is committed is read from a second
connection (``other_connection``). One test runs from an event loop with no
sync caller (as under an ASGI server), one as Django's TestCase runs an
``async def`` test.
"""

import asyncio
import math

import pytest
from asgiref.sync import async_to_sync, sync_to_async
from demo import views
from demo.models import Order
from django.db import connections, transaction
from django.test import AsyncClient, TestCase, override_settings

from django_pgqueue import (
    InvalidMessage,
    QueueControlError,
    Workflow,
    WorkflowError,
    acancel,
    aenqueue,
    aenqueue_many,
    cancel,
    enqueue,
    enqueue_many,
)
from django_pgqueue.models import Message, Status

from .conftest import raw_connection

pytestmark = pytest.mark.django_db(transaction=True)


class Rollback(Exception):
    pass


def committed(conn, table="django_pgqueue_message", columns="topic"):
    """The rows of ``table`` that another client can see, in id order."""
    rows = conn.execute(f"SELECT {columns} FROM {table} ORDER BY id").fetchall()
    return [row[0] if len(row) == 1 else row for row in rows]


# --- committed at once, or in the transaction open on the caller's thread ----------


def test_aenqueue_without_a_transaction_commits_at_once(other_connection):
    message = async_to_sync(aenqueue)("async.one", {"n": 1}, priority=5, queue="mail")
    assert committed(other_connection, columns="id, topic, queue, priority") == [
        (message.pk, "async.one", "mail", 5)
    ], "aenqueue() outside a transaction must commit before it returns"
    assert message.created is True
    assert (message.payload, message.status) == ({"n": 1}, Status.WAITING)
    assert message.run_at is not None and message.created_at is not None


def test_aenqueue_returns_what_enqueue_returns_for_a_dedup_key(other_connection):
    first = enqueue("async.dedup", {"n": 1}, dedup_key="k")
    again = async_to_sync(aenqueue)("async.dedup", {"n": 2}, dedup_key="k")
    assert (again.created, again.pk, again.payload) == (False, first.pk, {"n": 1}), (
        "aenqueue() must return the unfinished message that holds the dedup_key, as enqueue() does"
    )
    assert committed(other_connection) == ["async.dedup"]


def test_aenqueue_many_without_a_transaction_commits_at_once(other_connection):
    messages = async_to_sync(aenqueue_many)(
        [{"payload": {"n": n}} for n in range(3)] + [{"topic": "async.other"}],
        topic="async.many",
        priority=3,
    )
    assert [m.created for m in messages] == [True] * 4
    assert committed(other_connection, columns="id, topic, priority") == [
        (messages[0].pk, "async.many", 3),
        (messages[1].pk, "async.many", 3),
        (messages[2].pk, "async.many", 3),
        (messages[3].pk, "async.other", 3),
    ]


@pytest.mark.parametrize("form", ["aenqueue", "aenqueue_many"])
def test_the_async_forms_join_the_transaction_open_on_their_thread(other_connection, form):
    def send(topic):
        if form == "aenqueue":
            return async_to_sync(aenqueue)(topic, {})
        return async_to_sync(aenqueue_many)([{"payload": {}}], topic=topic)

    with transaction.atomic():
        send("async.kept")
        assert committed(other_connection) == [], "visible before the transaction committed"
    with pytest.raises(Rollback), transaction.atomic():
        send("async.discarded")
        raise Rollback
    assert committed(other_connection) == ["async.kept"]


# --- the "with my writes" pattern: one sync function under atomic, awaited -------------


@transaction.atomic
def record_order(customer, fail=False):
    order = Order.objects.create(customer=customer)
    message = enqueue("async.order", {"order_id": order.pk})
    if fail:
        raise Rollback(f"after the enqueue of message {message.pk}")
    return order, message


async def place(customer, fail=False):
    return await sync_to_async(record_order)(customer, fail)


def test_the_pattern_commits_the_writes_and_the_message_together(other_connection):
    order, message = async_to_sync(place)("ada")
    assert committed(other_connection, "demo_order", "id, customer") == [(order.pk, "ada")]
    assert committed(other_connection, columns="id, payload") == [
        (message.pk, {"order_id": order.pk})
    ]


def test_a_rollback_of_the_patterns_transaction_discards_the_message(other_connection):
    with pytest.raises(Rollback, match="after the enqueue of message [0-9]+"):
        async_to_sync(place)("bob", fail=True)
    assert committed(other_connection, "demo_order", "id") == []
    assert committed(other_connection) == [], "the rolled-back transaction's message was kept"


def test_from_a_loop_without_a_sync_caller_the_pattern_and_aenqueue_commit(other_connection):
    """As under an ASGI server or asyncio.run(): the sync forms run on
    asgiref's one thread for thread-sensitive code, with its connection."""

    async def main():
        try:
            order, _ = await place("cy")
            with pytest.raises(Rollback):
                await place("dee", fail=True)
            message = await aenqueue("async.loop", {})
            return order, message
        finally:
            await sync_to_async(connections.close_all)()  # that thread's connection

    order, message = asyncio.run(main())
    assert committed(other_connection, "demo_order", "customer") == ["cy"]
    assert committed(other_connection, columns="topic, payload") == [
        ("async.order", {"order_id": order.pk}),
        ("async.loop", {}),
    ]
    assert message.created is True


# --- the queue on another database: deferred to the caller's commit, as enqueue() ------


@pytest.mark.django_db(transaction=True, databases=["default", "other"])
@override_settings(PGQUEUE={"DATABASE": "other"})
def test_on_another_alias_aenqueue_waits_for_the_callers_commit():
    with transaction.atomic(using="default"):
        message = async_to_sync(aenqueue)("cross", {"n": 1})
        assert message.pk is None and message.created is None, "inserted before the commit"
        assert not Message.objects.using("other").exists()
    assert message.created is True
    assert Message.objects.using("other").get().pk == message.pk
    assert not Message.objects.using("default").exists(), "written to the caller's database"

    with pytest.raises(Rollback), transaction.atomic(using="default"):
        async_to_sync(aenqueue)("cross.discarded", {})
        async_to_sync(aenqueue_many)([{"payload": 1}], topic="cross.discarded")
        raise Rollback
    assert list(Message.objects.using("other").values_list("topic", flat=True)) == ["cross"]


@pytest.mark.django_db(transaction=True, databases=["default", "other"])
@override_settings(PGQUEUE={"DATABASE": "other"})
def test_on_another_alias_aenqueue_in_autocommit_inserts_at_once():
    # No transaction on "default": on_commit runs at once, as for enqueue().
    synced = enqueue("cross.sync", {})
    awaited = async_to_sync(aenqueue)("cross.async", {})
    assert (synced.created, awaited.created) == (True, True)
    assert list(Message.objects.using("other").order_by("pk").values_list("pk", flat=True)) == [
        synced.pk,
        awaited.pk,
    ]


# --- bad input: the sync form's exception, unchanged, and nothing written --------------


def _empty_workflow():
    return Workflow(name="empty")


def _unknown_after():
    wf = Workflow(name="unknown")
    wf.add("wf.value", name="a", after=["nope"])
    return wf


BAD_CALLS = [
    # (what, the sync call, the async call)
    (
        "priority out of range",
        lambda: enqueue("t", {}, priority=500),
        lambda: aenqueue("t", {}, priority=500),
    ),
    ("empty topic", lambda: enqueue("", {}), lambda: aenqueue("", {})),
    (
        "NaN payload",
        lambda: enqueue("t", {"x": math.nan}),
        lambda: aenqueue("t", {"x": math.nan}),
    ),
    ("unknown alias", lambda: enqueue("t", using="nope"), lambda: aenqueue("t", using="nope")),
    (
        "unknown keyword",
        lambda: enqueue_many([{}], topic="t", prio=1),
        lambda: aenqueue_many([{}], topic="t", prio=1),
    ),
    (
        "a dict for the iterable",
        lambda: enqueue_many({"topic": "t"}),
        lambda: aenqueue_many({"topic": "t"}),
    ),
    (
        "a bad second message",
        lambda: enqueue_many([{"payload": 1}, {"payload": 2, "delay": -1}], topic="t"),
        lambda: aenqueue_many([{"payload": 1}, {"payload": 2, "delay": -1}], topic="t"),
    ),
    ("a bad id", lambda: cancel([1, 0]), lambda: acancel([1, 0])),
    (
        "another model's queryset",
        lambda: cancel(Order.objects.all()),
        lambda: acancel(Order.objects.all()),
    ),
    (
        "an empty workflow",
        lambda: _empty_workflow().enqueue(),
        lambda: _empty_workflow().aenqueue(),
    ),
    ("an unknown step", lambda: _unknown_after().enqueue(), lambda: _unknown_after().aenqueue()),
]


@pytest.mark.parametrize(
    "sync_call, async_call", [c[1:] for c in BAD_CALLS], ids=[c[0] for c in BAD_CALLS]
)
def test_bad_input_raises_what_the_sync_form_raises_and_writes_nothing(
    other_connection, sync_call, async_call
):
    with pytest.raises((InvalidMessage, QueueControlError, WorkflowError)) as from_sync:
        sync_call()

    async def awaited():
        return await async_call()

    with pytest.raises(type(from_sync.value)) as from_async:
        async_to_sync(awaited)()
    assert type(from_async.value) is type(from_sync.value)
    assert str(from_async.value) == str(from_sync.value)
    assert committed(other_connection) == []
    assert committed(other_connection, "django_pgqueue_workflow", "id") == []


# --- acancel() and Workflow.aenqueue() ------------------------------------------------------


def test_acancel_cancels_and_commits_as_cancel_does(other_connection, make_message):
    waiting = make_message("async.cancel")
    running = make_message("async.cancel", status=Status.PROCESSING)
    untouched = make_message("async.cancel")
    # A queryset is evaluated on the sync thread, not in the event loop.
    queryset = Message.objects.filter(pk__in=[waiting.pk, running.pk, 10**12])
    result = async_to_sync(acancel)(queryset, by="test")
    assert (result.cancelled, result.requested, result.already, result.finished) == (1, 1, 0, 0)
    assert committed(other_connection, columns="id, status") == [
        (waiting.pk, Status.CANCELLED),
        (running.pk, Status.PROCESSING),
        (untouched.pk, Status.WAITING),
    ]
    again = async_to_sync(acancel)([waiting, running.pk])
    assert (again.cancelled, again.requested, again.already) == (0, 0, 2)


def test_workflow_aenqueue_commits_the_workflow_and_its_steps(other_connection):
    wf = Workflow(name="async workflow")
    first = wf.add("wf.value", {"value": 1}, name="first")
    wf.add("wf.value", {"value": 2}, name="second", after=[first])
    run = async_to_sync(wf.aenqueue)()
    assert run.pk is not None
    assert committed(other_connection, "django_pgqueue_workflow", "id, name") == [
        (run.pk, "async workflow")
    ]
    assert sorted(committed(other_connection, "django_pgqueue_workflowstep", "name")) == [
        "first",
        "second",
    ]
    assert sorted(run.steps()) == ["first", "second"]


def test_workflow_aenqueue_joins_the_transaction_open_on_its_thread(other_connection):
    wf = Workflow(name="rolled back")
    wf.add("wf.value", {"value": 1})
    with pytest.raises(Rollback), transaction.atomic():
        async_to_sync(wf.aenqueue)()
        raise Rollback
    assert committed(other_connection, "django_pgqueue_workflow", "id") == []
    assert committed(other_connection) == []


# --- the demo's async views through Django's AsyncClient ---------------------------------


def test_an_async_view_that_awaits_aenqueue_commits_its_message(other_connection):
    response = async_to_sync(AsyncClient().post)("/demo/orders/async/", {"customer": "ada"})
    assert response.status_code == 201, response.content
    message_id = response.json()["message_id"]
    assert committed(other_connection, columns="id, topic, payload") == [
        (message_id, "demo.welcome_email", {"customer": "ada"})
    ], "the async view's message is not committed after its response"


def test_the_async_view_with_writes_commits_the_order_and_its_message(other_connection):
    response = async_to_sync(AsyncClient().post)(
        "/demo/orders/async/with-writes/", {"customer": "ada"}
    )
    assert response.status_code == 201, response.content
    ids = response.json()
    assert committed(other_connection, "demo_order", "id, customer") == [(ids["order_id"], "ada")]
    assert committed(other_connection, columns="id, payload") == [
        (ids["message_id"], {"customer": "ada", "order_id": ids["order_id"]})
    ]


def test_the_async_view_with_writes_commits_neither_when_it_fails_after_the_enqueue(
    other_connection, monkeypatch
):
    enqueued = []

    def enqueue_then_fail(*args, **kwargs):
        enqueued.append(enqueue(*args, **kwargs))
        raise Rollback("failed after the enqueue")

    monkeypatch.setattr(views, "enqueue", enqueue_then_fail)
    with pytest.raises(Rollback, match="failed after the enqueue"):
        async_to_sync(AsyncClient().post)("/demo/orders/async/with-writes/", {"customer": "bob"})
    assert [m.created for m in enqueued] == [True], "the message was never inserted"
    assert committed(other_connection, "demo_order", "id") == []
    assert committed(other_connection) == [], "the rolled-back view's message was kept"


class AsyncTestCaseTests(TestCase):
    """Django's TestCase runs an async test under async_to_sync: the view's
    sync work runs on the test's thread, in the test's transaction (the
    docs' example)."""

    async def test_the_async_views_message_is_in_the_tests_transaction(self):
        response = await self.async_client.post("/demo/orders/async/", {"customer": "ada"})
        self.assertEqual(response.status_code, 201)
        self.assertTrue(
            await Message.objects.filter(pk=response.json()["message_id"]).aexists(),
            "the test's connection does not see the view's message",
        )
        self.assertEqual(
            await sync_to_async(_committed_elsewhere)(),
            [],
            "the view's message was committed: its sync work ran outside the test's transaction",
        )


def _committed_elsewhere():
    with raw_connection(autocommit=True) as conn:
        return committed(conn)
