"""Ordered streams (the transactional outbox): publish, the order of
delivery against out-of-order commits and rollbacks, the checkpoint's
atomicity with the subscriber's writes, retries, block and dead-letter, one
worker per subscription, retention, the worker option, and real worker
processes (two at once; kill -9 mid-delivery).

Deliveries run one pass at a time (``delivery.deliver``) in this
process, outside any transaction (``transactional_db``): an event becomes
deliverable once every transaction older than it has ended, in the whole
PostgreSQL cluster, so a delivery that must happen is polled for with a
deadline (another test run on the same server may hold a transaction open
for a moment); one that must not happen is asserted at once. The deadline
(HORIZON_TIMEOUT) is long: the suite's other pytest-xdist processes run
tests in transactions of their own on the same server, for as long as a
test takes on a loaded machine.
"""

import datetime
import logging
import signal
import sys
import threading
import time

import pytest
from demo.models import Handled
from django.core.management import CommandError, call_command
from django.db import OperationalError, connection, transaction
from django.test import override_settings
from django.utils import timezone
from psycopg.types.json import Jsonb

from django_pgqueue import InvalidMessage, conf, maintenance, publish, signals, subscriber
from django_pgqueue.exceptions import DuplicateSubscriber
from django_pgqueue.models import DeadLetter, StreamEvent, Subscription, SubscriptionState
from django_pgqueue.streams import CHANNEL, delivery, subscribers, subscriptions

from .conftest import raw_connection, running_worker, wait_until
from .test_pgbouncer import pgbouncer  # noqa: F401  (the fixture: a PgBouncer of our own)

pytestmark = pytest.mark.django_db(transaction=True)

LEDGER = "test.ledger"
BLOCKING = "test.blocking"
DEAD_LETTERING = "test.dead_lettering"
EVENTS_TABLE = "django_pgqueue_streamevent"


def spec(name):
    return subscribers.lookup(name)


# Seconds to wait for every older transaction of the cluster to end (see above).
HORIZON_TIMEOUT = 120


def deliver(name, **kwargs):
    """One delivery that does something, polled for until the events it
    waits for are deliverable (see the module docstring)."""
    return wait_until(
        lambda: (
            (found := delivery.deliver(spec(name), **kwargs)).outcome != delivery.IDLE and found
        ),
        timeout=HORIZON_TIMEOUT,
        message=f"a delivery to {name}",
    )


def settle(stream, position):
    """Wait until no transaction older than the event at ``position`` is open."""
    wait_until(
        lambda: subscriptions.head(stream)[1] == position,
        timeout=HORIZON_TIMEOUT,
        message="older transactions",
    )


def delivered(name=LEDGER):
    """Positions in the order their handling committed (the ledger's ids)."""
    return list(
        Handled.objects.filter(topic=name).order_by("id").values_list("message_id", flat=True)
    )


def row(name):
    return Subscription.objects.get(name=name)


def insert(conn, stream="test.events", payload=None):
    """A plain SQL INSERT from another client; returns the position."""
    return conn.execute(
        f"INSERT INTO {EVENTS_TABLE} (stream, payload) VALUES (%s, %s) RETURNING position",
        [stream, Jsonb(payload or {})],
    ).fetchone()[0]


@pytest.fixture
def temporary_subscriber():
    """Register subscribers for one test; forgotten at teardown."""
    names = []

    def register(stream, name, func, **options):
        subscriber(stream, name=name, **options)(func)
        names.append(name)
        return spec(name)

    yield register
    for name in names:
        subscribers.unregister(name)


# --- publish --------------------------------------------------------------------------


def test_publish_inserts_in_the_callers_transaction_with_position_and_xid():
    with transaction.atomic():
        first = publish("test.events", {"n": 1}, key="order-1", headers={"trace": "t-1"})
        second = publish("test.events", {"n": 2})
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_current_xact_id()::text")
            xid = int(cursor.fetchone()[0])
    assert second.position > first.position
    assert first.xid == second.xid == xid, "the event's xid is its transaction's"
    stored = StreamEvent.objects.get(pk=first.position)
    assert (stored.stream, stored.key, stored.payload) == ("test.events", "order-1", {"n": 1})
    assert stored.headers == {"trace": "t-1"} and stored.xid == xid
    assert stored.created_at == first.created_at

    with pytest.raises(RuntimeError), transaction.atomic():
        gone = publish("test.events", {"n": 3})
        raise RuntimeError("roll back")
    assert not StreamEvent.objects.filter(pk=gone.position).exists(), "a rollback kept it"


def test_a_plain_sql_insert_gets_its_position_xid_and_time_from_defaults():
    with raw_connection() as conn:
        position = insert(conn, payload={"from": "sql"})
        xid = int(conn.execute("SELECT pg_current_xact_id()::text").fetchone()[0])
        conn.commit()
    event = StreamEvent.objects.get(pk=position)
    assert event.xid == xid and event.created_at is not None and event.headers == {}


