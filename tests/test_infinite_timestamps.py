"""PostgreSQL's infinite timestamps ('infinity', '-infinity') and years past
9999 or BC, which Python has no datetime for: enqueue never writes one, and
a row that another client wrote with one anyway is shown, reported and
handled like any other (read as fields.TIMESTAMP_MAX or TIMESTAMP_MIN),
never a crash. The rows are written by plain SQL."""

import datetime
import io
import json
import re
import signal

import django
import pytest
from demo.models import Handled
from django.core.management import call_command
from django.db import connection
from django.db.models import Min
from django.urls import reverse
from django.utils import formats, timezone
from psycopg.types.json import Jsonb

from django_pgqueue import InvalidMessage, enqueue, enqueue_many
from django_pgqueue.enqueuing import STREAM_CHUNK
from django_pgqueue.fields import TIMESTAMP_MAX, TIMESTAMP_MIN
from django_pgqueue.models import (
    AlertState,
    DeadLetter,
    GroupRelease,
    Message,
    StreamEvent,
    Subscription,
    TaskRecord,
    WorkerHeartbeat,
)
from django_pgqueue.streams import delivery, subscribers

from .claiming import claim
from .conftest import wait_until

# What PostgreSQL takes, what it reads as.
OUT_OF_RANGE = {
    "infinity": TIMESTAMP_MAX,
    "-infinity": TIMESTAMP_MIN,
    "10000-01-01 00:00:00+00": TIMESTAMP_MAX,
    "0100-01-01 00:00:00+00 BC": TIMESTAMP_MIN,
    # Python has these, but not in every time zone (Kiritimati is UTC+14).
    "9999-12-31 23:00:00+00": TIMESTAMP_MAX,
    "0001-01-01 01:00:00+00": TIMESTAMP_MIN,
}
MODELS = [Message, DeadLetter, WorkerHeartbeat, GroupRelease, AlertState, TaskRecord]
MODELS += [StreamEvent, Subscription]


def timestamp_columns(model):
    return [
        f.column for f in model._meta.concrete_fields if f.get_internal_type() == "DateTimeField"
    ]


def set_timestamps(obj, value, columns=None):
    """Write ``value`` (a PostgreSQL literal) into timestamp columns of
    ``obj``'s row (default: all of them) by plain SQL, as another client may."""
    model = type(obj)
    columns = columns or timestamp_columns(model)
    assignments = ", ".join(f"{column} = %s::timestamptz" for column in columns)
    with connection.cursor() as cursor:
        cursor.execute(
            f"UPDATE {model._meta.db_table} SET {assignments} WHERE {model._meta.pk.column} = %s",
            [value] * len(columns) + [obj.pk],
        )
        assert cursor.rowcount == 1


def shown(value):
    """A datetime as the admin shows it (in the current time zone)."""
    return formats.localize(timezone.template_localtime(value))


# --- enqueue writes none --------------------------------------------------------------


class SaysInfinity(datetime.datetime):
    """A datetime whose text says what the INSERT must not send."""

    def isoformat(self, *args, **kwargs):
        return "infinity"

    def __str__(self):
        return "infinity"


EAST, WEST = (datetime.timezone(datetime.timedelta(hours=h)) for h in (14, -12))
BAD_TIMES = [
    # (enqueue keywords, words of the InvalidMessage)
    ({"run_at": "infinity"}, "run_at must be a datetime, not str"),
    ({"run_at": float("inf")}, "run_at must be a datetime, not float"),
    ({"delay": "inf"}, "delay must be a timedelta or a number of seconds, not str"),
    ({"delay": float("inf")}, "delay must be zero or more seconds, not inf"),
    ({"delay": float("-inf")}, "delay must be zero or more seconds, not -inf"),
    ({"delay": float("nan")}, "delay must be zero or more seconds, not nan"),
    ({"delay": 1e12}, "delay must not reach past 9999-12-31T00:00:00+00:00"),
    ({"delay": datetime.timedelta.max}, "delay must not reach past 9999-12-31"),
    (
        {"run_at": datetime.datetime(9999, 12, 31, 20, tzinfo=WEST)},  # 10000-01-01 08:00 UTC
        "run_at must be from 0001-01-02T00:00:00+00:00 to 9999-12-31T00:00:00+00:00, "
        "not 9999-12-31T20:00:00-12:00",
    ),
    ({"run_at": datetime.datetime(1, 1, 1, 3, tzinfo=EAST)}, "not 0001-01-01T03:00:00+14:00"),
    ({"run_at": datetime.datetime.max.replace(tzinfo=datetime.UTC)}, "run_at must be from"),
    ({"run_at": datetime.datetime.min.replace(tzinfo=datetime.UTC)}, "run_at must be from"),
]


