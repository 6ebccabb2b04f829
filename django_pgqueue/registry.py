"""Handlers: ``@handler(topic, ...)`` and the lookup from topic to handler.

Handlers live in a ``handlers`` module of any installed app; the app's
``ready()`` imports them all (``autodiscover``), the way the admin finds
``admin.py``. A second handler for a topic stops start-up with both
locations named.

Also what handlers and stream subscribers (``streams.subscribers``) share:
the registry of specs by name (``Specs``), the options in seconds
(``seconds_option``), where a function is defined (``location_of``), and
how one is called (``call``).
"""

from __future__ import annotations

import datetime
import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from asgiref.sync import async_to_sync
from django.utils.module_loading import autodiscover_modules

from django_pgqueue import conf
from django_pgqueue.exceptions import DuplicateHandler
from django_pgqueue.schedules.spec import ScheduleSpec, from_handler


class Spec(Protocol):
    """What ``Specs`` and ``call`` need of a handler's or a subscriber's spec."""

    @property
    def func(self) -> Callable[[Any], Any]: ...

    @property
    def is_async(self) -> bool: ...

    @property
    def location(self) -> str: ...


S = TypeVar("S", bound=Spec)
F = TypeVar("F", bound=Callable[..., Any])


class Specs(Generic[S]):
    """Specs by name: a handler's by topic, a subscriber's by subscription
    name (``key``, the spec's attribute). A second spec under a name, from
    another place in the code, raises ``duplicate`` naming both locations
    (``what``: "two handlers for topic"); the same function registered again
    (its module imported twice) replaces it."""

    def __init__(self, key: str, duplicate: type[Exception], what: str) -> None:
        self._specs: dict[str, S] = {}
        self._key = key
        self._duplicate = duplicate
        self._what = what

    def register(self, spec: S) -> None:
        name = getattr(spec, self._key)
        existing = self._specs.get(name)
        if existing is not None and existing.location != spec.location:
            raise self._duplicate(f"{self._what} {name!r}: {existing.location} and {spec.location}")
        self._specs[name] = spec

    def unregister(self, name: str) -> None:
        """Forget the spec ``name`` (for tests and reloading)."""
        self._specs.pop(name, None)

    def lookup(self, name: str) -> S | None:
        """The spec named ``name``, or None."""
        return self._specs.get(name)

    def all(self) -> list[S]:
        """Every spec, by name."""
        return [self._specs[name] for name in sorted(self._specs)]

    def decorator(self, where: str, spec: Callable[..., S]) -> Callable[[F], F]:
        """A decorator (``where`` names it in errors) that registers the
        function it decorates as ``spec(func=, is_async=, location=)``, and
        returns the function itself."""

        def decorate(func: F) -> F:
            if not callable(func):
                raise TypeError(f"{where} decorates a callable, not {func!r}")
            is_async = inspect.iscoroutinefunction(func)
            self.register(spec(func=func, is_async=is_async, location=location_of(func)))
            return func

        return decorate


@dataclass(frozen=True)
class HandlerSpec:
    topic: str
    func: Callable[[Any], Any]
    max_attempts: int | None
    timeout: float | None
    atomic: bool
    backoff_base: float | None
    backoff_cap: float | None
    backoff_jitter: bool | None
    is_async: bool
    location: str
    dead_letter_blocks_group: bool | None = None
    schedule: ScheduleSpec | None = None  # schedule=: ticks enqueued to its topic


_handlers: Specs[HandlerSpec] = Specs("topic", DuplicateHandler, "two handlers for topic")
register, unregister, lookup = _handlers.register, _handlers.unregister, _handlers.lookup
all_handlers = _handlers.all