@pytest.mark.parametrize(
    "args, kwargs, error",
    [
        (("", {}), {}, "stream must not be empty"),
        (("bad stream!", {}), {}, "may contain only"),
        ((7, {}), {}, "stream must be a string"),
        (("s" * 201, {}), {}, "the limit is 200"),
        (("test.events", object()), {}, "payload is not JSON-serializable"),
        (("test.events", {"x": float("nan")}), {}, "payload is not JSON-serializable"),
        (("test.events", {1: "a"}), {}, "dict key that is not a string"),
        (("test.events", {}), {"key": ""}, "key must be a non-empty string"),
        (("test.events", {}), {"key": 5}, "key must be a non-empty string"),
        (("test.events", {}), {"key": "k" * 256}, "the limit is 255"),
        (("test.events", {}), {"headers": ["a"]}, "headers must be a dict"),
        (("test.events", {}), {"headers": {"a": {1, 2}}}, "headers is not JSON-serializable"),
        (("test.events", {}), {"using": "nope"}, "not a database alias"),
    ],
)
def test_publish_refuses_bad_input_and_writes_nothing(args, kwargs, error):
    with pytest.raises(InvalidMessage, match=error):
        publish(*args, **kwargs)
    assert not StreamEvent.objects.exists()


def test_publish_wakes_listeners_at_commit_unless_notify_is_off():
    with raw_connection(autocommit=True) as listener:
        listener.execute(f"LISTEN {CHANNEL}")
        with transaction.atomic():
            publish("test.events", {})
            publish("test.events", {})
            assert not list(listener.notifies(timeout=0.1)), "notified before the commit"
        got = [n.payload for n in listener.notifies(timeout=5, stop_after=1)]
        assert got == ["test.events"]
        assert not list(listener.notifies(timeout=0.2)), "one wake-up per transaction and stream"
        with override_settings(PGQUEUE={"NOTIFY": False}):
            publish("test.events", {})
        assert not list(listener.notifies(timeout=0.2)), "notified with NOTIFY off"


@pytest.mark.django_db(transaction=True, databases=["default", "other"])
def test_publish_to_a_stream_on_another_alias_waits_for_the_callers_commit():
    with override_settings(PGQUEUE={"DATABASE": "other"}):
        with transaction.atomic():
            event = publish("test.events", {"n": 1})
            assert event.position is None and not StreamEvent.objects.using("other").exists()
        assert StreamEvent.objects.using("other").get().position == event.position
        with pytest.raises(RuntimeError), transaction.atomic():
            publish("test.events", {"n": 2})
            raise RuntimeError("roll back")
        assert StreamEvent.objects.using("other").count() == 1
    assert not StreamEvent.objects.exists()


def test_event_published_is_sent_after_the_commit_only():
    seen = []

    def receiver(sender, event, using, **kwargs):
        seen.append((event.stream, event.position, using))

    signals.event_published.connect(receiver)
    try:
        with transaction.atomic():
            event = publish("test.events", {})
            assert seen == []
        with pytest.raises(RuntimeError), transaction.atomic():
            publish("test.events", {})
            raise RuntimeError
    finally:
        signals.event_published.disconnect(receiver)
    assert seen == [("test.events", event.position, "default")]


# --- order: late commits, rollbacks ---------------------------------------------------


def test_an_event_that_commits_before_an_older_open_one_waits_for_it():
    with raw_connection() as a, raw_connection() as b:
        first = insert(a)  # A takes a position and stays open
        second = insert(b)
        b.commit()  # B, later, commits first
        assert delivery.deliver(spec(LEDGER)).outcome == delivery.IDLE
        assert delivered() == [] and row(LEDGER).checkpoint_position == 0
        probe = delivery.probe([row(LEDGER).pk])[0]
        assert probe.held and not probe.due, "B's event is committed but held back"
        a.commit()
    settle("test.events", second)
    deliver(LEDGER)
    assert delivered() == [first, second], "A's event first, then B's"


def test_an_older_transaction_that_publishes_last_is_never_skipped():
    # A gets its transaction id first, B publishes (and stays open), then A
    # publishes, at a higher position, and commits. A's event is deliverable
    # (B is younger); B's, at the lower position, commits after the
    # checkpoint passed A's. Compared on positions alone it would be skipped.
    with raw_connection() as a, raw_connection() as b:
        a.execute("SELECT pg_current_xact_id()")
        low = insert(b)
        high = insert(a)
        a.commit()
        deliver(LEDGER)
        assert delivered() == [high]
        b.commit()
    settle("test.events", low)
    deliver(LEDGER)
    assert delivered() == [high, low], "every event, once, in (xid, position) order"


def test_a_rolled_back_publish_leaves_a_gap_that_is_passed_over():
    with raw_connection() as a, raw_connection() as b:
        gap = insert(a)
        after = insert(b)
        b.commit()
        assert delivery.deliver(spec(LEDGER)).outcome == delivery.IDLE
        a.rollback()
    deliver(LEDGER)
    assert delivered() == [after] and after > gap
    assert row(LEDGER).checkpoint_position == after


def test_a_batch_goes_in_order_and_says_when_more_is_waiting(monkeypatch):
    # The savepoints, not the time limit, end the first delivery here (the
    # limit has a test of its own below): on a loaded machine 50 deliveries
    # can take longer than BATCH_SECONDS. The ledger writes a row per event:
    # each event has a savepoint, and a batch opens at most BATCH_SAVEPOINTS.
    monkeypatch.setattr(delivery, "BATCH_SECONDS", 60.0)
    positions = [publish("test.events", {"n": n}).position for n in range(120)]
    settle("test.events", positions[-1])
    first = deliver(LEDGER)
    assert (first.delivered, first.more) == (delivery.BATCH_SAVEPOINTS, True)
    while delivery.deliver(spec(LEDGER)).more:
        pass
    assert delivered() == positions
    subscription = Subscription.objects.with_lag().get(name=LEDGER)
    assert (subscription.lag, subscription.delivered) == (0, 120)
    assert subscription.head_position == positions[-1] == subscription.checkpoint_position