@pytest.mark.django_db
@pytest.mark.parametrize(("kwargs", "words"), BAD_TIMES, ids=[w for _, w in BAD_TIMES])
def test_enqueue_refuses_a_time_python_could_not_read_back(kwargs, words):
    with pytest.raises(InvalidMessage, match=re.escape(words)):
        enqueue("t", {}, **kwargs)
    with pytest.raises(InvalidMessage, match=r"^message 1: .*" + re.escape(words)):
        enqueue_many([{"topic": "t"}, {"topic": "t", **kwargs}])
    assert not Message.objects.exists()


@pytest.mark.django_db
@pytest.mark.parametrize(("kwargs", "words"), BAD_TIMES[-4:], ids=[w for _, w in BAD_TIMES[-4:]])
def test_enqueue_many_refuses_one_in_a_later_pipelined_chunk_and_writes_nothing(kwargs, words):
    messages = [{"payload": n} for n in range(STREAM_CHUNK * 2)]
    messages[STREAM_CHUNK + 7] = {"payload": "bad", **kwargs}
    with pytest.raises(InvalidMessage, match=rf"^message {STREAM_CHUNK + 7}: run_at must be"):
        enqueue_many(messages, topic="t")
    assert not Message.objects.exists()


@pytest.mark.django_db
def test_the_latest_and_earliest_run_at_are_taken_and_read_back():
    for run_at in (TIMESTAMP_MAX, TIMESTAMP_MIN, datetime.datetime(9999, 12, 30, 12, tzinfo=EAST)):
        many = enqueue_many([{"topic": "t", "run_at": run_at}] * 2)[0]
        for message in (enqueue("t", run_at=run_at), many):
            assert message.run_at == run_at
            assert Message.objects.get(pk=message.pk).run_at == run_at


@pytest.mark.django_db
def test_a_datetime_subclass_goes_in_as_the_datetime_it_holds_not_its_text():
    run_at = SaysInfinity(2030, 1, 2, 3, 4, 5, tzinfo=datetime.UTC)
    enqueue("t", run_at=run_at)
    enqueue_many([{"payload": n} for n in range(2)], topic="t", run_at=run_at)
    enqueue_many([{"payload": n} for n in range(STREAM_CHUNK + 1)], topic="t", run_at=run_at)
    with connection.cursor() as cursor:
        cursor.execute("SELECT DISTINCT run_at::text FROM django_pgqueue_message")
        assert cursor.fetchall() == [("2030-01-02 03:04:05+00",)]


# --- every read survives one ----------------------------------------------------------


@pytest.mark.django_db
@pytest.mark.parametrize("value", OUT_OF_RANGE, ids=list(OUT_OF_RANGE))
def test_every_timestamp_of_every_table_reads_clamped(value, make_message, make_dead_letter):
    """Models, values() and aggregates; NULL stays NULL."""
    make_message()
    make_dead_letter()
    WorkerHeartbeat.objects.create(
        worker_id="w", hostname="h", pid=1, queues=["default"], concurrency=1,
        expires_at=timezone.now(),
    )  # fmt: skip
    GroupRelease.objects.create(group_key="g")
    AlertState.objects.create(topic="t", category="business", last_sent_at=timezone.now())
    TaskRecord.objects.create(id="00000000-0000-0000-0000-000000000001", task_path="x.y")
    Subscription.objects.create(name="s", stream="st")
    StreamEvent.objects.create(stream="st", payload={})
    for model in MODELS:
        set_timestamps(model.objects.get(), value)
    expected = OUT_OF_RANGE[value]
    for model in MODELS:
        columns = [
            f.attname for f in model._meta.concrete_fields if f.column in timestamp_columns(model)
        ]
        obj = model.objects.get()
        assert {c: getattr(obj, c) for c in columns} == dict.fromkeys(columns, expected), model
        assert model.objects.values(*columns).get() == dict.fromkeys(columns, expected), model
    assert Message.objects.aggregate(first=Min("run_at"))["first"] == expected
    set_timestamps(Message.objects.get(), None, ["first_failed_at"])
    assert Message.objects.get().first_failed_at is None


