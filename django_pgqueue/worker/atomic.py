"""Atomic handlers sharing a transaction (and its commit): a handler thread
runs the atomic jobs waiting in the pool one after another, each in a
savepoint, and commits them with their acknowledgement (one DELETE guarded
by each lease token) once it has run a batch of them, none is waiting, or
ATOMIC_BATCH_SECONDS have passed. Many handlers share one commit, and each
message's writes still commit or roll back with its own acknowledgement."""

from __future__ import annotations

import logging
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Protocol

from django.db import DatabaseError, connections, transaction

from django_pgqueue import conf, lifecycle
from django_pgqueue.db import (
    LazySavepoint,
    autocommit_if_unused,
    drop_broken_connections,
    first_line,
    lock_timed_out,
    transaction_failed,
)
from django_pgqueue.worker.config import WorkerConfig
from django_pgqueue.worker.job import DONE, LOST, Job, LeaseLost
from django_pgqueue.worker.ledger import Ledger
from django_pgqueue.worker.outcomes import Outcomes
from django_pgqueue.worker.pool import HandlerPool
from django_pgqueue.workflows import bookkeeping

logger = logging.getLogger(__package__)

# A batch takes no more jobs once it has run this long (seconds).
ATOMIC_BATCH_SECONDS = 0.05
# At most this many savepoints (handlers that queried) per shared
# transaction: each savepoint that writes takes a subtransaction id, and
# past 64 in one transaction PostgreSQL's snapshots overflow to pg_subtrans,
# which slows every session. Handlers that run no query open none: a batch
# of them ends at the worker's batch size or ATOMIC_BATCH_SECONDS.
ATOMIC_BATCH_MAX = 50


class _BatchRolledBack(Exception):
    """Roll the whole atomic batch back; its other jobs run again alone."""


class Runner(Protocol):
    """What a batch needs of the executor that runs it."""

    def start(self, job: Job) -> bool: ...

    def run_one(self, job: Job) -> None: ...

    def run_job(self, job: Job) -> None: ...

    def finished(self, job: Job, outcome: str) -> None: ...