def test_a_batch_takes_no_more_events_once_it_has_run_its_time(monkeypatch):
    monkeypatch.setattr(delivery, "BATCH_SECONDS", 0.0)
    positions = [publish("test.events", {"n": n}).position for n in range(3)]
    settle("test.events", positions[-1])
    first = deliver(LEDGER)
    assert (first.delivered, first.more) == (1, True)
    assert row(LEDGER).checkpoint_position == positions[0]


def test_an_async_subscriber_writes_in_the_deliverys_transaction(temporary_subscriber):
    from asgiref.sync import sync_to_async

    async def handle(event):
        await sync_to_async(Handled.objects.create)(
            message_id=event.position, topic="async", attempt=event.attempts, pid=0
        )
        if event.payload.get("fail"):
            raise RuntimeError("after the write")

    temporary_subscriber("test.async", "test.async", handle)
    ok = publish("test.async", {}).position
    settle("test.async", publish("test.async", {"fail": True}).position)
    assert deliver("test.async").outcome == delivery.RETRYING
    assert delivered("async") == [ok], "the failed event's write was committed"


# --- the checkpoint, failures -----------------------------------------------------------


def test_a_failing_event_commits_none_of_its_writes_and_the_checkpoint_stops_before_it():
    ok = [publish("test.events", {"n": n}).position for n in range(2)]
    bad = publish("test.events", {"raise": "RuntimeError", "times": 1}).position
    settle("test.events", bad)
    result = deliver(LEDGER)
    assert (result.outcome, result.delivered) == (delivery.RETRYING, 2)
    assert delivered() == ok, "the failing event's ledger row was committed"
    subscription = row(LEDGER)
    assert subscription.checkpoint_position == ok[-1], "the checkpoint passed the failing event"
    assert (subscription.state, subscription.attempts) == (SubscriptionState.RETRYING, 1)
    assert subscription.failing_position == bad
    assert subscription.last_error == "RuntimeError: something odd"
    assert subscription.retry_at > timezone.now() - datetime.timedelta(seconds=1)

    early = subscription.retry_at - datetime.timedelta(seconds=1)
    assert delivery.deliver(spec(LEDGER), now=early).outcome == delivery.NOT_DUE
    later = subscription.retry_at + datetime.timedelta(seconds=1)
    assert deliver(LEDGER, now=later).outcome == delivery.DELIVERED
    assert delivered() == [*ok, bad]
    assert Handled.objects.get(message_id=bad).attempt == 2
    subscription = row(LEDGER)
    assert (subscription.state, subscription.attempts, subscription.retry_at) == (
        SubscriptionState.ACTIVE, 0, None,
    )  # fmt: skip


def test_retries_back_off_with_retry_after(temporary_subscriber):
    from django_pgqueue import Retry

    def later(event):
        raise Retry(after=30)

    temporary_subscriber("test.retry", "test.retry_after", later, max_attempts=5)
    publish("test.retry", {})
    now = timezone.now()
    result = deliver("test.retry_after", now=now)
    assert result.outcome == delivery.RETRYING
    assert result.retry_at == now + datetime.timedelta(seconds=30)
    assert row("test.retry_after").retry_at == result.retry_at


def test_a_subscriber_that_swallows_a_database_error_fails_its_event(temporary_subscriber):
    def swallow(event):
        Handled.objects.create(message_id=event.position, topic="x", attempt=1, pid=0)
        try:
            with connection.cursor() as cursor:
                cursor.execute("SELECT no_such_column FROM demo_handled")
        except Exception:
            pass

    temporary_subscriber("test.swallow", "test.swallow", swallow)
    publish("test.swallow", {})
    assert deliver("test.swallow").outcome == delivery.RETRYING
    assert "BrokenTransaction" in row("test.swallow").last_error
    assert not Handled.objects.exists()


class Halt(BaseException):
    """Neither an Exception nor one of Python's own."""


@pytest.mark.parametrize(
    "raise_it, error",
    [
        (lambda: sys.exit(3), "SystemExit: 3"),
        (lambda: (_ for _ in ()).throw(KeyboardInterrupt()), "KeyboardInterrupt"),
        (lambda: (_ for _ in ()).throw(Halt("halted")), "Halt: halted"),
    ],
    ids=["SystemExit", "KeyboardInterrupt", "a BaseException of its own"],
)
def test_a_subscriber_that_raises_a_base_exception_fails_its_event_not_the_thread(
    temporary_subscriber, raise_it, error
):
    def halt(event):
        Handled.objects.create(message_id=event.position, topic="halt", attempt=1, pid=0)
        raise_it()

    temporary_subscriber(
        "test.halt", "test.halt", halt, max_attempts=2, backoff_base=0.05, backoff_cap=0.05
    )
    bad = publish("test.halt", {}).position
    with running_worker(subscriptions=["test.halt", LEDGER], poll_interval=0.2) as worker:

        def alive_and(condition):
            assert worker.stream_delivery_died is None, worker.stream_delivery_died
            return condition()

        # Tried again, then stopped with its reason, as any failure.
        blocked = Subscription.objects.filter(name="test.halt", state=SubscriptionState.BLOCKED)
        wait_until(
            lambda: alive_and(blocked.exists),
            timeout=HORIZON_TIMEOUT,
            message="the subscription to block",
        )
        # The delivery thread lives on and delivers to the others.
        position = publish("test.events", {}).position
        wait_until(
            lambda: alive_and(lambda: delivered() == [position]),
            timeout=HORIZON_TIMEOUT,
            message="the next delivery",
        )
        healthy, details = worker.health()
        assert details["streams"]["alive"] and "last_error" not in details["streams"], details
        assert worker.stream_delivery_died is None
    subscription = row("test.halt")
    assert (subscription.attempts, subscription.failing_position) == (2, bad)
    assert subscription.last_error == error
    assert subscription.checkpoint_position == 0 and delivered("halt") == [], "rolled back"


