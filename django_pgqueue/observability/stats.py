"""Read-only aggregates over the queue tables, one query each.

They run on the database the code works on (``conf.database_alias()``:
``PGQUEUE["DATABASE"]``, or the one an enclosing ``conf.on_database`` names,
as the commands, metrics, health check and admin do for each database of
the queues), write nothing and take no locks, so the admin summary, the
status command, the metrics and the health check may call them as often as
they like. Each returns
values in a stable order: plain tuples and dicts, or (``workers``,
``subscriptions_with_lag``) rows with the annotations they are read for.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from django.db import connections
from django.db.models import BooleanField, Case, Count, ExpressionWrapper, Min, Q, Value, When
from django.db.models.functions import Now
from django.utils import timezone

from django_pgqueue import conf
from django_pgqueue.models import (
    UNFINISHED,
    DeadLetter,
    Message,
    Status,
    Subscription,
    WorkerHeartbeat,
    Workflow,
    WorkflowStatus,
)
from django_pgqueue.streams import subscribers
from django_pgqueue.streams.subscribers import SubscriberSpec


def dead_letters_by_topic_and_category(state: str | None = None) -> list[tuple[str, str, int]]:
    """``[(topic, category, count), ...]`` of the dead letters, by topic then
    category; only those in ``state`` (a DeadLetterState) when given."""
    rows = DeadLetter.objects.using(conf.database_alias())
    if state is not None:
        rows = rows.filter(state=state)
    return [
        (row["topic"], row["category"], row["count"])
        for row in rows.values("topic", "category")
        .annotate(count=Count("id"))
        .order_by("topic", "category")
    ]


def queue_depth_by_status() -> list[tuple[str, str, int]]:
    """``[(queue, status, count), ...]`` of the messages in the queue table
    (waiting, delayed or not, and processing), by queue then status."""
    return [
        (row["queue"], row["status"], row["count"])
        for row in Message.objects.using(conf.database_alias())
        .values("queue", "status")
        .annotate(count=Count("id"))
        .order_by("queue", "status")
    ]


def oldest_ready_age(now: datetime.datetime | None = None) -> dict[str, float]:
    """``{queue: seconds}``: for each queue with a ready message (waiting,
    ``run_at <= now``), how long the one ready longest has been ready, that is
    ``now - run_at``: the wait a worker has not yet picked up. A queue with no
    ready message is absent. (A delayed message counts from its ``run_at``,
    not its creation: waiting for its time is not lag.)"""
    now = now or timezone.now()
    rows = (
        Message.objects.using(conf.database_alias())
        .filter(status=Status.WAITING, run_at__lte=now)
        .values("queue")
        .annotate(oldest=Min("run_at"))
        .order_by("queue")
    )
    return {row["queue"]: (now - row["oldest"]).total_seconds() for row in rows}


# What a message in the queue table is doing, for metrics and status: the
# waiting status split by whether its time has come; blocked (behind an
# earlier message of its group) and processing as they are.
READY, DELAYED, BLOCKED, PROCESSING = "ready", "delayed", "blocked", "processing"


def messages_by_queue_topic_state(
    now: datetime.datetime | None = None,
) -> list[tuple[str, str, str, int]]:
    """``[(queue, topic, state, count), ...]`` of the queue table, with state
    one of ready (waiting, due), delayed (waiting for its run_at: a delay or a
    retry's backoff), blocked (behind an earlier message of its group) and
    processing (leased), sorted."""
    now = now or timezone.now()
    state = Case(
        When(status=Status.PROCESSING, then=Value(PROCESSING)),
        When(status=Status.BLOCKED, then=Value(BLOCKED)),
        When(run_at__lte=now, then=Value(READY)),
        default=Value(DELAYED),
    )
    rows = (
        Message.objects.using(conf.database_alias())
        .filter(status__in=UNFINISHED)  # not the cancelled rows kept for the record
        .annotate(state=state)
        .values("queue", "topic", "state")
        .annotate(count=Count("id"))
        .order_by("queue", "topic", "state")
    )
    return [(row["queue"], row["topic"], row["state"], row["count"]) for row in rows]


# The partitions shown per queue, busiest first (no metric has a label
# per partition: their number has no bound).
TOP_PARTITIONS = 5

PARTITIONS_SQL = """
WITH counts AS (
    SELECT queue, partition_key,
        count(*) FILTER (WHERE status = 'waiting' AND run_at <= %(now)s) AS ready,
        count(*) FILTER (WHERE status = 'processing') AS running
    FROM {table}
    WHERE partition_key IS NOT NULL AND status IN ('waiting', 'processing')
    GROUP BY queue, partition_key
), ranked AS (
    SELECT *,
        count(*) FILTER (WHERE ready > 0) OVER (PARTITION BY queue) AS ready_partitions,
        row_number() OVER (PARTITION BY queue ORDER BY ready DESC, partition_key) AS by_ready,
        row_number() OVER (PARTITION BY queue ORDER BY running DESC, partition_key) AS by_running
    FROM counts
)
SELECT queue, partition_key, ready, running, ready_partitions, by_ready, by_running
FROM ranked
WHERE (by_ready <= %(top)s AND ready > 0) OR (by_running <= %(top)s AND running > 0)
   OR (by_ready = 1)
ORDER BY queue, partition_key
"""


@dataclass
class Partitions:
    """A queue's partitions (its messages' ``partition_key``): how many have
    ready messages, and the busiest by ready and by running messages, as
    ``[(partition_key, count), ...]``, most first."""

    ready: int = 0
    top_ready: list[tuple[str, int]] = field(default_factory=list)
    top_running: list[tuple[str, int]] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        return {
            "ready": self.ready,
            "top_ready": [{"partition": key, "count": n} for key, n in self.top_ready],
            "top_running": [{"partition": key, "count": n} for key, n in self.top_running],
        }


def partitions_by_queue(
    now: datetime.datetime | None = None, top: int = TOP_PARTITIONS
) -> dict[str, Partitions]:
    """``{queue: Partitions}`` for each queue that holds ready or running
    messages with a ``partition_key`` (the others, and the messages without
    one, are not partitions here): one pass over those messages."""
    now = now or timezone.now()
    using = conf.database_alias()
    found: dict[str, Partitions] = {}
    by_ready: dict[str, list[tuple[int, str, int]]] = {}
    by_running: dict[str, list[tuple[int, str, int]]] = {}
    with connections[using].cursor() as cursor:
        cursor.execute(
            PARTITIONS_SQL.format(table=Message._meta.db_table), {"now": now, "top": top}
        )
        for queue, key, ready, running, ready_partitions, rank_ready, rank_running in cursor:
            found.setdefault(queue, Partitions(ready=ready_partitions))
            if ready and rank_ready <= top:
                by_ready.setdefault(queue, []).append((rank_ready, key, ready))
            if running and rank_running <= top:
                by_running.setdefault(queue, []).append((rank_running, key, running))
    for queue, partitions in found.items():
        partitions.top_ready = [(key, n) for _, key, n in sorted(by_ready.get(queue, []))]
        partitions.top_running = [(key, n) for _, key, n in sorted(by_running.get(queue, []))]
    return found


def dead_letters_by_topic_category_state(
    queues: list[str] | None = None,
) -> list[tuple[str, str, str, int]]:
    """``[(topic, category, state, count), ...]`` of the dead letters, sorted;
    only those of ``queues`` when given."""
    rows = DeadLetter.objects.using(conf.database_alias())
    if queues is not None:
        rows = rows.filter(queue__in=queues)
    counts = (
        rows.values("topic", "category", "state")
        .annotate(count=Count("id"))
        .order_by("topic", "category", "state")
    )
    return [(row["topic"], row["category"], row["state"], row["count"]) for row in counts]


def dead_letters_by_queue(state: str | None = None) -> dict[str, int]:
    """``{queue: dead letters}``; only those in ``state`` when given."""
    rows = DeadLetter.objects.using(conf.database_alias())
    if state is not None:
        rows = rows.filter(state=state)
    counts = rows.values("queue").annotate(count=Count("id")).order_by("queue")
    return {row["queue"]: row["count"] for row in counts}


def workers() -> list[Any]:
    """The worker table's rows, each with ``alive`` (its heartbeat is fresh
    by the database's clock) and ``heartbeat_age`` (seconds), newest first."""
    rows = WorkerHeartbeat.objects.using(conf.database_alias()).annotate(
        alive=ExpressionWrapper(Q(expires_at__gt=Now()), output_field=BooleanField()),
        now=Now(),
    )
    result: list[Any] = list(rows.order_by("-heartbeat_at", "worker_id"))
    for row in result:
        row.heartbeat_age = max((row.now - row.heartbeat_at).total_seconds(), 0.0)
    return result


