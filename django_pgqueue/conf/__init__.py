"""Settings: one ``PGQUEUE`` dict in the project's settings, every key optional.

Values are read at call time (``get``), never cached at import, so
``override_settings`` and per-test changes just work. The keys, their
defaults and meanings are in ``defaults.py``; ``problems.py`` says what is
wrong with a value (``validate`` returns the problems that ``checks.py``
turns into system-check errors). Everything is read as ``conf.NAME``.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

from django_pgqueue.conf.defaults import (
    ACCESS_CHOICES,
    ALERT_TOPIC,
    DB_TIMEOUT_MAX,
    DEFAULTS,
    KEY_MAX_LENGTH,
    NAME_RE,
    PRIORITY_MAX,
    PRIORITY_MIN,
    QUEUE_MAX_LENGTH,
    SECRET_KEYS,
    TOPIC_MAX_LENGTH,
)
from django_pgqueue.conf.limits import (
    LONGEST_PERIOD,
    NO_LIMITS,
    Limits,
    Rate,
    concurrency_problem,
    configured_limits,
    configured_unfair,
    configured_weights,
    parse_rate,
    rate_problem,
    weight_problem,
)
from django_pgqueue.conf.problems import (
    RULE_CONDITIONS,
    alias_problem,
    async_concurrency_problem,
    host_problem,
    is_int,
    name_problem,
    rule_problem,
    text_problem,
    validate,
)

__all__ = [
    "LONGEST_PERIOD",
    "NO_LIMITS",
    "ACCESS_CHOICES",
    "ALERT_TOPIC",
    "DB_TIMEOUT_MAX",
    "DEFAULTS",
    "KEY_MAX_LENGTH",
    "Limits",
    "NAME_RE",
    "PRIORITY_MAX",
    "PRIORITY_MIN",
    "QUEUE_MAX_LENGTH",
    "RULE_CONDITIONS",
    "Rate",
    "SECRET_KEYS",
    "TOPIC_MAX_LENGTH",
    "Secret",
    "alias_problem",
    "concurrency_problem",
    "configured_limits",
    "configured_unfair",
    "configured_weights",
    "database_alias",
    "databases",
    "queue_database",
    "queues_by_database",
    "stream_database",
    "get",
    "hide_secrets",
    "on_database",
    "async_concurrency_problem",
    "host_problem",
    "is_int",
    "milliseconds",
    "name_problem",
    "parse_rate",
    "queue_limits",
    "unfair_queues",
    "queues",
    "rate_problem",
    "weight_problem",
    "rule_problem",
    "text_problem",
    "validate",
]


def get(name: str) -> Any:
    """The value of ``PGQUEUE[name]``, or its default."""
    if name not in DEFAULTS:
        raise KeyError(f"PGQUEUE has no setting {name!r}")
    user = getattr(settings, "PGQUEUE", None) or {}
    if not isinstance(user, dict):
        raise ImproperlyConfigured(
            f"PGQUEUE must be a dict, not {type(user).__name__} (manage.py check tells more)"
        )
    return user.get(name, DEFAULTS[name])


# The database that code works on in this context (``on_database``): a
# worker's engine, or a command or admin page going through every database.
_ON_DATABASE: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "pgqueue_on_database", default=None
)


def database_alias() -> str:
    """The database alias whose queue tables this code works on: the one an
    enclosing ``on_database()`` names (a worker's engine, a command going
    through every database), else ``PGQUEUE["DATABASE"]``, the home of every
    queue and stream that names no database of its own."""
    return _ON_DATABASE.get() or get("DATABASE")


@contextmanager
def on_database(alias: str) -> Iterator[str]:
    """Work on the queue tables of ``alias`` within the block: every
    ``database_alias()`` of this thread (and of the threads and tasks it
    starts with its context copied) says ``alias``, as Django's
    ``timezone.override()`` sets the current time zone. The functions that
    take a queue (``enqueue``, ``pause``, ...) route by the queue's own
    database (``queue_database``) whatever the block says."""
    problem = alias_problem(alias)
    if problem:
        raise ImproperlyConfigured(f"on_database({alias!r}): the alias {problem}")
    token = _ON_DATABASE.set(alias)
    try:
        yield alias
    finally:
        _ON_DATABASE.reset(token)


def queue_database(queue: str | None = None) -> str:
    """The database alias of ``queue``'s messages (default: the default
    queue): its ``"database"`` in the dict form of QUEUES, else DATABASE."""
    configured = get("QUEUES")
    if isinstance(configured, dict):
        entry = configured.get(queue or get("DEFAULT_QUEUE"))
        if entry and entry.get("database"):
            return entry["database"]
    return get("DATABASE")


def stream_database(stream: str) -> str:
    """The database alias of ``stream``'s events and subscriptions:
    ``PGQUEUE["STREAMS"][stream]["database"]``, else DATABASE."""
    entry = (get("STREAMS") or {}).get(stream)
    if entry and entry.get("database"):
        return entry["database"]
    return get("DATABASE")


def databases() -> list[str]:
    """Every alias that holds the app's tables: DATABASE first, then the
    other aliases that QUEUES and STREAMS name, in the order named."""
    found = [get("DATABASE")]
    for entries in (get("QUEUES"), get("STREAMS")):
        if isinstance(entries, dict):
            found += [
                entry["database"] for entry in entries.values() if entry and entry.get("database")
            ]
    return list(dict.fromkeys(found))


def queues_by_database(queues: Iterable[str]) -> dict[str, list[str]]:
    """``queues`` grouped by their database alias (``queue_database``), the
    aliases in the order of ``databases()``, the queues in the order given."""
    grouped: dict[str, list[str]] = {alias: [] for alias in databases()}
    for queue in queues:
        grouped.setdefault(queue_database(queue), []).append(queue)
    return {alias: names for alias, names in grouped.items() if names}


def queues() -> list[str]:
    """The configured queues (PGQUEUE["QUEUES"], or the default queue)."""
    configured = get("QUEUES")
    return list(configured) if configured else [get("DEFAULT_QUEUE")]


def queue_limits() -> dict[str, Limits]:
    """{queue: Limits} of the queues PGQUEUE["QUEUES"] gives limits (its dict
    form); the run-time overrides are ``controls``'."""
    return configured_limits(get("QUEUES"))


