"""The failure policy: classification and backoff, as pure functions."""

import datetime
import random
from types import SimpleNamespace

import pytest
from django.core.exceptions import ValidationError
from django.db import OperationalError
from django.test import override_settings

from django_pgqueue import Permanent, Retry
from django_pgqueue import conf as pgconf
from django_pgqueue.exceptions import HandlerTimeout
from django_pgqueue.models import Category
from django_pgqueue.policy import (
    DEAD_LETTER,
    RETRY,
    Decision,
    classify,
    decide,
    max_attempts_for,
    retry_delay,
)
from django_pgqueue.registry import HandlerSpec


class PaymentDeclined(Exception):
    pass


def message(topic="t", payload=None, max_attempts=None):
    return SimpleNamespace(topic=topic, payload=payload or {}, max_attempts=max_attempts)


def spec(**options):
    fields = dict(
        topic="t",
        func=None,
        max_attempts=None,
        timeout=None,
        atomic=True,
        backoff_base=None,
        backoff_cap=None,
        backoff_jitter=None,
        is_async=False,
        location="here",
    )
    return HandlerSpec(**{**fields, **options})


@pytest.mark.parametrize(
    ("exc", "category"),
    [
        (Permanent("bad"), Category.PERMANENT),
        (Retry(after=1), Category.TRANSIENT),
        (HandlerTimeout(), Category.TRANSIENT),
        (ValidationError("no"), Category.BUSINESS),
        (ConnectionRefusedError(), Category.DEPENDENCY),
        (ConnectionResetError(), Category.DEPENDENCY),
        (TimeoutError(), Category.TRANSIENT),
        (TimeoutError(), Category.TRANSIENT),
        (OperationalError("deadlock detected"), Category.TRANSIENT),
        (KeyError("sku"), Category.PERMANENT),
        (ValueError("x"), Category.PERMANENT),
        (UnicodeDecodeError("utf-8", b"\xff", 0, 1, "bad"), Category.PERMANENT),
        (RuntimeError("?"), Category.UNKNOWN),
        (PaymentDeclined(), Category.UNKNOWN),
    ],
)
def test_builtin_classification(exc, category):
    assert classify(exc, message()) == category


def test_rules_from_settings_come_before_the_builtin_ones():
    rules = [
        {"exception": f"{__name__}.PaymentDeclined", "category": "business"},
        {"exception": ValueError, "message": "try later", "category": "transient"},
        {"regex": r"HTTP 5\d\d", "category": "dependency"},
        {"topic": "imports", "category": "permanent"},
        {"payload": lambda p: p.get("test_order"), "category": "business"},
    ]
    with override_settings(PGQUEUE={"CLASSIFY_RULES": rules}):
        assert classify(PaymentDeclined(), message()) == Category.BUSINESS
        assert classify(ValueError("please try later"), message()) == Category.TRANSIENT
        assert classify(ValueError("malformed"), message()) == Category.PERMANENT
        assert classify(RuntimeError("got HTTP 503"), message()) == Category.DEPENDENCY
        assert classify(RuntimeError("x"), message(topic="imports")) == Category.PERMANENT
        assert classify(RuntimeError("x"), message(payload={"test_order": 1})) == "business"
        assert classify(RuntimeError("x"), message()) == Category.UNKNOWN


def test_classifier_callable_comes_first_and_may_pass():
    def classifier(exc, msg):
        return "dependency" if "upstream" in str(exc) else None

    with override_settings(PGQUEUE={"CLASSIFIER": classifier}):
        assert classify(ValueError("upstream said 502"), message()) == Category.DEPENDENCY
        assert classify(ValueError("bad"), message()) == Category.PERMANENT


@pytest.mark.parametrize(
    ("rules", "words"),
    [
        ([{"category": "transient"}], "needs at least one condition"),
        ([{"message": "x", "category": "sometimes"}], "category must be one of"),
        ([{"message": "x", "category": "transient", "colour": 1}], "unknown key(s) colour"),
        ([{"exception": "no.such.Error", "category": "transient"}], "cannot be imported"),
        ([{"exception": "os.path.join", "category": "transient"}], "must be an exception class"),
        ([{"regex": "(", "category": "transient"}], "does not compile"),
        ({"message": "x"}, "must be a list of rule dicts"),
    ],
)
def test_malformed_rules_are_reported_by_the_checks(rules, words):
    with override_settings(PGQUEUE={"CLASSIFY_RULES": rules}):
        [(_id, msg, _hint)] = pgconf.validate()
    assert words in msg


def test_retry_delay_is_exponential_capped_and_fully_jittered():
    assert [retry_delay(n, 2, 60, jitter=False) for n in range(1, 8)] == [2, 4, 8, 16, 32, 60, 60]
    rng = random.Random(7)
    samples = [retry_delay(3, 2, 60, rng=rng) for _ in range(2000)]
    assert all(0 <= s <= 8 for s in samples)
    assert min(samples) < 0.5 and max(samples) > 7.5, "full jitter spans [0, bound]"
    assert retry_delay(10_000, 2, 60, jitter=False) == 60, "no overflow on huge attempts"


def test_decide():
    no_jitter = {"PGQUEUE": {"BACKOFF_JITTER": False, "BACKOFF_BASE": 1.0}}
    with override_settings(**no_jitter):
        assert decide(Category.PERMANENT, 1, 5).action == DEAD_LETTER
        assert decide(Category.BUSINESS, 1, 5).action == DEAD_LETTER
        assert decide(Category.UNKNOWN, 5, 5).action == DEAD_LETTER, "attempts used up"
        assert decide(Category.UNKNOWN, 3, 5) == Decision(RETRY, 4.0)
        assert decide(Category.TRANSIENT, 1, 5) == Decision(RETRY, 1.0)
        assert decide(Category.DEPENDENCY, 1, 5) == Decision(RETRY, 5.0), "dependency waits longer"
        assert decide(Category.TRANSIENT, 1, 5, retry_after=30) == Decision(RETRY, 30.0)
        assert decide(Category.TRANSIENT, 5, 5, retry_after=30).action == DEAD_LETTER
        handler = spec(backoff_base=10.0, backoff_cap=15.0)
        assert decide(Category.TRANSIENT, 1, 5, handler) == Decision(RETRY, 10.0)
        assert decide(Category.TRANSIENT, 3, 5, handler) == Decision(RETRY, 15.0)


def test_retry_validates_after():
    assert Retry(after=datetime.timedelta(minutes=1)).after == 60.0
    with pytest.raises(ValueError, match="Retry.after=.... takes seconds"):
        Retry(after=-1)
    with pytest.raises(ValueError, match="takes seconds"):
        Retry(after="soon")


def test_max_attempts_precedence():
    with override_settings(PGQUEUE={"MAX_ATTEMPTS": 7}):
        assert max_attempts_for(message(), None) == 7
        assert max_attempts_for(message(), spec(max_attempts=3)) == 3
        assert max_attempts_for(message(max_attempts=2), spec(max_attempts=3)) == 2
