"""Bad input to enqueue() and enqueue_many(): a clear exception at the call
site, and nothing written."""

import datetime
import decimal
import math

import pytest

from django_pgqueue import InvalidMessage, enqueue, enqueue_many
from django_pgqueue.models import Message

pytestmark = pytest.mark.django_db

NOW = datetime.datetime(2030, 1, 1, tzinfo=datetime.UTC)


def deeply_nested(depth):
    value = []
    for _ in range(depth):
        value = [value]
    return value


BAD = [
    # (enqueue keywords, words the message must contain)
    ({"topic": "t", "payload": object()}, "payload is not JSON-serializable"),
    ({"topic": "t", "payload": {1, 2}}, "payload is not JSON-serializable"),
    ({"topic": "t", "payload": {"x": math.nan}}, "payload is not JSON-serializable"),
    ({"topic": "t", "payload": {"s": "a\x00b"}}, "NUL character"),
    ({"topic": "t", "payload": deeply_nested(100_000)}, "nested too deeply"),
    ({"topic": ""}, "topic must not be empty"),
    ({"topic": "x" * 201}, "topic is 201 characters long; the limit is 200"),
    ({"topic": None}, "topic must be a string"),
    ({"topic": "has space"}, "may contain only letters"),
    ({"topic": "t", "queue": ""}, "queue must not be empty"),
    ({"topic": "t", "queue": "q" * 101}, "queue is 101 characters long; the limit is 100"),
    ({"topic": "t", "queue": "bad'name"}, "may contain only letters"),
    ({"topic": "t", "delay": -1}, "delay must be zero or more seconds"),
    ({"topic": "t", "delay": datetime.timedelta(seconds=-5)}, "delay must be zero or more"),
    ({"topic": "t", "delay": math.inf}, "delay must be zero or more seconds"),
    ({"topic": "t", "delay": "10"}, "delay must be a timedelta or a number"),
    ({"topic": "t", "delay": True}, "delay must be a timedelta or a number"),
    ({"topic": "t", "delay": 5, "run_at": NOW}, "give delay or run_at, not both"),
    ({"topic": "t", "run_at": "2030-01-01"}, "run_at must be a datetime"),
    ({"topic": "t", "run_at": datetime.datetime(2030, 1, 1)}, "naive datetime"),
    # PostgreSQL would take these (tests/test_infinite_timestamps.py has more).
    ({"topic": "t", "delay": datetime.timedelta.max}, "delay must not reach past 9999-12-31"),
    ({"topic": "t", "run_at": datetime.datetime.max.replace(tzinfo=datetime.UTC)}, "run_at must"),
    ({"topic": "t", "priority": 101}, "priority 101 is out of range [-100, 100]"),
    ({"topic": "t", "priority": -101}, "priority -101 is out of range"),
    ({"topic": "t", "priority": 1.5}, "priority must be an integer"),
    ({"topic": "t", "priority": decimal.Decimal(1)}, "priority must be an integer"),
    ({"topic": "t", "max_attempts": 0}, "max_attempts must be a whole number of at least 1"),
    ({"topic": "t", "max_attempts": "3"}, "max_attempts must be a whole number"),
    ({"topic": "t", "dedup_key": ""}, "dedup_key must be a non-empty string"),
    ({"topic": "t", "dedup_key": 42}, "dedup_key must be a non-empty string"),
    ({"topic": "t", "group_key": "g" * 256}, "group_key is 256 characters long"),
    ({"topic": "t", "partition_key": ""}, "partition_key must be a non-empty string"),
    ({"topic": "t", "partition_key": 42}, "partition_key must be a non-empty string"),
    ({"topic": "t", "partition_key": "p" * 256}, "partition_key is 256 characters long"),
    ({"topic": "t", "headers": ["not", "a", "dict"]}, "headers must be a dict"),
    ({"topic": "t", "headers": {1: "x"}}, "headers must be a dict with string keys"),
    ({"topic": "t", "headers": {"x": object()}}, "headers is not JSON-serializable"),
]


@pytest.mark.parametrize(("kwargs", "words"), BAD, ids=[words for _, words in BAD])
def test_enqueue_rejects_bad_input_and_writes_nothing(kwargs, words):
    with pytest.raises(InvalidMessage, match=words.replace("[", r"\[").replace("]", r"\]")):
        enqueue(**kwargs)
    assert Message.objects.count() == 0


@pytest.mark.parametrize(("kwargs", "words"), BAD, ids=[words for _, words in BAD])
def test_enqueue_many_rejects_the_whole_batch_and_names_the_bad_message(kwargs, words):
    good = {"topic": "fine", "payload": 1}
    with pytest.raises(InvalidMessage, match=r"^message 1: "):
        enqueue_many([good, kwargs, good])
    assert Message.objects.count() == 0


@pytest.mark.parametrize(("kwargs", "words"), BAD, ids=[words for _, words in BAD])
def test_enqueue_many_rejects_bad_defaults_as_the_first_message(kwargs, words):
    """The defaults are checked once for all messages that give nothing else;
    their error reads as it would from each message."""
    with pytest.raises(InvalidMessage, match=r"^message 0: "):
        enqueue_many([{}, {}], **kwargs)
    assert Message.objects.count() == 0


def test_enqueue_many_names_a_bad_payload_among_payload_only_messages():
    with pytest.raises(InvalidMessage, match=r"^message 2: payload is not JSON-serializable"):
        enqueue_many([{"payload": 1}, {}, {"payload": object()}], topic="t")
    assert Message.objects.count() == 0


def test_enqueue_rejects_an_unknown_keyword():
    with pytest.raises(TypeError, match="unexpected keyword argument 'dealy'"):
        enqueue("t", {}, dealy=5)
    assert Message.objects.count() == 0


def test_enqueue_rejects_an_unknown_database_alias():
    with pytest.raises(InvalidMessage, match="using='nope' is not a database alias"):
        enqueue("t", {}, using="nope")
    assert Message.objects.count() == 0


@pytest.mark.parametrize(
    ("messages", "kwargs", "words"),
    [
        ([{"topic": "t", "dealy": 5}], {}, "message 0: unknown key.s. dealy"),
        ([{"payload": 1}], {"dealy": 5}, "unknown keyword.s. dealy"),
        ([{"payload": 1}], {}, "message 0: no topic"),
        (["not a dict"], {}, "message 0: expected a dict"),
        ({"topic": "t"}, {}, "takes an iterable of dicts"),
    ],
)
def test_enqueue_many_rejects_malformed_batches(messages, kwargs, words):
    with pytest.raises(InvalidMessage, match=words):
        enqueue_many(messages, **kwargs)
    assert Message.objects.count() == 0