def unfair_queues() -> frozenset[str]:
    """The queues that PGQUEUE["QUEUES"] gives "fair": False: claimed in
    strict order, without the rotation between their partitions."""
    return configured_unfair(get("QUEUES"))


def queue_weights() -> dict[str, int]:
    """{queue: weight} when PGQUEUE["QUEUES"] gives a queue a weight (a
    worker serving several shares its claims by weight), else {}."""
    return configured_weights(get("QUEUES"))


def milliseconds(seconds: float | None) -> str | None:
    """A LOCK_TIMEOUT or STATEMENT_TIMEOUT as PostgreSQL reads it ("5000ms"),
    or None."""
    return None if seconds is None else f"{max(1, round(seconds * 1000))}ms"


class Secret(str):
    """A secret setting's value: the same string to every use (equal to it,
    sent as it is), but its repr is Django's mask. Django's debug page (the
    technical 500 page and its text and e-mail forms) masks settings by name
    only (API, AUTH, TOKEN, KEY, SECRET, PASS, SIGNATURE), which
    "ALERT_WEBHOOK_URL" and the header names in "ALERT_WEBHOOK_HEADERS" need
    not match, and shows every other value through repr(), as do pprint and
    the debug page's local variables."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "'********************'"


def hide_secrets(user: object = None) -> None:
    """Make the secret values of the PGQUEUE setting (``user``, default the
    current one) ``Secret`` strings, in place, so that no debug page shows
    them whatever the project's exception reporter filter. Called when the
    app is ready and whenever PGQUEUE changes (override_settings); anything
    that is not a string is left to the system checks."""
    if user is None:
        user = getattr(settings, "PGQUEUE", None)
    if not isinstance(user, dict):
        return
    for key in ("ENDPOINT_TOKEN", "ALERT_WEBHOOK_URL"):
        value = user.get(key)
        if isinstance(value, str) and not isinstance(value, Secret):
            user[key] = Secret(value)
    headers = user.get("ALERT_WEBHOOK_HEADERS")
    if isinstance(headers, dict):
        for name, value in list(headers.items()):
            if isinstance(value, str) and not isinstance(value, Secret):
                headers[name] = Secret(value)
