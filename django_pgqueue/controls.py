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
(``set_limits``), until ``clear_limits`` gives the settings back. So do
the limits of each partition of a queue (its ``"partition"`` entry), unless
a named partition has its own (``set_partition_limits``, a
``PartitionLimit`` row), until ``clear_partition_limits``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from django.db import connections, transaction
from django.db.models.functions import Now

from django_pgqueue import conf
from django_pgqueue.exceptions import InvalidMessage, QueueControlError
from django_pgqueue.models import PartitionLimit, QueueState
from django_pgqueue.sql import wakeups as wakeups_sql
from django_pgqueue.validation import check_key

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
    paused = []
    for alias in conf.databases():  # each queue's row is on its own database
        rows = QueueState.objects.using(alias).filter(paused=True)
        paused += [
            n for n in rows.values_list("name", flat=True) if conf.queue_database(n) == alias
        ]
    return sorted(paused)


def set_limits(
    name: str, *, concurrency: int | None = None, rate: str | None = None, by: str = ""
) -> None:
    """Give the queue ``name`` these limits at run time, over those of the
    settings: at most ``concurrency`` of its messages processing at once,
    at most ``rate`` ("100/m") started per period, all workers together;
    None: no limit of that kind. Held until ``clear_limits``."""
    _checked_limits(concurrency, rate)
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


def set_partition_limits(
    queue: str,
    partition_key: str | None,
    *,
    concurrency: int | None = None,
    rate: str | None = None,
    by: str = "",
) -> None:
    """Give one partition of the queue ``queue`` these limits, in place of
    those its ``"partition"`` settings give every partition (a paying
    tenant's higher rate): at most ``concurrency`` of the partition's
    messages processing at once, at most ``rate`` ("100/m") started per
    period, all workers together; None: no limit of that kind.
    ``partition_key`` is the messages' ``partition_key``; None or "": the
    default partition (the messages without one). Held until
    ``clear_partition_limits``. Bad input raises ``QueueControlError``
    before anything is written."""
    _checked(queue)
    key = _checked_partition(partition_key)
    _checked_limits(concurrency, rate)
    using = conf.queue_database(queue)
    with transaction.atomic(using=using):
        rows = PartitionLimit.objects.using(using)
        # Made first if missing (two callers at once: one inserts, the
        # other's INSERT waits for its commit, then its UPDATE writes over it).
        rows.bulk_create([PartitionLimit(queue=queue, partition_key=key)], ignore_conflicts=True)
        # updated_at changes on every write: the workers' poll compares it.
        rows.filter(queue=queue, partition_key=key).update(
            concurrency=concurrency, rate=rate or "", changed_by=by[:150], updated_at=Now()
        )
        notify_workers([QUEUES_CHANGED], using)
    logger.info(
        "Queue %s: limits of %s set to concurrency=%s rate=%s by %s",
        queue,
        partition_name(key),
        concurrency,
        rate,
        by or "?",
        extra={"queue": queue, "partition_key": key, "state": "partition_limits_set"},
    )


def clear_partition_limits(queue: str, partition_key: str | None, *, by: str = "") -> bool:
    """The partition ``partition_key`` of the queue ``queue`` (None or "":
    the default partition) takes the limits of the queue's ``"partition"``
    settings again. Returns whether it had limits of its own."""
    _checked(queue)
    key = _checked_partition(partition_key)
    using = conf.queue_database(queue)
    with transaction.atomic(using=using):
        deleted, _ = (
            PartitionLimit.objects.using(using).filter(queue=queue, partition_key=key).delete()
        )
        if deleted:
            notify_workers([QUEUES_CHANGED], using)
    if deleted:
        logger.info(
            "Queue %s: limits of %s from the settings again, by %s",
            queue,
            partition_name(key),
            by or "?",
            extra={"queue": queue, "partition_key": key, "state": "partition_limits_cleared"},
        )
    return bool(deleted)