def live_workers_by_queue() -> dict[str, int]:
    """``{queue: number of alive workers serving it}``; queues no alive worker
    serves are absent."""
    return live_by_queue(workers())


def live_by_queue(rows: list[Any]) -> dict[str, int]:
    """``{queue: number of alive workers serving it}`` among ``rows`` (of ``workers()``)."""
    counts: dict[str, int] = {}
    for row in rows:
        if row.alive:
            for queue in row.queues:
                counts[queue] = counts.get(queue, 0) + 1
    return counts


# --- streams (the transactional outbox) -------------------------------------------------


# The state shown for a subscription the code declares (@subscriber) that no
# worker has started yet: it has no row, so no checkpoint, lag or error.
NOT_STARTED = "not started"


def subscriptions_not_started(started: Iterable[str]) -> list[SubscriberSpec]:
    """The registered subscribers whose subscription is not among the names
    ``started`` (a worker creates a subscription's row when it starts
    delivering to it)."""
    names = set(started)
    return [spec for spec in subscribers.registered() if spec.name not in names]


def subscription_states() -> dict[str, dict[str, str]]:
    """``{name: {"stream": ..., "state": ...}}`` of every subscription by
    name: its row's state, or NOT_STARTED for a declared one without a row."""
    rows = Subscription.objects.using(conf.database_alias()).values_list("name", "stream", "state")
    found = {name: {"stream": stream, "state": state} for name, stream, state in rows}
    for spec in subscriptions_not_started(found):
        found[spec.name] = {"stream": spec.stream, "state": NOT_STARTED}
    return dict(sorted(found.items()))


def subscriptions_with_lag() -> list[Any]:
    """Every subscription, by name, with ``head_position``, ``lag`` (events
    after its checkpoint, at most models.streams.LAG_COUNT_CAP) and
    ``oldest_pending_at`` (when the first of them was published, or None),
    plus ``now`` (the database's clock)."""
    return list(
        Subscription.objects.using(conf.database_alias())
        .with_lag()
        .annotate(now=Now())
        .order_by("name")
    )


def workflows_by_status() -> dict[str, int]:
    """{status: how many workflows}, every status present (0 when none);
    finished ones count until retention prunes them."""
    counts = dict(
        Workflow.objects.using(conf.database_alias())
        .values("status")
        .annotate(n=Count("id"))
        .values_list("status", "n")
    )
    return {status: counts.get(status, 0) for status in WorkflowStatus.values}
