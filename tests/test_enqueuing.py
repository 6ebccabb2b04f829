"""enqueue() and enqueue_many() against the real PostgreSQL: transactions,
wake-ups, dedup, bulk inserts, cross-alias deferral and the signal."""

import datetime
import threading
import uuid

import pytest
from django.db import OperationalError, connections, transaction
from django.db.models.signals import post_init
from django.test import override_settings
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from django_pgqueue import enqueue, enqueue_many, enqueuing, testing
from django_pgqueue.exceptions import InvalidMessage
from django_pgqueue.models import Message, Status
from django_pgqueue.notify import CHANNEL
from django_pgqueue.signals import message_enqueued


def committed_topics(conn):
    """Topics of the messages another client can see, in id order."""
    return [row[0] for row in conn.execute("SELECT topic FROM django_pgqueue_message ORDER BY id")]


class Rollback(Exception):
    pass


@pytest.fixture
def enqueued_signals():
    received = []

    def receiver(sender, message, using, **kwargs):
        received.append((message.pk, message.topic, using))

    message_enqueued.connect(receiver)
    yield received
    message_enqueued.disconnect(receiver)


# --- transactions -------------------------------------------------------------


def test_commit_publishes(other_connection):
    with transaction.atomic():
        message = enqueue("orders.created", {"order_id": 1})
        assert committed_topics(other_connection) == [], "visible before the commit"
    assert committed_topics(other_connection) == ["orders.created"]
    row = Message.objects.get(pk=message.pk)
    assert row.payload == {"order_id": 1}
    assert row.status == Status.WAITING
    assert row.queue == "default"
    assert row.attempts == 0
    assert message.created is True


def test_rollback_discards(other_connection, enqueued_signals):
    with pytest.raises(Rollback), transaction.atomic():
        enqueue("orders.created", {"order_id": 1})
        raise Rollback
    assert committed_topics(other_connection) == []
    assert Message.objects.count() == 0
    assert enqueued_signals == [], "the signal fired for a rolled-back message"


def test_savepoint_rollback_discards_only_the_inner_messages(other_connection, enqueued_signals):
    with transaction.atomic():
        outer = enqueue("outer", 1)
        with pytest.raises(Rollback), transaction.atomic():
            enqueue("inner", 2)
            enqueue_many([{"payload": 3}, {"payload": 4}], topic="inner")
            raise Rollback
        after = enqueue("after", 5)
    assert committed_topics(other_connection) == ["outer", "after"]
    assert enqueued_signals == [(outer.pk, "outer", "default"), (after.pk, "after", "default")]


def test_signal_fires_after_commit_not_before(transactional_db, enqueued_signals):
    with transaction.atomic():
        message = enqueue("orders.created", {})
        assert enqueued_signals == [], "the signal fired before the commit"
    assert enqueued_signals == [(message.pk, "orders.created", "default")]


def test_without_a_transaction_the_message_is_committed_at_once(other_connection):
    enqueue("autocommit", {})
    assert committed_topics(other_connection) == ["autocommit"]


# --- wake-ups -----------------------------------------------------------------


def test_notify_arrives_at_commit_and_not_before(listener):
    with transaction.atomic():
        enqueue("orders.created", {})
        assert listener.received(timeout=0.3) == [], "NOTIFY was delivered before the commit"
    assert listener.wait_for(1) == [(CHANNEL, "default")]


def test_rolled_back_insert_wakes_nobody(listener):
    with pytest.raises(Rollback), transaction.atomic():
        enqueue("orders.created", {})
        raise Rollback
    assert listener.received(timeout=0.3) == []


def test_one_notify_per_statement_and_queue_not_per_row(listener):
    enqueue_many([{"payload": n, "queue": "a" if n % 2 else "b"} for n in range(500)], topic="t")
    got = listener.wait_for(2)
    got += listener.received(timeout=0.3)  # anything beyond the two expected
    assert sorted(got) == [(CHANNEL, "a"), (CHANNEL, "b")]


