"""manage.py pgqueue_worker: option validation and a burst run; every option
of every command refuses a value it cannot use with an error naming it."""

import io
import json
import os
import re
import subprocess
import sys

import pytest
from demo.models import Handled
from django.core.management import CommandError, call_command

from django_pgqueue import enqueue
from django_pgqueue.models import Message

from .conftest import MANAGE, database_url


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--concurrency", "0"], "--concurrency: must be at least 1, not 0"),
        (["--concurrency", "many"], "--concurrency: 'many' is not a whole number"),
        (["--async-concurrency", "0"], "--async-concurrency: must be at least 1, not 0"),
        (["--batch-size", "-3"], "--batch-size: must be at least 1"),
        (["--prefetch", "-1"], "--prefetch: must be zero or more, not -1"),
        (["--prefetch", "many"], r"--prefetch: 'many' is not a whole number \(or 'auto'\)"),
        (["--max-messages", "1.5"], "--max-messages: '1.5' is not a whole number"),
        (["--shutdown-timeout", "-1"], "--shutdown-timeout: must be zero or more seconds"),
        (["--poll-interval", "0"], "--poll-interval: must be more than zero seconds"),
        (["--poll-interval", "nan"], "--poll-interval: must be more than zero seconds"),
        (["--lease", "soon"], "--lease: 'soon' is not a number of seconds"),
        (["--queues", ","], "--queues: give at least one queue name"),
        (["--queues", "ok,not ok"], "--queues: queue name 'not ok' may contain only"),
        (["--log-level", "LOUD"], "--log-level: must be one of DEBUG, INFO"),
        (["--colour"], "unrecognized arguments: --colour"),
    ],
)
def test_bad_options_get_a_clear_error(args, words):
    with pytest.raises(CommandError, match=words):
        call_command("pgqueue_worker", *args)


@pytest.mark.django_db(transaction=True)
def test_burst_run_handles_the_ready_messages_of_its_queues_and_exits():
    mine = enqueue("test.record", {}, queue="mail")
    other = enqueue("test.record", {}, queue="sms")
    call_command("pgqueue_worker", "--burst", "--queues", "mail,reports", "--log-level", "ERROR")
    assert list(Handled.objects.values_list("message_id", flat=True)) == [mine.pk]
    assert list(Message.objects.values_list("pk", flat=True)) == [other.pk]


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("prefetch", ["auto", "AUTO", "0", "7"])
def test_prefetch_takes_auto_or_a_number(prefetch):
    messages = [enqueue("test.record", {}) for _ in range(3)]
    call_command("pgqueue_worker", "--burst", "--prefetch", prefetch, "--log-level", "ERROR")
    assert sorted(Handled.objects.values_list("message_id", flat=True)) == [m.pk for m in messages]
    assert not Message.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_max_messages_stops_after_that_many():
    for _ in range(5):
        enqueue("test.record", {})
    call_command(
        "pgqueue_worker", "--max-messages", "2", "--concurrency", "1", "--log-level", "ERROR"
    )
    assert Handled.objects.count() == 2
    assert Message.objects.count() == 3


# --- every option of every command: a bad value is an error naming it -----------------

# Each text option (and positional) of each command, as the arguments before
# its value, the value's place marked by {}, and its name in the error.
TEXT_OPTIONS = [
    (["pgqueue_deadletters", "list", "--topic", "{}"], "--topic"),
    (["pgqueue_deadletters", "list", "--topic", "ok,{}"], "--topic"),
    (["pgqueue_deadletters", "list", "--category", "{}"], "--category"),
    (["pgqueue_deadletters", "list", "--state", "{}"], "--state"),
    (["pgqueue_deadletters", "list", "--since", "{}"], "--since"),
    (["pgqueue_deadletters", "list", "--ids", "{}"], "--ids"),
    (["pgqueue_deadletters", "revive", "--all", "--queue", "{}"], "--queue"),
    (["pgqueue_deadletters", "revive", "--all", "--topic-to", "{}"], "--topic-to"),
    (["pgqueue_deadletters", "revive", "--all", "--note", "{}"], "--note"),
    (["pgqueue_deadletters", "revive", "--all", "--by", "{}"], "--by"),
    (["pgqueue_deadletters", "resolve", "--all", "--note", "{}"], "--note"),
    (["pgqueue_deadletters", "resolve", "--all", "--note", "x", "--by", "{}"], "--by"),
    (["pgqueue_deadletters", "categorize", "--all", "--to", "{}"], "--to"),
    (["pgqueue_deadletters", "categorize", "--all", "--to", "business", "--note", "{}"], "--note"),
    (["pgqueue_status", "--queue", "{}"], "--queue"),
    (["pgqueue_subscriptions", "pause", "{}"], "NAME"),
    (["pgqueue_subscriptions", "resume", "test.ledger", "{}"], "NAME"),
    (["pgqueue_subscriptions", "reset", "{}", "--to", "end"], "NAME"),
    (["pgqueue_subscriptions", "reset", "test.ledger", "--to", "{}"], "--to"),
    (["pgqueue_worker", "--queues", "{}"], "--queues"),
    (["pgqueue_worker", "--http-host", "{}"], "--http-host"),
    (["pgqueue_worker", "--subscriptions", "{}"], "--subscriptions"),
    (["pgqueue_worker", "--log-level", "{}"], "--log-level"),
]
# A NUL (PostgreSQL text cannot hold it), and what bytes of a command line
# that are not UTF-8 arrive as: a lone surrogate, which cannot be encoded.
HOSTILE_TEXT = {"nul": "a\x00b", "undecodable": "a\udcffb"}