def partition_limits(queue: str | None = None) -> list[PartitionLimit]:
    """The partitions with limits of their own (of ``queue`` only, when
    given), by queue and partition key (the default partition, "", first)."""
    rows = PartitionLimit.objects.using(conf.database_alias())
    if queue is not None:
        rows = rows.filter(queue=queue)
    return list(rows.order_by("queue", "partition_key"))


def partition_limits_of(row: PartitionLimit) -> conf.Limits:
    """The limits a ``PartitionLimit`` row gives its partition."""
    return conf.Limits(row.concurrency, conf.parse_rate(row.rate) if row.rate else None)


def partition_limits_for(queue: str, row: PartitionLimit | None = None) -> conf.Limits:
    """The limits that hold for a partition of the queue ``queue``: its own
    (``row``, if it has one), else those of the queue's ``"partition"``
    settings."""
    if row is not None:
        return partition_limits_of(row)
    return conf.queue_limits().get(queue, conf.NO_LIMITS).partition or conf.NO_LIMITS


def partition_name(partition_key: str) -> str:
    """How a partition is named to people: "partition tenant:42", or "the
    default partition" for ""."""
    return f"partition {partition_key}" if partition_key else "the default partition"


def states(names: Iterable[str] | None = None) -> dict[str, QueueState]:
    """{name: QueueState} of the queues with a row (only ``names`` when given)."""
    rows = QueueState.objects.using(conf.database_alias())
    if names is not None:
        rows = rows.filter(name__in=list(names))
    return {row.name: row for row in rows}


def current(names: Iterable[str] | None = None) -> Controls:
    """The paused queues and the limits that hold now, of ``names`` (all
    queues when None), in two queries (the queues' state, and which have
    limits for named partitions)."""
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
            limits[row.name] = limits_of(row, limits.get(row.name))
    named = PartitionLimit.objects.using(conf.database_alias())
    if wanted is not None:
        named = named.filter(queue__in=list(wanted))
    for name in named.values_list("queue", flat=True).distinct():
        limits[name] = replace(limits.get(name, conf.NO_LIMITS), named_partitions=True)
    return Controls(frozenset(paused), {name: value for name, value in limits.items() if value})


def limits_of(row: QueueState, configured: conf.Limits | None = None) -> conf.Limits:
    """The limits a row sets (when ``limits_set``), over the queue's
    ``configured`` ones: it sets the queue's own, not its partitions'."""
    return conf.Limits(
        row.concurrency,
        conf.parse_rate(row.rate) if row.rate else None,
        partition=None if configured is None else configured.partition,
    )


def limits_for(name: str, row: QueueState | None = None) -> conf.Limits:
    """The limits that hold for the queue ``name`` (``row``: its QueueState,
    if it has one)."""
    configured = conf.queue_limits().get(name, conf.NO_LIMITS)
    if row is not None and row.limits_set:
        return limits_of(row, configured)
    return configured


# --- the writes -----------------------------------------------------------------------


def _checked(name: str) -> str:
    problem = conf.name_problem("queue name", name, conf.QUEUE_MAX_LENGTH)
    if problem:
        raise QueueControlError(problem)
    return name


def _checked_partition(partition_key: str | None) -> str:
    """``partition_key`` as stored: checked as a message's is; "" for the
    default partition (None or "")."""
    if partition_key is None or partition_key == "":
        return ""
    try:
        check_key("partition_key", partition_key)
    except InvalidMessage as exc:
        raise QueueControlError(str(exc)) from None
    problem = conf.text_problem(partition_key)  # PostgreSQL's text: no NUL
    if problem:
        raise QueueControlError(f"partition_key {problem}")
    return partition_key


def _checked_limits(concurrency: int | None, rate: str | None) -> None:
    if concurrency is not None:
        problem = conf.concurrency_problem(concurrency)
        if problem:
            raise QueueControlError(f"concurrency {problem}, not {concurrency!r}")
    if rate is not None:
        problem = conf.rate_problem(rate)
        if problem:
            raise QueueControlError(f"rate {problem}, not {rate!r}")


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
    using = conf.queue_database(name)
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
