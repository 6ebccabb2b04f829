"""The queues at a glance, for the admin's Queues page and ``pgqueue_queues
list``: per queue what it holds (ready, delayed, blocked, processing, the
oldest ready message's age, new dead letters, its busiest partitions) and
its run-time state
(paused, the limits that hold and where they come from, the partitions with
limits of their own). Read only, a few aggregate queries (``stats``,
``controls``)."""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Any

from django.utils import timezone

from django_pgqueue import conf, controls
from django_pgqueue.models import DeadLetterState, PartitionLimit, QueueState
from django_pgqueue.observability import stats

# Where a queue's limits come from.
FROM_SETTINGS, FROM_RUN_TIME = "settings", "run time"
# The partitions with limits of their own that a queue's row names.
NAMED_PARTITION_LIMITS = 5


@dataclass
class QueueRow:
    name: str
    database: str = ""  # the alias whose tables these figures are of
    counts: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(
            (stats.READY, stats.DELAYED, stats.BLOCKED, stats.PROCESSING), 0
        )
    )
    oldest_ready_age: float | None = None  # seconds; None: nothing ready
    dead_letters: int = 0  # new (untriaged) ones
    paused: bool = False
    paused_at: datetime.datetime | None = None
    changed_by: str = ""
    limits: conf.Limits = conf.NO_LIMITS
    limits_from: str = ""  # FROM_SETTINGS, FROM_RUN_TIME, or "" (none)
    # Its messages' partitions (partition_key); None: none has one.
    partitions: stats.Partitions | None = None
    # Its partitions with limits of their own, by key (controls.set_partition_limits).
    partition_limits: list[PartitionLimit] = field(default_factory=list)

    @property
    def partition_limits_text(self) -> str:
        """Its partitions with limits of their own, the first few:
        "tenant:42: concurrency 5; (default): none; and 3 more"."""
        named = [
            f"{row.partition_key or '(default)'}: {controls.partition_limits_of(row)}"
            for row in self.partition_limits[:NAMED_PARTITION_LIMITS]
        ]
        more = len(self.partition_limits) - NAMED_PARTITION_LIMITS
        if more > 0:
            named.append(f"and {more} more")
        return "; ".join(named)

    @property
    def ready(self) -> int:
        return self.counts[stats.READY]

    @property
    def delayed(self) -> int:
        return self.counts[stats.DELAYED]

    @property
    def blocked(self) -> int:
        return self.counts[stats.BLOCKED]

    @property
    def processing(self) -> int:
        return self.counts[stats.PROCESSING]

    def as_json(self) -> dict[str, Any]:
        each = self.limits.partition  # the settings' limits of each partition
        return {
            "queue": self.name,
            "database": self.database,
            **self.counts,
            "oldest_ready_age_seconds": (
                None if self.oldest_ready_age is None else round(self.oldest_ready_age, 3)
            ),
            "dead_letters_new": self.dead_letters,
            "paused": self.paused,
            "paused_at": self.paused_at.isoformat() if self.paused_at else None,
            "changed_by": self.changed_by,
            **_limits_json(self.limits),
            "limits_from": self.limits_from or None,
            "partitions": None if self.partitions is None else self.partitions.as_json(),
            "partition": None if each is None else _limits_json(each),
            "partition_limits": [
                {
                    "partition": row.partition_key or None,
                    **_limits_json(controls.partition_limits_of(row)),
                    "changed_by": row.changed_by,
                    "updated_at": row.updated_at.isoformat(),
                }
                for row in self.partition_limits
            ],
        }


def _limits_json(limits: conf.Limits) -> dict[str, Any]:
    """``{"concurrency", "rate"}`` of ``limits`` (None: no limit of that kind)."""
    return {
        "concurrency": limits.concurrency,
        "rate": None if limits.rate is None else str(limits.rate),
    }


def every_database(
    aliases: list[str] | None = None, now: datetime.datetime | None = None
) -> list[QueueRow]:
    """``overview()`` of each database of ``aliases`` (default: every one
    that holds the queues, ``conf.databases()``), one after the other."""
    now = now or timezone.now()
    rows = []
    for alias in aliases or conf.databases():
        with conf.on_database(alias):
            rows += overview(now)
    return rows


def overview(now: datetime.datetime | None = None) -> list[QueueRow]:
    """Every queue of the database the code works on
    (``conf.database_alias()``) that is configured there, holds messages or
    new dead letters, or has a run-time state: the configured ones first (in
    the settings' order), then the others by name."""
    alias = conf.database_alias()
    now = now or timezone.now()
    messages = stats.messages_by_queue_topic_state(now=now)
    ages = stats.oldest_ready_age(now=now)
    dead = stats.dead_letters_by_queue(DeadLetterState.NEW)
    partitions = stats.partitions_by_queue(now=now)
    states = controls.states()
    named: dict[str, list[PartitionLimit]] = {}
    for limit in controls.partition_limits():
        named.setdefault(limit.queue, []).append(limit)
    configured = [name for name in conf.queues() if conf.queue_database(name) == alias]
    others = ({row[0] for row in messages} | set(dead) | set(states) | set(named)) - set(configured)
    rows = {name: QueueRow(name, alias) for name in [*configured, *sorted(others)]}
    for name, _topic, state, count in messages:
        rows[name].counts[state] += count
    for name, row in rows.items():
        row.oldest_ready_age = ages.get(name)
        row.dead_letters = dead.get(name, 0)
        row.partitions = partitions.get(name)
        row.partition_limits = named.get(name, [])
        _state_of(row, states.get(name))
    return list(rows.values())


def _state_of(row: QueueRow, state: QueueState | None) -> None:
    row.limits = controls.limits_for(row.name, state)
    if state is not None and state.limits_set:
        row.limits_from = FROM_RUN_TIME
    elif row.limits:
        row.limits_from = FROM_SETTINGS
    if state is not None:
        row.paused, row.paused_at, row.changed_by = state.paused, state.paused_at, state.changed_by
