"""Running handlers on the handler threads (``pool``): a job alone, in a
transaction of its own (atomic) or none; several atomic ones in a shared
transaction when others wait behind it (``atomic``); and the handlers that
run past their timeout, given up on so that they hold neither a thread nor
the jobs of their batch."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

from django.db import DatabaseError, connections, transaction

from django_pgqueue import conf, lifecycle
from django_pgqueue.db import (
    autocommit_if_unused,
    drop_broken_connections,
    first_line,
    lock_timed_out,
)
from django_pgqueue.exceptions import HandlerTimeout
from django_pgqueue.lifecycle.guards import log_lease_lost
from django_pgqueue.models import Category, Message
from django_pgqueue.worker.acks import Acks
from django_pgqueue.worker.atomic import AtomicBatches
from django_pgqueue.worker.config import Metrics, WorkerConfig
from django_pgqueue.worker.event_loop import EventLoop
from django_pgqueue.worker.job import ACK_PENDING, DONE, LOST, SETTLED, Job, LeaseLost
from django_pgqueue.worker.ledger import Ledger
from django_pgqueue.worker.outcomes import Outcomes
from django_pgqueue.worker.pool import HandlerPool
from django_pgqueue.worker.wakeup import Wakeup
from django_pgqueue.workflows import bookkeeping

logger = logging.getLogger(__package__)


class _AckLocked(Exception):
    """An atomic handler's acknowledgement waited past LOCK_TIMEOUT for a row
    lock held by another transaction: roll the handler's work back."""


@dataclass(eq=False)
class Executor:
    config: WorkerConfig
    ledger: Ledger
    pool: HandlerPool
    wakeup: Wakeup
    acks: Acks
    outcomes: Outcomes
    metrics: Metrics
    atomic: AtomicBatches = field(init=False)
    # Runs the async handlers with atomic=False, when the worker has one.
    event_loop: EventLoop | None = None

    def __post_init__(self) -> None:
        self.atomic = AtomicBatches(self.config, self.ledger, self.pool, self.outcomes, self)

    # --- handler threads ------------------------------------------------------

    def run_job(self, job: Job) -> None:
        """Run a job the pool gave this thread."""
        if not self.start(job):
            return
        # Share a transaction only when others wait behind this one: a lone
        # message skips the savepoint round trips (lower latency when idle).
        spec = job.spec
        if spec is not None and spec.atomic and self.config.batch_size > 1 and self.ledger.queued:
            self.atomic.run(job)
        else:
            self.run_one(job)

    def dispatch(self, job: Job) -> None:
        """Hand a claimed job to what runs it: the event loop for an async
        handler with atomic=False (when the worker has one), else the
        handler threads."""
        if job.on_loop and self.event_loop is not None:  # (Ledger.add decided)
            self.event_loop.submit(job)
        else:
            self.pool.submit(job)

    def start(self, job: Job) -> bool:
        """Take ``job`` for this thread (``begin``); False if it was handed
        back or abandoned meanwhile, or ended cancelled before it started."""
        if not self.begin(job):
            return False
        if job.cancel_requested:  # told before it started: it never runs
            self.settle(job, None, ran=False)
            return False
        return True

    def begin(self, job: Job) -> bool:
        """``Ledger.start`` for the thread or task that runs ``job`` (no
        database work: the event loop calls it too); False if it was handed
        back or abandoned meanwhile."""
        if not self.ledger.start(job):
            return False
        if self.ledger.wakes_the_loop(job):
            # The loop sleeps past this handler's deadline: wake it (no
            # claim, only a new reckoning of when to wake) so that a timeout
            # is noticed when it passes, not at the next poll.
            self.wakeup.set()
        if not job.cancel_requested:
            self.metrics.started(job.message)
        return True

    def settle(self, job: Job, failure: BaseException | None, ran: bool = True) -> None:
        """End a run that took no transaction of the handler's (atomic=False,
        or never ran): it succeeded (its acknowledgement waits to be
        flushed), failed with ``failure`` (its retry or dead letter is
        recorded), or, ``ran`` False, ended cancelled before it started."""
        if not ran:
            outcome = self.outcomes.cancelled(job, "cancelled before it started")
        elif failure is None:
            outcome = ACK_PENDING
        else:
            outcome = self._failed(job, failure)
        self.finished(job, outcome)

    def _failed(self, job: Job, failure: BaseException) -> str:
        """Record ``job``'s failure (unless it was given up on meanwhile) on a
        working connection, and leave one behind. (A success leaves its
        connection as it is: looking costs more than a no-op handler, and a
        connection broken without an error reaching us fails the next
        handler, which replaces it.)"""
        drop_broken_connections()
        try:
            return LOST if job.abandoned else self.outcomes.record_failure(job, failure)
        finally:
            drop_broken_connections()

    def run_one(self, job: Job) -> None:
        """Run one started job in a transaction of its own (atomic) or none."""
        message, spec = job.message, job.spec
        try:
            if spec is None:
                outcome = self.outcomes.record_failure(
                    job,
                    LookupError(f"no handler for topic {message.topic!r}"),
                    category=Category.PERMANENT,
                )
            elif spec.atomic:
                connection = connections[conf.database_alias()]
                with transaction.atomic(using=connection.alias):
                    job.run_handler()
                    if job.abandoned:
                        raise LeaseLost
                    if message.workflow_step_id is None:
                        # A handler that ran no query: its acknowledgement
                        # commits alone, in one round trip.
                        with autocommit_if_unused(connection):
                            if not _ack_waiting_for_locks(message):
                                raise LeaseLost
                    else:
                        # So does a step's, with its bookkeeping (unless its
                        # handler added steps: they are written first).
                        with (
                            nullcontext()
                            if bookkeeping.adds_steps([message])
                            else autocommit_if_unused(connection)
                        ):
                            moved = _ack_step_waiting_for_locks(message, job.step_result)
                        if moved is None:
                            raise LeaseLost
                        self.metrics.workflows(moved.released, moved.finished)
                outcome = DONE
            else:
                job.run_handler()
                outcome = ACK_PENDING
        except LeaseLost:
            job.log_lease_lost_before_commit()
            outcome = LOST
        except _AckLocked as exc:
            # Recording a retry would wait for the same lock: the lease, which
            # the heartbeat cannot extend while the row is locked, brings the
            # message back once it expires and the row is free.
            drop_broken_connections()
            _log_ack_locked(message, exc)
            outcome = LOST
        except BaseException as exc:  # noqa: BLE001  (a handler may raise anything)
            outcome = self._failed(job, exc)
        self.finished(job, outcome)

    def finished(self, job: Job, outcome: str) -> None:
        """``job``'s run ended with ``outcome``: book it, report a success,
        wake the main loop if it has work, and acknowledge a batch's worth
        of atomic=False jobs from this thread."""
        if job.duration is None and job.started is not None:
            job.duration = time.monotonic() - job.started
        if job.span is not None:
            job.end_span(outcome)
        message = job.message
        acks, has_work = self.ledger.finish(job, outcome)
        grouped = message.group_key is not None
        if outcome == DONE:
            self.outcomes.done(message, job.duration)
        if grouped and outcome in SETTLED:
            # Its group may go on (acknowledged or dead-lettered): the next
            # claim promotes the group's next message.
            self.wakeup.release_groups()
        elif has_work or self.wakeup.groups_released or (grouped and outcome == ACK_PENDING):
            self.wakeup.set()
        if acks:
            self.acks.send_from_handler_thread(acks)

    # --- timeouts (the main loop) -----------------------------------------------

    def expire_timeouts(self) -> None:
        """Give up on the handlers past their deadline: replace their thread,
        record the attempt as failed (TRANSIENT), and free the jobs of their
        batch."""
        for job in self.ledger.late(time.monotonic()):
            self.ledger.abandon([job])  # whatever the handler does now is discarded
            if job.task is not None:
                job.interrupt("timeout")  # an async handler: its task is cancelled
            else:
                self.pool.abandon(job.thread)  # a thread: replaced
            timeout = job.spec.timeout if job.spec is not None else None
            logger.warning(
                "Message id=%s topic=%s attempt=%s: handler ran past its timeout of %ss",
                job.message.pk,
                job.message.topic,
                job.message.attempts,
                timeout,
            )
            exc = HandlerTimeout(f"timeout: the handler ran past {timeout}s")
            self.finished(job, self.outcomes.record_failure(job, exc, Category.TRANSIENT))
            self._free_hostages(job)

    def _free_hostages(self, job: Job) -> None:
        """The messages whose handlers succeeded in the same (uncommitted)
        transaction as a timed-out handler would wait for it: hand them back
        to the queue now (their writes roll back with the batch, and the
        batch's acknowledgement finds their leases gone). Those whose handler
        failed would wait for it too, to record their failure: record it now
        (the batch thread then skips them)."""
        hostages, failed = self.ledger.hostages(job)
        if hostages:
            released = lifecycle.release([j.message for j in hostages])
            logger.warning(
                "Worker %s: handed back %s message(s) that shared a transaction with the "
                "timed-out one",
                self.config.worker_id,
                released,
            )
        for other, failure in failed:
            self.finished(other, self.outcomes.record_failure(other, failure))