def test_ctrl_c_on_the_main_thread_stops_a_delivery_and_records_nothing(temporary_subscriber):
    # Python raises the operator's Ctrl-C in the main thread only, wherever
    # it runs: there a KeyboardInterrupt stops the program (the batch rolls
    # back), and counts no attempt against the subscriber.
    def interrupted(event):
        Handled.objects.create(message_id=event.position, topic="interrupted", attempt=1, pid=0)
        raise KeyboardInterrupt

    temporary_subscriber("test.interrupted", "test.interrupted", interrupted)
    settle("test.interrupted", publish("test.interrupted", {}).position)
    with pytest.raises(KeyboardInterrupt):
        delivery.deliver(spec("test.interrupted"))
    subscription = row("test.interrupted")
    assert (subscription.state, subscription.attempts) == (SubscriptionState.ACTIVE, 0)
    assert subscription.checkpoint_position == 0 and delivered("interrupted") == []


def test_an_exhausted_event_blocks_the_subscription_until_an_operator_acts():
    blocked_signals = []
    signals.subscription_blocked.connect(
        lambda sender, **kw: blocked_signals.append(kw), weak=False, dispatch_uid="t"
    )
    try:
        bad = publish("test.failing", {"raise": "RuntimeError"}).position
        following = publish("test.failing", {}).position
        assert deliver(BLOCKING).outcome == delivery.RETRYING
        later = row(BLOCKING).retry_at + datetime.timedelta(seconds=1)
        assert deliver(BLOCKING, now=later).outcome == delivery.BLOCKED
    finally:
        signals.subscription_blocked.disconnect(dispatch_uid="t")
    subscription = row(BLOCKING)
    assert (subscription.state, subscription.attempts) == (SubscriptionState.BLOCKED, 2)
    assert subscription.failing_position == bad and subscription.checkpoint_position == 0
    assert blocked_signals == [
        {"subscription": BLOCKING, "stream": "test.failing", "position": bad,
         "error": "RuntimeError: something odd", "signal": signals.subscription_blocked}
    ]  # fmt: skip
    far = later + datetime.timedelta(days=1)
    assert delivery.deliver(spec(BLOCKING), now=far).outcome == delivery.STOPPED
    assert delivered(BLOCKING) == [] and not DeadLetter.objects.exists()

    assert subscriptions.resume([BLOCKING]) == 1  # tried again, fresh attempts
    assert deliver(BLOCKING).outcome == delivery.RETRYING
    assert (row(BLOCKING).state, row(BLOCKING).attempts) == (SubscriptionState.RETRYING, 1)

    assert subscriptions.reset([BLOCKING], bad) == 1  # skip it
    assert row(BLOCKING).state == SubscriptionState.ACTIVE
    assert deliver(BLOCKING).outcome == delivery.DELIVERED
    assert delivered(BLOCKING) == [following]


def test_a_permanent_error_blocks_at_once():
    publish("test.failing", {"raise": "ValueError"})
    assert deliver(BLOCKING).outcome == delivery.BLOCKED
    assert row(BLOCKING).attempts == 1


def test_dead_letter_moves_the_event_and_the_subscription_goes_on():
    seen = []
    signals.dead_lettered.connect(
        lambda sender, **kw: seen.append(kw["message_id"]), weak=False, dispatch_uid="t"
    )
    try:
        bad = publish("test.failing", {"raise": "RuntimeError"}, key="o-7", headers={"h": 1})
        following = publish("test.failing", {"n": 2})
        assert deliver(DEAD_LETTERING).outcome == delivery.RETRYING
        later = row(DEAD_LETTERING).retry_at + datetime.timedelta(seconds=1)
        result = deliver(DEAD_LETTERING, now=later)
    finally:
        signals.dead_lettered.disconnect(dispatch_uid="t")
    assert result.outcome == delivery.DEAD_LETTERED
    dead = DeadLetter.objects.get()
    assert (dead.topic, dead.message_id, dead.queue) == ("test.failing", bad.position, "default")
    assert (dead.category, dead.attempts, dead.payload) == ("unknown", 2, bad.payload)
    assert dead.headers == {
        "h": 1,
        "pgqueue_subscription": DEAD_LETTERING,
        "pgqueue_stream_position": bad.position,
        "pgqueue_stream_key": "o-7",
    }
    assert dead.reason == "RuntimeError: something odd" and "Traceback" in dead.traceback
    assert seen == [bad.position]
    subscription = row(DEAD_LETTERING)
    assert subscription.state == SubscriptionState.ACTIVE
    assert (subscription.checkpoint_position, subscription.checkpoint_xid) == (
        bad.position,
        bad.xid,
    )
    assert deliver(DEAD_LETTERING).outcome == delivery.DELIVERED
    assert delivered(DEAD_LETTERING) == [following.position]