def test_one_notify_per_transaction_and_queue_across_statements(listener):
    # The trigger calls pg_notify() per row; PostgreSQL folds the duplicates.
    with transaction.atomic():
        for n in range(20):
            enqueue("t", n, queue="a" if n % 2 else "b")
        enqueue_many([{"payload": n} for n in range(30)], topic="t", queue="a")
    got = listener.wait_for(2)
    got += listener.received(timeout=0.3)
    assert sorted(got) == [(CHANNEL, "a"), (CHANNEL, "b")]


def test_rows_inserted_not_waiting_notify_nobody(listener, other_connection):
    other_connection.execute(
        "INSERT INTO django_pgqueue_message (topic, payload, status)"
        " VALUES ('from.sql', '{}', 'done')"
    )
    assert listener.received(timeout=0.3) == []


def test_raw_sql_insert_gets_defaults_and_a_notification(listener, other_connection):
    other_connection.execute(
        "INSERT INTO django_pgqueue_message (topic, payload) VALUES ('from.sql', '{\"x\": 1}')"
    )
    assert listener.wait_for(1) == [(CHANNEL, "default")]
    row = Message.objects.get(topic="from.sql")
    assert row.payload == {"x": 1}
    assert row.queue == "default"
    assert row.status == Status.WAITING
    assert row.headers == {}
    assert row.priority == 0
    assert row.attempts == 0
    assert row.max_attempts is None
    assert row.last_error == ""
    assert row.run_at <= timezone.now()
    assert row.created_at == row.updated_at == row.run_at


# --- options ------------------------------------------------------------------


@pytest.mark.django_db
def test_options_are_stored():
    at = timezone.now() + datetime.timedelta(hours=1)
    message = enqueue(
        "t",
        [1, "two"],
        run_at=at,
        priority=7,
        queue="emails",
        dedup_key="d",
        group_key="g",
        headers={"correlation_id": "abc"},
        max_attempts=3,
    )
    row = Message.objects.get(pk=message.pk)
    assert (row.payload, row.run_at, row.priority, row.queue) == ([1, "two"], at, 7, "emails")
    assert (row.dedup_key, row.group_key, row.max_attempts) == ("d", "g", 3)
    assert row.headers == {"correlation_id": "abc"}
    assert message.run_at == at


def _prepared_inserts():
    with connections["default"].cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_prepared_statements"
            " WHERE statement LIKE 'INSERT INTO \"django_pgqueue_message\"%%'"
        )
        return cursor.fetchone()[0]


@pytest.mark.django_db
def test_the_one_message_insert_is_prepared_and_stores_every_option_the_same():
    """psycopg prepares the repeated INSERT (server-side binding): every
    option must come out of it as typed as from the first, unprepared runs."""
    at = timezone.now() + datetime.timedelta(hours=1)
    variants = [
        dict(),
        dict(run_at=at, priority=-100, max_attempts=2147483647, dedup_key="k", group_key="g"),
        dict(delay=1.5, priority=100, queue="q", headers={"h": ["x", None]}, partition_key="p"),
        dict(delay=datetime.timedelta(minutes=2), max_attempts=1),
    ]
    for number in range(7):  # past psycopg's prepare_threshold (5)
        for index, options in enumerate(variants):
            dedup = {"dedup_key": f"k{number}"} if "dedup_key" in options else {}
            message = enqueue("t.prepared", {"n": number, "i": index}, **{**options, **dedup})
            row = Message.objects.get(pk=message.pk)
            assert row.payload == {"n": number, "i": index}
            assert (row.priority, row.queue) == (
                options.get("priority", 0),
                options.get("queue", "default"),
            )
            assert (row.max_attempts, row.dedup_key, row.group_key, row.partition_key) == (
                options.get("max_attempts"),
                dedup.get("dedup_key"),
                options.get("group_key"),
                options.get("partition_key"),
            )
            assert row.headers == options.get("headers", {})
            assert message.run_at == row.run_at and message.created_at == row.created_at
            if "run_at" in options:
                assert row.run_at == at
            elif "delay" in options:
                assert row.run_at > row.created_at
            else:  # now(): the start of the test's transaction
                assert row.run_at <= row.created_at
    assert _prepared_inserts() >= 1