@pytest.fixture(params=["UTC", "Pacific/Kiritimati", "Etc/GMT+12"])
def time_zone(request, settings):
    """The project's time zone: UTC, 14 hours east of it, 12 hours west."""
    settings.TIME_ZONE = request.param
    return request.param


@pytest.mark.django_db
@pytest.mark.parametrize("value", ["infinity", "-infinity"])
def test_the_admin_lists_and_shows_rows_with_infinite_timestamps(
    value, time_zone, admin_client, make_message, make_dead_letter
):
    message = make_message()
    dead = make_dead_letter()
    heartbeat = WorkerHeartbeat.objects.create(
        worker_id="w", hostname="h", pid=1, queues=["default"], concurrency=1,
        expires_at=timezone.now(),
    )  # fmt: skip
    subscription = Subscription.objects.create(name="s", stream="st")
    event = StreamEvent.objects.create(stream="st", payload={})
    for obj in (message, dead, heartbeat, subscription, event):
        set_timestamps(obj, value)
    text = shown(OUT_OF_RANGE[value])

    pages = [
        ("message", message, "run_at"),
        ("deadletter", dead, "dead_lettered_at"),
        ("workerheartbeat", heartbeat, "heartbeat_at"),
        ("subscription", subscription, "retry_at"),
        ("streamevent", event, "created_at"),
    ]
    for model_name, obj, column in pages:
        listing = admin_client.get(reverse(f"admin:django_pgqueue_{model_name}_changelist"))
        assert listing.status_code == 200, (model_name, listing.content[:300])
        assert [row.pk for row in listing.context["cl"].result_list] == [obj.pk], model_name
        assert text in listing.content.decode(), f"{model_name} list: no {column} {text!r}"
        if model_name != "workerheartbeat":  # it has no change page
            page = admin_client.get(
                reverse(f"admin:django_pgqueue_{model_name}_change", args=[obj.pk])
            )
            assert page.status_code == 200, (model_name, page.content[:300])
            assert text in page.content.decode(), f"{model_name} page: no {column} {text!r}"

    # The dead letters' date hierarchy: a row at no date is in no year.
    url = reverse("admin:django_pgqueue_deadletter_changelist")
    for query in ({}, {"dead_lettered_at__year": 2026}, {"dead_lettered_at__year": 1}):
        assert admin_client.get(url, query).status_code == 200, query
    # Django cannot filter on year 9999 (it computes the year's end in Python).
    for query in ({}, {"dead_lettered_at__month": 12}):
        query = {"dead_lettered_at__year": 9999, **query}
        assert admin_client.get(url, query)["Location"].endswith("?e=1"), query
    summary = admin_client.get(reverse("admin:django_pgqueue_deadletter_summary"))
    assert summary.status_code == 200


@pytest.mark.django_db
@pytest.mark.parametrize("value", ["infinity", "-infinity"])
def test_the_commands_report_rows_with_infinite_timestamps(value, make_message, make_dead_letter):
    ready = make_message()  # due at -infinity: the oldest ready message there can be
    make_message(topic="test.later")
    dead = make_dead_letter()
    heartbeat = WorkerHeartbeat.objects.create(
        worker_id="w", hostname="h", pid=1, queues=["default"], concurrency=1,
        expires_at=timezone.now(),
    )  # fmt: skip
    set_timestamps(ready, "-infinity", ["run_at"])
    set_timestamps(ready, value, ["created_at", "updated_at"])
    set_timestamps(Message.objects.get(topic="test.later"), "infinity", ["run_at"])
    set_timestamps(dead, value)
    set_timestamps(heartbeat, value)

    out = io.StringIO()
    call_command("pgqueue_status", "--json", stdout=out)
    report = json.loads(out.getvalue())
    queue = report["queues"]["default"]
    assert (queue["ready"], queue["delayed"]) == (1, 1)
    assert queue["oldest_ready_age_seconds"] > 2000 * 365 * 86400
    [worker] = report["workers"]
    assert worker["heartbeat_at"] == OUT_OF_RANGE[value].isoformat()
    assert worker["alive"] is (value == "infinity")
    out = io.StringIO()
    call_command("pgqueue_status", stdout=out)
    assert "Dead letters" in out.getvalue()

    out = io.StringIO()
    call_command("pgqueue_deadletters", "list", stdout=out)
    assert OUT_OF_RANGE[value].strftime("%Y-%m-%d") in out.getvalue()
    out = io.StringIO()
    call_command("pgqueue_deadletters", "list", "--json", stdout=out)
    [listed] = json.loads(out.getvalue())
    assert listed["dead_lettered_at"] == OUT_OF_RANGE[value].isoformat().replace("+00:00", "Z")


