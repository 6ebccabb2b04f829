"""Subscribers: ``@subscriber(stream, name=...)`` and the lookup by
subscription name.

Subscribers live in a ``subscribers`` module of any installed app (or in its
``handlers`` module); the app's ``ready()`` imports them all
(``autodiscover``), as it does for handlers. A second subscriber under one
name stops start-up with both locations named.
"""

import inspect
from dataclasses import dataclass

from django.utils.module_loading import autodiscover_modules

from django_pgqueue import conf
from django_pgqueue.exceptions import DuplicateSubscriber
from django_pgqueue.models.streams import STREAM_NAME_MAX_LENGTH, SUBSCRIPTION_NAME_MAX_LENGTH
from django_pgqueue.registry import _location, _seconds

BLOCK, DEAD_LETTER = "block", "dead_letter"
ON_FAILURE = (BLOCK, DEAD_LETTER)
BEGINNING, END = "beginning", "end"
STARTS = (BEGINNING, END)

# Events per delivery transaction, each in a savepoint of its own. Past 64
# savepoints that write in one transaction PostgreSQL's snapshots overflow
# to pg_subtrans, which slows every session.
BATCH_SIZE = 50
BATCH_SIZE_MAX = 60

_subscribers = {}


@dataclass(frozen=True)
class SubscriberSpec:
    name: str
    stream: str
    func: object
    max_attempts: int | None
    backoff_base: float | None
    backoff_cap: float | None
    backoff_jitter: bool | None
    on_failure: str
    start: str
    batch_size: int
    is_async: bool
    location: str


def subscriber(
    stream,
    *,
    name,
    max_attempts=None,
    backoff_base=None,
    backoff_cap=None,
    backoff_jitter=None,
    on_failure=BLOCK,
    start=BEGINNING,
    batch_size=BATCH_SIZE,
):
    """Register the decorated function as the subscription ``name`` of ``stream``.

    The function is called with each event (a ``subscriptions.Event``) in
    order, in a transaction on the queue's database that also moves the
    subscription's checkpoint past it: its database writes and the move
    commit together or not at all.

    A failing event is tried again with backoff (``max_attempts`` and the
    backoff options override the PGQUEUE settings of the same name), then,
    ``on_failure="block"`` (default), the subscription stops at it until an
    operator acts, or ``on_failure="dead_letter"``, the event goes to the
    dead letters and the subscription moves on. ``start``: where a new
    subscription begins, at the oldest stored event (``"beginning"``) or
    after the events published so far (``"end"``). ``batch_size``: events
    per transaction. ``async def`` functions are accepted.
    """
    where = f"@subscriber({stream!r}, name={name!r})"
    problem = conf.name_problem("stream", stream, STREAM_NAME_MAX_LENGTH)
    if problem:
        raise ValueError(f"@subscriber: {problem}")
    problem = conf.name_problem("subscription name", name, SUBSCRIPTION_NAME_MAX_LENGTH)
    if problem:
        raise ValueError(f"@subscriber({stream!r}): {problem}")
    if max_attempts is not None and not (conf.is_int(max_attempts) and max_attempts >= 1):
        raise ValueError(f"{where}: max_attempts must be at least 1")
    backoff_base = _seconds(where, "backoff_base", backoff_base)
    backoff_cap = _seconds(where, "backoff_cap", backoff_cap)
    if backoff_jitter is not None and not isinstance(backoff_jitter, bool):
        raise ValueError(f"{where}: backoff_jitter must be True, False or None")
    if on_failure not in ON_FAILURE:
        raise ValueError(
            f"{where}: on_failure must be 'block' or 'dead_letter', not {on_failure!r}"
        )
    if start not in STARTS:
        raise ValueError(f"{where}: start must be 'beginning' or 'end', not {start!r}")
    if not (conf.is_int(batch_size) and 1 <= batch_size <= BATCH_SIZE_MAX):
        raise ValueError(f"{where}: batch_size must be a whole number from 1 to {BATCH_SIZE_MAX}")

    def decorate(func):
        if not callable(func):
            raise TypeError(f"{where} decorates a callable, not {func!r}")
        register(
            SubscriberSpec(
                name=name,
                stream=stream,
                func=func,
                max_attempts=max_attempts,
                backoff_base=backoff_base,
                backoff_cap=backoff_cap,
                backoff_jitter=backoff_jitter,
                on_failure=on_failure,
                start=start,
                batch_size=batch_size,
                is_async=inspect.iscoroutinefunction(func),
                location=_location(func),
            )
        )
        return func

    return decorate


def register(spec):
    existing = _subscribers.get(spec.name)
    if existing is not None and existing.location != spec.location:
        raise DuplicateSubscriber(
            f"two subscribers named {spec.name!r}: {existing.location} and {spec.location}"
        )
    _subscribers[spec.name] = spec


def unregister(name):
    """Forget the subscriber ``name`` (for tests and reloading)."""
    _subscribers.pop(name, None)


def lookup(name):
    """The SubscriberSpec named ``name``, or None."""
    return _subscribers.get(name)


def registered():
    """Every SubscriberSpec, by name."""
    return [_subscribers[name] for name in sorted(_subscribers)]


def select(names):
    """The SubscriberSpecs a worker serves: ``"all"``, ``"none"``, or a list
    (or comma-separated string) of names. An unknown name is a ValueError
    that lists the registered ones."""
    if names == "all":
        return registered()
    if names == "none" or names is None:
        return []
    if isinstance(names, str):
        names = [part.strip() for part in names.split(",") if part.strip()]
    if not names:
        raise ValueError("give 'all', 'none' or at least one subscription name")
    unknown = [name for name in names if name not in _subscribers]
    if unknown:
        known = ", ".join(sorted(_subscribers)) or "none is registered"
        raise ValueError(
            f"unknown subscription(s) {', '.join(map(repr, unknown))} (registered: {known})"
        )
    return [_subscribers[name] for name in dict.fromkeys(names)]


def autodiscover():
    autodiscover_modules("subscribers")