@pytest.mark.django_db
def test_a_message_with_every_option_at_its_default_is_stored_as_the_long_insert_stores_it():
    """enqueue(topic, payload) sends a shorter INSERT (three parameters, the
    rest the table's defaults): its row is the one the full INSERT writes
    for the same options, run_at the transaction's now() as without delay."""
    from django_pgqueue import enqueuing

    plain = enqueue("t.plain", {"n": 1})
    full = enqueue("t.plain", {"n": 1}, headers={"h": 1})  # not plain: every column bound
    assert enqueuing._ONE_SQL[enqueuing.INSERT_ONE_PLAIN_SQL].count("%s") == 3
    columns = [f.attname for f in Message._meta.concrete_fields]
    rows = {row["id"]: row for row in Message.objects.filter(topic="t.plain").values(*columns)}
    same = {"id", "headers", "created_at", "updated_at"}
    plain_row, full_row = rows[plain.pk], rows[full.pk]
    assert {k: v for k, v in plain_row.items() if k not in same} == {
        k: v for k, v in full_row.items() if k not in same
    }
    assert plain_row["headers"] == {} and full_row["headers"] == {"h": 1}
    with connections["default"].cursor() as cursor:
        cursor.execute("SELECT now()")
        (now,) = cursor.fetchone()
    assert plain_row["run_at"] == full_row["run_at"] == now == plain.run_at
    assert plain.created_at == plain_row["created_at"] and plain.created is True


@pytest.mark.django_db
def test_without_a_prepare_threshold_nothing_is_prepared():
    """The PgBouncer setting (OPTIONS prepare_threshold None) is honoured."""
    connection = connections["default"]
    connection.ensure_connection()
    connection.connection.prepare_threshold = None
    try:
        for number in range(8):
            enqueue("t.unprepared", {"n": number})
        assert _prepared_inserts() == 0
        assert Message.objects.filter(topic="t.unprepared").count() == 8
    finally:
        connection.close()  # the next test gets a connection with the default


@pytest.mark.django_db(transaction=True)
def test_the_insert_cursor_is_kept_per_connection_and_replaced_with_it(other_connection):
    """prepared_cursor keeps one cursor per connection; a closed connection
    or a backend that died gets a new one, and Django's execute wrappers
    see every statement sent through the kept cursor."""
    connection = connections["default"]
    seen = []

    def wrapper(execute, sql, params, many, context):
        seen.append(sql.split(None, 3)[:3])
        return execute(sql, params, many, context)

    with connection.execute_wrapper(wrapper):
        enqueue("t.cursor", {"n": 1})
        first = connection._pgqueue_prepared_cursor[-1]
        enqueue("t.cursor", {"n": 2})
        assert connection._pgqueue_prepared_cursor[-1] is first
        assert seen == [["INSERT", "INTO", '"django_pgqueue_message"']] * 2

        connection.close()  # a new connection (CONN_MAX_AGE, close_old_connections)
        enqueue("t.cursor", {"n": 3})
        assert connection._pgqueue_prepared_cursor[-1] is not first

        # The backend dies under the kept cursor: the call fails, Django
        # drops the unusable connection, and the next call works again.
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_backend_pid()")
            (pid,) = cursor.fetchone()
        other_connection.execute("SELECT pg_terminate_backend(%s)", [pid])
        with pytest.raises(OperationalError):
            enqueue("t.cursor", {"n": 4})
        connection.close_if_unusable_or_obsolete()
        enqueue("t.cursor", {"n": 5})
    assert committed_topics(other_connection) == ["t.cursor"] * 4
    assert sorted(m.payload["n"] for m in Message.objects.filter(topic="t.cursor")) == [1, 2, 3, 5]


@pytest.mark.django_db
def test_while_queries_are_logged_the_kept_cursor_is_djangos_logging_one():
    """With the query log on (DEBUG, CaptureQueriesContext) the kept cursor
    is Django's client-side one, so the log has the SQL; when the log goes
    off, it is closed and replaced by the server-binding one."""
    connection = connections["default"]
    with CaptureQueriesContext(connection) as queries:
        enqueue("t.logged", {"n": 1})
        logging_cursor = connection._pgqueue_prepared_cursor[-1]
        enqueue("t.logged", {"n": 2})
        assert connection._pgqueue_prepared_cursor[-1] is logging_cursor
    inserts = [q["sql"] for q in queries.captured_queries if q["sql"].startswith("INSERT")]
    assert len(inserts) == 2 and all("'t.logged'" in sql for sql in inserts)
    enqueue("t.logged", {"n": 3})
    assert connection._pgqueue_prepared_cursor[-1] is not logging_cursor
    assert logging_cursor.cursor.closed
    assert Message.objects.filter(topic="t.logged").count() == 3


