"""Run-time control of the queues: pause and resume them, change their
limits. The only writer of ``QueueState``.

The state lives in the database, so it outlives workers and deploys and is
the same for every worker on every host. Each change is one transaction
that also sends a NOTIFY on the control channel (delivered at its commit):
every listening worker reads the state again within a second, and every
worker does on its poll interval anyway (the fallback; poll-only mode relies
on it). A paused queue is not claimed from; its running messages finish,
and enqueueing into it goes on as usual.

Limits (concurrency, rate) come from ``PGQUEUE["QUEUES"]`` unless set here
(``set_limits``), until ``clear_limits`` gives the settings back.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

from django.db import connections, transaction
from django.db.models.functions import Now

from django_pgqueue import conf
from django_pgqueue.exceptions import QueueControlError
from django_pgqueue.models import QueueState
from django_pgqueue.sql import wakeups as wakeups_sql

logger = logging.getLogger(__name__)

# The control channel's payload when queues' state changed.
QUEUES_CHANGED = "queues"


@dataclass(frozen=True)
class Controls:
    """What the workers need of the queues' state: the paused queues and
    the limits that hold (the run-time ones over the settings'), for the
    queues that have any."""

    paused: frozenset[str] = frozenset()
    limits: dict[str, conf.Limits] = field(default_factory=dict)


def pause_queue(name: str, *, by: str = "") -> bool:
    """Pause the queue ``name``: no worker claims from it (within a second).
    Running messages finish; enqueueing goes on. Returns whether it was
    running (False: it was paused already)."""
    return _set_paused(name, True, by)


def resume_queue(name: str, *, by: str = "") -> bool:
    """Resume the queue ``name``. Returns whether it was paused."""
    return _set_paused(name, False, by)


def paused_queues() -> list[str]:
    """The names of the paused queues, sorted."""
    rows = QueueState.objects.using(conf.database_alias()).filter(paused=True)
    return sorted(rows.values_list("name", flat=True))


def set_limits(
    name: str, *, concurrency: int | None = None, rate: str | None = None, by: str = ""
) -> None:
    """Give the queue ``name`` these limits at run time, over those of the
    settings: at most ``concurrency`` of its messages processing at once,
    at most ``rate`` ("100/m") started per period, all workers together;
    None: no limit of that kind. Held until ``clear_limits``."""
    if concurrency is not None:
        problem = conf.concurrency_problem(concurrency)
        if problem:
            raise QueueControlError(f"concurrency {problem}, not {concurrency!r}")
    if rate is not None:
        problem = conf.rate_problem(rate)
        if problem:
            raise QueueControlError(f"rate {problem}, not {rate!r}")
    _change(
        name,
        by,
        limits_set=True,
        concurrency=concurrency,
        rate=rate or "",
    )
    logger.info(
        "Queue %s: limits set to concurrency=%s rate=%s by %s",
        name,
        concurrency,
        rate,
        by or "?",
        extra={"queue": name, "state": "limits_set"},
    )


def clear_limits(name: str, *, by: str = "") -> None:
    """The queue ``name`` takes its limits from the settings again."""
    _change(name, by, limits_set=False, concurrency=None, rate="")
    logger.info("Queue %s: limits from the settings again", name, extra={"queue": name})


def states(names: Iterable[str] | None = None) -> dict[str, QueueState]:
    """{name: QueueState} of the queues with a row (only ``names`` when given)."""
    rows = QueueState.objects.using(conf.database_alias())
    if names is not None:
        rows = rows.filter(name__in=list(names))
    return {row.name: row for row in rows}


def current(names: Iterable[str] | None = None) -> Controls:
    """The paused queues and the limits that hold now, of ``names`` (all
    queues when None), in one query."""
    wanted = None if names is None else set(names)
    limits = {
        name: value
        for name, value in conf.queue_limits().items()
        if wanted is None or name in wanted
    }
    paused = set()
    for row in states(wanted).values():
        if row.paused:
            paused.add(row.name)
        if row.limits_set:
            limits[row.name] = limits_of(row)
    return Controls(frozenset(paused), {name: value for name, value in limits.items() if value})


def limits_of(row: QueueState) -> conf.Limits:
    """The limits a row sets (when ``limits_set``)."""
    return conf.Limits(row.concurrency, conf.parse_rate(row.rate) if row.rate else None)


def limits_for(name: str, row: QueueState | None = None) -> conf.Limits:
    """The limits that hold for the queue ``name`` (``row``: its QueueState,
    if it has one)."""
    if row is not None and row.limits_set:
        return limits_of(row)
    return conf.queue_limits().get(name, conf.NO_LIMITS)


# --- the writes -----------------------------------------------------------------------


def _checked(name: str) -> str:
    problem = conf.name_problem("queue name", name, conf.QUEUE_MAX_LENGTH)
    if problem:
        raise QueueControlError(problem)
    return name


def _set_paused(name: str, paused: bool, by: str) -> bool:
    changed = _change(
        name,
        by,
        only_if_changed=("paused", paused),
        paused=paused,
        paused_at=Now() if paused else None,
    )
    if changed:
        logger.info(
            "Queue %s %s by %s",
            name,
            "paused" if paused else "resumed",
            by or "?",
            extra={"queue": name, "state": "paused" if paused else "resumed"},
        )
    return changed


def _change(
    name: str,
    by: str,
    only_if_changed: tuple[str, object] | None = None,
    **values: object,
) -> bool:
    """Write ``values`` to the queue's row (made if missing) and tell the
    workers, in one transaction; with ``only_if_changed`` (a field and its
    new value), nothing happens when the row already holds it. Returns
    whether it wrote."""
    _checked(name)
    using = conf.database_alias()
    with transaction.atomic(using=using):
        # The row locked, made first if missing (two callers at once: one
        # inserts, the other waits for it and then finds it).
        QueueState.objects.using(using).bulk_create([QueueState(name=name)], ignore_conflicts=True)
        row = QueueState.objects.using(using).select_for_update().get(name=name)
        if only_if_changed is not None and getattr(row, only_if_changed[0]) == only_if_changed[1]:
            return False
        QueueState.objects.using(using).filter(name=name).update(
            **values, changed_by=by[:150], updated_at=Now()
        )
        notify_workers([QUEUES_CHANGED], using)
    return True


def notify_workers(payloads: list[str], using: str) -> None:
    """NOTIFY the control channel with ``payloads``, in the caller's
    transaction (delivered at its commit); nothing in poll-only mode, where
    no worker listens."""
    if payloads and conf.get("NOTIFY"):
        with connections[using].cursor() as cursor:
            cursor.execute(wakeups_sql.CONTROL_NOTIFY_SQL, [payloads])
