"""Handlers: ``@handler(topic, ...)`` and the lookup from topic to handler.

Handlers live in a ``handlers`` module of any installed app; the app's
``ready()`` imports them all (``autodiscover``), the way the admin finds
``admin.py``. A second handler for a topic stops start-up with both
locations named.
"""

import datetime
import inspect
from dataclasses import dataclass

from django.utils.module_loading import autodiscover_modules

from django_pgqueue import conf
from django_pgqueue.exceptions import DuplicateHandler

_handlers = {}


@dataclass(frozen=True)
class HandlerSpec:
    topic: str
    func: object
    max_attempts: int | None
    timeout: float | None
    atomic: bool
    backoff_base: float | None
    backoff_cap: float | None
    backoff_jitter: bool | None
    is_async: bool
    location: str
    dead_letter_blocks_group: bool | None = None


def handler(
    topic,
    *,
    max_attempts=None,
    timeout=None,
    atomic=True,
    backoff_base=None,
    backoff_cap=None,
    backoff_jitter=None,
    dead_letter_blocks_group=None,
):
    """Register the decorated function as the handler of ``topic``.

    ``atomic=True`` runs the handler and the message's acknowledgement in one
    transaction on the queue's database. ``timeout`` (seconds) bounds how long
    the worker waits for it. The other options override the PGQUEUE settings
    of the same name for this topic (``dead_letter_blocks_group``: the
    setting DEAD_LETTER_BLOCKS_GROUP). ``async def`` functions are accepted.
    """
    problem = conf.name_problem("topic", topic, conf.TOPIC_MAX_LENGTH)
    if problem:
        raise ValueError(f"@handler: {problem}")
    if max_attempts is not None and not (conf.is_int(max_attempts) and max_attempts >= 1):
        raise ValueError(f"@handler({topic!r}): max_attempts must be at least 1")
    where = f"@handler({topic!r})"
    timeout = _seconds(where, "timeout", timeout)
    backoff_base = _seconds(where, "backoff_base", backoff_base)
    backoff_cap = _seconds(where, "backoff_cap", backoff_cap)
    if not isinstance(atomic, bool):
        raise ValueError(f"@handler({topic!r}): atomic must be True or False")
    if backoff_jitter is not None and not isinstance(backoff_jitter, bool):
        raise ValueError(f"@handler({topic!r}): backoff_jitter must be True, False or None")
    if dead_letter_blocks_group is not None and not isinstance(dead_letter_blocks_group, bool):
        raise ValueError(
            f"@handler({topic!r}): dead_letter_blocks_group must be True, False or None"
        )

    def decorate(func):
        if not callable(func):
            raise TypeError(f"@handler({topic!r}) decorates a callable, not {func!r}")
        spec = HandlerSpec(
            topic=topic,
            func=func,
            max_attempts=max_attempts,
            timeout=timeout,
            atomic=atomic,
            backoff_base=backoff_base,
            backoff_cap=backoff_cap,
            backoff_jitter=backoff_jitter,
            is_async=inspect.iscoroutinefunction(func),
            location=_location(func),
            dead_letter_blocks_group=dead_letter_blocks_group,
        )
        register(spec)
        return func

    return decorate


def register(spec):
    existing = _handlers.get(spec.topic)
    if existing is not None and existing.location != spec.location:
        raise DuplicateHandler(
            f"two handlers for topic {spec.topic!r}: {existing.location} and {spec.location}"
        )
    _handlers[spec.topic] = spec


def unregister(topic):
    """Forget the handler of ``topic`` (for tests and reloading)."""
    _handlers.pop(topic, None)


def lookup(topic):
    """The HandlerSpec for ``topic``, or None."""
    return _handlers.get(topic)


def autodiscover():
    autodiscover_modules("handlers")


def _location(func):
    func = inspect.unwrap(func)
    try:
        line = inspect.getsourcelines(func)[1]
    except (OSError, TypeError):
        line = "?"
    filename = inspect.getsourcefile(func) or getattr(func, "__module__", "?")
    return f"{func.__module__}.{func.__qualname__} ({filename}:{line})"


def _seconds(where, option, value):
    """A decorator's option in seconds (a number or a timedelta), as a float;
    ``where`` names the decorator in the error."""
    if value is None:
        return None
    if isinstance(value, datetime.timedelta):
        value = value.total_seconds()
    if not isinstance(value, int | float) or isinstance(value, bool) or not 0 < value < 1e9:
        raise ValueError(f"{where}: {option} must be a positive number of seconds")
    return float(value)