@dataclass(eq=False)
class AtomicBatches:
    config: WorkerConfig
    ledger: Ledger
    pool: HandlerPool
    outcomes: Outcomes
    runner: Runner  # the executor: starts, runs and finishes the jobs

    def run(self, first: Job) -> None:
        """Run ``first`` and the atomic jobs queued behind it in one
        transaction, each in a savepoint, and commit them with their
        acknowledgement.

        A handler's savepoint is opened just before its first query (see
        db.LazySavepoint): one that runs no query costs no round trip. A
        handler that raises rolls back to its savepoint (with the
        ``on_commit`` callbacks it registered); its failure is recorded after
        the commit. If the acknowledgement finds a lease gone, or a failure
        cannot be undone on its own, the whole transaction rolls back and the
        other jobs (those that still hold their lease) run again one by one:
        their writes were rolled back, nothing happens twice.
        """
        runner = self.runner
        using = conf.database_alias()
        connection = connections[using]
        batch, succeeded = [first], []
        failed: list[tuple[Job, BaseException]] = []
        after = None  # a job taken from the pool that cannot join the batch
        began = time.monotonic()
        acked = None  # the ids the acknowledgement found still leased
        lost: list[Job] = []  # lost their lease, the others acknowledged alone
        # Where each succeeded job's on_commit callbacks are in the connection's list.
        registered: dict[Job, tuple[int, int]] = {}
        lock_timeout = None  # the acknowledgement's error when it waited too long for a lock
        limit = self.config.batch_size
        # Each handler's savepoint opens before its first query (none for
        # one that runs none); one it cannot return to rolls the batch back.
        savepoint = LazySavepoint(connection, "pgqueue_job", _BatchRolledBack)
        try:
            with transaction.atomic(using=using), connection.execute_wrapper(savepoint):
                job = first
                while True:
                    job.batch = batch
                    callbacks = len(connection.run_on_commit)
                    savepoint.arm()
                    try:
                        job.run_handler()
                        if job.abandoned:
                            raise LeaseLost
                        if connection.needs_rollback or transaction_failed(connection):
                            # The handler swallowed a database error.
                            raise DatabaseError("the handler left its transaction unusable")
                        savepoint.disarm()
                        job.handler_returned()  # it cannot time out any more
                        job.uncommitted = True
                        succeeded.append(job)
                        registered[job] = (callbacks, len(connection.run_on_commit))
                    except BaseException as exc:  # noqa: BLE001  (a handler may raise anything)
                        job.handler_returned()
                        if not isinstance(exc, LeaseLost):  # a timed-out job is recorded
                            failed.append((job, exc))
                            job.failure = exc
                        # Undo this job alone: its writes and its on_commit callbacks.
                        # (If the connection is gone this raises: the batch fails.)
                        savepoint.rollback()
                        connection.needs_rollback = False
                        del connection.run_on_commit[callbacks:]
                    if (
                        len(batch) >= limit
                        or savepoint.opened >= ATOMIC_BATCH_MAX
                        or time.monotonic() - began > ATOMIC_BATCH_SECONDS
                    ):
                        break
                    taken = self.pool.take_nowait()
                    if taken is None:
                        break
                    if taken.spec is None or not taken.spec.atomic:
                        after = taken
                        break
                    if not runner.start(taken):
                        break
                    batch.append(taken)
                    job = taken
                keep = [j for j in succeeded if not j.abandoned]
                # Workflow steps move in the acknowledgement's transaction
                # (and its round trip).
                steps = [
                    (j.message, str(j.step_result))
                    for j in keep
                    if j.message.workflow_step_id is not None
                ]
                moved = None
                if keep:
                    try:
                        # No handler of the batch ran a query: the
                        # acknowledgement commits alone, in one round trip.
                        with (
                            nullcontext(False)
                            if steps and bookkeeping.adds_steps(m for m, _ in steps)
                            else autocommit_if_unused(connection) as alone
                        ):
                            messages = [j.message for j in keep]
                            if steps:
                                acked, moved = bookkeeping.acknowledge(messages, steps, using)
                            else:
                                acked = lifecycle.ack_leased(messages)
                    except DatabaseError as exc:
                        if not lock_timed_out(exc):
                            raise
                        # A row of the batch is locked by another transaction
                        # (past LOCK_TIMEOUT): the others need not wait for it.
                        lock_timeout = first_line(exc)
                        raise _BatchRolledBack from exc
                    if len(acked) != len(keep):
                        if not alone:
                            raise _BatchRolledBack
                        # Committed already, and without writes to undo: the
                        # acknowledged are done, the others lost their lease.
                        lost = [j for j in keep if j.message.id not in acked]
                        succeeded = [j for j in succeeded if j not in lost]
                        # Their on_commit callbacks must not run (the last first:
                        # the earlier ones' positions stay as they are).
                        for job in reversed(lost):
                            start, end = registered[job]
                            del connection.run_on_commit[start:end]
                    if moved is not None:
                        self.outcomes.metrics.workflows(moved.released, moved.finished)
        except _BatchRolledBack:
            # Rolled back: run again, alone, the jobs that still held their lease
            # (all of them when the acknowledgement did not run).
            self._log_rollback(succeeded, acked, lock_timeout)
            for job in succeeded:
                job.uncommitted = False
                if job.abandoned:
                    continue
                if acked is None or job.message.id in acked:
                    job.duration = None
                    runner.run_one(job)
                else:
                    job.log_lease_lost_before_commit()
                    runner.finished(job, LOST)
            succeeded = []
        except BaseException as exc:  # noqa: BLE001  (the database failed under the batch)
            drop_broken_connections()
            if succeeded:  # (the failed ones' failures are recorded below)
                logger.warning(
                    "Worker %s: a batch of %s atomic handler(s) could not commit (%s); "
                    "the messages run again (handed back once the database answers when "
                    "the connection died, else after their lease)",
                    self.config.worker_id,
                    len(succeeded),
                    first_line(exc),
                )
            for job in succeeded:
                job.uncommitted = False
                self.outcomes.lost_connection(job, exc)
                runner.finished(job, LOST)
            succeeded = []
            for job in self.ledger.in_flight(batch):
                if not any(job is j for j, _ in failed):  # (recorded below)
                    self.outcomes.lost_connection(job, exc)
        finally:
            drop_broken_connections()
        for job in succeeded:
            job.uncommitted = False
            runner.finished(job, LOST if job.abandoned else DONE)
        for job in lost:
            job.uncommitted = False
            job.log_lease_lost_before_commit()
            runner.finished(job, LOST)
        for job, failure in failed:
            outcome = LOST if job.abandoned else self.outcomes.record_failure(job, failure)
            runner.finished(job, outcome)
        # A job cut off by a broken connection (neither succeeded nor failed):
        # its lease expires and maintenance returns it.
        for job in self.ledger.in_flight(batch):
            runner.finished(job, LOST)
        for job in batch:
            job.batch = job.failure = None  # no reference cycles: freed at once, not by the GC
        if after is not None:
            runner.run_job(after)

    def _log_rollback(
        self, succeeded: list[Job], acked: set[int] | None, lock_timeout: str | None
    ) -> None:
        worker_id = self.config.worker_id
        if lock_timeout is not None:
            logger.warning(
                "Worker %s: the acknowledgement of an atomic batch waited too long for a row "
                "lock held by another transaction (%s); the batch was rolled back and its %s "
                "message(s) run again one by one",
                worker_id,
                lock_timeout,
                len(succeeded),
            )
        elif acked is None:
            logger.warning(
                "Worker %s: a handler's failure could not be undone on its own (it broke "
                "the transaction before its first query through Django); its batch was "
                "rolled back and the other %s message(s) run again one by one",
                worker_id,
                len(succeeded),
            )
        else:
            logger.warning(
                "Worker %s: %s of %s message(s) of an atomic batch lost their lease before "
                "the commit; the batch was rolled back and the others run again one by one",
                worker_id,
                len(succeeded) - len(acked),
                len(succeeded),
            )