@pytest.mark.django_db
@pytest.mark.parametrize("delay", [30, 30.0, datetime.timedelta(seconds=30)])
def test_delay_sets_run_at_from_the_database_clock(delay):
    with connections["default"].cursor() as cursor:
        cursor.execute("SELECT now()")
        (now,) = cursor.fetchone()
    message = enqueue("t", {}, delay=delay)
    assert Message.objects.get(pk=message.pk).run_at == now + datetime.timedelta(seconds=30)


@pytest.mark.django_db
def test_payload_uses_djangos_json_encoder():
    when = datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=datetime.UTC)
    message = enqueue("t", {"when": when, "amount": __import__("decimal").Decimal("1.50")})
    assert Message.objects.get(pk=message.pk).payload == {
        "when": "2026-01-02T03:04:05Z",
        "amount": "1.50",
    }


# --- dedup --------------------------------------------------------------------


@pytest.mark.django_db
def test_dedup_returns_the_unfinished_message_instead_of_a_second_row():
    first = enqueue("emails.send", {"to": "a"}, dedup_key="welcome-42")
    second = enqueue("emails.send", {"to": "b"}, dedup_key="welcome-42")
    assert first.created is True
    assert second.created is False, "the return value must say no row was inserted"
    assert second.pk == first.pk
    assert second.payload == {"to": "a"}, "the existing message is returned"
    testing.assert_enqueued("emails.send", count=1)


@pytest.mark.django_db
def test_dedup_is_per_topic_and_only_among_unfinished_messages():
    first = enqueue("a", {}, dedup_key="k")
    assert enqueue("b", {}, dedup_key="k").created is True, "another topic is another key space"
    Message.objects.filter(pk=first.pk).update(
        status=Status.PROCESSING, lease_token=uuid.uuid4(), lease_expires_at=timezone.now()
    )
    assert enqueue("a", {}, dedup_key="k").created is False, "a leased message is unfinished"
    Message.objects.filter(pk=first.pk).update(status=Status.DONE)
    again = enqueue("a", {}, dedup_key="k")
    assert again.created is True and again.pk != first.pk
    Message.objects.filter(pk=again.pk).delete()
    assert enqueue("a", {}, dedup_key="k").created is True


@pytest.mark.django_db
def test_dedup_holder_finishing_between_insert_and_look_up_is_inserted_again():
    holder = enqueue("a", "old", dedup_key="k")
    gap = []

    def holder_finishes_first(execute, sql, params, many, context):
        # The first statement after the skipped INSERT is the look-up of the
        # holder: the holder is acknowledged in this very gap, just before it.
        if gap == ["insert"]:
            gap.append("look-up")
            Message.objects.filter(pk=holder.pk).delete()
        elif sql.startswith("INSERT") and not gap:
            gap.append("insert")
        return execute(sql, params, many, context)

    with connections["default"].execute_wrapper(holder_finishes_first):
        message = enqueue("a", "new", dedup_key="k")
    assert gap == ["insert", "look-up"], "the enqueue did not look the holder up after its INSERT"
    assert message.created is True and message.pk != holder.pk
    assert list(Message.objects.values_list("payload", flat=True)) == ["new"]


@pytest.mark.django_db
def test_messages_without_dedup_key_never_conflict():
    assert enqueue("a", {}).pk != enqueue("a", {}).pk


