"""The failure policy: pure functions, no database.

``classify`` turns an exception into a Category; ``decide`` turns a category
and the attempt count into "retry after N seconds" or "dead-letter now".

Order of classification: the CLASSIFIER callable, then CLASSIFY_RULES (first
match wins), then the built-in rules below, then UNKNOWN.
"""

from __future__ import annotations

import datetime
import json
import random
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from django.core.exceptions import PermissionDenied, ValidationError
from django.db import InterfaceError, OperationalError
from django.utils.module_loading import import_string

from django_pgqueue import conf
from django_pgqueue.exceptions import HandlerTimeout, Permanent, Retry
from django_pgqueue.models import Category

if TYPE_CHECKING:
    from django_pgqueue.models import Message
    from django_pgqueue.registry import HandlerSpec

# Built-in rules, most specific first. Decisions that depend on the meaning of
# an application's own exceptions belong in CLASSIFY_RULES.
BUILTIN_RULES = (
    (Permanent, Category.PERMANENT),
    (Retry, Category.TRANSIENT),
    (HandlerTimeout, Category.TRANSIENT),
    # A business rule said no: a person should look, retrying won't help.
    (ValidationError, Category.BUSINESS),
    (PermissionDenied, Category.BUSINESS),
    # A downstream service refused or dropped the connection.
    (ConnectionError, Category.DEPENDENCY),
    # Timeouts and database blips (deadlock, serialization failure, restart).
    (TimeoutError, Category.TRANSIENT),
    (socket.timeout, Category.TRANSIENT),
    (OperationalError, Category.TRANSIENT),
    (InterfaceError, Category.TRANSIENT),
    # Malformed data: the same payload will fail the same way next time.
    (json.JSONDecodeError, Category.PERMANENT),
    (UnicodeError, Category.PERMANENT),
    (KeyError, Category.PERMANENT),
    (TypeError, Category.PERMANENT),
    (ValueError, Category.PERMANENT),
)

RETRY = "retry"
DEAD_LETTER = "dead_letter"


class Failed(Protocol):
    """What failed, as the rules see it: a Message, or a stream's Event
    (whose topic is its stream)."""

    @property
    def topic(self) -> str: ...

    @property
    def payload(self) -> Any: ...


class Backoff(Protocol):
    """A handler's or a subscriber's own backoff options (None: the setting's)."""

    @property
    def backoff_base(self) -> float | None: ...

    @property
    def backoff_cap(self) -> float | None: ...

    @property
    def backoff_jitter(self) -> bool | None: ...


class Uniform(Protocol):
    """A source of random numbers (the ``random`` module, a ``random.Random``)."""

    def uniform(self, a: float, b: float) -> float: ...


@dataclass(frozen=True)
class Decision:
    action: str  # RETRY or DEAD_LETTER
    delay: float = 0.0  # seconds, for RETRY


def classify(exc: BaseException, message: Failed | None = None) -> Category:
    """The Category of ``exc`` raised while handling ``message``."""
    classifier = conf.get("CLASSIFIER")
    if classifier is not None:
        if isinstance(classifier, str):
            classifier = import_string(classifier)
        category = classifier(exc, message)
        if category is not None:
            return Category(category)
    for rule in conf.get("CLASSIFY_RULES"):
        if _rule_matches(rule, exc, message):
            return Category(rule["category"])
    for exc_class, category in BUILTIN_RULES:
        if isinstance(exc, exc_class):
            return category
    return Category.UNKNOWN


def _rule_matches(rule: Mapping[str, Any], exc: BaseException, message: Failed | None) -> bool:
    exception = rule.get("exception")
    if exception is not None:
        if isinstance(exception, str):
            exception = import_string(exception)
        if not isinstance(exc, exception):
            return False
    text = str(exc)
    if "message" in rule and rule["message"] not in text:
        return False
    if "regex" in rule and not re.search(rule["regex"], text):
        return False
    if "topic" in rule and (message is None or message.topic != rule["topic"]):
        return False
    if "payload" in rule:
        predicate = rule["payload"]
        if isinstance(predicate, str):
            predicate = import_string(predicate)
        if message is None or not predicate(message.payload):
            return False
    return True


def retry_delay(
    attempt: int, base: float, cap: float, jitter: bool = True, rng: Uniform = random
) -> float:
    """Seconds to wait after failed attempt number ``attempt`` (1-based).

    Exponential with a cap; with full jitter, uniform in [0, bound], which
    spreads a burst of failures out instead of retrying them in lockstep.
    """
    exponent = min(max(attempt - 1, 0), 64)  # 2**64 * base overflows nothing
    bound = min(cap, base * (2**exponent))
    return rng.uniform(0, bound) if jitter else bound


def max_attempts_for(message: Message, spec: HandlerSpec | None) -> int:
    """The attempt limit: the message's own, else its handler's, else the setting."""
    if message.max_attempts is not None:
        return message.max_attempts
    if spec is not None and spec.max_attempts is not None:
        return spec.max_attempts
    return conf.get("MAX_ATTEMPTS")


def dead_letter_blocks_group(message: Message, spec: HandlerSpec | None) -> bool:
    """Whether dead-lettering ``message`` keeps its group blocked: never for
    a message without a group; else its handler's choice, else the setting."""
    if message.group_key is None:
        return False
    if spec is not None and spec.dead_letter_blocks_group is not None:
        return spec.dead_letter_blocks_group
    return conf.get("DEAD_LETTER_BLOCKS_GROUP")


def decide(
    category: str,
    attempts: int,
    max_attempts: int,
    spec: Backoff | None = None,
    retry_after: float | datetime.timedelta | None = None,
    rng: Uniform = random,
) -> Decision:
    """Retry (with a delay) or dead-letter, for a failure of ``category`` after
    ``attempts`` attempts out of ``max_attempts``."""
    if category in (Category.PERMANENT, Category.BUSINESS):
        return Decision(DEAD_LETTER)
    if attempts >= max_attempts:
        return Decision(DEAD_LETTER)
    if retry_after is not None:
        if isinstance(retry_after, datetime.timedelta):
            retry_after = retry_after.total_seconds()
        return Decision(RETRY, max(float(retry_after), 0.0))
    base = _option(spec, "backoff_base", "BACKOFF_BASE")
    if category == Category.DEPENDENCY:
        base *= conf.get("DEPENDENCY_BACKOFF_FACTOR")
    cap = _option(spec, "backoff_cap", "BACKOFF_CAP")
    jitter = _option(spec, "backoff_jitter", "BACKOFF_JITTER")
    return Decision(RETRY, retry_delay(attempts, base, cap, jitter, rng))


def _option(spec: Backoff | None, attribute: str, setting: str) -> Any:
    value = getattr(spec, attribute, None) if spec is not None else None
    return conf.get(setting) if value is None else value