def test_an_event_python_cannot_read_fails_permanently():
    # PostgreSQL reads it; Python's decoder does not (3.13's reads 5,000 deep; see test_poison)
    nested = "[" * 12_000 + "]" * 12_000
    with raw_connection() as conn:
        conn.execute(
            f"INSERT INTO {EVENTS_TABLE} (stream, payload) VALUES ('test.failing', %s::jsonb)",
            [nested],
        )
        conn.commit()
    assert deliver(BLOCKING).outcome == delivery.BLOCKED
    assert "nested too deeply" in row(BLOCKING).last_error
    assert deliver(DEAD_LETTERING).outcome == delivery.DEAD_LETTERED
    dead = DeadLetter.objects.values_list("topic", "category").get()
    assert dead == ("test.failing", "permanent"), "the stored JSON is kept as it was"


def test_one_delivery_at_a_time_per_subscription():
    publish("test.events", {})
    subscription_id = subscriptions.ensure([spec(LEDGER)])[LEDGER]
    with raw_connection() as other:  # another worker's delivery holds the lock
        other.execute(
            "SELECT pg_advisory_xact_lock(%s, %s)", [subscriptions.LOCK_KEY, subscription_id]
        )
        outcome = delivery.deliver(spec(LEDGER), subscription_id)
        assert outcome.outcome == delivery.BUSY and delivered() == []
        other.rollback()
    assert deliver(LEDGER, subscription_id=subscription_id).delivered == 1


# The worker's LOCK_TIMEOUT in the tests of its limits (seconds); a wait for
# a lock that these tests hold ends past it, far sooner than RELEASE_AFTER.
SHORT_LOCK_TIMEOUT = 0.3
RELEASE_AFTER = 30.0


@override_settings(PGQUEUE={"LOCK_TIMEOUT": SHORT_LOCK_TIMEOUT})
def test_a_delivery_gives_up_on_a_held_table_lock_and_its_subscriber_runs_without_limits(
    temporary_subscriber,
):
    seen = []

    def settings_seen(event):
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT current_setting('lock_timeout'), current_setting('statement_timeout')"
            )
            seen.append(cursor.fetchone())

    temporary_subscriber("test.limits", "test.limits", settings_seen)
    subscription_id = subscriptions.ensure([spec("test.limits")])["test.limits"]
    settle("test.limits", publish("test.limits", {}).position)
    with connection.cursor() as cursor:  # the session's own, outside any transaction
        cursor.execute(
            "SELECT current_setting('lock_timeout'), current_setting('statement_timeout')"
        )
        session = cursor.fetchone()
    with raw_connection() as locker:
        # What a migration, a VACUUM FULL or a TRUNCATE holds.
        locker.execute(f"LOCK TABLE {EVENTS_TABLE} IN ACCESS EXCLUSIVE MODE")
        release = threading.Timer(RELEASE_AFTER, locker.rollback)  # a bound, not the test
        release.start()
        started = time.monotonic()
        try:
            with pytest.raises(OperationalError, match="lock timeout"):
                delivery.deliver(spec("test.limits"), subscription_id)
            waited = time.monotonic() - started
        finally:
            release.cancel()
            locker.rollback()
    assert waited < RELEASE_AFTER / 2, f"the delivery waited {waited:.1f}s for the lock"
    assert row("test.limits").checkpoint_position == 0 and seen == []
    assert deliver("test.limits", subscription_id=subscription_id).outcome == delivery.DELIVERED
    assert seen == [session], "the subscriber's queries ran under the worker's limits"


@pytest.mark.parametrize("table", [EVENTS_TABLE, "django_pgqueue_subscription"])
def test_the_delivery_thread_retries_past_a_held_lock_and_delivers_once_it_is_gone(table):
    position = publish("test.events", {}).position
    with (
        override_settings(PGQUEUE={"LOCK_TIMEOUT": SHORT_LOCK_TIMEOUT}),
        raw_connection() as locker,
    ):
        locker.execute(f"LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE")
        with running_worker(subscriptions=[LEDGER], poll_interval=0.2) as worker:

            def streams():
                return worker.health()[1].get("streams") or {}  # {} until it starts

            # Its queries give up, and say so, instead of waiting for the lock.
            wait_until(
                lambda: "lock timeout" in streams().get("last_error", ""),
                timeout=RELEASE_AFTER,
                message="the delivery thread to give up on the lock",
            )
            assert streams()["alive"] and delivered() == []
            locker.rollback()
            wait_until(
                lambda: delivered() == [position],
                timeout=HORIZON_TIMEOUT,
                message="the delivery once the lock is gone",
            )
            wait_until(lambda: "last_error" not in streams(), message="the error to clear")


def test_an_operator_change_during_a_delivery_rolls_the_batch_back(temporary_subscriber):
    def meddle(event):
        Handled.objects.create(message_id=event.position, topic="meddle", attempt=1, pid=0)
        with raw_connection(autocommit=True) as other:  # not through the lock: a raw UPDATE
            other.execute("UPDATE django_pgqueue_subscription SET state = 'paused'")

    temporary_subscriber("test.meddle", "test.meddle", meddle)
    publish("test.meddle", {})
    assert deliver("test.meddle").outcome == delivery.MOVED
    assert not Handled.objects.exists() and row("test.meddle").checkpoint_position == 0


