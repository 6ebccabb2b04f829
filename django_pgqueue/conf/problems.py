"""Why a value cannot be what it is meant to be: a queue or topic name, a
database alias, a host, a classification rule, each ``PGQUEUE`` setting.

Each check returns the problem as the end of a sentence ("must be ...") or
None. ``validate`` runs the check of every key the project sets;
``checks.py`` turns its problems into system-check errors, and commands,
handlers and ``enqueue`` reuse the name checks.
"""

from __future__ import annotations

import difflib
import importlib.util
import ipaddress
import re
from collections.abc import Callable
from typing import Any, TypeGuard
from urllib.parse import urlsplit

from django.conf import settings
from django.utils.module_loading import import_string

from django_pgqueue.conf.defaults import (
    ACCESS_CHOICES,
    DB_TIMEOUT_MAX,
    DEFAULTS,
    NAME_RE,
    QUEUE_MAX_LENGTH,
    SECRET_KEYS,
    STREAM_BATCH_SIZE_MAX,
)
from django_pgqueue.conf.limits import limits_problem

Problem = str | None


def is_int(value: object) -> TypeGuard[int]:
    """An int that is not a bool (``True`` is an ``int`` to Python)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool)


def name_problem(kind: str, value: object, max_length: int) -> Problem:
    """Why ``value`` is not a valid queue or topic name, or None if it is."""
    if not isinstance(value, str):
        return f"{kind} must be a string, not {type(value).__name__}"
    if not value:
        return f"{kind} must not be empty"
    if len(value) > max_length:
        return f"{kind} is {len(value)} characters long; the limit is {max_length}"
    if not NAME_RE.match(value):
        return (
            f"{kind} {value!r} may contain only letters, digits and _ . : / - "
            "and must not start with punctuation other than _"
        )
    return None


def text_problem(text: str) -> Problem:
    """Why the string ``text`` cannot go to PostgreSQL as text, or None. It
    cannot hold NUL; and bytes that are not UTF-8 (a command line's arrive as
    lone surrogates) cannot be encoded at all."""
    if "\x00" in text:
        return "must not contain a NUL character"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return f"{text!r} is not valid UTF-8 text"
    return None


def alias_problem(value: object) -> Problem:
    if not isinstance(value, str) or not value:
        return "must be a database alias (a non-empty string)"
    if value not in settings.DATABASES:
        return f"names the alias {value!r}, which is not in DATABASES"
    return None


_HOST_LABEL_RE = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)\Z")


def host_problem(value: object) -> Problem:
    """Why ``value`` cannot be the address a worker's HTTP ports listen on
    (WORKER_HTTP_HOST, --http-host), or None: an IPv4 or IPv6 address, or a
    host name. Whether it can be bound is known only when the worker binds."""
    if not isinstance(value, str) or not value:
        return "must be an IP address or a host name (a non-empty string)"
    try:
        ipaddress.ip_address(value)
        return None
    except ValueError:
        pass
    labels = value.split(".")
    # An all-digit last label is a mistyped IPv4 address ("10.0.0.256"), not a name.
    if (
        len(value) <= 253
        and all(_HOST_LABEL_RE.match(label) for label in labels)
        and not labels[-1].isdigit()
    ):
        return None
    return (
        "must be an IP address (e.g. 127.0.0.1, 0.0.0.0, ::1) or a host name, "
        "without brackets or a port"
    )


RULE_CONDITIONS = ("exception", "message", "regex", "topic", "payload")


def rule_problem(rule: object) -> Problem:
    """Why a CLASSIFY_RULES entry is malformed, or None."""
    if not isinstance(rule, dict):
        return "each rule must be a dict"
    unknown = sorted(set(rule) - {"category", *RULE_CONDITIONS})
    if unknown:
        return f"a rule has unknown key(s) {', '.join(unknown)}"
    categories = ("transient", "dependency", "permanent", "business", "unknown")
    if rule.get("category") not in categories:
        return f"a rule's category must be one of {', '.join(categories)}"
    if not any(key in rule for key in RULE_CONDITIONS):
        return f"a rule needs at least one condition: {', '.join(RULE_CONDITIONS)}"
    exception = rule.get("exception")
    if exception is not None and not (
        isinstance(exception, type) and issubclass(exception, BaseException)
    ):
        try:
            imported = import_string(exception) if isinstance(exception, str) else None
        except ImportError as exc:
            return f"a rule's exception cannot be imported ({exc})"
        if not (isinstance(imported, type) and issubclass(imported, BaseException)):
            return "a rule's exception must be an exception class or its dotted path"
    for key in ("message", "topic"):
        if key in rule and not isinstance(rule[key], str):
            return f"a rule's {key} must be a string"
    if "regex" in rule:
        try:
            re.compile(rule["regex"])
        except (re.error, TypeError) as exc:
            return f"a rule's regex does not compile ({exc})"
    if "payload" in rule and not callable(rule["payload"]):
        problem = _importable(rule["payload"])
        if problem:
            return f"a rule's payload predicate {problem}"
    return None


# --- the check of each setting ------------------------------------------------------


def _bool(value: object) -> Problem:
    return None if isinstance(value, bool) else "must be True or False"


def _queue(value: object) -> Problem:
    return name_problem("the queue name", value, QUEUE_MAX_LENGTH)


def _positive_int(value: object) -> Problem:
    if is_int(value) and value >= 1:
        return None
    return "must be a whole number of at least 1"


# The most coroutines a worker's event loop runs at once: each holds a
# message, its lease extended by the heartbeat.
ASYNC_CONCURRENCY_MAX = 100_000


def async_concurrency_problem(value: object) -> Problem:
    if is_int(value) and 1 <= value <= ASYNC_CONCURRENCY_MAX:
        return None
    return f"must be a whole number from 1 to {ASYNC_CONCURRENCY_MAX:,}"


def _non_negative_int(value: object) -> Problem:
    if is_int(value) and value >= 0:
        return None
    return "must be a whole number of at least 0"


def _stream_batch_size(value: object) -> Problem:
    if is_int(value) and 1 <= value <= STREAM_BATCH_SIZE_MAX:
        return None
    return f"must be a whole number from 1 to {STREAM_BATCH_SIZE_MAX:,}"


def _positive_number(value: object) -> Problem:
    if _is_number(value) and 0 < value < float("inf"):
        return None
    return "must be a number of seconds greater than 0"


def _seconds_or_zero(value: object) -> Problem:
    if _is_number(value) and 0 <= value < float("inf"):
        return None
    return "must be a number of seconds (0 turns it off)"


def _factor(value: object) -> Problem:
    if _is_number(value) and 1 <= value < float("inf"):
        return None
    return "must be a number of at least 1"


def _db_timeout(value: object) -> Problem:
    if value is None or (_is_number(value) and 0.001 <= value <= DB_TIMEOUT_MAX):
        return None
    return f"must be a number of seconds from 0.001 to {DB_TIMEOUT_MAX:.0f}, or None"


def _webhook_timeout(value: object) -> Problem:
    # The alert handler's own timeout is 60 s: a request must give up first.
    if _is_number(value) and 0 < value <= 50:
        return None
    return "must be a number of seconds greater than 0 and at most 50"


def _retention(value: object) -> Problem:
    if value is None or _positive_number(value) is None:
        return None
    return "must be a number of seconds greater than 0, or None (keep every event)"


def _queues(value: object) -> Problem:
    if value is None:
        return None
    if not isinstance(value, list | tuple | dict) or not value:
        return (
            "must be a non-empty list of queue names, a dict of queue names to their "
            "limits, or None"
        )
    for name in value:
        problem = _queue(name)
        if problem:
            return problem
    if len(set(value)) != len(value):
        return "names a queue twice"
    if isinstance(value, dict):
        for name, limits in value.items():
            problem = limits_problem(limits)
            if not problem and limits and limits.get("database") is not None:
                problem = alias_problem(limits["database"])
                problem = problem and f"database {problem}"
            if problem:
                return f"queue {name!r}: {problem}"
    return None


def _streams(value: object) -> Problem:
    if value is None:
        return None
    if not isinstance(value, dict):
        return 'must be a dict of stream names to their settings ({"database": alias}), or None'
    for name, entry in value.items():
        if not isinstance(name, str) or not NAME_RE.match(name):
            return f"names the stream {name!r}, which is not a valid name"
        if not isinstance(entry, dict) or set(entry) - {"database"}:
            return f'stream {name!r}: must be a dict whose one key is "database"'
        problem = entry.get("database") is not None and alias_problem(entry["database"])
        if problem:
            return f"stream {name!r}: database {problem}"
    return None


def _retention_or_none(value: object) -> Problem:
    if value is None or _positive_number(value) is None:
        return None
    return "must be a number of seconds greater than 0, or None (keep them)"


def _positive_int_or_none(value: object) -> Problem:
    if value is None or _positive_int(value) is None:
        return None
    return "must be a whole number of at least 1, or None (never vacuum from the worker)"


def _keep_finished(value: object) -> Problem:
    if _is_number(value) and 0 <= value < float("inf"):
        return None
    return "must be a number of seconds, at least 0 (0 keeps no history)"


def _schedules(value: object) -> Problem:
    # Only the shape: each entry is checked in checks.py (pgqueue.E110), which
    # names the schedule and the field.
    if isinstance(value, dict) and all(isinstance(name, str) for name in value):
        return None
    return "must be a dict of schedule names to their entries"


def _access(value: object) -> Problem:
    if value in ACCESS_CHOICES:
        return None
    return "must be one of " + ", ".join(repr(c) for c in ACCESS_CHOICES)


def _token(value: object) -> Problem:
    if value is None:
        return None
    if not isinstance(value, str) or len(value) < 16:
        return "must be a string of at least 16 characters, or None"
    return None


def _http_url(value: object) -> Problem:
    if value is None:
        return None
    if not isinstance(value, str) or not re.match(r"^https?://[^\s/]+", value):
        return "must be an http:// or https:// URL, or None"
    return None


def _webhook_url(value: object) -> Problem:
    problem = _http_url(value)
    if problem or not isinstance(value, str):
        return problem
    try:
        netloc = urlsplit(value).netloc
    except ValueError:  # e.g. an unclosed IPv6 bracket
        return "must be a valid http:// or https:// URL, or None"
    if "@" in netloc:
        # urllib sends no credentials from the URL (and would put them into
        # its error messages): they belong in a header.
        return (
            "must not carry a user name or password (user:password@host); send them in "
            "ALERT_WEBHOOK_HEADERS, e.g. an Authorization header"
        )
    return None


def _headers(value: object) -> Problem:
    if not isinstance(value, dict):
        return "must be a dict of header names to values"
    for name, header in value.items():
        if not isinstance(name, str) or not re.match(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$", name):
            return f"has an invalid header name {name!r}"
        if not isinstance(header, str) or "\r" in header or "\n" in header:
            return f"header {name!r} must have a one-line string value"
    return None


def _classifier(value: object) -> Problem:
    if value is None or callable(value):
        return None
    return _importable(value)


def _importable(value: object) -> Problem:
    if not isinstance(value, str):
        return "must be a callable or its dotted path"
    try:
        imported = import_string(value)
    except ImportError as exc:
        return f"cannot be imported ({exc})"
    return None if callable(imported) else "does not name a callable"


def _tracing(value: object) -> Problem:
    if value is not None and not isinstance(value, bool):
        return "must be None (on when opentelemetry-api is installed), True or False"
    if value is True and importlib.util.find_spec("opentelemetry") is None:
        return "is True but opentelemetry-api is not installed (pip install django-pgqueue[otel])"
    return None


def _rules(value: object) -> Problem:
    if not isinstance(value, list | tuple):
        return "must be a list of rule dicts"
    for index, rule in enumerate(value):
        problem = rule_problem(rule)
        if problem:
            return f"rule {index}: {problem}"
    return None


CHECKS: dict[str, Callable[[Any], Problem]] = {
    "DATABASE": alias_problem,
    "STREAMS": _streams,
    "NOTIFY": _bool,
    "DEFAULT_QUEUE": _queue,
    "MAX_ATTEMPTS": _positive_int,
    "BACKOFF_BASE": _positive_number,
    "BACKOFF_CAP": _positive_number,
    "BACKOFF_JITTER": _bool,
    "DEAD_LETTER_BLOCKS_GROUP": _bool,
    "DEPENDENCY_BACKOFF_FACTOR": _factor,
    "CLASSIFY_RULES": _rules,
    "CLASSIFIER": _classifier,
    "LEASE_SECONDS": _positive_number,
    "POLL_INTERVAL": _positive_number,
    "ASYNC_CONCURRENCY": async_concurrency_problem,
    "QUEUES": _queues,
    "HEARTBEAT_INTERVAL": _positive_number,
    "LOG_SUMMARY_INTERVAL": _seconds_or_zero,
    "LOCK_TIMEOUT": _db_timeout,
    "STATEMENT_TIMEOUT": _db_timeout,
    "METRICS_ACCESS": _access,
    "HEALTH_ACCESS": _access,
    "ENDPOINT_TOKEN": _token,
    "WORKER_HTTP_HOST": host_problem,
    "ALERT_WEBHOOK_URL": _webhook_url,
    "ALERT_WEBHOOK_HEADERS": _headers,
    "ALERT_WEBHOOK_TIMEOUT": _webhook_timeout,
    "ALERT_WEBHOOK_RETRIES": _non_negative_int,
    "ALERT_WINDOW": _positive_number,
    "ALERT_SITE_URL": _http_url,
    "STREAM_RETENTION": _retention,
    "STREAM_BATCH_SIZE": _stream_batch_size,
    "SCHEDULES": _schedules,
    "CANCELLED_RETENTION": _retention_or_none,
    "VACUUM_DEAD_ROWS": _positive_int_or_none,
    "KEEP_FINISHED": _keep_finished,
    "KEEP_RESOLVED_DEAD_LETTERS": _retention_or_none,
    "KEEP_TASK_RESULTS": _retention_or_none,
    "TRACING": _tracing,
}


def validate() -> list[tuple[str, str, str]]:
    """Problems with the ``PGQUEUE`` setting, as (id, message, hint) tuples."""
    user = getattr(settings, "PGQUEUE", None)
    if user is None:
        return []
    if not isinstance(user, dict):
        return [
            (
                "pgqueue.E001",
                f"PGQUEUE must be a dict, not {type(user).__name__}.",
                'Write PGQUEUE = {"NOTIFY": False, ...} or remove the setting.',
            )
        ]
    problems = []
    for key, value in user.items():
        if key not in DEFAULTS:
            close = difflib.get_close_matches(str(key), DEFAULTS, n=1)
            hint = f"Did you mean {close[0]!r}? " if close else ""
            problems.append(
                (
                    "pgqueue.E002",
                    f"PGQUEUE has an unknown key {key!r}.",
                    hint + "Known keys: " + ", ".join(sorted(DEFAULTS)) + ".",
                )
            )
            continue
        problem = CHECKS[key](value)
        if problem:
            shown = "a hidden value" if key in SECRET_KEYS else repr(value)
            problems.append(
                (
                    "pgqueue.E003",
                    f"PGQUEUE[{key!r}] {problem} (got {shown}).",
                    f"Fix or remove PGQUEUE[{key!r}]; its default is {DEFAULTS[key]!r}.",
                )
            )
    for key in ("METRICS_ACCESS", "HEALTH_ACCESS"):
        if user.get(key) == "token" and not user.get("ENDPOINT_TOKEN"):
            problems.append(
                (
                    "pgqueue.E003",
                    f"PGQUEUE[{key!r}] is 'token' but PGQUEUE['ENDPOINT_TOKEN'] is not set.",
                    "Set ENDPOINT_TOKEN to a long random string (read it from the "
                    "environment), or choose 'open' or 'staff'.",
                )
            )
    return problems