def test_dedup_against_a_concurrent_uncommitted_enqueue_waits_for_it(other_connection):
    # Another client holds an uncommitted message with the key; ON CONFLICT
    # waits for it, so the outcome follows that transaction's fate.
    other_connection.autocommit = False
    other_connection.execute(
        "INSERT INTO django_pgqueue_message (topic, payload, dedup_key) VALUES ('a', '1', 'k')"
    )
    result = {}

    def enqueue_in_a_thread():
        try:
            result["message"] = enqueue("a", 2, dedup_key="k")
        finally:
            connections.close_all()  # this thread's own connections

    thread = threading.Thread(target=enqueue_in_a_thread)
    thread.start()
    thread.join(timeout=0.5)
    assert thread.is_alive(), "the second enqueue did not wait for the first transaction"
    other_connection.rollback()
    thread.join(timeout=10)
    assert result["message"].created is True, "after the other rollback the key was free"


# --- enqueue_many -------------------------------------------------------------


@pytest.mark.django_db
def test_enqueue_many_writes_all_rows_in_one_statement_and_returns_them():
    size = enqueuing.STREAM_CHUNK - 1  # the most one INSERT takes
    items = [{"payload": {"n": n}} for n in range(size)]
    items[10]["priority"] = 5
    items[20]["topic"] = "other.topic"
    with CaptureQueriesContext(connections["default"]) as queries:
        messages = enqueue_many(items, topic="numbers", queue="bulk")
    inserts = [q["sql"] for q in queries.captured_queries if q["sql"].lstrip().startswith("INSERT")]
    assert len(inserts) == 1, f"expected one INSERT, got {len(inserts)}"
    assert len(queries.captured_queries) == 1, "nothing else should be queried"
    assert [m.payload for m in messages] == [{"n": n} for n in range(size)]
    assert all(m.created for m in messages)
    ids = [m.pk for m in messages]
    assert ids == sorted(ids), "messages come back in input order"
    stored = {m.pk: m for m in Message.objects.filter(pk__in=ids)}
    assert len(stored) == size
    assert stored[ids[10]].priority == 5
    assert stored[ids[20]].topic == "other.topic"
    assert {m.queue for m in stored.values()} == {"bulk"}


@pytest.mark.django_db
def test_options_given_once_are_stored_as_when_each_message_gives_them():
    """enqueue_many's shared-options INSERT (options as parameters, payloads
    as one array) stores what its array-of-rows INSERT stores."""
    at = timezone.now() + datetime.timedelta(hours=1)
    options = {
        "queue": "bulk", "priority": -7, "max_attempts": 4, "headers": {"source": "import"},
    }  # fmt: skip
    for timing in ({"delay": 30.25}, {"run_at": at}, {}):
        shared = enqueue_many(
            [{"payload": {"n": n}} for n in range(3)], topic="t.shared", **options, **timing
        )
        each = enqueue_many(
            [{"payload": {"n": n}, "topic": "t.shared", **options, **timing} for n in range(3)]
            + [{"payload": "mixed", "topic": "t.other"}]  # rows that differ: the other INSERT
        )[:3]
        for one, other in zip(shared, each, strict=True):
            a, b = Message.objects.get(pk=one.pk), Message.objects.get(pk=other.pk)
            for field in ("queue", "topic", "payload", "headers", "priority", "max_attempts"):
                assert getattr(a, field) == getattr(b, field) == getattr(one, field), field
            assert one.run_at == a.run_at and one.created_at == a.created_at
            if "delay" in timing:  # run_at counts from the transaction's start
                assert 30 < (a.run_at - a.created_at).total_seconds() <= 30.25
                assert 30 < (b.run_at - b.created_at).total_seconds() <= 30.25
        if "run_at" in timing:
            assert {m.run_at for m in shared} == {at}


@pytest.mark.django_db
def test_a_dedup_or_group_key_given_once_applies_to_every_message_of_the_call():
    chunk = enqueuing.STREAM_CHUNK
    deduped = enqueue_many([{"payload": n} for n in range(chunk + 2)], topic="t", dedup_key="k")
    assert [m.created for m in deduped] == [True] + [False] * (chunk + 1)
    assert {m.pk for m in deduped} == {deduped[0].pk} and deduped[-1].payload == 0
    grouped = enqueue_many([{"payload": n} for n in range(3)], topic="t", group_key="g")
    each = enqueue_many([{"payload": n, "topic": "t", "group_key": "h"} for n in range(3)])
    for messages in (grouped, each):  # the group trigger ran on every row, either way
        stored = [Message.objects.get(pk=m.pk) for m in messages]
        assert [m.status for m in stored] == [m.status for m in messages]
    assert [m.status for m in grouped] == [m.status for m in each]
    assert {m.group_key for m in grouped} == {"g"}


