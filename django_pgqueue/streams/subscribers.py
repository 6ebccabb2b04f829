"""Subscribers: ``@subscriber(stream, name=...)`` and the lookup by
subscription name.

Subscribers live in a ``subscribers`` module of any installed app (or in its
``handlers`` module); the app's ``ready()`` imports them all
(``autodiscover``), as it does for handlers. A second subscriber under one
name stops start-up with both locations named.
"""

from __future__ import annotations

import datetime
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from django.utils.module_loading import autodiscover_modules

from django_pgqueue import conf
from django_pgqueue.conf.defaults import STREAM_BATCH_SIZE_MAX
from django_pgqueue.exceptions import DuplicateSubscriber
from django_pgqueue.models.streams import STREAM_NAME_MAX_LENGTH, SUBSCRIPTION_NAME_MAX_LENGTH
from django_pgqueue.registry import F, Specs, seconds_option

BLOCK, DEAD_LETTER = "block", "dead_letter"
ON_FAILURE = (BLOCK, DEAD_LETTER)
BEGINNING, END = "beginning", "end"
STARTS = (BEGINNING, END)

# batch_size: events per delivery transaction (None: PGQUEUE["STREAM_BATCH_SIZE"]).
BATCH_SIZE_MAX = STREAM_BATCH_SIZE_MAX


@dataclass(frozen=True)
class SubscriberSpec:
    name: str
    stream: str
    func: Callable[[Any], Any]
    max_attempts: int | None
    backoff_base: float | None
    backoff_cap: float | None
    backoff_jitter: bool | None
    on_failure: str
    start: str
    batch_size: int | None  # None: PGQUEUE["STREAM_BATCH_SIZE"]
    is_async: bool
    location: str


_subscribers: Specs[SubscriberSpec] = Specs("name", DuplicateSubscriber, "two subscribers named")
register, unregister, lookup = _subscribers.register, _subscribers.unregister, _subscribers.lookup


def subscriber(
    stream: str,
    *,
    name: str,
    max_attempts: int | None = None,
    backoff_base: float | datetime.timedelta | None = None,
    backoff_cap: float | datetime.timedelta | None = None,
    backoff_jitter: bool | None = None,
    on_failure: str = BLOCK,
    start: str = BEGINNING,
    batch_size: int | None = None,
) -> Callable[[F], F]:
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
    per transaction (default PGQUEUE["STREAM_BATCH_SIZE"]). ``async def`` functions are accepted.
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
    base_seconds = seconds_option(where, "backoff_base", backoff_base)
    cap_seconds = seconds_option(where, "backoff_cap", backoff_cap)
    if backoff_jitter is not None and not isinstance(backoff_jitter, bool):
        raise ValueError(f"{where}: backoff_jitter must be True, False or None")
    if on_failure not in ON_FAILURE:
        raise ValueError(
            f"{where}: on_failure must be 'block' or 'dead_letter', not {on_failure!r}"
        )
    if start not in STARTS:
        raise ValueError(f"{where}: start must be 'beginning' or 'end', not {start!r}")
    good_size = conf.is_int(batch_size) and 1 <= batch_size <= BATCH_SIZE_MAX
    if batch_size is not None and not good_size:
        raise ValueError(
            f"{where}: batch_size must be a whole number from 1 to {BATCH_SIZE_MAX:,}, or None"
        )
    return _subscribers.decorator(
        where,
        functools.partial(
            SubscriberSpec,
            name=name,
            stream=stream,
            max_attempts=max_attempts,
            backoff_base=base_seconds,
            backoff_cap=cap_seconds,
            backoff_jitter=backoff_jitter,
            on_failure=on_failure,
            start=start,
            batch_size=batch_size,
        ),
    )


def registered() -> list[SubscriberSpec]:
    """Every SubscriberSpec, by name."""
    return _subscribers.all()


def select(names: str | Sequence[str] | None) -> list[SubscriberSpec]:
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
    unknown = [name for name in names if lookup(name) is None]
    if unknown:
        known = ", ".join(spec.name for spec in registered()) or "none is registered"
        raise ValueError(
            f"unknown subscription(s) {', '.join(map(repr, unknown))} (registered: {known})"
        )
    return [spec for name in dict.fromkeys(names) if (spec := lookup(name)) is not None]


def subscriptions_on(specs: Sequence[SubscriberSpec], alias: str) -> list[SubscriberSpec]:
    """Those of ``specs`` whose stream is on the database ``alias``
    (``conf.stream_database``): what a worker's engine on ``alias`` serves."""
    return [spec for spec in specs if conf.stream_database(spec.stream) == alias]


def autodiscover() -> None:
    autodiscover_modules("subscribers")