def test_a_new_subscription_can_start_at_the_end(temporary_subscriber):
    old = publish("test.tail", {}).position
    settle("test.tail", old)
    temporary_subscriber("test.tail", "test.tail", lambda event: None, start="end")
    subscriptions.ensure([spec("test.tail")])
    assert row("test.tail").checkpoint_position == old
    assert delivery.deliver(spec("test.tail")).outcome == delivery.IDLE


def test_a_subscription_row_of_another_stream_is_not_served(caplog):
    Subscription.objects.create(name=LEDGER, stream="test.elsewhere")
    with caplog.at_level(logging.ERROR, logger="django_pgqueue"):
        assert subscriptions.ensure([spec(LEDGER)]) == {}
    assert "follows stream test.elsewhere in the database but is registered" in caplog.text


def test_operator_functions_refuse_bad_input_and_change_nothing():
    subscriptions.ensure([spec(LEDGER)])
    with pytest.raises(subscriptions.SubscriptionError, match="no subscription named 'nope'"):
        subscriptions.pause(["nope"])
    for bad in (-1, "1", 1.5, True, None):
        with pytest.raises(subscriptions.SubscriptionError, match="whole number"):
            subscriptions.reset([LEDGER], bad)
    with pytest.raises(subscriptions.SubscriptionError, match="no event at position 99"):
        subscriptions.reset([LEDGER], 99)
    assert row(LEDGER).checkpoint_position == 0 and row(LEDGER).state == "active"
    assert subscriptions.pause([LEDGER]) == 1 and subscriptions.pause([LEDGER]) == 0
    publish("test.events", {})
    assert delivery.deliver(spec(LEDGER)).outcome == delivery.STOPPED


# --- the registry and the worker option -------------------------------------------------


@pytest.mark.parametrize(
    "args, kwargs, error",
    [
        (("",), {"name": "x"}, "stream must not be empty"),
        (("s",), {"name": ""}, "subscription name must not be empty"),
        (("s",), {"name": "bad name"}, "may contain only"),
        (("s",), {"name": "x", "max_attempts": 0}, "max_attempts must be at least 1"),
        (("s",), {"name": "x", "backoff_base": -1}, "backoff_base must be a positive"),
        (("s",), {"name": "x", "on_failure": "skip"}, "on_failure must be 'block' or"),
        (("s",), {"name": "x", "start": "middle"}, "start must be 'beginning' or 'end'"),
        (("s",), {"name": "x", "batch_size": 0}, "batch_size must be a whole number"),
        (("s",), {"name": "x", "backoff_jitter": "yes"}, "backoff_jitter must be"),
    ],
)
def test_subscriber_refuses_bad_options(args, kwargs, error):
    with pytest.raises(ValueError, match=error):
        subscriber(*args, **kwargs)


def test_a_second_subscriber_under_one_name_is_refused():
    with pytest.raises(DuplicateSubscriber, match="two subscribers named 'test.ledger'"):
        subscriber("test.events", name=LEDGER)(lambda event: None)
    assert spec(LEDGER).location.startswith("demo.subscribers.test_ledger")


def test_the_worker_option_names_registered_subscriptions():
    assert subscribers.select("none") == [] and subscribers.select(None) == []
    assert [s.name for s in subscribers.select(f"{LEDGER}, {BLOCKING}")] == [LEDGER, BLOCKING]
    assert {s.name for s in subscribers.select("all")} >= {LEDGER, BLOCKING, DEAD_LETTERING}
    with pytest.raises(CommandError, match=r"unknown subscription\(s\) 'nope' \(registered: "):
        call_command("pgqueue_worker", "--burst", "--subscriptions", "nope")
    with pytest.raises(CommandError, match="give 'all', 'none' or at least one"):
        call_command("pgqueue_worker", "--burst", "--subscriptions", " , ")


def test_a_worker_delivers_in_a_thread_of_its_own_and_stops_with_it():
    with running_worker(subscriptions=[LEDGER], poll_interval=0.2) as worker:
        assert [s.name for s in worker.subscriptions] == [LEDGER]
        position = publish("test.events", {}).position
        wait_until(lambda: delivered() == [position], message="the worker's delivery")
    assert list(Subscription.objects.values_list("name", flat=True)) == [LEDGER]
    with pytest.raises(ValueError, match="unknown subscription"):
        running_worker(subscriptions=["nope"]).__enter__()


def test_the_subscriptions_command_lists_and_steers_them():
    import io

    events = [publish("test.events", {}).position for _ in range(3)]
    subscriptions.ensure([spec(LEDGER), spec(BLOCKING)])
    out = io.StringIO()
    call_command("pgqueue_subscriptions", "list", stdout=out)
    lines = out.getvalue().splitlines()
    assert lines[0].split()[:5] == ["NAME", "STREAM", "STATE", "CHECKPOINT", "LAG"]
    assert lines[2].split() == [LEDGER, "test.events", "active", "0", "3"]
    call_command("pgqueue_subscriptions", "pause", LEDGER, BLOCKING, stdout=out)
    assert "pause: 2 of 2 subscription(s) changed" in out.getvalue()
    call_command("pgqueue_subscriptions", "reset", LEDGER, "--to", str(events[1]), stdout=out)
    assert (row(LEDGER).state, row(LEDGER).checkpoint_position) == ("paused", events[1])
    call_command("pgqueue_subscriptions", "resume", LEDGER, stdout=out)
    assert row(LEDGER).state == "active"
    with pytest.raises(CommandError, match="has no event at position 999999"):
        call_command("pgqueue_subscriptions", "reset", LEDGER, "--to", "999999")
    with pytest.raises(CommandError, match="neither a position"):
        call_command("pgqueue_subscriptions", "reset", LEDGER, "--to", "soon")
    with pytest.raises(CommandError, match="no subscription named 'nope'"):
        call_command("pgqueue_subscriptions", "pause", "nope")


