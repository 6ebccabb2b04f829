"""A scheduler round, and "run now".

``run_round`` is what every worker's scheduler does whenever a tick may be
due: in one transaction on the queue's database it locks the state rows of
the schedules (SKIP LOCKED: a schedule another scheduler is working on is
left to it), reads the database's clock and each schedule's cursor, and for
each schedule records its due ticks in the ledger and enqueues a message for
each tick it recorded. The ledger's unique (schedule, tick) is what makes a
tick one message; the lock only saves the others the work. A crash at any
point rolls the tick and its message back together, and the next round (of
any worker) enqueues the tick again.

A tick's message has ``run_at`` = the tick and the headers
``pgqueue-schedule`` (the schedule's name) and ``pgqueue-scheduled-at`` (the
tick, ISO 8601 with the offset of the schedule's time zone). A ``task``
schedule enqueues its Django Task through ``PgQueueBackend``, so that a
result exists; a ``topic`` schedule enqueues a message with its payload.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.db import DatabaseError, connections, transaction
from django.utils.module_loading import import_string

from django_pgqueue import conf, enqueuing
from django_pgqueue.models import Message
from django_pgqueue.schedules import state, ticks
from django_pgqueue.schedules.spec import ScheduleSpec
from django_pgqueue.sql import timeouts as timeouts_sql

logger = logging.getLogger(__name__)

SCHEDULE_HEADER = "pgqueue-schedule"
SCHEDULED_AT_HEADER = "pgqueue-scheduled-at"
RUN_NOW_HEADER = "pgqueue-run-now"  # True on a message of "run now", outside the ticks


@dataclass(frozen=True)
class RoundResult:
    """What one round did, by schedule name."""

    now: datetime.datetime  # the database's clock
    enqueued: dict[str, int] = field(default_factory=dict)
    skipped: dict[str, int] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)  # name: why its ticks wait
    busy: tuple[str, ...] = ()  # locked by another scheduler: left to it
    more: bool = False  # a backfill goes on: run the next round at once
    next_tick: datetime.datetime | None = None  # the first tick of any schedule after now


def headers(spec: ScheduleSpec, tick: datetime.datetime) -> dict[str, Any]:
    """The headers of the message of ``spec``'s ``tick``."""
    return {
        SCHEDULE_HEADER: spec.name,
        SCHEDULED_AT_HEADER: tick.astimezone(spec.zone).isoformat(),
    }


def run_round(
    specs: Sequence[ScheduleSpec],
    now: datetime.datetime | None = None,
    limit: int = ticks.ROUND_LIMIT,
) -> RoundResult:
    """Enqueue every due tick of ``specs`` once; see the module's docstring.
    ``now`` defaults to the database's clock (tests pass a fabricated one)."""
    using = conf.database_alias()
    by_name = {spec.name: spec for spec in specs}
    state.ensure(by_name)
    enqueued: dict[str, int] = {}
    skipped: dict[str, tuple[int, bool]] = {}
    failed: dict[str, str] = {}
    more = False
    own_transaction = not connections[using].in_atomic_block
    with timeouts_sql.worker_transaction(using):
        locked = state.lock(list(by_name), idle_limit=own_transaction)
        clock, last = state.clock_and_last_ticks([row.name for row in locked])
        now = now or clock
        for row in locked:
            spec = by_name[row.name]
            cursor = _later(last.get(row.name), row.skipped_through)
            if not (spec.enabled if row.enabled is None else row.enabled):
                _skip_paused(spec, cursor, now)
                continue
            due = ticks.due(spec, cursor, now, limit)
            more = more or due.more
            try:
                with transaction.atomic(using=using):  # one schedule's failure spares the rest
                    enqueued[spec.name] = _enqueue_due(spec, due)
            except DatabaseError:
                raise  # the round is lost; the scheduler reconnects and tries again
            except Exception as exc:  # a task that cannot be imported or enqueued...
                failed[spec.name] = f"{type(exc).__name__}: {exc}"
                logger.error(
                    "Schedule %r: its ticks could not be enqueued", spec.name, exc_info=True
                )
                continue
            if due.skipped:
                skipped[spec.name] = (due.skipped, due.counted_all)
    # Logged once committed: the ticks were enqueued (skipped) for good.
    for name, count in enqueued.items():
        if count:
            logger.debug("Schedule %r: %s tick(s) enqueued", name, count)
    for name, (count, counted_all) in skipped.items():
        logger.warning(
            "Schedule %r: skipped %s%s missed tick(s), more than %gs late (backfill: %gs)",
            name,
            "" if counted_all else "at least ",
            count,
            ticks.window(by_name[name]).total_seconds(),
            by_name[name].backfill.total_seconds(),
        )
    upcoming = [tick for spec in specs if (tick := ticks.next_tick(spec, now)) is not None]
    return RoundResult(
        now=now,
        enqueued={name: count for name, count in enqueued.items() if count},
        skipped={name: count for name, (count, _) in skipped.items()},
        failed=failed,
        busy=tuple(sorted(set(by_name) - {row.name for row in locked})),
        more=more,
        next_tick=min(upcoming, default=None),
    )