def handler(
    topic: str,
    *,
    max_attempts: int | None = None,
    timeout: float | datetime.timedelta | None = None,
    atomic: bool = True,
    backoff_base: float | datetime.timedelta | None = None,
    backoff_cap: float | datetime.timedelta | None = None,
    backoff_jitter: bool | None = None,
    dead_letter_blocks_group: bool | None = None,
    schedule: str | float | datetime.timedelta | dict[str, Any] | None = None,
) -> Callable[[F], F]:
    """Register the decorated function as the handler of ``topic``.

    ``atomic=True`` runs the handler and the message's acknowledgement in one
    transaction on the queue's database. ``timeout`` (seconds) bounds how long
    the worker waits for it. The other options override the PGQUEUE settings
    of the same name for this topic (``dead_letter_blocks_group``: the
    setting DEAD_LETTER_BLOCKS_GROUP). ``async def`` functions are accepted.

    ``schedule``: enqueue a message for ``topic`` periodically, as an entry
    of PGQUEUE["SCHEDULES"] named after the topic would: a cron expression
    ("0 6 * * mon"), an interval (seconds or a timedelta), or a dict of the
    entry's other fields ({"cron": ..., "payload": ..., "timezone": ...}).
    """
    problem = conf.name_problem("topic", topic, conf.TOPIC_MAX_LENGTH)
    if problem:
        raise ValueError(f"@handler: {problem}")
    if max_attempts is not None and not (conf.is_int(max_attempts) and max_attempts >= 1):
        raise ValueError(f"@handler({topic!r}): max_attempts must be at least 1")
    where = f"@handler({topic!r})"
    timeout_seconds = seconds_option(where, "timeout", timeout)
    base_seconds = seconds_option(where, "backoff_base", backoff_base)
    cap_seconds = seconds_option(where, "backoff_cap", backoff_cap)
    if not isinstance(atomic, bool):
        raise ValueError(f"{where}: atomic must be True or False")
    if backoff_jitter is not None and not isinstance(backoff_jitter, bool):
        raise ValueError(f"{where}: backoff_jitter must be True, False or None")
    if dead_letter_blocks_group is not None and not isinstance(dead_letter_blocks_group, bool):
        raise ValueError(f"{where}: dead_letter_blocks_group must be True, False or None")
    # InvalidSchedule is a ValueError that names the field and says how to fix it.
    scheduled = None if schedule is None else from_handler(topic, schedule, where)
    return _handlers.decorator(
        where,
        functools.partial(
            HandlerSpec,
            topic=topic,
            max_attempts=max_attempts,
            timeout=timeout_seconds,
            atomic=atomic,
            backoff_base=base_seconds,
            backoff_cap=cap_seconds,
            backoff_jitter=backoff_jitter,
            dead_letter_blocks_group=dead_letter_blocks_group,
            schedule=scheduled,
        ),
    )


def autodiscover() -> None:
    autodiscover_modules("handlers")


def call(spec: Spec, argument: object, role: str = "handler") -> object:
    """Run ``spec``'s function on ``argument`` (a message, an event) in this
    thread; ``role`` names it in the error about a function that did not run."""
    if spec.is_async:
        # async_to_sync runs the coroutine on an event loop while this thread
        # serves its sync_to_async calls, so ORM work lands in this thread's
        # connection, inside the caller's transaction.
        return async_to_sync(spec.func)(argument)
    result = spec.func(argument)
    if result is not None and (inspect.iscoroutine(result) or inspect.isgenerator(result)):
        # Its body never ran: a success would lose the message's (event's) work.
        result.close()  # no "never awaited" warning later
        raise TypeError(
            f"the {role} returned a {type(result).__name__} instead of running: "
            "declare it with async def, or make it a plain function"
        )
    return result


def location_of(func: Callable[..., object]) -> str:
    """Where ``func`` is defined: ``module.qualname (file:line)``, for the
    error about two functions under one name."""
    func = inspect.unwrap(func)
    line: int | str
    try:
        line = inspect.getsourcelines(func)[1]
    except (OSError, TypeError):
        line = "?"
    filename = inspect.getsourcefile(func) or getattr(func, "__module__", "?")
    return f"{func.__module__}.{func.__qualname__} ({filename}:{line})"


def seconds_option(where: str, option: str, value: object) -> float | None:
    """A decorator's option in seconds (a number or a timedelta), as a float;
    ``where`` names the decorator in the error."""
    if value is None:
        return None
    if isinstance(value, datetime.timedelta):
        value = value.total_seconds()
    if not isinstance(value, int | float) or isinstance(value, bool) or not 0 < value < 1e9:
        raise ValueError(f"{where}: {option} must be a positive number of seconds")
    return float(value)
