"""Background duties that one worker at a time performs.

``run_once`` is called by every worker's heartbeat thread (and the stream
thread); the first to take the maintenance lock, a transaction-scoped
advisory lock, does the round, the others skip it. Each duty is a function
that returns counts; the callers only schedule rounds:

- ``rescue_expired``: messages whose lease expired (their worker died, or
  could not keep the lease) go back to the queue, or to the dead-letter
  table when that run was their last attempt;
- the rows of workers dead for DEAD_WORKER_RETENTION are deleted;
- stream events that every subscription has passed, past their retention,
  are deleted (streams.prune_events).
"""

from __future__ import annotations

import datetime
import logging
import os
import time
from collections.abc import Collection
from dataclasses import dataclass

from django.db import connections
from django.db.models import F, Q
from django.db.models.functions import Now

from django_pgqueue import conf, lifecycle, policy, registry, sql, streams
from django_pgqueue.models import Category, Message, Status, WorkerHeartbeat

logger = logging.getLogger(__name__)

# The maintenance lock's key (sql.MAINTENANCE_LOCK_SQL): "pgqu".
MAINTENANCE_LOCK_KEY = 0x70677175

# A dead worker's row stays this long after its last heartbeat, so status and
# the admin still show what died; then maintenance deletes it.
DEAD_WORKER_RETENTION = datetime.timedelta(days=1)


@dataclass(frozen=True)
class MaintenanceResult:
    rescued: int
    rescued_dead_lettered: int
    workers_pruned: int = 0
    events_pruned: int = 0  # streams: events past their retention


@dataclass(frozen=True)
class RescueResult:
    requeued: int
    dead_lettered: int


def try_maintenance_lock() -> bool:
    """Inside a transaction: take the maintenance lock if no one holds it."""
    with connections[conf.database_alias()].cursor() as cursor:
        cursor.execute(sql.MAINTENANCE_LOCK_SQL, [MAINTENANCE_LOCK_KEY])
        taken: bool = cursor.fetchone()[0]
        return taken


def run_once(
    now: datetime.datetime | None = None, rescue_limit: int = 1000
) -> MaintenanceResult | None:
    """Do one round of maintenance if no other worker is doing it.

    Returns a MaintenanceResult, or None when another worker holds the lock.
    """
    with sql.worker_transaction():
        if not try_maintenance_lock():
            logger.debug(
                "Maintenance round in process %s skipped: another holds the lock", os.getpid()
            )
            return None
        began = time.time()
        rescue = rescue_expired(now=now, limit=rescue_limit)
        pruned, _ = (
            WorkerHeartbeat.objects.using(conf.database_alias())
            .filter(expires_at__lt=(now or Now()) - DEAD_WORKER_RETENTION)
            .delete()
        )
        events_pruned = streams.prune_events(now=now)
        # Logged before the commit releases the lock: the rounds' times, in
        # the logs of every worker, never overlap (one worker at a time).
        logger.debug(
            "Maintenance round in process %s from %.6f to %.6f (Unix time)",
            os.getpid(),
            began,
            time.time(),
        )
    if rescue.requeued or rescue.dead_lettered:
        logger.info(
            "Maintenance: rescued %s message(s) of lost workers, dead-lettered %s",
            rescue.requeued,
            rescue.dead_lettered,
            extra={"rescued": rescue.requeued},
        )
    return MaintenanceResult(
        rescued=rescue.requeued,
        rescued_dead_lettered=rescue.dead_lettered,
        workers_pruned=pruned,
        events_pruned=events_pruned,
    )


def rescue_expired(now: datetime.datetime | None = None, limit: int = 1000) -> RescueResult:
    """Return messages whose lease expired (their worker died) to the queue,
    with the failure recorded and the attempt counted
    (lifecycle.requeue_lost); dead-letter those that have used up their
    attempts (lifecycle.dead_letter). At most ``limit`` messages, the
    longest expired first.

    A ``processing`` row without a lease (constraint
    ``pgqueue_msg_processing_has_lease`` forbids it; a row from before it, or
    written with the constraint dropped) counts as expired: nothing else
    would ever return it.

    Rows are locked with SKIP LOCKED, so a message being acknowledged right
    now is left alone; the transitions then find them still in the state
    they were picked in, locked by this transaction.
    """
    using = conf.database_alias()
    expired_at = now or Now()
    expired_lease = (
        Q(lease_expires_at__lt=expired_at)
        | Q(lease_expires_at__isnull=True)
        | Q(lease_token__isnull=True)
    )
    with sql.worker_transaction(using):
        expired = list(
            Message.objects.using(using)
            .select_for_update(skip_locked=True)
            .filter(expired_lease, status=Status.PROCESSING)
            .defer("payload", "headers")  # not needed, and maybe not loadable
            .order_by(F("lease_expires_at").asc(nulls_first=True))[:limit]
        )
        beats = _last_beats({m.locked_by for m in expired if m.locked_by}, using)
        requeue: list[Message] = []
        exhausted: list[Message] = []
        for message in expired:
            spec = registry.lookup(message.topic)
            limit_reached = message.attempts >= policy.max_attempts_for(message, spec)
            (exhausted if limit_reached else requeue).append(message)
        requeued = sum(
            lifecycle.requeue_lost(message, _lost_reason(message, beats), now)
            for message in requeue
        )
        dead_lettered = 0
        for message in exhausted:
            reason = f"{_lost_reason(message, beats)} on the last of {message.attempts} attempts"
            dead = lifecycle.dead_letter(
                message, Category.TRANSIENT, reason, worker=message.locked_by, now=now
            )
            dead_lettered += dead is not None
    return RescueResult(requeued=requeued, dead_lettered=dead_lettered)


def _last_beats(worker_ids: Collection[str], using: str) -> dict[str, datetime.datetime]:
    """{worker id: its last heartbeat} of those of ``worker_ids`` that have a row."""
    if not worker_ids:
        return {}
    return dict(
        WorkerHeartbeat.objects.using(using)
        .filter(worker_id__in=worker_ids)
        .values_list("worker_id", "heartbeat_at")
    )


def _lost_reason(message: Message, beats: dict[str, datetime.datetime]) -> str:
    """Why ``message``'s run ended without an outcome: its worker stopped
    beating, or kept beating but could not keep the lease; or it never had
    a lease."""
    if message.lease_token is None or message.lease_expires_at is None:
        return (
            f"{lifecycle.LEASE_MISSING}: processing without a lease "
            f"(locked by {message.locked_by!r})"
        )
    beat = beats.get(message.locked_by)
    if beat is not None and beat > message.lease_expires_at:
        # The worker beat after the lease ran out, so it was alive: the
        # heartbeat extends leases with SKIP LOCKED, and a row that another
        # transaction kept locked past the lease (the handler's own
        # acknowledgement waiting on a lock, a long admin edit) expires
        # under a worker that is alive and well.
        return (
            f"{lifecycle.LEASE_EXPIRED}: the lease of {message.locked_by} expired while that "
            "worker was still alive (its heartbeat could not extend it: the row was locked by "
            "another transaction, or the worker could not reach the database in time)"
        )
    return f"{lifecycle.WORKER_LOST}: the lease of {message.locked_by or 'a worker'} expired"