@pytest.mark.django_db
def test_enqueue_many_gives_each_message_its_own_headers_unless_the_caller_shares_one():
    first, second = enqueue_many([{"payload": 1}, {"payload": 2}], topic="t")
    first.headers["trace"] = "x"
    assert second.headers == {}
    shared = {"source": "import"}
    a, b = enqueue_many([{"payload": 1}, {"payload": 2}], topic="t", headers=shared)
    assert a.headers is shared and b.headers is shared  # as the caller gave it
    assert {m.headers["source"] for m in Message.objects.filter(pk__in=[a.pk, b.pk])} == {"import"}


@pytest.mark.django_db
def test_enqueue_many_with_dedup_keys_reports_each_outcome():
    existing = enqueue("t", "old", dedup_key="a")
    messages = enqueue_many(
        [
            {"payload": 1, "dedup_key": "a"},  # exists already
            {"payload": 2, "dedup_key": "b"},
            {"payload": 3},
            {"payload": 4, "dedup_key": "b"},  # same key earlier in the batch
        ],
        topic="t",
    )
    assert [m.created for m in messages] == [False, True, True, False]
    assert messages[0].pk == existing.pk and messages[0].payload == "old"
    assert messages[3].pk == messages[1].pk
    assert Message.objects.count() == 3


@pytest.mark.django_db
def test_a_large_enqueue_many_is_sent_in_chunks_and_reports_each_outcome():
    """Past STREAM_CHUNK rows: several pipelined INSERTs in one transaction,
    dedup conflicts found in any chunk (with the table and across chunks)."""
    chunk = enqueuing.STREAM_CHUNK
    existing = enqueue("t", "old", dedup_key="held")
    items = [{"payload": n} for n in range(2 * chunk + 1)]
    items[5]["dedup_key"] = "held"  # exists already
    items[chunk + 3]["dedup_key"] = "twice"
    items[2 * chunk]["dedup_key"] = "twice"  # the same key, two chunks later
    with CaptureQueriesContext(connections["default"]) as queries:
        messages = enqueue_many(items, topic="t")
    inserts = [q for q in queries.captured_queries if q["sql"].startswith("INSERT")]
    assert len(inserts) == 3, "one INSERT per chunk"
    assert [m.payload for m in messages[:5]] == [0, 1, 2, 3, 4]
    assert messages[5].pk == existing.pk and messages[5].created is False
    assert messages[2 * chunk].pk == messages[chunk + 3].pk
    assert messages[2 * chunk].created is False
    created = [m for m in messages if m.created]
    assert len(created) == 2 * chunk - 1
    assert [m.pk for m in created] == sorted(m.pk for m in created), "ids follow the input"
    stored = dict(Message.objects.values_list("pk", "payload"))
    assert len(stored) == 2 * chunk  # the existing one and the created ones
    assert all(stored[m.pk] == m.payload for m in created)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("inside_a_transaction", [False, True])
def test_a_bad_row_late_in_a_large_enqueue_many_writes_nothing(inside_a_transaction):
    chunk = enqueuing.STREAM_CHUNK
    items = [{"payload": n} for n in range(2 * chunk + 10)]
    items[chunk + 5]["priority"] = 1000
    if inside_a_transaction:
        with transaction.atomic():
            before = enqueue("t", "before")
            with pytest.raises(InvalidMessage, match=f"message {chunk + 5}: priority"):
                enqueue_many(items, topic="t")
            after = enqueue("t", "after")  # the caller's transaction goes on
        assert set(Message.objects.values_list("pk", flat=True)) == {before.pk, after.pk}
    else:
        with pytest.raises(InvalidMessage, match=f"message {chunk + 5}: priority"):
            enqueue_many(items, topic="t")
        assert not Message.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_a_database_error_in_a_later_chunk_writes_nothing_and_leaves_a_usable_connection():
    from django.db import DatabaseError

    chunk = enqueuing.STREAM_CHUNK
    items = [{"payload": n} for n in range(2 * chunk + 10)]
    items[chunk + 5]["payload"] = "boom"
    with connections["default"].cursor() as cursor:
        cursor.execute(
            """CREATE FUNCTION test_boom() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
                IF NEW.payload = '"boom"'::jsonb THEN RAISE EXCEPTION 'boom row'; END IF;
                RETURN NEW;
            END $$;
            CREATE TRIGGER test_boom BEFORE INSERT ON django_pgqueue_message
                FOR EACH ROW EXECUTE FUNCTION test_boom()"""
        )
    try:
        with pytest.raises(DatabaseError, match="boom row"):
            enqueue_many(items, topic="t")
        assert not Message.objects.exists()
        assert enqueue("t", "next").created is True
    finally:
        with connections["default"].cursor() as cursor:
            cursor.execute(
                "DROP TRIGGER test_boom ON django_pgqueue_message; DROP FUNCTION test_boom()"
            )


