"""The jobs a worker holds, from their claim to their acknowledgement, and
what it has finished.

A job is *in flight* from its claim until its handler is done (*queued*
until a handler thread takes it); then, for atomic=False handlers, *unacked*
until its acknowledgement is flushed. One lock guards it all, because a job
moves from one to the other in one step: the loop, the heartbeat and
shutdown never miss a job nor see it twice. This is the only writer of
those collections and of the ``processed`` count.
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from collections.abc import Callable

from django_pgqueue.sql import claim as claim_sql
from django_pgqueue.worker.config import AUTO_PREFETCH_SECONDS, WorkerConfig, runs_on_event_loop
from django_pgqueue.worker.job import ACK_PENDING, SETTLED, Job

# Acknowledgements of atomic=False handlers wait at most this long to be
# flushed together (or until a batch's worth is waiting).
ACK_DELAY = 0.05
# --prefetch auto: the weight of a handler's duration in the running
# average (about the last twenty runs count).
DURATION_WEIGHT = 0.05
# The event loop's room counts in the claims for this long after the last
# claim that brought an async handler's message: a worker whose queues hold
# only sync messages claims for its threads alone, as without the loop (it
# would hold the loop's share of them in its queue, away from the other
# workers and from a pause).
ASYNC_ROOM_SECONDS = 10.0


class Ledger:
    def __init__(self, config: WorkerConfig, stuck: Callable[[], int]) -> None:
        self._config = config
        # What it may hold: read on every claim and finish. With
        # prefetch_auto it follows the handlers' durations (claim_size),
        # starting with the threads alone until a handler has run.
        # (The threads'; the event loop's is async_concurrency, apart.)
        self._capacity = config.concurrency if config.prefetch_auto else config.capacity
        self._average_duration: float | None = None  # seconds, prefetch_auto only
        self._stuck = stuck  # handler threads lost to timed-out handlers, not replaced
        self._lock = threading.Lock()
        self._inflight: dict[int, Job] = {}  # message id -> job whose handler runs
        self._on_loop = 0  # of those, the jobs of the event loop
        self._loop_seen = -math.inf  # time.monotonic() of the last claim that brought one
        self._unacked: dict[int, Job] = {}  # message id -> job done, not acknowledged yet
        self.queued = 0  # jobs in flight that no thread has taken yet
        self._acking = 0  # acknowledgements a handler thread is sending
        self._sending: list[Job] = []  # their jobs
        self.ack_due: float | None = None  # time.monotonic() by which to flush the unacked
        # When the main loop next wakes (time.monotonic()), set by the loop
        # before it waits; read by the handler threads (wakes_the_loop).
        self.loop_wakes_at = math.inf
        self.processed = 0  # acknowledged, retried or dead-lettered by this worker

    # --- claims ---------------------------------------------------------------

    def claim_size(self) -> int:
        """How many messages to claim now: up to the free capacity, at most a
        batch; while the threads still have enough queued work, nothing until
        a whole batch is free (fewer, larger claims)."""
        with self._lock:
            if self._config.prefetch_auto:
                self._capacity = self._auto_capacity()
            return self._claim_size_locked()

    def _auto_capacity(self) -> int:
        """The threads, and ahead of them what they finish in about
        AUTO_PREFETCH_SECONDS at the handlers' average duration, at most
        ``prefetch``: nothing ahead for handlers slower than that."""
        config, average = self._config, self._average_duration
        if average is None:
            return config.concurrency  # no handler has run yet
        if average <= 0:
            return config.capacity
        ahead = int(config.concurrency * AUTO_PREFETCH_SECONDS / average)
        return config.concurrency + min(config.prefetch, ahead)

    def _claim_size_locked(self) -> int:
        config = self._config
        free = self._capacity - (len(self._inflight) - self._on_loop) - self._stuck()
        if free < config.batch_size and self.queued >= config.concurrency:
            free = 0  # the threads have queued work: wait until a batch is free
        if config.async_concurrency and time.monotonic() - self._loop_seen < ASYNC_ROOM_SECONDS:
            # Async handlers' messages came lately: the event loop's room too.
            free = max(free, 0) + config.async_concurrency - self._on_loop
        return max(0, min(free, config.batch_size))

    def add(self, jobs: list[Job]) -> None:
        """Claimed ``jobs``, before they go to the handler threads: all in
        flight before any thread starts (an atomic batch sees them)."""
        loop = self._config.async_concurrency > 0
        with self._lock:
            for job in jobs:
                self._inflight[job.row[claim_sql.ROW_ID]] = job
                if loop and runs_on_event_loop(job.spec):
                    job.on_loop = True
                    self._on_loop += 1
                    self._loop_seen = time.monotonic()
            self.queued += len(jobs)

    def start(self, job: Job) -> bool:
        """Take ``job`` out of the queue for this thread; False if it was
        handed back (shutdown) or abandoned meanwhile."""
        with self._lock:
            if not job.queued:
                return False
            job.queued = False
            self.queued -= 1
            if job.abandoned:
                return False
            job.started = time.monotonic()
            if job.spec is not None and job.spec.timeout is not None:
                job.deadline = job.started + job.spec.timeout
            job.thread = threading.get_ident()
        return True

    def finish(self, job: Job, outcome: str) -> tuple[list[Job], bool]:
        """``job``'s handler is done with ``outcome``. Returns the unacked
        jobs this thread should acknowledge now (a batch's worth is waiting:
        on its own connection, while the main loop's claim runs on another),
        and whether the main loop has work: a claim is due, acknowledgements
        are piling up, or nothing is left in flight."""
        message = job.message
        acks: list[Job] = []
        duration = job.duration
        with self._lock:
            if duration is not None and self._config.prefetch_auto:
                average = self._average_duration
                if average is not None:
                    duration = average + (duration - average) * DURATION_WEIGHT
                self._average_duration = duration
            if self._inflight.get(message.id) is job:
                self._remove_locked(job)
            if outcome == ACK_PENDING and not job.abandoned:
                self._unacked[message.id] = job
                if message.group_key is not None:
                    # Its group's next message waits for this acknowledgement:
                    # flush now (with the claim that promotes the next one).
                    self.ack_due = time.monotonic()
                elif self.ack_due is None:
                    self.ack_due = time.monotonic() + ACK_DELAY
                if len(self._unacked) >= self._config.batch_size and not self._acking:
                    acks = self._take_unacked_locked()
                    self._acking = len(acks)
                    self._sending = acks
            elif outcome in SETTLED:
                self.processed += 1
            has_work = (
                self._claim_size_locked() > 0
                or len(self._unacked) >= self._config.batch_size
                or not self._inflight
            )
        return acks, has_work

    def _remove_locked(self, job: Job) -> None:
        """``job`` is no longer in flight (if it was)."""
        if self._inflight.pop(job.message.id, None) is job and job.on_loop:
            self._on_loop -= 1

    # --- acknowledgements -----------------------------------------------------

    def take_unacked(self) -> list[Job]:
        """The finished atomic=False jobs, to acknowledge now."""
        with self._lock:
            return self._take_unacked_locked()

    def _take_unacked_locked(self) -> list[Job]:
        jobs = list(self._unacked.values())
        self._unacked.clear()
        self.ack_due = None
        return jobs

    def put_back(self, jobs: list[Job], delay: float) -> None:
        """Acknowledge ``jobs`` again, ``delay`` seconds from now at the latest."""
        if not jobs:
            return
        with self._lock:
            for job in jobs:
                self._unacked.setdefault(job.message.id, job)
            due = time.monotonic() + delay
            self.ack_due = due if self.ack_due is None else min(self.ack_due, due)

    def acked(self, count: int) -> None:
        """``count`` acknowledgements removed their row."""
        with self._lock:
            self.processed += count

    def sent(self) -> None:
        """The handler thread that took a batch of acknowledgements (``finish``)
        is done with it: acknowledged, or put back."""
        with self._lock:
            self._acking = 0
            self._sending = []

    # --- what it holds ----------------------------------------------------------

    def count(self) -> int:
        """Messages in flight (the inflight gauge, the health check, the heartbeat)."""
        with self._lock:
            return len(self._inflight)

    def held_ids(self) -> set[int]:
        """The ids of every message it holds: in flight, unacked, or being
        acknowledged by a handler thread (worker.cutoff's sweep)."""
        with self._lock:
            return {*self._inflight, *self._unacked, *(j.message.id for j in self._sending)}

    def busy(self) -> bool:
        """Whether a message is still in flight or unacknowledged."""
        with self._lock:
            return bool(self._inflight or self._unacked or self._acking)

    def in_flight(self, jobs: list[Job]) -> list[Job]:
        """Those of ``jobs`` still in flight (their run has not finished)."""
        with self._lock:
            return [job for job in jobs if self._inflight.get(job.message.id) is job]

    def leased(self) -> list[Job]:
        """The jobs whose lease the heartbeat extends: in flight or unacked."""
        with self._lock:
            return [
                job
                for job in itertools.chain(self._inflight.values(), self._unacked.values())
                if not job.abandoned
            ]

    def request_cancel(self, ids: set[int]) -> list[Job]:
        """Cancellation was asked for the messages ``ids``: mark those in
        flight (their handler's ``cancel_requested()`` turns True; one that
        has not started ends cancelled without running). Returns the jobs
        newly marked."""
        with self._lock:
            jobs = [self._inflight.get(pk) for pk in ids]
            marked = [j for j in jobs if j is not None and not j.cancel_requested]
            for job in marked:
                job.cancel_requested = True
        return marked

    # --- timeouts -----------------------------------------------------------------

    def wakes_the_loop(self, job: Job) -> bool:
        """Whether ``job``'s deadline (set by ``start``) comes before the main
        loop's next wake-up (``loop_wakes_at``), which was reckoned before
        this handler started: the loop must look again, or it notices the
        overrun only when it wakes for another reason (its next poll)."""
        return job.deadline is not None and job.deadline < self.loop_wakes_at

    def next_deadline(self) -> float:
        """When the first running handler times out (time.monotonic(); inf: none does)."""
        with self._lock:
            deadlines = [j.deadline for j in self._inflight.values() if j.deadline is not None]
        return min(deadlines, default=math.inf)

    def late(self, now: float) -> list[Job]:
        """The jobs whose handler ran past its deadline."""
        with self._lock:
            return [
                j for j in self._inflight.values() if j.deadline is not None and now > j.deadline
            ]

    def abandon(self, jobs: list[Job]) -> None:
        """Give up on ``jobs``: whatever their handler does now is discarded."""
        with self._lock:
            for job in jobs:
                job.abandoned = True
                self._remove_locked(job)

    def hostages(self, job: Job) -> tuple[list[Job], list[tuple[Job, BaseException]]]:
        """The jobs of ``job``'s atomic batch that would wait for it: those
        whose handler succeeded (uncommitted), and those whose handler failed
        with their failure (not recorded yet). All are abandoned."""
        with self._lock:
            batch = job.batch or ()
            succeeded = [j for j in batch if j.uncommitted and not j.abandoned]
            failed = [(j, j.failure) for j in batch if j.failure is not None and not j.abandoned]
            for other in (*succeeded, *(j for j, _ in failed)):
                other.abandoned = True
                self._remove_locked(other)
        return succeeded, failed

    # --- shutdown ---------------------------------------------------------------------

    def unstarted(self) -> list[Job]:
        """Take back the jobs no thread has started (they are abandoned)."""
        with self._lock:
            unstarted = [j for j in self._inflight.values() if j.queued]
            for job in unstarted:
                job.queued, job.abandoned = False, True
                self.queued -= 1
                self._remove_locked(job)
        return unstarted

    def leftover(self) -> list[Job]:
        """Abandon every job still held (in flight or unacked)."""
        with self._lock:
            leftover = list(self._inflight.values()) + list(self._unacked.values())
            for job in leftover:
                job.abandoned = True
        return leftover