# --- retention ----------------------------------------------------------------------------


def test_retention_deletes_old_events_every_subscription_has_passed():
    old = timezone.now() - datetime.timedelta(days=8)
    passed_old = publish("test.events", {"n": 1}).position
    unpassed_old = publish("test.events", {"n": 2}).position
    fresh = publish("test.events", {"n": 3}).position
    unsubscribed = publish("test.nobody", {}).position
    StreamEvent.objects.exclude(pk=fresh).update(created_at=old)
    settle("test.nobody", unsubscribed)
    ids = subscriptions.ensure([spec(LEDGER)])
    event = StreamEvent.objects.get(pk=passed_old)
    Subscription.objects.filter(pk=ids[LEDGER]).update(
        checkpoint_xid=event.xid, checkpoint_position=event.position
    )
    with override_settings(PGQUEUE={"STREAM_RETENTION": None}):
        assert maintenance.run_once().events_pruned == 0
    result = maintenance.run_once()
    assert result.events_pruned == 2
    assert set(StreamEvent.objects.values_list("pk", flat=True)) == {unpassed_old, fresh}
    assert unsubscribed not in StreamEvent.objects.values_list("pk", flat=True)
    # Passed and a day older than the cutoff: a fabricated clock, same rule.
    settle("test.events", fresh)
    subscriptions.reset([LEDGER], "end")
    later = timezone.now() + datetime.timedelta(days=8)
    assert maintenance.run_once(now=later).events_pruned == 2
    assert not StreamEvent.objects.exists()


def test_stream_retention_setting_is_validated():
    for good in (None, 1, 3600.5):
        with override_settings(PGQUEUE={"STREAM_RETENTION": good}):
            assert conf.validate() == []
    for bad in (0, -1, "7d", True, float("inf")):
        with override_settings(PGQUEUE={"STREAM_RETENTION": bad}):
            [(check_id, message, _)] = conf.validate()
            assert check_id == "pgqueue.E003" and "or None (keep every event)" in message


# --- indexes -------------------------------------------------------------------------------


def plan(sql, params):
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SET LOCAL enable_seqscan = off")  # a small table: ask for the index
        cursor.execute("EXPLAIN " + sql, params)
        return "\n".join(row[0] for row in cursor.fetchall())


def test_the_hot_statements_read_the_stream_index():
    from django_pgqueue.streams import retention

    ids = subscriptions.ensure([spec(LEDGER)])
    tables = {"events": EVENTS_TABLE, "subs": "django_pgqueue_subscription"}
    statements = {
        "next events": (
            delivery.statement(delivery.NEXT_SQL),
            [None, 50, ids[LEDGER]],  # now, limit, id
        ),
        "probe": (delivery.statement(delivery.PROBE_SQL), [list(ids.values())]),
        "head": (subscriptions.HEAD_SQL.format(**tables), ["test.events"]),
        "retention": (
            retention.PRUNE_SQL.format(**tables),
            {"stream": "test.events", "limit": 10, "now": None, "keep": 1.0},
        ),
    }
    for name, (sql, params) in statements.items():
        text = plan(sql, params)
        assert "pgqueue_event_stream_idx" in text, f"{name} does not use the stream index:\n{text}"
        assert f"Seq Scan on {EVENTS_TABLE}" not in text, f"{name} scans the table:\n{text}"
    for name in ("next events", "probe", "retention"):
        text = plan(*statements[name])
        assert 'ROW(xid, "position")' in text, f"{name}: the checkpoint is no index bound"


# --- real worker processes ------------------------------------------------------------------


@pytest.mark.slow
def test_two_workers_deliver_each_event_once_and_in_order(start_worker):
    options = ("--subscriptions", LEDGER, "--poll-interval", "0.2", "--log-level", "INFO")
    workers = [
        start_worker(*options),
        start_worker(*options, pgqueue={"NOTIFY": False}),  # poll-only
    ]
    # Both serve the subscription before the events come (a fast one would
    # deliver them all while the other starts, and get SIGTERM before its
    # handler is in place).
    wait_until(
        lambda: all("delivering to subscription" in worker.log() for worker in workers),
        timeout=60,
        message="both workers to start delivering",
    )
    positions = []
    for batch in range(30):
        with transaction.atomic():
            positions += [publish("test.events", {"b": batch, "n": n}).position for n in range(10)]
    wait_until(
        lambda: Handled.objects.filter(topic=LEDGER).count() >= len(positions),
        timeout=60,
        message="every event to be delivered",
    )
    assert delivered() == positions, "an event was delivered twice, skipped or out of order"
    for worker in workers:
        worker.signal(signal.SIGTERM)
        assert worker.wait(timeout=30) == 0, worker.log()
        assert "changed during the delivery" not in worker.log(), "two deliveries overlapped"
    assert row(LEDGER).delivered == len(positions)