@pytest.mark.django_db
@pytest.mark.parametrize("value", OUT_OF_RANGE, ids=list(OUT_OF_RANGE))
def test_the_claim_reads_a_row_with_such_timestamps(value, make_message):
    """The claim reads its rows' timestamps as text (models.timestamp_from_text)."""
    message = make_message()
    set_timestamps(message, value, ["created_at", "first_failed_at"])
    set_timestamps(message, "-infinity", ["run_at"])
    [claimed] = claim(["default"], 1, "w", 60)
    assert (claimed.pk, claimed.created_at, claimed.first_failed_at) == (
        message.pk,
        OUT_OF_RANGE[value],
        OUT_OF_RANGE[value],
    )


@pytest.mark.slow
def test_a_real_worker_handles_and_dead_letters_rows_with_infinite_timestamps(
    start_worker, admin_client
):
    every = ["run_at", "created_at", "updated_at", "first_failed_at"]
    rows = {
        "handled": enqueue("test.record", {}),
        "handled, retried first": enqueue("test.fail", {"times": 1}),
        "dead, permanent": enqueue("test.fail", {"raise": "Permanent"}),
        "dead, no handler": enqueue("no.such.topic", {}),
    }
    for value, name in [("infinity", "handled"), ("-infinity", "handled, retried first")]:
        set_timestamps(rows[name], value, every[1:])
        set_timestamps(rows[name], "-infinity", ["run_at"])
    set_timestamps(rows["dead, permanent"], "infinity", every[1:])
    set_timestamps(rows["dead, no handler"], "-infinity", every)

    worker = start_worker("--concurrency", "2", "--poll-interval", "0.2")
    ids = {message.pk for message in rows.values()}
    wait_until(
        lambda: not Message.objects.filter(pk__in=ids).exists(),
        timeout=60,
        message="every row to be handled or dead-lettered",
    )
    handled = set(Handled.objects.values_list("message_id", flat=True))
    dead = {d.message_id: d for d in DeadLetter.objects.all()}
    assert handled == {rows["handled"].pk, rows["handled, retried first"].pk}
    assert set(dead) == {rows["dead, permanent"].pk, rows["dead, no handler"].pk}
    assert dead[rows["dead, permanent"].pk].first_failed_at == TIMESTAMP_MAX
    for letter in dead.values():
        page = admin_client.get(reverse("admin:django_pgqueue_deadletter_change", args=[letter.pk]))
        assert page.status_code == 200

    after = enqueue("test.record", {})
    wait_until(
        lambda: Handled.objects.filter(message_id=after.pk).exists(),
        timeout=60,
        message="the worker to handle the next message",
    )
    worker.signal(signal.SIGTERM)
    assert worker.wait(timeout=30) == 0, worker.log()
    assert "Traceback" not in worker.log() and "DataError" not in worker.log(), worker.log()


@pytest.mark.django_db(transaction=True)
def test_a_stream_event_published_at_infinity_is_delivered():
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO django_pgqueue_streamevent (stream, payload, created_at) "
            "VALUES ('test.events', %s, 'infinity') RETURNING position",
            [Jsonb({})],
        )
        [position] = cursor.fetchone()
    spec = subscribers.lookup("test.ledger")
    wait_until(
        lambda: delivery.deliver(spec).outcome == delivery.DELIVERED,
        timeout=60,
        message="the delivery",
    )
    assert list(Handled.objects.values_list("message_id", flat=True)) == [position]
    subscription = Subscription.objects.get(name="test.ledger")
    set_timestamps(subscription, "infinity", ["retry_at"])
    assert delivery.probe([subscription.pk])[0].retry_at == TIMESTAMP_MAX


@pytest.mark.skipif(django.VERSION < (6, 0), reason="django.tasks exists from Django 6.0 on")
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("value", ["infinity", "-infinity"])
def test_a_task_result_with_infinite_timestamps_is_read(value):
    from demo import tasks as demo
    from django.tasks import default_task_backend

    result = demo.add.enqueue(1, 2)
    set_timestamps(TaskRecord.objects.get(pk=result.id), value)
    set_timestamps(Message.objects.get(), value, ["created_at", "updated_at"])
    read = default_task_backend.get_result(result.id)
    assert read.enqueued_at == OUT_OF_RANGE[value]
