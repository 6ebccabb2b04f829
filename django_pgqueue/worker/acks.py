"""Acknowledgements of atomic=False handlers, sent in batches: carried by the
next claim's round trip (``claiming``), flushed by the main loop when due
(``flush``), or sent by a handler thread once a batch's worth is waiting
(``send_from_handler_thread``). The waiting jobs are kept in the Ledger.

An acknowledgement waits a moment for a row that another transaction has
locked (mostly the heartbeat's lease extension, for milliseconds), then
skips it and tries it again a moment later (``LOCKED_ACK_DELAY``), skipping
it at once from then on (sql.acks)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from django.db import connections, transaction

from django_pgqueue import conf, lifecycle
from django_pgqueue.db import drop_broken_connections, first_line
from django_pgqueue.worker.job import Job
from django_pgqueue.worker.ledger import ACK_DELAY, Ledger
from django_pgqueue.worker.outcomes import Outcomes
from django_pgqueue.worker.wakeup import Wakeup
from django_pgqueue.workflows import bookkeeping

logger = logging.getLogger(__package__)

# An acknowledgement that found its row locked by another transaction is
# tried again this much later, and logged once the row has been locked for
# LOCKED_ACK_WARNING seconds (the heartbeat's lease extension locks rows for
# milliseconds: no reason to warn).
LOCKED_ACK_DELAY = 0.1
LOCKED_ACK_WARNING = 1.0


@dataclass(eq=False)
class Acks:
    worker_id: str
    ledger: Ledger
    wakeup: Wakeup
    outcomes: Outcomes
    # The jobs whose acknowledgement found their row locked and waits to be
    # sent again: these skip locked rows at once (``wait_briefly``).
    deferred: set[Job] = field(default_factory=set)

    def wait_briefly(self, jobs: list[Job]) -> bool:
        """Whether the acknowledgement of ``jobs`` may first wait briefly for
        a locked row (lifecycle.ack_unlocked): not when one of them found
        its row locked before (no scan of the jobs when none did)."""
        return not self.deferred or self.deferred.isdisjoint(jobs)

    def flush(self) -> None:
        """Acknowledge the jobs waiting for it."""
        jobs = self.ledger.take_unacked()
        if jobs:
            self._send(jobs)

    def send_from_handler_thread(self, jobs: list[Job]) -> None:
        """Acknowledge the batch ``jobs`` that a handler thread took (on its
        own connection); on failure the main loop flushes them again."""
        try:
            self._send(jobs)
        except BaseException as exc:  # noqa: BLE001  (the main loop flushes them again)
            drop_broken_connections()
            logger.warning(
                "Worker %s: could not acknowledge %s message(s) (%s); retrying",
                self.worker_id,
                len(jobs),
                first_line(exc),
            )
        finally:
            self.ledger.sent()
            self.wakeup.set()

    def put_back(self, jobs: list[Job]) -> None:
        """Acknowledgements that were not sent (the statement failed): flushed again."""
        self.ledger.put_back(jobs, ACK_DELAY)

    def acknowledged(self, jobs: list[Job], finished: set[int], busy: set[int]) -> None:
        """The acknowledgement of ``jobs`` removed the rows ``finished``, and
        skipped those ``busy`` (locked by another transaction: sent again
        later); the others had lost their lease (lifecycle logged them)."""
        self.ledger.acked(len(finished))
        if self.deferred:
            self.deferred.difference_update(jobs)  # the busy ones are deferred again below
        self.outcomes.all_done([job for job in jobs if job.message.id in finished])
        waiting = [job for job in jobs if job.message.id in busy] if busy else None
        if waiting:
            self._wait_for_locked(waiting)

    def carried(self, jobs: list[Job]) -> list[Job]:
        """Of ``jobs``, those a claim may carry: a workflow step's
        acknowledgement is sent apart first, in a transaction with its
        step's bookkeeping (on failure all of them wait to be flushed again)."""
        if not any(job.message.workflow_step_id is not None for job in jobs):
            return jobs
        steps = [job for job in jobs if job.message.workflow_step_id is not None]
        plain = [job for job in jobs if job.message.workflow_step_id is None]
        try:
            self._send_steps(steps)
        except BaseException:
            self.put_back(plain)
            raise
        return plain

    def _send(self, jobs: list[Job]) -> None:
        """Acknowledge ``jobs``; on failure they wait to be flushed again."""
        jobs = self.carried(jobs)
        if not jobs:
            return
        try:
            finished, busy = lifecycle.ack_unlocked(
                [job.message for job in jobs], wait_briefly=self.wait_briefly(jobs)
            )
        except BaseException:
            self.put_back(jobs)
            raise
        self.acknowledged(jobs, finished, busy)
        if any(job.message.group_key is not None for job in jobs):
            self.wakeup.release_groups()  # the next claim promotes their groups' next

    def _wait_for_locked(self, jobs: list[Job]) -> None:
        """Acknowledge ``jobs`` again a moment later: another transaction has
        their row locked (the acknowledgement skipped it). Mostly that is the
        heartbeat's lease extension, for a few milliseconds; a row locked for
        longer (an admin, a script) is logged, once. The leases are extended
        whenever the row is free; a lease that runs out meanwhile returns the
        message to the queue (it runs again: atomic=False)."""
        now = time.monotonic()
        self.deferred.update(jobs)
        for job in jobs:
            if job.ack_busy_since is None:
                job.ack_busy_since = now
            elif not job.ack_busy_logged and now - job.ack_busy_since >= LOCKED_ACK_WARNING:
                job.ack_busy_logged = True  # one line per message, not one per try
                logger.warning(
                    "Message id=%s topic=%s attempt=%s: acknowledgement deferred for %.1fs, "
                    "another transaction holds its row locked; trying again",
                    job.message.pk,
                    job.message.topic,
                    job.message.attempts,
                    now - job.ack_busy_since,
                    extra={
                        "message_id": job.message.pk,
                        "topic": job.message.topic,
                        "attempt": job.message.attempts,
                        "state": "ack_deferred",
                    },
                )
        self.ledger.put_back(jobs, LOCKED_ACK_DELAY)

    def _send_steps(self, jobs: list[Job]) -> None:
        """Acknowledge workflow steps' messages and move their steps (the
        steps after them released), in one transaction; on failure they
        wait to be flushed again."""
        using = conf.database_alias()
        messages = [job.message for job in jobs]
        steps = [(job.message, str(job.step_result)) for job in jobs]
        try:
            if bookkeeping.adds_steps(messages):
                with transaction.atomic(using=using):  # the added steps, with the rest
                    finished, moved = bookkeeping.acknowledge(
                        messages, steps, using, skip_locked=True
                    )
            else:
                # One statement in autocommit, its commit not waiting for the
                # WAL flush, like ack_unlocked's: a lost acknowledgement
                # loses its step's end with it, and the message runs again.
                async_commit = not connections[using].in_atomic_block
                finished, moved = bookkeeping.acknowledge(
                    messages, steps, using, async_commit=async_commit, skip_locked=True
                )
            busy = lifecycle.unacknowledged(messages, finished)
        except BaseException:
            self.put_back(jobs)
            raise
        self.outcomes.metrics.workflows(moved.released, moved.finished)
        self.acknowledged(jobs, finished, busy)
        if any(job.message.group_key is not None for job in jobs):
            self.wakeup.release_groups()
