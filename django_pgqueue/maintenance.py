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
  are deleted (streams.prune_events);
- cancelled messages past CANCELLED_RETENTION are deleted, and the starts
  of rate-limited queues that no window reaches (``prune_cancelled``);
- after the round, at most every PRUNE_INTERVAL seconds per process: the
  history, the overview's counts, resolved dead letters and Tasks results
  past their retention (``prune``, in batches of ``retention.BATCH_SIZE``
  rows, each batch its own transaction under the maintenance lock);
- after the round: a VACUUM of the queue table when its dead rows pile up
  faster than autovacuum comes by (``vacuum.vacuum_if_due``).
"""

from __future__ import annotations

import datetime
import logging
import os
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from django.db import connections
from django.db.models import F, Q
from django.db.models.functions import Now

from django_pgqueue import conf, lifecycle, policy, registry, retention, streams, vacuum
from django_pgqueue.models import Category, Message, QueueStart, Status, WorkerHeartbeat
from django_pgqueue.sql import history as history_sql
from django_pgqueue.sql import maintenance as maintenance_sql
from django_pgqueue.sql import timeouts as timeouts_sql
from django_pgqueue.sql.acks import ids_by_token

logger = logging.getLogger(__name__)

# The maintenance lock's key (sql.maintenance.MAINTENANCE_LOCK_SQL): "pgqu".
MAINTENANCE_LOCK_KEY = 0x70677175

# A dead worker's row stays this long after its last heartbeat (retention).
DEAD_WORKER_RETENTION = retention.DEAD_WORKER_RETENTION
# Seconds between two prunes (``prune``) by one process's rounds: a prune
# that finds nothing is five index probes, but a busy worker runs a round
# every few seconds. Time-bounded: a prune stops after PRUNE_BUDGET seconds
# (the next one goes on), so a backlog of old rows never holds up the round.
PRUNE_INTERVAL = 60.0
PRUNE_BUDGET = 5.0
_next_prune = 0.0  # time.monotonic() of this process's next prune


@dataclass(frozen=True)
class MaintenanceResult:
    rescued: int
    rescued_dead_lettered: int
    workers_pruned: int = 0
    events_pruned: int = 0  # streams: events past their retention
    cancelled_pruned: int = 0  # cancelled messages past CANCELLED_RETENTION
    # The prune after the round, when one was due (not compared: when it is
    # due depends on the process's earlier rounds).
    pruned: PruneResult | None = field(default=None, compare=False)
    # The queue table's VACUUM after the round, when its dead rows called
    # for one (not compared: it depends on the server's statistics).
    vacuumed: vacuum.VacuumResult | None = field(default=None, compare=False)


@dataclass(frozen=True)
class PruneResult:
    """Rows deleted (or, in a dry run, due) by kind (retention.KINDS)."""

    counts: dict[str, int]
    complete: bool = True  # False: stopped by the time budget (or the lock); more is due

    def __str__(self) -> str:
        return ", ".join(f"{kind} {n}" for kind, n in self.counts.items())


@dataclass(frozen=True)
class RescueResult:
    requeued: int
    dead_lettered: int
    cancelled: int = 0  # their cancellation was asked: cancelled, not requeued


def try_maintenance_lock() -> bool:
    """Inside a transaction: take the maintenance lock if no one holds it."""
    with connections[conf.database_alias()].cursor() as cursor:
        cursor.execute(maintenance_sql.MAINTENANCE_LOCK_SQL, [MAINTENANCE_LOCK_KEY])
        taken: bool = cursor.fetchone()[0]
        return taken


def run_once(
    now: datetime.datetime | None = None, rescue_limit: int = 1000
) -> MaintenanceResult | None:
    """Do one round of maintenance if no other worker is doing it.

    Returns a MaintenanceResult, or None when another worker holds the lock.
    """
    with timeouts_sql.worker_transaction():
        if not try_maintenance_lock():
            logger.debug(
                "Maintenance round in process %s skipped: another holds the lock", os.getpid()
            )
            return None
        began = time.time()
        rescue = rescue_expired(now=now, limit=rescue_limit)
        pruned = retention.delete_batch("workers", now, conf.database_alias(), retention.BATCH_SIZE)
        events_pruned = streams.prune_events(now=now)
        cancelled_pruned = prune_cancelled(now=now)
        history_sql.fold_counts(now)  # the overview's counts: one row per minute
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
    global _next_prune
    pruned_now = None
    if time.monotonic() >= _next_prune:
        _next_prune = time.monotonic() + PRUNE_INTERVAL
        pruned_now = prune(now=now)
    # After the round's transaction: VACUUM cannot run inside one.
    vacuumed = vacuum.vacuum_if_due()
    return MaintenanceResult(
        rescued=rescue.requeued,
        rescued_dead_lettered=rescue.dead_lettered,
        workers_pruned=pruned,
        events_pruned=events_pruned,
        cancelled_pruned=cancelled_pruned,
        pruned=pruned_now,
        vacuumed=vacuumed,
    )


def prune(
    now: datetime.datetime | None = None,
    *,
    dry_run: bool = False,
    budget: float = PRUNE_BUDGET,
    batch_size: int = retention.BATCH_SIZE,
) -> PruneResult:
    """Delete what is past its retention (retention.KINDS), each kind in
    batches of at most ``batch_size`` rows: each batch is one DELETE in a
    transaction of its own that holds the maintenance lock (so two workers
    never prune at once, and no batch holds its locks for long or makes a
    big transaction). Stops after ``budget`` seconds, or when another
    process holds the lock (its round prunes), with ``complete`` False.
    ``dry_run``: delete nothing, count what is due."""
    using = conf.database_alias()
    counts = dict.fromkeys(retention.KINDS, 0)
    if dry_run:
        for kind in retention.KINDS:
            counts[kind] = retention.count_due(kind, now, using)
        return PruneResult(counts)
    deadline = time.monotonic() + budget
    for kind in retention.KINDS:
        while True:
            if time.monotonic() >= deadline:
                return _pruned(PruneResult(counts, complete=False))
            with timeouts_sql.worker_transaction(using):
                if not try_maintenance_lock():
                    return _pruned(PruneResult(counts, complete=False))
                deleted = retention.delete_batch(kind, now, using, batch_size)
            counts[kind] += deleted
            if deleted < batch_size:
                break
    with timeouts_sql.worker_transaction(using):
        if try_maintenance_lock():
            history_sql.summarize_history_indexes(using)
    return _pruned(PruneResult(counts))


def _pruned(result: PruneResult) -> PruneResult:
    if any(result.counts.values()):
        logger.info(
            "Maintenance: pruned %s%s",
            result,
            "" if result.complete else " (more is due)",
            extra={"pruned": result.counts},
        )
    return result


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
    with timeouts_sql.worker_transaction(using):
        expired = list(
            Message.objects.using(using)
            .select_for_update(skip_locked=True)
            .filter(expired_lease, status=Status.PROCESSING)
            .defer("payload", "headers")  # not needed, and maybe not loadable
            .order_by(F("lease_expires_at").asc(nulls_first=True))[:limit]
        )
        beats = _last_beats({m.locked_by for m in expired if m.locked_by}, using)
        return _rescue(expired, lambda message: _lost_reason(message, beats), now)


def rescue_cut_off(
    messages: Collection[Message], reason: str, now: datetime.datetime | None = None
) -> tuple[RescueResult, set[int]]:
    """Return ``messages`` at once, whose runs died with their worker's
    connection to the database (a failover, a network cut,
    ``pg_terminate_backend``), as the rescue returns a lost run without
    waiting for the lease to expire: back to the queue due now, ``reason``
    recorded as a TRANSIENT failure, the attempt counted; dead-lettered on
    their last attempt; cancelled if that was asked.

    Only the rows still ``processing`` under the messages' lease tokens
    change: a run whose transaction committed before the connection died
    (its acknowledgement deleted the row) is never handed back. Rows that
    another transaction holds locked are skipped (SKIP LOCKED): the
    cut-off backend's own transaction, still open on the server, may yet
    commit. Returns what was done, and the ids of those skipped: still
    under their lease, to try again."""
    using = conf.database_alias()
    held = Q(pk__in=[])
    for token, ids in ids_by_token(messages).items():
        if token is not None:
            held |= Q(pk__in=ids, lease_token=token)
    rows = Message.objects.using(using).filter(held, status=Status.PROCESSING)
    with timeouts_sql.worker_transaction(using):
        found = list(
            rows.select_for_update(skip_locked=True).defer("payload", "headers")  # (as above)
        )
        result = _rescue(found, lambda message: reason, now)
        locked = set(rows.exclude(pk__in=[m.pk for m in found]).values_list("pk", flat=True))
    return result, locked


def rescue_orphans(
    worker_id: str, held: Collection[int], reason: str, now: datetime.datetime | None = None
) -> RescueResult:
    """Return the messages that the database says ``worker_id`` holds and the
    worker does not (ids not in ``held``), as the rescue returns lost runs,
    without waiting for their leases. After a lost connection they are
    those whose claim committed without the worker learning of it (the
    reply was lost), and, after a failover to an asynchronous standby, those
    whose outcome (an acknowledgement, a retry) the old primary had not
    streamed: the worker believes them finished, the new primary has them
    running. The caller makes sure that no claim of its own is under way:
    a claim's rows are held once it returns. Rows locked by another
    transaction are skipped."""
    using = conf.database_alias()
    with timeouts_sql.worker_transaction(using):
        orphans = list(
            Message.objects.using(using)
            .select_for_update(skip_locked=True)
            .filter(status=Status.PROCESSING, locked_by=worker_id)
            .exclude(pk__in=list(held))
            .defer("payload", "headers")  # (as above)
        )
        return _rescue(orphans, lambda message: reason, now)


def _rescue(
    messages: list[Message],
    reason_of: Callable[[Message], str],
    now: datetime.datetime | None,
) -> RescueResult:
    """Requeue, dead-letter or cancel ``messages``, whose runs were lost,
    locked by the caller's transaction (``reason_of(message)``: why)."""
    requeue: list[Message] = []
    exhausted: list[Message] = []
    cancelled = 0
    for message in messages:
        if message.cancel_requested_at is not None:
            # Its cancellation was asked: it never runs again.
            cancelled += lifecycle.cancel_running(
                message, f"cancelled: {reason_of(message)}", now=now
            )
            continue
        spec = registry.lookup(message.topic)
        limit_reached = message.attempts >= policy.max_attempts_for(message, spec)
        (exhausted if limit_reached else requeue).append(message)
    requeued = sum(lifecycle.requeue_lost(message, reason_of(message), now) for message in requeue)
    dead_lettered = 0
    for message in exhausted:
        reason = f"{reason_of(message)} on the last of {message.attempts} attempts"
        dead = lifecycle.dead_letter(
            message, Category.TRANSIENT, reason, worker=message.locked_by, now=now
        )
        dead_lettered += dead is not None
    return RescueResult(requeued=requeued, dead_lettered=dead_lettered, cancelled=cancelled)


def prune_cancelled(now: datetime.datetime | None = None, limit: int = 10_000) -> int:
    """Delete up to ``limit`` cancelled messages older than
    CANCELLED_RETENTION (none when it is None), and the starts of
    rate-limited queues that no window reaches any more (the claims delete
    their own queue's; these are of queues whose rate was removed).
    Returns how many messages it deleted."""
    using = conf.database_alias()
    clock = now or Now()
    QueueStart.objects.using(using).filter(
        started_at__lt=clock - datetime.timedelta(seconds=conf.LONGEST_PERIOD)
    ).delete()
    retention = conf.get("CANCELLED_RETENTION")
    if retention is None:
        return 0
    old = Message.objects.using(using).filter(
        status=Status.CANCELLED, updated_at__lt=clock - datetime.timedelta(seconds=retention)
    )
    deleted, _ = Message.objects.using(using).filter(pk__in=old.values("pk")[:limit]).delete()
    return deleted


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
