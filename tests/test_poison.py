"""Poison: rows another client wrote with whatever the table's constraints let
through, and handlers that return garbage, block or try to end their thread.
Each message ends handled or as a dead letter with a clear reason, and the
worker goes on to the next one."""

import _thread
import signal
import sys
import threading

import pytest
from demo.models import Handled
from django.db import connection

from django_pgqueue import enqueue, handler, registry
from django_pgqueue.models import DeadLetter, Message

from .conftest import running_worker, wait_until

# Past the JSON decoder of every Python we support (3.13 goes deepest), within
# what PostgreSQL parses (about 14,000 levels with the default max_stack_depth).
DEEP = "[" * 12000 + "]" * 12000

# (topic, payload, headers, other columns) inserted by plain SQL; test.record
# handles anything, a topic without a handler becomes a dead letter.
RAW_ROWS = {
    "no handler, JSON null payload and headers": ("no.such.topic", "null", "null", {}),
    "a name the rules forbid": ("has space \U0001f600", "{}", "{}", {}),
    "a scalar payload, array headers": ("test.record", '"just a string"', "[1, 2]", {}),
    "a number payload, string headers": ("test.record", "42", '"h"', {}),
    "a 2 MB payload": ("test.record", '{"blob": "' + "x" * 2_000_000 + '"}', "{}", {}),
    "the highest priority": ("test.record", "{}", "{}", {"priority": 100}),
    "the lowest priority": ("test.record", "{}", "{}", {"priority": -100}),
    "one attempt allowed": ("no.such.topic", "{}", "{}", {"max_attempts": 1}),
    "the most attempts": ("test.record", "{}", "{}", {"max_attempts": 2**31 - 1}),
    "attempts used up to the integer's limit": ("test.record", "{}", "{}", {"attempts": 2**31 - 1}),
    "due since -infinity": ("test.record", "{}", "{}", {"run_at": "-infinity"}),
    "failing, attempts at the limit": ("test.fail", "{}", "{}", {"attempts": 2**31 - 1}),
    # Past Python's JSON decoder (enqueue refuses to write it): dead-lettered
    # as stored, never loaded.
    "a payload nested 12,000 deep": ("test.record", DEEP, "{}", {}),
    "headers nested 12,000 deep": ("test.record", "{}", DEEP, {}),
}


def insert_raw(topic, payload, headers, columns):
    names = ["topic", "payload", "headers", *columns]
    values = [topic, payload, headers, *columns.values()]
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO django_pgqueue_message ({', '.join(names)}) "
            f"VALUES ({', '.join(['%s'] * len(names))}) RETURNING id",
            values,
        )
        return cursor.fetchone()[0]


@pytest.mark.slow
def test_a_real_worker_finishes_every_raw_row_and_keeps_working(start_worker):
    ids = {name: insert_raw(*row) for name, row in RAW_ROWS.items()}
    never_due = insert_raw("test.record", "{}", "{}", {"run_at": "infinity"})
    blocked = enqueue("test.timeout", {"seconds": 3600})  # timeout 1 s, 2 attempts
    worker = start_worker("--concurrency", "2", "--poll-interval", "0.2")
    finished = set(ids.values()) | {blocked.pk}
    wait_until(
        lambda: not Message.objects.filter(pk__in=finished).exists(),
        timeout=60,
        message="every raw row and the blocked message to be finished",
    )
    handled = set(Handled.objects.values_list("message_id", flat=True))
    dead = {d.message_id: d for d in DeadLetter.objects.defer("payload", "headers")}
    for name, pk in ids.items():
        assert (pk in handled) != (pk in dead), (
            f"{name}: handled {pk in handled}, dead {pk in dead}"
        )
    assert dead[ids["no handler, JSON null payload and headers"]].payload is None
    assert "no handler for topic 'has space" in dead[ids["a name the rules forbid"]].reason
    assert dead[blocked.pk].reason.startswith("HandlerTimeout: timeout"), dead[blocked.pk].reason
    assert Message.objects.filter(pk=never_due).exists(), "a row due at 'infinity' ran"
    for name, column in [
        ("a payload nested 12,000 deep", "payload"),
        ("headers nested 12,000 deep", "headers"),
    ]:
        letter = dead[ids[name]]
        assert letter.category == "permanent", (name, letter.reason)
        assert (
            letter.reason
            == f"Permanent: the {column} is nested too deeply for Python's JSON decoder"
        )
        with connection.cursor() as cursor:
            cursor.execute(
                f"SELECT {column}::text FROM django_pgqueue_deadletter WHERE id = %s", [letter.pk]
            )
            assert cursor.fetchone()[0] == DEEP, f"{name}: not kept as it was stored"

    after = enqueue("test.record", {"after": "the poison"})
    wait_until(
        lambda: Handled.objects.filter(message_id=after.pk).exists(),
        timeout=60,
        message="the worker to handle the next message",
    )
    assert worker.popen.poll() is None, worker.log()
    worker.signal(signal.SIGTERM)
    assert worker.wait(timeout=30) == 0, worker.log()
    assert "database error" not in worker.log(), "a raw row broke the claim or the poll"


# --- handlers that misbehave ----------------------------------------------------------


