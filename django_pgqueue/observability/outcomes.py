"""Read-only figures about finished messages: the history's size and age
(status, metrics) and the outcomes per minute and per hour (the admin's
queue overview), from the per-minute counts (``OutcomeCount``).

None of them reads the whole history: its size is PostgreSQL's estimate
(``pg_class.reltuples``, kept by ANALYZE and autovacuum) unless the table
is small enough to count, its age is the first row by primary key (rows
are written as messages finish), and the charts read at most a day of
count rows (a few per queue and minute), never the history itself.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from django.db import connections
from django.db.models import Sum
from django.db.models.functions import Trunc
from django.utils import timezone

from django_pgqueue import conf
from django_pgqueue.models import FinishedMessage, Outcome, OutcomeCount

# Below this estimate the history is counted exactly (a count of this many
# index entries takes a few milliseconds).
EXACT_COUNT_BELOW = 100_000
# The outcomes the overview draws, in its order.
OUTCOMES = [Outcome.DONE, Outcome.RETRIED, Outcome.DEAD_LETTERED, Outcome.CANCELLED]

ESTIMATE_SQL = "SELECT reltuples::bigint FROM pg_class WHERE oid = %s::regclass"
SIZE_SQL = "SELECT pg_total_relation_size(%s::regclass)"


def estimated_rows(model: Any, using: str | None = None) -> int | None:
    """PostgreSQL's estimate of the number of rows of ``model``'s table;
    None when the table was never analyzed (reltuples -1)."""
    using = using or conf.database_alias()
    with connections[using].cursor() as cursor:
        cursor.execute(ESTIMATE_SQL, [model._meta.db_table])
        row = cursor.fetchone()
    return None if row is None or row[0] < 0 else int(row[0])


def history_summary(now: datetime.datetime | None = None) -> dict[str, Any]:
    """``{"keep_finished_seconds", "rows", "rows_estimated", "bytes",
    "oldest_age_seconds"}`` of the history (oldest: None when it is empty)."""
    using = conf.database_alias()
    now = now or timezone.now()
    rows = FinishedMessage.objects.using(using)
    estimate = estimated_rows(FinishedMessage, using)
    estimated = estimate is not None and estimate >= EXACT_COUNT_BELOW
    count = estimate if estimated else rows.count()
    # The first row written (the primary key's order is the finish order;
    # BRIN cannot answer min()).
    first = rows.order_by("id").only("finished_at").first()
    oldest = None if first is None else first.finished_at
    with connections[using].cursor() as cursor:
        cursor.execute(SIZE_SQL, [FinishedMessage._meta.db_table])
        size = cursor.fetchone()[0]
    return {
        "keep_finished_seconds": conf.get("KEEP_FINISHED"),
        "rows": count,
        "rows_estimated": estimated,
        "bytes": size,
        "oldest_age_seconds": None if oldest is None else round((now - oldest).total_seconds(), 3),
    }


@dataclass(frozen=True)
class Series:
    """Counts of each outcome per time slot: ``slots`` (the start of each,
    oldest first) and ``counts[outcome][i]`` for slot i, per queue
    (``by_queue``) and in total (``total``)."""

    slots: list[datetime.datetime]
    total: dict[str, list[int]]
    by_queue: dict[str, dict[str, list[int]]]

    def sums(self, counts: dict[str, list[int]] | None = None) -> dict[str, int]:
        """Each outcome's sum over the slots."""
        return {outcome: sum(values) for outcome, values in (counts or self.total).items()}


def _slots(now: datetime.datetime, step: datetime.timedelta, n: int) -> list[datetime.datetime]:
    """The starts of the last ``n`` slots of ``step`` ending with the one
    that holds ``now`` (whole minutes or hours, in UTC)."""
    unit = "minutes" if step == datetime.timedelta(minutes=1) else "hours"
    current = now.astimezone(datetime.UTC).replace(second=0, microsecond=0)
    if unit == "hours":
        current = current.replace(minute=0)
    return [current - step * (n - 1 - i) for i in range(n)]


def _series(slots: list[datetime.datetime], rows: Iterable[tuple[Any, str, str, int]]) -> Series:
    index = {slot: i for i, slot in enumerate(slots)}
    total = {outcome.value: [0] * len(slots) for outcome in OUTCOMES}
    by_queue: dict[str, dict[str, list[int]]] = {}
    for slot, queue, outcome, count in rows:
        i = index.get(slot.astimezone(datetime.UTC))
        if i is None or outcome not in total:
            continue
        per_queue = by_queue.setdefault(queue, {o.value: [0] * len(slots) for o in OUTCOMES})
        per_queue[outcome][i] += count
        total[outcome][i] += count
    return Series(slots, total, dict(sorted(by_queue.items())))


def per_minute(now: datetime.datetime | None = None, minutes: int = 60) -> Series:
    """The outcomes per minute over the last ``minutes`` (the current one
    included)."""
    slots = _slots(now or timezone.now(), datetime.timedelta(minutes=1), minutes)
    rows = (
        OutcomeCount.objects.using(conf.database_alias())
        .filter(minute__gte=slots[0])
        .values_list("minute", "queue", "outcome", "count")
    )
    return _series(slots, rows)


def per_hour(now: datetime.datetime | None = None, hours: int = 24) -> Series:
    """The outcomes per hour over the last ``hours`` (the current one included)."""
    slots = _slots(now or timezone.now(), datetime.timedelta(hours=1), hours)
    rows = (
        OutcomeCount.objects.using(conf.database_alias())
        .filter(minute__gte=slots[0])
        .annotate(hour=Trunc("minute", "hour", tzinfo=datetime.UTC))
        .values_list("hour", "queue", "outcome")
        .annotate(total=Sum("count"))
        .order_by()
    )
    return _series(slots, rows)