@pytest.mark.django_db
def test_the_returned_messages_are_built_by_the_model_and_saved_on_its_alias():
    """Through Message.__init__ (its post_init signal fires), then marked
    saved as Model.save() leaves an instance, whatever the insert path."""
    built = []

    def receiver(sender, instance, **kwargs):
        built.append(instance)

    post_init.connect(receiver, sender=Message)
    try:
        one = enqueue("t.built", 1)
        few = enqueue_many([{"payload": n} for n in range(3)], topic="t.built")
        chunked = enqueue_many(
            [{"payload": n} for n in range(enqueuing.STREAM_CHUNK + 1)], topic="t.built"
        )
    finally:
        post_init.disconnect(receiver, sender=Message)
    returned = [one, *few, *chunked]
    assert {id(m) for m in returned} <= {id(m) for m in built}, "a message skipped __init__"
    for message in returned:
        assert (message._state.adding, message._state.db) == (False, "default")
        assert message.created is True and message.pk is not None


@pytest.mark.django_db
def test_enqueue_many_of_nothing_writes_nothing():
    with CaptureQueriesContext(connections["default"]) as queries:
        assert enqueue_many([], topic="t") == []
    assert queries.captured_queries == []


# --- another database alias ---------------------------------------------------


@pytest.mark.django_db(transaction=True, databases=["default", "other"])
@override_settings(PGQUEUE={"DATABASE": "other"})
def test_queue_on_another_alias_waits_for_the_callers_commit(enqueued_signals):
    with transaction.atomic(using="default"):
        message = enqueue("cross", {"n": 1})
        assert message.pk is None and message.created is None, "inserted before the commit"
        assert not Message.objects.using("other").exists()
    assert message.created is True and message.pk is not None
    row = Message.objects.using("other").get()
    assert (row.pk, row.payload) == (message.pk, {"n": 1})
    assert not Message.objects.using("default").exists(), "written to the caller's database"
    assert enqueued_signals == [(message.pk, "cross", "other")]


@pytest.mark.django_db(transaction=True, databases=["default", "other"])
@override_settings(PGQUEUE={"DATABASE": "other"})
def test_queue_on_another_alias_enqueues_nothing_when_the_caller_rolls_back(enqueued_signals):
    with pytest.raises(Rollback), transaction.atomic(using="default"):
        enqueue("cross", {})
        enqueue_many([{"payload": 1}], topic="cross")
        raise Rollback
    assert not Message.objects.using("other").exists()
    assert enqueued_signals == []


@pytest.mark.django_db(transaction=True, databases=["default", "other"])
@override_settings(PGQUEUE={"DATABASE": "other"})
def test_using_names_the_callers_alias():
    # The caller works in a transaction on "other", the queue's own alias:
    # the row joins that transaction directly.
    with transaction.atomic(using="other"):
        message = enqueue("same", {}, using="other")
        assert message.pk is not None
    assert Message.objects.using("other").filter(pk=message.pk).exists()