def with_value(args, value):
    return [arg.replace("{}", value) for arg in args]


@pytest.fixture
def rows_to_keep(make_dead_letter):
    """A dead letter and a subscription that no refused command may change."""
    from django_pgqueue.models import DeadLetter, Subscription

    make_dead_letter()
    Subscription.objects.create(name="test.ledger", stream="test.events")

    def snapshot():
        return (
            list(DeadLetter.objects.values()),
            list(Subscription.objects.values()),
            list(Message.objects.values()),
        )

    return snapshot


@pytest.mark.django_db
@pytest.mark.parametrize("value", HOSTILE_TEXT.values(), ids=list(HOSTILE_TEXT))
@pytest.mark.parametrize(
    ("args", "option"), TEXT_OPTIONS, ids=[" ".join(a) for a, _ in TEXT_OPTIONS]
)
def test_every_text_option_refuses_what_postgresql_cannot_take(rows_to_keep, args, option, value):
    before = rows_to_keep()
    with pytest.raises(CommandError, match=f"^Error: argument {option}: "):
        call_command(*with_value(args, value), stdout=io.StringIO(), stderr=io.StringIO())
    assert rows_to_keep() == before


BAD_NUMBERS = [
    (["pgqueue_deadletters", "list", "--limit", str(2**63)], "--limit: must be at most 92233"),
    (["pgqueue_deadletters", "revive", "--all", "--rate", "1e-300"], "--rate: must be at least"),
    (["pgqueue_status", "--max-age", "1e300"], "--max-age: must be at most 9223372036 seconds"),
    (["pgqueue_status", "--max-ready", str(2**63)], "--max-ready: must be at most"),
    (["pgqueue_worker", "--concurrency", "100000"], "--concurrency: must be at most 1000 (one"),
    (["pgqueue_worker", "--async-concurrency", "100001"], "--async-concurrency: must be at most"),
    (["pgqueue_worker", "--batch-size", str(10**20)], "--batch-size: must be at most"),
    (["pgqueue_worker", "--prefetch", str(10**20)], "--prefetch: must be at most"),
    (["pgqueue_worker", "--max-messages", str(10**20)], "--max-messages: must be at most"),
    (["pgqueue_worker", "--lease", "1e300"], "--lease: must be at most 9223372036 seconds"),
    (["pgqueue_worker", "--poll-interval", "1e10"], "--poll-interval: must be at most"),
    (["pgqueue_worker", "--shutdown-timeout", "1e300"], "--shutdown-timeout: must be at most"),
]


@pytest.mark.django_db
@pytest.mark.parametrize(("args", "words"), BAD_NUMBERS, ids=[w for _, w in BAD_NUMBERS])
def test_numbers_past_what_sql_or_a_thread_can_take_are_refused(rows_to_keep, args, words):
    before = rows_to_keep()
    with pytest.raises(CommandError, match=re.escape(words)):
        call_command(*args, stdout=io.StringIO(), stderr=io.StringIO())
    assert rows_to_keep() == before


@pytest.mark.django_db
def test_the_largest_numbers_taken_work():
    out = io.StringIO()
    call_command("pgqueue_deadletters", "list", "--limit", str(2**63 - 1), stdout=out)
    assert out.getvalue().strip() == "no dead letters"
    out = io.StringIO()
    call_command("pgqueue_status", "--max-age", "9223372036", "--json", stdout=out)
    assert json.loads(out.getvalue())["ok"] is True


def manage(*args):
    """A real manage.py process on the test database (arguments may be bytes)."""
    env = {
        **os.environ,
        "DATABASE_URL": database_url("default"),
        "OTHER_DATABASE_URL": database_url("other"),
        "PGQUEUE_JSON": "{}",
    }
    return subprocess.run(
        # A bound for a hung command only (a loaded machine starts Django slowly).
        [sys.executable, str(MANAGE), *args],
        env=env,
        capture_output=True,
        timeout=300,
    )


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    ("args", "option"),
    [
        ([b"pgqueue_deadletters", b"list", b"--topic", b"a\xffb"], b"--topic"),
        ([b"pgqueue_deadletters", b"resolve", b"--all", b"--note", b"x", b"--by=\xff"], b"--by"),
        ([b"pgqueue_subscriptions", b"pause", b"test.ledger", b"\xff"], b"NAME"),
        ([b"pgqueue_worker", b"--burst", b"--poll-interval", b"1e300"], b"--poll-interval"),
        ([b"pgqueue_worker", b"--burst", b"--lease", b"1e300"], b"--lease"),
    ],
)
def test_manage_py_names_the_bad_option_without_a_traceback(args, option):
    """A command line cannot carry a NUL; bytes that are not UTF-8 are what
    reaches the commands instead, and as unusable."""
    process = manage(*args)
    assert process.returncode == 2, process.stderr.decode(errors="replace")
    assert b"Traceback" not in process.stderr
    assert b"error: argument " + option + b": " in process.stderr, process.stderr