@pytest.mark.slow
def test_poll_only_workers_deliver_once_and_in_order_behind_pgbouncer(
    pgbouncer,  # noqa: F811  (the fixture imported above)
    start_worker,
):
    # Transaction pooling with fewer server connections than clients: the
    # subscription's lock and its checkpoint must hold without session state.
    options = ("--subscriptions", LEDGER, "--poll-interval", "0.1", "--log-level", "WARNING")
    env, pgqueue = pgbouncer.worker_env(), {"NOTIFY": False}
    workers = [start_worker(*options, pgqueue=pgqueue, env=env) for _ in range(2)]
    positions = []
    for batch in range(10):
        with transaction.atomic():
            positions += [publish("test.events", {"b": batch, "n": n}).position for n in range(20)]
    wait_until(
        lambda: Handled.objects.filter(topic=LEDGER).count() >= len(positions),
        timeout=60,
        message="every event to be delivered through PgBouncer",
    )
    assert delivered() == positions
    # Both up (the other may have delivered everything while this one was
    # still starting: a SIGTERM then would find no handler installed yet).
    from django_pgqueue.models import WorkerHeartbeat

    pids = [worker.pid for worker in workers]
    wait_until(
        lambda: WorkerHeartbeat.objects.filter(pid__in=pids).count() == len(pids),
        message="both workers' heartbeats",
    )
    for worker in workers:
        worker.signal(signal.SIGTERM)
        assert worker.wait(timeout=60) == 0, worker.log()
        assert "Traceback" not in worker.log(), worker.log()


@pytest.mark.slow
def test_kill_9_mid_delivery_loses_nothing_and_keeps_the_order(start_worker, tmp_path):
    positions = [
        publish("test.events", {"n": 1}).position,
        publish("test.events", {"sleep": 60, "once": str(tmp_path / "slept")}).position,
        publish("test.events", {"n": 3}).position,
    ]
    victim = start_worker("--subscriptions", LEDGER, "--poll-interval", "0.2")
    wait_until(lambda: (tmp_path / "slept").exists(), timeout=60, message="the delivery to start")
    subscription_id = row(LEDGER).pk
    with raw_connection(autocommit=True) as conn:
        holder = wait_until(
            lambda: conn.execute(
                "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND classid = %s "
                "AND objid = %s AND granted",
                [subscriptions.LOCK_KEY, subscription_id],
            ).fetchone(),
            timeout=60,
            message="the victim to hold the subscription's lock",
        )
    assert holder
    victim.signal(signal.SIGKILL)
    victim.wait(timeout=10)
    assert delivered() == [], "the killed batch's writes were committed"
    assert row(LEDGER).checkpoint_position == 0

    rescuer = start_worker("--subscriptions", LEDGER, "--poll-interval", "0.2")
    wait_until(lambda: len(delivered()) == 3, timeout=60, message="the batch to be redone")
    assert delivered() == positions
    assert set(Handled.objects.values_list("attempt", flat=True)) == {1}
    assert row(LEDGER).checkpoint_position == positions[-1]
    rescuer.signal(signal.SIGTERM)
    assert rescuer.wait(timeout=30) == 0


# --- --burst ---------------------------------------------------------------------------


@pytest.mark.slow
def test_burst_exits_once_every_due_event_is_delivered(start_worker):
    # Three batches (50 a batch) for one subscription, a failing event that
    # blocks another: the burst waits for the first, not for the second.
    positions = [publish("test.events", {"n": n}).position for n in range(120)]
    publish("test.failing", {"raise": "Permanent"})
    # A long poll interval: the exit must follow the deliveries, not a poll.
    worker = start_worker(
        "--burst", "--subscriptions", f"{LEDGER},{BLOCKING}", "--poll-interval", "60"
    )
    assert worker.wait(timeout=50) == 0, worker.log()
    assert delivered() == positions, "the burst exited before every due event was delivered"
    assert row(LEDGER).checkpoint_position == positions[-1]
    assert row(BLOCKING).state == SubscriptionState.BLOCKED


@pytest.mark.slow
def test_burst_waits_for_events_an_older_open_transaction_holds_back(start_worker):
    with raw_connection() as older:
        older.execute("SELECT pg_current_xact_id()")  # open, with a transaction id
        positions = [publish("test.events", {"n": n}).position for n in range(3)]
        worker = start_worker("--burst", "--subscriptions", LEDGER, "--poll-interval", "1")
        wait_until(
            lambda: Subscription.objects.filter(name=LEDGER).exists(),
            timeout=60,
            message="the worker's first round",
        )
        # Committed, but not deliverable until the older transaction ends.
        assert worker.popen.poll() is None, worker.log()
        assert delivered() == []
        older.rollback()
    assert worker.wait(timeout=30) == 0, worker.log()
    assert delivered() == positions


def test_burst_fails_when_the_delivery_thread_dies(caplog):
    # A subscriber's SystemExit is its failure; outside a subscriber one
    # still ends the delivery thread: here a receiver of subscription_blocked
    # that calls sys.exit() (signals.send catches Exceptions only). A burst
    # must not exit 0 as if all was delivered.
    def exit_receiver(sender, **kwargs):
        sys.exit(3)

    signals.subscription_blocked.connect(exit_receiver, weak=False, dispatch_uid="t")
    try:
        publish("test.events", {"raise": "Permanent"})
        with pytest.raises(
            CommandError, match=r"stream delivery stopped \(the delivery thread died: "
        ):
            call_command(
                "pgqueue_worker", "--burst", "--subscriptions", LEDGER, "--poll-interval", "60"
            )
    finally:
        signals.subscription_blocked.disconnect(dispatch_uid="t")
    assert "SystemExit: 3" in caplog.text
    assert delivered() == [] and row(LEDGER).state == SubscriptionState.BLOCKED
