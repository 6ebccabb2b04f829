"""The queues at a glance, for the admin's Queues page and ``pgqueue_queues
list``: per queue what it holds (ready, delayed, blocked, processing, the
oldest ready message's age, new dead letters, its busiest partitions) and
its run-time state
(paused, the limits that hold and where they come from). Read only, a few
aggregate queries (``stats``, ``controls``)."""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Any

from django.utils import timezone

from django_pgqueue import conf, controls
from django_pgqueue.models import DeadLetterState, QueueState
from django_pgqueue.observability import stats

# Where a queue's limits come from.
FROM_SETTINGS, FROM_RUN_TIME = "settings", "run time"


@dataclass
class QueueRow:
    name: str
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
        return {
            "queue": self.name,
            **self.counts,
            "oldest_ready_age_seconds": (
                None if self.oldest_ready_age is None else round(self.oldest_ready_age, 3)
            ),
            "dead_letters_new": self.dead_letters,
            "paused": self.paused,
            "paused_at": self.paused_at.isoformat() if self.paused_at else None,
            "changed_by": self.changed_by,
            "concurrency": self.limits.concurrency,
            "rate": None if self.limits.rate is None else str(self.limits.rate),
            "limits_from": self.limits_from or None,
            "partitions": None if self.partitions is None else self.partitions.as_json(),
        }


def overview(now: datetime.datetime | None = None) -> list[QueueRow]:
    """Every queue that is configured, holds messages or new dead letters,
    or has a run-time state: the configured ones first (in the settings'
    order), then the others by name."""
    now = now or timezone.now()
    messages = stats.messages_by_queue_topic_state(now=now)
    ages = stats.oldest_ready_age(now=now)
    dead = stats.dead_letters_by_queue(DeadLetterState.NEW)
    partitions = stats.partitions_by_queue(now=now)
    states = controls.states()
    configured = conf.queues()
    others = ({row[0] for row in messages} | set(dead) | set(states)) - set(configured)
    rows = {name: QueueRow(name) for name in [*configured, *sorted(others)]}
    for name, _topic, state, count in messages:
        rows[name].counts[state] += count
    for name, row in rows.items():
        row.oldest_ready_age = ages.get(name)
        row.dead_letters = dead.get(name, 0)
        row.partitions = partitions.get(name)
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