def run_now(spec: ScheduleSpec, by: str = "") -> Message:
    """Enqueue one message of ``spec`` now, outside its ticks (whether or not
    it is paused): ``pgqueue_schedules run NAME``, the admin's "run now".
    Returns the message (for a task: the task's message)."""
    using = conf.database_alias()
    with transaction.atomic(using=using):
        clock, _ = state.clock_and_last_ticks([])
        message = _enqueue(spec, clock, run_at=None, extra={RUN_NOW_HEADER: True})
    logger.info(
        "Schedule %r run now%s: message id=%s", spec.name, f" by {by}" if by else "", message.pk
    )
    return message


def _later(a: datetime.datetime | None, b: datetime.datetime | None) -> datetime.datetime | None:
    return max((x for x in (a, b) if x is not None), default=None)


def _skip_paused(
    spec: ScheduleSpec, cursor: datetime.datetime | None, now: datetime.datetime
) -> None:
    """A paused schedule's ticks are never run, even after it is resumed: its
    cursor moves to ``now`` whenever a tick fell due (a write per tick, no
    more than running it would cost; none while no tick falls due)."""
    upcoming = None if cursor is None else ticks.next_tick(spec, cursor)
    if cursor is None or (upcoming is not None and upcoming <= now):
        state.skip(spec.name, now, 0)


def _enqueue_due(spec: ScheduleSpec, due: ticks.Due) -> int:
    """Skip what ``due`` says is missed; record its ticks and enqueue a message
    for each one recorded here. Returns how many were enqueued."""
    if due.skipped_through is not None:
        state.skip(spec.name, due.skipped_through, due.skipped)
    recorded = state.record_ticks(spec.name, due.ticks)
    if recorded:
        state.set_messages(
            [(pk, _enqueue(spec, tick, run_at=tick, extra=None).pk) for pk, tick in recorded]
        )
    return len(recorded)


def _enqueue(
    spec: ScheduleSpec,
    tick: datetime.datetime,
    run_at: datetime.datetime | None,
    extra: dict[str, Any] | None,
) -> Message:
    """The message of ``spec`` for ``tick``, in the open transaction."""
    message_headers = {**headers(spec, tick), **(extra or {})}
    if spec.task is not None:
        return _enqueue_task(spec, run_at, message_headers)
    assert spec.topic is not None
    return enqueuing.enqueue(
        spec.topic,
        spec.payload,
        run_at=run_at,
        priority=0 if spec.priority is None else spec.priority,
        queue=spec.queue,
        headers=message_headers,
        using=conf.database_alias(),
    )


def _enqueue_task(
    spec: ScheduleSpec, run_at: datetime.datetime | None, message_headers: dict[str, Any]
) -> Message:
    """Enqueue the Django Task of ``spec`` through PgQueueBackend (Django 6+:
    the checks refuse a task schedule elsewhere), so that a result exists."""
    from django_pgqueue.tasks.backend import PgQueueBackend

    task = import_string(spec.task or "")
    options: dict[str, Any] = {"run_after": run_at}
    if spec.queue is not None:
        options["queue_name"] = spec.queue
    if spec.priority is not None:
        options["priority"] = spec.priority
    task = task.using(**options)
    backend = task.get_backend()
    if not isinstance(backend, PgQueueBackend):
        raise ImproperlyConfigured(
            f"the task {spec.task} uses the Tasks backend {task.backend!r}, which is not "
            "django_pgqueue.tasks.PgQueueBackend"
        )
    _, message = backend.enqueue_with_headers(
        task, list(spec.args), dict(spec.kwargs), message_headers
    )
    return message
