"""The failure policy: pure functions, no database.

``classify`` turns an exception into a Category; ``decide`` turns a category
and the attempt count into "retry after N seconds" or "dead-letter now".

Order of classification: the CLASSIFIER callable, then CLASSIFY_RULES (first
match wins), then the built-in rules below, then UNKNOWN.
"""

import datetime
import json
import random
import re
import socket
from dataclasses import dataclass

from django.core.exceptions import PermissionDenied, ValidationError
from django.db import InterfaceError, OperationalError
from django.utils.module_loading import import_string

from django_pgqueue import conf
from django_pgqueue.exceptions import HandlerTimeout, Permanent, Retry
from django_pgqueue.models import Category

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


@dataclass(frozen=True)
class Decision:
    action: str  # RETRY or DEAD_LETTER
    delay: float | None = None  # seconds, for RETRY


def classify(exc, message=None):
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


def _rule_matches(rule, exc, message):
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


def retry_delay(attempt, base, cap, jitter=True, rng=random):
    """Seconds to wait after failed attempt number ``attempt`` (1-based).

    Exponential with a cap; with full jitter, uniform in [0, bound], which
    spreads a burst of failures out instead of retrying them in lockstep.
    """
    exponent = min(max(attempt - 1, 0), 64)  # 2**64 * base overflows nothing
    bound = min(cap, base * (2**exponent))
    return rng.uniform(0, bound) if jitter else bound


def max_attempts_for(message, spec):
    """The attempt limit: the message's own, else its handler's, else the setting."""
    if message.max_attempts is not None:
        return message.max_attempts
    if spec is not None and spec.max_attempts is not None:
        return spec.max_attempts
    return conf.get("MAX_ATTEMPTS")


def dead_letter_blocks_group(message, spec):
    """Whether dead-lettering ``message`` keeps its group blocked: never for
    a message without a group; else its handler's choice, else the setting."""
    if message.group_key is None:
        return False
    if spec is not None and spec.dead_letter_blocks_group is not None:
        return spec.dead_letter_blocks_group
    return conf.get("DEAD_LETTER_BLOCKS_GROUP")


def decide(category, attempts, max_attempts, spec=None, retry_after=None, rng=random):
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


def _option(spec, attribute, setting):
    value = getattr(spec, attribute, None) if spec is not None else None
    return conf.get(setting) if value is None else value