def _ack_waiting_for_locks(message: Message) -> bool:
    """``lifecycle.ack``; a lock timeout (another transaction holds the row)
    raises _AckLocked."""
    with _lock_timeout_raises():
        return lifecycle.ack(message)


def _ack_step_waiting_for_locks(message: Message, result: str | None) -> bookkeeping.Moved | None:
    """``lifecycle.ack`` of a workflow step's message with its step's
    bookkeeping (``result``: the handler's result as JSON text): what the
    step's end did, None if the lease was lost. A lock timeout raises
    _AckLocked."""
    with _lock_timeout_raises():
        steps = [(message, str(result))]
        acked, moved = bookkeeping.acknowledge([message], steps, conf.database_alias())
    if acked:
        return moved
    log_lease_lost(message, "not acknowledged")
    return None


@contextmanager
def _lock_timeout_raises() -> Iterator[None]:
    """An acknowledgement that waited past LOCK_TIMEOUT for a row lock
    raises _AckLocked."""
    try:
        yield
    except DatabaseError as exc:
        if not lock_timed_out(exc):
            raise
        raise _AckLocked(first_line(exc)) from exc


def _log_ack_locked(message: Message, exc: _AckLocked) -> None:
    logger.warning(
        "Message id=%s topic=%s attempt=%s: not acknowledged, another transaction "
        "holds its row locked (%s); the handler's database writes were rolled back "
        "and the message runs again after its lease",
        message.pk,
        message.topic,
        message.attempts,
        exc,
        extra={
            "message_id": message.pk,
            "topic": message.topic,
            "attempt": message.attempts,
            "state": "ack_locked",
        },
    )
