"""What is old enough to delete, by kind, and its deletion in batches.

The kinds and their settings:

- ``history``: finished messages older than KEEP_FINISHED (all of them when
  it is 0: the history is off);
- ``counts``: the overview's per-minute outcome counts older than
  COUNTS_RETENTION (the overview draws one day);
- ``dead_letters``: resolved dead letters resolved, and revived ones
  revived, more than KEEP_RESOLVED_DEAD_LETTERS ago (None: kept); new dead
  letters never;
- ``task_results``: Django Tasks results (TaskRecord) that finished
  (successful or failed) more than KEEP_TASK_RESULTS ago (None: kept);
- ``workers``: worker rows DEAD_WORKER_RETENTION after their last
  heartbeat;
- ``workflows``: finished workflows (done, failed, cancelled) older than
  KEEP_FINISHED, the history's retention, with their steps (and results)
  and the steps' dependencies.

``delete_batch`` deletes at most ``limit`` rows of a kind in one statement
(``DELETE ... WHERE id IN (SELECT id ... LIMIT n)``, the oldest first when
an index gives that order): a short statement with few locks and a small
transaction, however much is due. The maintenance round (``maintenance.prune``)
repeats it under the maintenance lock until nothing is left or its time
budget is spent; ``pgqueue_prune`` runs the same on demand.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any

from django.db.models import Q, QuerySet
from django.db.models.functions import Now

from django_pgqueue import conf
from django_pgqueue.models import (
    DeadLetter,
    DeadLetterState,
    FinishedMessage,
    OutcomeCount,
    TaskRecord,
    TaskStatus,
    WorkerHeartbeat,
    Workflow,
)
from django_pgqueue.workflows import storing as workflows_storing

# At most this many rows per DELETE.
BATCH_SIZE = 10_000
# The overview draws the last day; a spare day covers clock skew and a late round.
COUNTS_RETENTION = datetime.timedelta(days=2)
# A dead worker's row stays this long after its last heartbeat, so status and
# the admin still show what died; then maintenance deletes it.
DEAD_WORKER_RETENTION = datetime.timedelta(days=1)

Clock = datetime.datetime | Now


def _seconds(name: str) -> datetime.timedelta | None:
    value = conf.get(name)
    return None if value is None else datetime.timedelta(seconds=value)


def history(clock: Clock) -> QuerySet[FinishedMessage] | None:
    keep = _seconds("KEEP_FINISHED") or datetime.timedelta(0)
    # Oldest first by primary key (the finish order): the scan stops at the batch size.
    return FinishedMessage.objects.filter(finished_at__lt=clock - keep).order_by("id")


def counts(clock: Clock) -> QuerySet[OutcomeCount] | None:
    return OutcomeCount.objects.filter(minute__lt=clock - COUNTS_RETENTION).order_by("minute")


def dead_letters(clock: Clock) -> QuerySet[DeadLetter] | None:
    keep = _seconds("KEEP_RESOLVED_DEAD_LETTERS")
    if keep is None:
        return None
    cutoff = clock - keep
    return DeadLetter.objects.filter(
        Q(state=DeadLetterState.RESOLVED, resolved_at__lt=cutoff)
        | Q(state=DeadLetterState.REVIVED, revived_at__lt=cutoff)
    ).order_by()


def task_results(clock: Clock) -> QuerySet[TaskRecord] | None:
    keep = _seconds("KEEP_TASK_RESULTS")
    if keep is None:
        return None
    return TaskRecord.objects.filter(
        status__in=[TaskStatus.SUCCESSFUL, TaskStatus.FAILED], finished_at__lt=clock - keep
    ).order_by()


def workers(clock: Clock) -> QuerySet[WorkerHeartbeat] | None:
    return WorkerHeartbeat.objects.filter(expires_at__lt=clock - DEAD_WORKER_RETENTION).order_by()


def workflows(clock: Clock) -> QuerySet[Workflow] | None:
    keep = _seconds("KEEP_FINISHED") or datetime.timedelta(0)
    return Workflow.objects.filter(finished_at__lt=clock - keep).order_by("finished_at")


# The kinds, in the order a round prunes them (and pgqueue_prune prints them).
KINDS: dict[str, Callable[[Clock], QuerySet[Any] | None]] = {
    "history": history,
    "counts": counts,
    "dead_letters": dead_letters,
    "task_results": task_results,
    "workers": workers,
    "workflows": workflows,
}


def due(kind: str, now: datetime.datetime | None, using: str) -> QuerySet[Any] | None:
    """The rows of ``kind`` old enough to delete, on ``using`` (None: that
    kind is kept, its setting is None)."""
    rows = KINDS[kind](now or Now())
    return None if rows is None else rows.using(using)


def count_due(kind: str, now: datetime.datetime | None, using: str) -> int:
    """How many rows of ``kind`` a prune would delete now (a dry run)."""
    rows = due(kind, now, using)
    return 0 if rows is None else rows.count()


def delete_batch(kind: str, now: datetime.datetime | None, using: str, limit: int) -> int:
    """Delete at most ``limit`` rows of ``kind`` that are due, in one
    statement; returns how many it deleted."""
    rows = due(kind, now, using)
    if rows is None:
        return 0
    model = rows.model
    if model is Workflow:
        # With their steps and the steps' dependencies (no cascade in the
        # database: see models.workflows).
        return workflows_storing.delete(list(rows.values_list("pk", flat=True)[:limit]), using)
    deleted, _ = model.objects.using(using).filter(pk__in=rows.values("pk")[:limit]).delete()
    return deleted