@pytest.mark.django_db
def test_the_returned_messages_carry_the_stored_timestamps():
    import datetime as dt

    at = timezone.now() + dt.timedelta(hours=2)
    plain, delayed, scheduled = enqueue_many(
        [{"payload": {}}, {"payload": {}, "delay": 90.5}, {"payload": {}, "run_at": at}],
        topic="stamps",
    )
    keyed = enqueue("stamps", {}, dedup_key="k", delay=dt.timedelta(minutes=1))
    for message in (plain, delayed, scheduled, keyed):
        stored = Message.objects.get(pk=message.pk)
        assert (message.run_at, message.created_at, message.updated_at) == (
            stored.run_at,
            stored.created_at,
            stored.updated_at,
        )
        assert message.run_at.tzinfo is not None
    assert scheduled.run_at == at
    # run_at counts from the transaction's start, created_at is the statement's time.
    assert 90 < (delayed.run_at - delayed.created_at).total_seconds() <= 90.5


# --- enqueue()'s short way (validation inline, one statement) ------------------


@pytest.mark.django_db
@pytest.mark.parametrize(
    "options, words",
    [
        ({"topic": ["not", "hashable"]}, "topic must be a string"),
        ({"topic": "t", "queue": {"not": "hashable"}}, "queue must be a string"),
        ({"topic": "t", "priority": True}, "priority must be an integer"),
        ({"topic": "t", "priority": 2**70}, "out of range"),
        ({"topic": "t", "max_attempts": False}, "max_attempts must be a whole number"),
        ({"topic": "t", "group_key": ""}, "group_key must be a non-empty string"),
    ],
)
def test_the_inline_checks_refuse_what_the_full_ones_refuse(options, words):
    """enqueue() checks the common values inline: a value of another type
    (unhashable, a bool for an int) still gets its sentence, nothing written."""
    topic = options.pop("topic")
    with pytest.raises(InvalidMessage, match=words):
        enqueue(topic, {}, **options)
    assert not Message.objects.exists()


@pytest.mark.django_db
def test_a_circular_payload_is_named_as_such():
    """The shared C encoder keeps no memo of the containers it is in: a
    circular payload recurses, and the error still says what it is."""
    payload: list = []
    payload.append(payload)
    with pytest.raises(InvalidMessage, match="Circular reference detected"):
        enqueue("t", payload)
    with pytest.raises(InvalidMessage, match="message 1: payload is not JSON-serializable"):
        enqueue_many([{"payload": 1}, {"payload": {"loop": payload}}], topic="t")
    assert not Message.objects.exists()


@pytest.mark.django_db
def test_the_payload_is_encoded_as_djangos_encoder_encodes_it():
    from django.core.serializers.json import DjangoJSONEncoder

    payload = {
        "when": timezone.now(),
        "price": __import__("decimal").Decimal("1.10"),
        "id": uuid.uuid4(),
        "text": "é☃",
        "tuple": (1, 2.5, None, True),
    }
    message = enqueue("t.encoded", payload)
    with connections["default"].cursor() as cursor:
        cursor.execute(
            "SELECT payload::text FROM django_pgqueue_message WHERE id = %s", [message.pk]
        )
        (stored,) = cursor.fetchone()
    with connections["default"].cursor() as cursor:
        cursor.execute("SELECT %s::jsonb::text", [DjangoJSONEncoder().encode(payload)])
        assert stored == cursor.fetchone()[0]


@pytest.mark.django_db
def test_a_topic_of_a_str_subclass_is_stored_as_its_text():
    class Name(str):
        pass

    message = enqueue(Name("t.subclass"), {})
    assert Message.objects.get(pk=message.pk).topic == "t.subclass"


@pytest.mark.django_db
def test_enqueue_sends_one_statement():
    """A one-message enqueue on the queue's own database: its INSERT and
    nothing else (no look-up, no savepoint); a dedup conflict adds the
    look-up of the message holding the key."""
    enqueue("t.one", {})
    with CaptureQueriesContext(connections["default"]) as queries:
        enqueue("t.one", {"n": 1})
    assert [q["sql"].split()[0] for q in queries.captured_queries] == ["INSERT"]
    first = enqueue("t.one", {}, dedup_key="k")
    with CaptureQueriesContext(connections["default"]) as queries:
        again = enqueue("t.one", {}, dedup_key="k")
    assert [q["sql"].split()[0] for q in queries.captured_queries] == ["INSERT", "SELECT"]
    assert (again.pk, again.created, first.created) == (first.pk, False, True)