class Unprintable:
    def __repr__(self):
        raise RuntimeError("repr")

    def __bool__(self):
        raise RuntimeError("bool")

    def __eq__(self, other):
        raise RuntimeError("eq")

    __hash__ = object.__hash__


async def _coroutine():
    return 1


def _kill_thread():
    _thread.exit()


RELEASE = threading.Event()  # set at teardown: the blocked handler's thread returns

# name -> (the handler's body, what becomes of the message: "done" or the
# dead letter's (category, reason prefix))
MISBEHAVING = {
    "returns an object": (lambda: object(), "done"),
    "returns an unprintable object": (lambda: Unprintable(), "done"),
    "returns a coroutine": (
        lambda: _coroutine(),
        ("permanent", "TypeError: the handler returned a coroutine instead of running"),
    ),
    "returns a generator": (
        lambda: (x for x in [1]),
        ("permanent", "TypeError: the handler returned a generator instead of running"),
    ),
    "raises SystemExit": (lambda: sys.exit(3), ("unknown", "SystemExit: 3")),
    "raises KeyboardInterrupt": (
        lambda: (_ for _ in ()).throw(KeyboardInterrupt()),
        ("unknown", "KeyboardInterrupt"),
    ),
    "raises GeneratorExit": (
        lambda: (_ for _ in ()).throw(GeneratorExit()),
        ("unknown", "GeneratorExit"),
    ),
    "exits its thread": (_kill_thread, ("unknown", "SystemExit")),
    "blocks forever": (lambda: RELEASE.wait(), ("transient", "HandlerTimeout: timeout")),
}


@pytest.fixture
def misbehaving_handlers():
    """One handler per MISBEHAVING entry, atomic and not, each allowed one
    attempt (a failure is a dead letter at once) and a 1 s timeout."""
    RELEASE.clear()
    topics = {}
    for index, (name, (body, _)) in enumerate(MISBEHAVING.items()):
        for atomic in (True, False):
            topic = f"poison.{index}.{'atomic' if atomic else 'plain'}"

            def run(message, body=body):
                return body()

            handler(topic, max_attempts=1, timeout=1, atomic=atomic)(run)
            topics[topic] = name

    @handler("poison.async_exit", max_attempts=1)
    async def async_exit(message):
        raise SystemExit("from a coroutine")

    topics["poison.async_exit"] = "async SystemExit"
    yield topics
    RELEASE.set()
    for topic in topics:
        registry.unregister(topic)


@pytest.mark.django_db(transaction=True)
def test_misbehaving_handlers_end_in_a_clear_outcome_and_the_worker_goes_on(
    misbehaving_handlers,
):
    messages = {topic: enqueue(topic, {}) for topic in misbehaving_handlers}
    with running_worker(concurrency=3, poll_interval=0.2, shutdown_timeout=1):
        wait_until(
            lambda: not Message.objects.filter(pk__in=[m.pk for m in messages.values()]).exists(),
            timeout=60,
            message="every misbehaving handler's message to be finished",
        )
        after = enqueue("test.record", {})
        wait_until(
            lambda: Handled.objects.filter(message_id=after.pk).exists(),
            timeout=60,
            message="the worker to handle the next message",
        )
    RELEASE.set()  # the blocked handlers return; their late results are discarded
    dead = {d.message_id: d for d in DeadLetter.objects.defer("payload", "headers")}
    for topic, message in messages.items():
        name = misbehaving_handlers[topic]
        expected = MISBEHAVING.get(name, (None, ("unknown", "SystemExit: from a coroutine")))[1]
        if expected == "done":
            assert message.pk not in dead, f"{topic} ({name}): dead-lettered: {dead[message.pk]}"
            continue
        assert message.pk in dead, f"{topic} ({name}) was not dead-lettered"
        category, reason = expected
        got = dead[message.pk]
        assert (got.category, got.reason[: len(reason)]) == (category, reason), (
            f"{topic} ({name}): {got.category} {got.reason!r}"
        )


@pytest.mark.django_db(transaction=True)
def test_the_rescue_of_expired_leases_never_loads_a_payload():
    """Maintenance rescues every expired lease, whatever JSON the rows hold:
    a row Python cannot load goes back to the queue or to the dead letters
    like the others."""
    from django_pgqueue import maintenance

    lease = {
        "status": "processing",
        "lease_expires_at": "2000-01-01T00:00:00Z",
        "lease_token": "00000000-0000-0000-0000-000000000001",
        "locked_by": "a dead worker",
    }
    again = insert_raw("test.record", DEEP, "{}", {**lease, "attempts": 1, "max_attempts": 3})
    last = insert_raw("test.record", DEEP, DEEP, {**lease, "attempts": 3, "max_attempts": 3})
    plain = insert_raw("test.record", "{}", "{}", {**lease, "attempts": 3, "max_attempts": 3})

    result = maintenance.rescue_expired()

    assert (result.requeued, result.dead_lettered) == (1, 2)
    assert Message.objects.filter(pk=again, status="waiting").exists()
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT message_id, payload::text, headers::text FROM django_pgqueue_deadletter"
            " ORDER BY message_id"
        )
        assert cursor.fetchall() == [(last, DEEP, DEEP), (plain, "{}", "{}")]
