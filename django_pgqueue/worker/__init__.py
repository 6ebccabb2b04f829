"""The worker: claim ready messages, run their handlers, acknowledge them.

Threads of one worker process:

- the main thread runs the loop: flush acknowledgements, claim up to the
  free capacity, hand messages to the pool, then wait for a notification,
  a free slot, the next due run_at or the poll interval;
- the listener holds a dedicated psycopg connection (never one of Django's
  pooled connections, which would carry the LISTEN to their next user) and
  wakes the loop when a NOTIFY names one of its queues;
- the heartbeat extends the leases of in-flight messages, records the
  worker's liveness in the worker table (an idle worker does that in its
  poll instead, so idling costs one query per poll interval) and runs
  maintenance (rescue of crashed workers' messages);
- ``concurrency`` handler threads, each with its own database connection.

Connections are kept open across messages (reconnecting per message costs
several times the work); a connection is dropped only when it is broken.
"""

import inspect
import itertools
import logging
import math
import os
import queue
import random
import signal
import socket
import threading
import time
import traceback
import uuid
from dataclasses import dataclass

import psycopg
from asgiref.sync import async_to_sync
from django.db import DatabaseError, connections, transaction

from django_pgqueue import conf, lifecycle, maintenance, policy, registry, signals
from django_pgqueue.exceptions import HandlerTimeout, Permanent, Retry, describe
from django_pgqueue.models import Category
from django_pgqueue.notify import CHANNEL, GROUPS_CHANNEL, listen_connection
from django_pgqueue.observability.metrics import DEAD_LETTERED, RETRIED, NullMetrics

logger = logging.getLogger(__name__)

# Database trouble in the main loop: wait this long, doubling up to the cap.
RECONNECT_DELAY = 0.5
RECONNECT_DELAY_CAP = 30.0

# Default --batch-size: this many messages per handler thread.
BATCH_PER_THREAD = 4

# Acknowledgements of atomic=False handlers wait at most this long to be
# flushed together (or until a batch's worth is waiting).
ACK_DELAY = 0.05

# An acknowledgement that found its row locked by another transaction is
# tried again this much later, and logged once the row has been locked for
# LOCKED_ACK_WARNING seconds (the heartbeat's lease extension locks rows for
# milliseconds: no reason to warn).
LOCKED_ACK_DELAY = 0.1
LOCKED_ACK_WARNING = 1.0

# Atomic handlers share a transaction (and its commit): a handler thread runs
# the atomic messages waiting in the pool one after another, each in a
# savepoint, and commits them with their acknowledgement once it has run
# batch_size of them, none is waiting, or this much time has passed.
ATOMIC_BATCH_SECONDS = 0.05
# At most this many handlers per shared transaction: each savepoint that
# writes takes a subtransaction id, and past 64 in one transaction
# PostgreSQL's snapshots overflow to pg_subtrans, which slows every session.
ATOMIC_BATCH_MAX = 50
SAVEPOINT_SQL = "SAVEPOINT pgqueue_job"
NEXT_SAVEPOINT_SQL = "RELEASE SAVEPOINT pgqueue_job; SAVEPOINT pgqueue_job"
ROLLBACK_SAVEPOINT_SQL = "ROLLBACK TO SAVEPOINT pgqueue_job"


class _LeaseLost(Exception):
    """The handler's lease is gone: roll its work back."""


class _AckLocked(Exception):
    """An atomic handler's acknowledgement waited past LOCK_TIMEOUT for a row
    lock held by another transaction: roll the handler's work back."""


class _BatchRolledBack(Exception):
    """Roll the whole atomic batch back; its other jobs run again alone."""


class _HandlerSavepoint:
    """An execute wrapper on the queue's connection while an atomic batch
    runs: just before the running handler's first query it opens the
    handler's savepoint (releasing the previous handler's, in the same round
    trip). A handler that runs no query through Django (it calls an API,
    sends an email) costs no round trip, and has nothing to undo.

    Queries sent around Django (the driver's connection, ``callproc``,
    ``copy``) open no savepoint: a handler must not fail after writing that
    way. A failure that left the transaction broken with no savepoint to
    return to rolls the whole batch back (``_BatchRolledBack``)."""

    def __init__(self, connection):
        self.connection = connection
        self.armed = False  # a handler is running
        self.placed = False  # the running handler's savepoint is open
        self.exists = False  # some savepoint is open in this transaction

    def __call__(self, execute, sql, params, many, context):
        if self.armed and not self.placed:
            self._open()
        return execute(sql, params, many, context)

    def arm(self):
        self.armed, self.placed = True, False

    def disarm(self):
        self.armed = False

    def _open(self):
        self.armed = False  # if the savepoint fails, the batch rolls back
        _execute_raw(self.connection, NEXT_SAVEPOINT_SQL if self.exists else SAVEPOINT_SQL)
        self.exists = self.placed = self.armed = True

    def rollback(self):
        """Undo the running handler's writes; without its savepoint there is
        nothing to undo unless the transaction broke (the whole batch then
        rolls back)."""
        was_armed, self.armed = self.armed, False
        if self.placed:
            _execute_raw(self.connection, ROLLBACK_SAVEPOINT_SQL)
        elif not was_armed or _transaction_failed(self.connection):
            # Not armed: opening the savepoint failed, the previous one is
            # not this handler's to return to.
            raise _BatchRolledBack


DONE, ACK_PENDING, FAILED, LOST = "done", "ack_pending", "failed", "lost"


@dataclass(eq=False)
class _Job:
    # The claim's row; the Message is built from it when first needed, in a
    # handler thread: the main loop goes on to its next claim sooner.
    row: tuple
    spec: object
    started: float | None = None  # time.monotonic() when a thread picked it up
    deadline: float | None = None
    thread: int | None = None
    abandoned: bool = False  # timed out or handed back: its late result is discarded
    lease_lost: bool = False
    duration: float | None = None  # seconds the handler took
    queued: bool = True  # submitted to the pool, no thread has taken it yet
    batch: list | None = None  # the jobs sharing its transaction (atomic handlers)
    uncommitted: bool = False  # its handler succeeded; the batch has not committed yet
    failure: BaseException | None = None  # its handler raised; recorded after the batch
    # When an acknowledgement first found its row locked by another
    # transaction, and whether that was logged.
    ack_busy_since: float | None = None
    ack_busy_logged: bool = False
    _message: object = None

    @property
    def message(self):
        message = self._message
        if message is None:
            message = self._message = lifecycle.message_from_row(self.row)
        return message


class Worker:
    """One worker process's engine. ``run()`` blocks until stopped (or, in
    burst mode, until nothing is ready and the subscriptions it serves have
    delivered every due event); ``stop()`` may be called from any
    thread or a signal handler."""

    def __init__(
        self,
        queues=None,
        concurrency=4,
        batch_size=None,
        prefetch=None,
        burst=False,
        max_messages=None,
        shutdown_timeout=30.0,
        poll_interval=None,
        lease_seconds=None,
        worker_id=None,
        metrics=None,
        subscriptions=None,
    ):
        self.queues = list(queues or conf.queues())
        self.concurrency = concurrency
        # Claims of several messages per thread make fewer round trips (and,
        # for atomic handlers, fewer commits), like Celery's prefetch multiplier.
        self.batch_size = batch_size or BATCH_PER_THREAD * concurrency
        # Messages claimed ahead of the running ones, so that a claim can be a
        # batch while every thread is busy (their leases are extended like
        # the running ones', and shutdown hands them back at once).
        self.prefetch = self.batch_size if prefetch is None else prefetch
        self.capacity = concurrency + self.prefetch
        self.burst = burst
        self.max_messages = max_messages
        self.shutdown_timeout = shutdown_timeout
        self.poll_interval = poll_interval or conf.get("POLL_INTERVAL")
        self.lease_seconds = lease_seconds or conf.get("LEASE_SECONDS")
        self.listen = conf.get("NOTIFY")
        self.heartbeat_interval = conf.get("HEARTBEAT_INTERVAL")
        # The heartbeat thread beats only when the polls have not: later than
        # a poll that was due could (interval + a jittered poll, with room to
        # spare), yet within two intervals, so the row (alive for three)
        # never goes stale while the worker polls rarely or is busy.
        self._thread_beat_after = min(
            max(1.5 * self.heartbeat_interval, self.heartbeat_interval + 1.5 * self.poll_interval),
            2 * self.heartbeat_interval,
        )
        self.hostname = socket.gethostname()
        self.worker_id = worker_id or f"{self.hostname}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        self.metrics = metrics or NullMetrics()
        # Streams: the subscriptions it delivers to ("all", "none"/None, or
        # names; an unknown name is a ValueError), in threads of their own
        # (stream_worker.py).
        from django_pgqueue.streams.subscribers import select

        self.subscriptions = select(subscriptions)
        self._streams = None
        self.claimed = 0
        self.processed = 0  # acknowledged, retried or dead-lettered by this worker

        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._notified = False
        # A message group may wait for its next message's promotion: the
        # next claim promotes first (lifecycle.ack_and_claim_rows).
        self._groups_released = False
        self._stopping = threading.Event()  # no more claims
        self._exit = threading.Event()  # helper threads end
        self._maintenance_wanted = False
        self._heartbeat_wake = threading.Event()  # exit, or maintenance wanted
        self._inflight = {}  # message id -> _Job whose handler runs
        self._unacked = {}  # message id -> _Job done, acknowledgement not yet flushed
        self._ack_due = None  # time.monotonic() by which the unacked must be flushed
        self._acking = 0  # acknowledgements a handler thread is sending
        self._few_ready = False  # the last claim came back short
        self._queued = 0  # jobs in _inflight that no thread has taken yet
        self._pool = None
        self._threads = []
        self._last_beat = None  # time.monotonic() of the last recorded heartbeat
        # For health checks: when the main loop last went round, and the
        # database error it is recovering from, if any.
        self._loop_seen = time.monotonic()
        self.loop_error = None

    # --- public ---------------------------------------------------------------

    def run(self, install_signals=False):
        if connections[conf.database_alias()].in_atomic_block:
            # Claims would become savepoints of the caller's transaction and
            # stay invisible to every other worker until it commits.
            raise RuntimeError("Worker.run() cannot be called inside a transaction")
        previous = self._install_signals() if install_signals else None
        logger.info(
            "Worker %s starting: queues=%s concurrency=%s batch=%s notify=%s lease=%ss",
            self.worker_id,
            ",".join(self.queues),
            self.concurrency,
            self.batch_size,
            self.listen,
            self.lease_seconds,
        )
        self._pool = _HandlerPool(self.concurrency, self._run_job)
        self.metrics.track_inflight(self._inflight_count)
        self._start_thread(self._heartbeat_loop, "pgqueue-heartbeat")
        if self.listen:
            self._start_thread(self._listen_loop, "pgqueue-listener")
        from django_pgqueue.streams.thread import start_for  # streams: None when it serves none

        self._streams = start_for(self)
        try:
            self._loop()
        finally:
            self._shutdown()
            if previous:
                for signum, handler in previous.items():
                    signal.signal(signum, handler)
        logger.info("Worker %s stopped after %s message(s)", self.worker_id, self.processed)
        return self.processed

    def stop(self):
        """Stop claiming; in-flight handlers get ``shutdown_timeout`` to finish."""
        self._stopping.set()
        self._wake.set()

    def health(self):
        """``(healthy, details)`` for the --health-port: healthy while the main
        loop goes round (it wakes at least once per poll interval) and its
        last database work succeeded, and, when it delivers to stream
        subscriptions, while its delivery thread lives and goes round
        (``StreamWorker.health``, under "streams")."""
        loop_age = time.monotonic() - self._loop_seen
        loop_alive = not self._stopping.is_set() and loop_age < self.poll_interval * 2 + 5
        details = {
            "worker_id": self.worker_id,
            "queues": self.queues,
            "loop_alive": loop_alive,
            "loop_age_seconds": round(loop_age, 3),
            "inflight": self._inflight_count(),
            "processed": self.processed,
        }
        if self.loop_error:
            details["loop_error"] = self.loop_error
        healthy = loop_alive and not self.loop_error
        if self._streams is not None:
            streams_healthy, details["streams"] = self._streams.health()
            healthy = healthy and streams_healthy
        return healthy, details

    @property
    def stream_delivery_died(self):
        """Why its stream delivery thread died (None while it lives, or when
        it delivers to no subscription)."""
        streams = self._streams
        return streams.error if streams is not None and streams.dead else None

    # --- the loop -------------------------------------------------------------

    def _loop(self):
        ready_hint = True  # catch up on whatever is ready at start
        probe = False
        due_at = None
        next_poll = time.monotonic() + self._poll_delay()
        db_delay = RECONNECT_DELAY
        while not self._stopping.is_set():
            self._loop_seen = time.monotonic()
            try:
                if not (ready_hint and self._claim_size() > 0 and not self._limit_reached()):
                    self._flush_acks()  # else the claim below carries them
                self._expire_timeouts()
                if self._limit_reached() and not self._busy():
                    break
                if self.burst and not ready_hint and not self._busy():
                    probe = True  # all done: exit unless more is ready
                if ready_hint and self._claim_size() > 0 and not self._limit_reached():
                    asked, got = self._claim()
                    # A full batch: more may be waiting; so may more groups.
                    ready_hint = got == asked or self._groups_released
                    probe = probe or got < asked
                if probe:
                    probe = False
                    beat = self._beat() if self._beat_due(self.heartbeat_interval) else None
                    found = lifecycle.probe(self.queues, beat)
                    if beat is not None:
                        self._last_beat = time.monotonic()
                    if found.lease_expired:  # a worker died: rescue now
                        self._maintenance_wanted = True
                        self._heartbeat_wake.set()
                    if found.groups_released:
                        with self._lock:
                            self._groups_released = True
                    if found.ready or found.groups_released:
                        ready_hint = True
                    elif self.burst and not self._busy() and self._streams_caught_up():
                        break
                    until_due = found.seconds_until_due()
                    due_at = None if until_due is None else time.monotonic() + until_due
                db_delay = RECONNECT_DELAY
                self.loop_error = None
            except DatabaseError as exc:
                _drop_broken_connections()
                self.loop_error = _first_line(exc)
                self.metrics.reconnected("loop")
                logger.warning(
                    "Worker %s: database error (%s)%s; retrying in %.1fs",
                    self.worker_id,
                    self.loop_error,
                    _error_hint(exc),
                    db_delay,
                )
                self._stopping.wait(db_delay * random.uniform(0.8, 1.2))
                db_delay = min(db_delay * 2, RECONNECT_DELAY_CAP)
                ready_hint = probe = True
                continue
            if ready_hint and self._claim_size() > 0 and not self._limit_reached():
                continue
            now = time.monotonic()
            wake_at = min(
                next_poll, due_at or math.inf, self._next_deadline(), self._ack_due or math.inf
            )
            self._wake.wait(max(0.0, wake_at - now))
            self._wake.clear()
            now = time.monotonic()
            with self._lock:
                if self._notified or self._groups_released:
                    self._notified = False
                    ready_hint = True
            if due_at is not None and now >= due_at:
                due_at = None
                ready_hint = True
            if now >= next_poll:
                next_poll = now + self._poll_delay()
                probe = True

    def _streams_caught_up(self):
        """--burst: every served subscription has delivered what is due (or
        the delivery thread has died: it delivers nothing more)."""
        streams = self._streams
        return streams is None or streams.caught_up or not streams.alive

    def _claim(self):
        asked = self._claim_size()
        if self.max_messages is not None:
            asked = min(asked, self.max_messages - self.claimed)
        acks = self._take_unacked()
        with self._lock:
            promote = self._groups_released or any(job.message.group_key for job in acks)
            self._groups_released = False
        started = time.perf_counter()
        try:
            result = lifecycle.ack_and_claim_rows(
                [job.message for job in acks],
                self.queues,
                asked,
                self.worker_id,
                self.lease_seconds,
                few_ready=self._few_ready,
                promote=promote,
            )
        except BaseException:
            self._return_unacked(acks)  # flushed again next time
            if promote:
                with self._lock:
                    self._groups_released = True
            raise
        finished, busy, rows = result.acked, result.busy, result.rows
        if result.groups_left:
            with self._lock:
                self._groups_released = True
        self.metrics.claimed(len(rows), time.perf_counter() - started)
        # After a short claim the next one expects few (lifecycle.claim's few_ready).
        self._few_ready = len(rows) < asked
        self._acked(acks, finished, busy)
        self.claimed += len(rows)
        jobs = [_Job(row=row, spec=registry.lookup(row[lifecycle.ROW_TOPIC])) for row in rows]
        with self._lock:  # all in flight before any thread starts (an atomic batch sees them)
            for job in jobs:
                self._inflight[job.row[lifecycle.ROW_ID]] = job
            self._queued += len(jobs)
        for job in jobs:
            self._pool.submit(job)
        return asked, len(rows)

    def _inflight_count(self):
        with self._lock:
            return len(self._inflight)

    def _claim_size(self):
        """How many messages to claim now: up to the free capacity, at most a
        batch; while the threads still have enough queued work, nothing until
        a whole batch is free (fewer, larger claims)."""
        with self._lock:
            free = self.capacity - len(self._inflight) - self._pool.stuck()
            return self._claim_size_locked(free)

    def _claim_size_locked(self, free):
        if free <= 0 or (free < self.batch_size and self._queued >= self.concurrency):
            return 0
        return min(free, self.batch_size)

    def _loop_has_work_locked(self):
        """Whether a finished job should wake the main loop: a claim is due,
        acknowledgements are piling up, or nothing is left in flight."""
        free = self.capacity - len(self._inflight) - self._pool.stuck()
        return (
            self._claim_size_locked(free) > 0
            or len(self._unacked) >= self.batch_size
            or not self._inflight
        )

    def _busy(self):
        with self._lock:
            return bool(self._inflight or self._unacked or self._acking)

    def _limit_reached(self):
        return self.max_messages is not None and self.claimed >= self.max_messages

    def _poll_delay(self):
        return self.poll_interval * random.uniform(0.9, 1.1)

    def _next_deadline(self):
        with self._lock:
            deadlines = [j.deadline for j in self._inflight.values() if j.deadline is not None]
        return min(deadlines, default=math.inf)

    # --- handler threads ------------------------------------------------------

    def _start(self, job):
        """Take ``job`` out of the queue for this thread; False if it was
        handed back (shutdown) or abandoned meanwhile."""
        with self._lock:
            if not job.queued:
                return False
            job.queued = False
            self._queued -= 1
            if job.abandoned:
                return False
            job.started = time.monotonic()
            if job.spec is not None and job.spec.timeout is not None:
                job.deadline = job.started + job.spec.timeout
            job.thread = threading.get_ident()
        self.metrics.started(job.message)
        return True

    def _run_job(self, job):
        if not self._start(job):
            return
        # Share a transaction only when others wait behind this one: a lone
        # message skips the savepoint round trips (lower latency when idle).
        if job.spec is not None and job.spec.atomic and self.batch_size > 1 and self._queued:
            self._run_atomic_batch(job)
        else:
            self._run_one(job)

    def _run_one(self, job):
        """Run one started job in a transaction of its own (atomic) or none."""
        message, spec = job.message, job.spec
        try:
            if spec is None:
                outcome = self._record_failure(
                    job,
                    LookupError(f"no handler for topic {message.topic!r}"),
                    category=Category.PERMANENT,
                )
            elif spec.atomic:
                with transaction.atomic(using=conf.database_alias()):
                    _call(spec, message)
                    if job.abandoned or not _ack_waiting_for_locks(message):
                        raise _LeaseLost
                outcome = DONE
            else:
                _call(spec, message)
                outcome = ACK_PENDING
        except _LeaseLost:
            _log_lease_lost_before_commit(job)
            outcome = LOST
        except _AckLocked as exc:
            # Recording a retry would wait for the same lock: the lease, which
            # the heartbeat cannot extend while the row is locked, brings the
            # message back once it expires and the row is free.
            _drop_broken_connections()
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
            outcome = LOST
        except BaseException as exc:  # noqa: BLE001  (a handler may raise anything)
            # Record the failure on a working connection, and leave one behind.
            # (A success leaves its connection as it is: looking costs more
            # than a no-op handler, and a connection broken without an error
            # reaching us fails the next handler, which replaces it.)
            _drop_broken_connections()
            try:
                outcome = LOST if job.abandoned else self._record_failure(job, exc)
            finally:
                _drop_broken_connections()
        self._finished(job, outcome)

    def _finished(self, job, outcome):
        if job.duration is None:
            job.duration = time.monotonic() - job.started
        message = job.message
        acks = None
        with self._lock:
            if self._inflight.get(message.id) is job:
                del self._inflight[message.id]
            if outcome == ACK_PENDING and not job.abandoned:
                self._unacked[message.id] = job
                if message.group_key is not None:
                    # Its group's next message waits for this acknowledgement:
                    # flush now (with the claim that promotes the next one).
                    self._ack_due = time.monotonic()
                elif self._ack_due is None:
                    self._ack_due = time.monotonic() + ACK_DELAY
                if len(self._unacked) >= self.batch_size and not self._acking:
                    # A batch's worth: this thread acknowledges them on its own
                    # connection, while the main loop's claim runs on another.
                    acks = self._take_unacked_locked()
                    self._acking = len(acks)
            elif outcome in (DONE, FAILED):
                self.processed += 1
            if message.group_key is not None and outcome in (DONE, FAILED):
                # Its group may go on (acknowledged or dead-lettered): the
                # next claim promotes the group's next message.
                self._groups_released = True
            wake = (
                self._loop_has_work_locked()
                or self._groups_released
                or (outcome == ACK_PENDING and message.group_key is not None)
            )
        if outcome == DONE:
            self._log_done(message, job.duration)
        if wake:
            self._wake.set()
        if acks:
            self._ack_from_handler_thread(acks)

    def _ack_from_handler_thread(self, jobs):
        try:
            self._send_acks(jobs)
        except BaseException as exc:  # noqa: BLE001  (the main loop flushes them again)
            _drop_broken_connections()
            logger.warning(
                "Worker %s: could not acknowledge %s message(s) (%s); retrying",
                self.worker_id,
                len(jobs),
                _first_line(exc),
            )
        finally:
            with self._lock:
                self._acking = 0
            self._wake.set()

    def _run_atomic_batch(self, first):
        """Run ``first`` and the atomic jobs queued behind it in one
        transaction, each in a savepoint, and commit them with their
        acknowledgement (one DELETE guarded by each lease token): many
        handlers share one commit, and each message's writes still commit
        or roll back with its own acknowledgement.

        A handler's savepoint is opened just before its first query (see
        _HandlerSavepoint): one that runs no query costs no round trip. A
        handler that raises rolls back to its savepoint (with the
        ``on_commit`` callbacks it registered); its failure is recorded after
        the commit. If the acknowledgement finds a lease gone, or a failure
        cannot be undone on its own, the whole transaction rolls back and the
        other jobs (those that still hold their lease) run again one by one:
        their writes were rolled back, nothing happens twice.
        """
        using = conf.database_alias()
        connection = connections[using]
        batch, succeeded, failed = [first], [], []
        after = None  # a job taken from the pool that cannot join the batch
        began = time.monotonic()
        acked = None  # the ids the acknowledgement found still leased
        lock_timeout = None  # the acknowledgement's error when it waited too long for a lock
        limit = min(self.batch_size, ATOMIC_BATCH_MAX)
        savepoint = _HandlerSavepoint(connection)
        try:
            with transaction.atomic(using=using), connection.execute_wrapper(savepoint):
                job = first
                while True:
                    job.batch = batch
                    callbacks = len(connection.run_on_commit)
                    savepoint.arm()
                    try:
                        _call(job.spec, job.message)
                        if job.abandoned:
                            raise _LeaseLost
                        if connection.needs_rollback or _transaction_failed(connection):
                            # The handler swallowed a database error.
                            raise DatabaseError("the handler left its transaction unusable")
                        savepoint.disarm()
                        job.duration = time.monotonic() - job.started
                        job.deadline = None  # its handler is done: it cannot time out
                        job.uncommitted = True
                        succeeded.append(job)
                    except BaseException as exc:  # noqa: BLE001  (a handler may raise anything)
                        job.duration = time.monotonic() - job.started
                        job.deadline = None
                        if not isinstance(exc, _LeaseLost):  # a timed-out job is recorded
                            failed.append((job, exc))
                            job.failure = exc
                        # Undo this job alone: its writes and its on_commit callbacks.
                        # (If the connection is gone this raises: the batch fails.)
                        savepoint.rollback()
                        connection.needs_rollback = False
                        del connection.run_on_commit[callbacks:]
                    if len(batch) >= limit or time.monotonic() - began > ATOMIC_BATCH_SECONDS:
                        break
                    job = self._pool.take_nowait()
                    if job is None:
                        break
                    if not (job.spec is not None and job.spec.atomic):
                        after = job
                        break
                    if not self._start(job):
                        break
                    batch.append(job)
                keep = [j for j in succeeded if not j.abandoned]
                if keep:
                    try:
                        acked = lifecycle.ack_leased([j.message for j in keep])
                    except DatabaseError as exc:
                        if not _lock_timed_out(exc):
                            raise
                        # A row of the batch is locked by another transaction
                        # (past LOCK_TIMEOUT): the others need not wait for it.
                        lock_timeout = _first_line(exc)
                        raise _BatchRolledBack from exc
                    if len(acked) != len(keep):
                        raise _BatchRolledBack
        except _BatchRolledBack:
            # Rolled back: run again, alone, the jobs that still held their lease
            # (all of them when the acknowledgement did not run).
            self._log_batch_rollback(succeeded, acked, lock_timeout)
            for job in succeeded:
                job.uncommitted = False
                if job.abandoned:
                    continue
                if acked is None or job.message.id in acked:
                    job.duration = None
                    self._run_one(job)
                else:
                    _log_lease_lost_before_commit(job)
                    self._finished(job, LOST)
            succeeded = []
        except BaseException as exc:  # noqa: BLE001  (the database failed under the batch)
            _drop_broken_connections()
            logger.warning(
                "Worker %s: a batch of %s atomic handler(s) could not commit (%s); "
                "their leases expire and the messages run again",
                self.worker_id,
                len(succeeded),
                _first_line(exc),
            )
            for job in succeeded:
                job.uncommitted = False
                self._finished(job, LOST)
            succeeded = []
        finally:
            _drop_broken_connections()
        for job in succeeded:
            job.uncommitted = False
            self._finished(job, LOST if job.abandoned else DONE)
        for job, exc in failed:
            outcome = LOST if job.abandoned else self._record_failure(job, exc)
            self._finished(job, outcome)
        # A job cut off by a broken connection (neither succeeded nor failed):
        # its lease expires and maintenance returns it.
        with self._lock:
            orphans = [j for j in batch if self._inflight.get(j.message.id) is j]
        for job in orphans:
            self._finished(job, LOST)
        for job in batch:
            job.batch = job.failure = None  # no reference cycles: freed at once, not by the GC
        if after is not None:
            self._run_job(after)

    def _log_batch_rollback(self, succeeded, acked, lock_timeout=None):
        if lock_timeout is not None:
            logger.warning(
                "Worker %s: the acknowledgement of an atomic batch waited too long for a row "
                "lock held by another transaction (%s); the batch was rolled back and its %s "
                "message(s) run again one by one",
                self.worker_id,
                lock_timeout,
                len(succeeded),
            )
            return
        if acked is None:
            logger.warning(
                "Worker %s: a handler's failure could not be undone on its own (it broke "
                "the transaction before its first query through Django); its batch was "
                "rolled back and the other %s message(s) run again one by one",
                self.worker_id,
                len(succeeded),
            )
            return
        logger.warning(
            "Worker %s: %s of %s message(s) of an atomic batch lost their lease before the "
            "commit; the batch was rolled back and the others run again one by one",
            self.worker_id,
            len(succeeded) - len(acked),
            len(succeeded),
        )

    def _log_done(self, message, duration):
        self.metrics.finished(message, DONE, duration)  # the outcome label, "done"
        # The hot path: nothing is built for a log record nobody keeps or a
        # signal nobody receives.
        if logger.isEnabledFor(logging.INFO):
            logger.info(
                "Message id=%s topic=%s attempt=%s done in %.3fs",
                message.id,
                message.topic,
                message.attempts,
                duration,
                extra={
                    "message_id": message.id,
                    "topic": message.topic,
                    "attempt": message.attempts,
                    "duration": duration,
                    "state": "done",
                },
            )
        if signals.message_done.has_listeners(type(message)):
            signals.send(
                signals.message_done,
                sender=type(message),
                message=message,
                duration=duration,
                worker=self.worker_id,
            )

    def _record_failure(self, job, exc, category=None):
        """Retry or dead-letter ``job``'s message after ``exc``; returns FAILED or LOST."""
        message, spec = job.message, job.spec
        duration = None if job.started is None else time.monotonic() - job.started
        try:
            if category is None:
                category = policy.classify(exc, message)
        except Exception:  # a broken CLASSIFIER must not lose the message
            logger.exception("Message id=%s: classification failed; using UNKNOWN", message.pk)
            category = Category.UNKNOWN
        reason = describe(exc)
        trace = "".join(traceback.format_exception(exc))
        decision = policy.decide(
            category,
            message.attempts,
            policy.max_attempts_for(message, spec),
            spec,
            retry_after=exc.after if isinstance(exc, Retry) else None,
        )
        try:
            if decision.action == policy.RETRY:
                if not lifecycle.retry_later(
                    message, decision.delay, category, f"{reason}\n\n{trace}".strip()
                ):
                    return LOST
                self.metrics.finished(message, RETRIED, duration)
                logger.info(
                    "Message id=%s topic=%s attempt=%s failed (%s: %s); retry in %.1fs",
                    message.pk,
                    message.topic,
                    message.attempts,
                    category,
                    reason,
                    decision.delay,
                    extra={
                        "message_id": message.pk,
                        "topic": message.topic,
                        "attempt": message.attempts,
                        "category": category,
                        "state": "retry_scheduled",
                    },
                )
                signals.send(
                    signals.message_retried,
                    sender=type(message),
                    message=message,
                    category=category,
                    reason=reason,
                    delay=decision.delay,
                    worker=self.worker_id,
                )
            elif (
                lifecycle.dead_letter(message, category, reason, trace, worker=self.worker_id)
                is None
            ):
                return LOST
            else:
                self.metrics.finished(message, DEAD_LETTERED, duration)
        except DatabaseError:
            _drop_broken_connections()
            logger.exception(
                "Message id=%s topic=%s: could not record the failure; its lease will expire "
                "and maintenance will return it to the queue",
                message.pk,
                message.topic,
            )
            return LOST
        return FAILED

    # --- acknowledgements, timeouts -------------------------------------------

    def _flush_acks(self):
        jobs = self._take_unacked()
        if jobs:
            self._send_acks(jobs)

    def _send_acks(self, jobs):
        """Acknowledge ``jobs``; on failure they wait to be flushed again."""
        try:
            finished, busy = lifecycle.ack_unlocked([job.message for job in jobs])
        except BaseException:
            self._return_unacked(jobs)
            raise
        self._acked(jobs, finished, busy)
        if any(job.message.group_key is not None for job in jobs):
            with self._lock:
                self._groups_released = True  # the next claim promotes their groups' next
            self._wake.set()

    def _take_unacked(self):
        """The finished atomic=False jobs whose acknowledgement is due."""
        with self._lock:
            return self._take_unacked_locked()

    def _take_unacked_locked(self):
        jobs = list(self._unacked.values())
        self._unacked.clear()
        self._ack_due = None
        return jobs

    def _return_unacked(self, jobs):
        with self._lock:
            for job in jobs:
                self._unacked.setdefault(job.message.pk, job)
            if jobs and self._ack_due is None:
                self._ack_due = time.monotonic() + ACK_DELAY

    def _acked(self, jobs, finished, busy=()):
        with self._lock:
            self.processed += len(finished)
        for job in jobs:
            if job.message.id in finished:  # lifecycle logged the lost ones
                self._log_done(job.message, job.duration)
        waiting = [job for job in jobs if job.message.id in busy]
        if waiting:
            self._wait_for_locked(waiting)

    def _wait_for_locked(self, jobs):
        """Acknowledge ``jobs`` again a moment later: another transaction has
        their row locked (the acknowledgement skipped it). Mostly that is the
        heartbeat's lease extension, for a few milliseconds; a row locked for
        longer (an admin, a script) is logged, once. The leases are extended
        whenever the row is free; a lease that runs out meanwhile returns the
        message to the queue (it runs again: atomic=False)."""
        now = time.monotonic()
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
        with self._lock:
            for job in jobs:
                self._unacked.setdefault(job.message.pk, job)
            due = time.monotonic() + LOCKED_ACK_DELAY
            self._ack_due = due if self._ack_due is None else min(self._ack_due, due)

    def _expire_timeouts(self):
        now = time.monotonic()
        with self._lock:
            late = [
                j for j in self._inflight.values() if j.deadline is not None and now > j.deadline
            ]
        for job in late:
            job.abandoned = True  # whatever the handler does now is discarded
            with self._lock:
                self._inflight.pop(job.message.pk, None)
            self._pool.abandon(job.thread)
            timeout = job.spec.timeout
            logger.warning(
                "Message id=%s topic=%s attempt=%s: handler ran past its timeout of %ss",
                job.message.pk,
                job.message.topic,
                job.message.attempts,
                timeout,
            )
            exc = HandlerTimeout(f"timeout: the handler ran past {timeout}s")
            if self._record_failure(job, exc, category=Category.TRANSIENT) == FAILED:
                with self._lock:
                    self.processed += 1
            self._free_hostages(job)

    def _free_hostages(self, job):
        """The messages whose handlers succeeded in the same (uncommitted)
        transaction as a timed-out handler would wait for it: hand them back
        to the queue now (their writes roll back with the batch, and the
        batch's acknowledgement finds their leases gone)."""
        with self._lock:
            hostages = [j for j in job.batch or () if j.uncommitted and not j.abandoned]
            for hostage in hostages:
                hostage.abandoned = True
                self._inflight.pop(hostage.message.pk, None)
            # Those whose handler failed would wait for it too, to record
            # their failure: record it now (the batch thread then skips them).
            failed = [j for j in job.batch or () if j.failure is not None and not j.abandoned]
            for other in failed:
                other.abandoned = True
                self._inflight.pop(other.message.pk, None)
        if hostages:
            released = lifecycle.release([j.message for j in hostages])
            logger.warning(
                "Worker %s: handed back %s message(s) that shared a transaction with the "
                "timed-out one",
                self.worker_id,
                released,
            )
        for other in failed:
            if self._record_failure(other, other.failure) == FAILED:
                with self._lock:
                    self.processed += 1

    # --- heartbeat ------------------------------------------------------------

    def _heartbeat_loop(self):
        """Extend leases while handlers run; run maintenance on a schedule while
        busy, and at once when an idle poll saw an expired lease. An idle
        worker so issues no query here: its poll is its only one."""
        maintenance_every = min(self.lease_seconds / 4, 15.0)
        tick = min(maintenance_every, self.heartbeat_interval / 2)
        next_maintenance = time.monotonic()
        while not self._exit.is_set():
            try:
                # An idle worker's poll carries its heartbeat (when due); this
                # thread writes one only when the polls did not, because the
                # worker is busy or polls less often than it beats.
                if self._beat_due(self._thread_beat_after):
                    lifecycle.heartbeat(self._beat())
                    self._last_beat = time.monotonic()
                busy = self._busy()
                if self._maintenance_wanted or (busy and time.monotonic() >= next_maintenance):
                    self._maintenance_wanted = False
                    maintenance.run_once()
                    next_maintenance = time.monotonic() + maintenance_every
                if busy:
                    self._extend_leases()
            except DatabaseError as exc:
                _drop_broken_connections()
                self.metrics.reconnected("heartbeat")
                logger.warning("Worker %s heartbeat: database error (%s)", self.worker_id, exc)
            self._heartbeat_wake.wait(tick)
            self._heartbeat_wake.clear()
        connections.close_all()

    def _beat_due(self, seconds):
        """Whether ``seconds`` passed since the last beat."""
        last = self._last_beat
        return last is None or time.monotonic() - last >= seconds

    def _beat(self):
        with self._lock:
            inflight = len(self._inflight)
            processed = self.processed
        return lifecycle.Beat(
            worker_id=self.worker_id,
            hostname=self.hostname,
            pid=os.getpid(),
            queues=self.queues,
            concurrency=self.concurrency,
            alive_for=self.heartbeat_interval * 3,
            inflight=inflight,
            processed=processed,
        )

    def _extend_leases(self):
        with self._lock:
            jobs = [
                j
                for j in itertools.chain(self._inflight.values(), self._unacked.values())
                if not j.abandoned
            ]
        if not jobs:
            return
        lost = lifecycle.extend_leases([j.message for j in jobs], self.lease_seconds)
        for job in jobs:
            if job.message.pk in lost and not job.lease_lost:
                job.lease_lost = True
                logger.warning(
                    "Message id=%s topic=%s attempt=%s: lease lost while the handler ran",
                    job.message.pk,
                    job.message.topic,
                    job.message.attempts,
                )

    # --- wake-ups -------------------------------------------------------------

    def _listen_loop(self):
        delay = RECONNECT_DELAY
        while not self._exit.is_set():
            try:
                with listen_connection(conf.database_alias()) as conn:
                    conn.execute(f"LISTEN {CHANNEL}; LISTEN {GROUPS_CHANNEL}")
                    delay = RECONNECT_DELAY
                    self._notify()  # poll once: notifications missed while away are gone
                    while not self._exit.is_set():
                        # Short slices: the thread notices shutdown quickly.
                        for notification in conn.notifies(timeout=0.25):
                            if notification.channel == GROUPS_CHANNEL:
                                with self._lock:
                                    self._groups_released = True
                                self._notify()
                            elif notification.payload in self.queues:
                                self._notify()
            except psycopg.Error as exc:
                if self._exit.is_set():
                    break
                self.metrics.reconnected("listener")
                logger.warning(
                    "Worker %s listener: %s; reconnecting in %.1fs",
                    self.worker_id,
                    str(exc).strip() or type(exc).__name__,
                    delay,
                )
                self._exit.wait(delay * random.uniform(0.8, 1.2))
                delay = min(delay * 2, RECONNECT_DELAY_CAP)

    def _notify(self):
        with self._lock:
            self._notified = True
        self._wake.set()

    # --- start and end --------------------------------------------------------

    def _start_thread(self, target, name):
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    def _install_signals(self):
        if threading.current_thread() is not threading.main_thread():
            return None
        received = []

        def on_signal(signum, frame):
            if received:
                logger.warning("Worker %s: second signal, exiting at once", self.worker_id)
                os._exit(1)
            received.append(signum)
            logger.info(
                "Worker %s: %s received, finishing in-flight messages",
                self.worker_id,
                signal.Signals(signum).name,
            )
            self.stop()

        return {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}

    def _shutdown(self):
        self._stopping.set()
        # Claimed but not started: hand back at once (no attempt counted).
        with self._lock:
            unstarted = [j for j in self._inflight.values() if j.queued]
            for job in unstarted:
                job.queued, job.abandoned = False, True
                self._queued -= 1
                del self._inflight[job.message.pk]
        if unstarted:
            try:
                lifecycle.release([job.message for job in unstarted])
            except DatabaseError:
                _drop_broken_connections()
                logger.warning(
                    "Worker %s: could not hand back %s prefetched message(s); "
                    "they return when their lease expires",
                    self.worker_id,
                    len(unstarted),
                )
        deadline = time.monotonic() + self.shutdown_timeout
        while self._busy() and time.monotonic() < deadline:
            try:
                self._flush_acks()
                self._expire_timeouts()
            except DatabaseError:
                _drop_broken_connections()
            if not self._busy():
                break
            self._wake.wait(min(0.1, max(0.0, deadline - time.monotonic())))
            self._wake.clear()
        if self._streams is not None:  # streams: let the batch in hand finish
            self._streams.stop(max(0.0, deadline - time.monotonic()))
        with self._lock:
            leftover = list(self._inflight.values()) + list(self._unacked.values())
            for job in leftover:
                job.abandoned = True
        if leftover:
            try:
                released = lifecycle.release([job.message for job in leftover])
                logger.warning(
                    "Worker %s: handed back %s unfinished message(s) without counting the attempt",
                    self.worker_id,
                    released,
                )
            except DatabaseError:
                logger.exception(
                    "Worker %s: could not hand back unfinished messages; "
                    "they return when their lease expires",
                    self.worker_id,
                )
        self._exit.set()
        self._heartbeat_wake.set()
        if self._pool is not None:
            self._pool.shutdown()
        for thread in self._threads:
            thread.join(timeout=5)
        try:
            lifecycle.unregister(self.worker_id)
        except DatabaseError:
            logger.warning(
                "Worker %s: could not remove its row from the worker table; "
                "it shows as dead once its heartbeat is stale",
                self.worker_id,
            )
        connections.close_all()


class _HandlerPool:
    """``size`` threads that run jobs. A thread stuck in a timed-out handler
    is replaced, so a hung handler does not take capacity away; at most
    ``size`` stuck threads are replaced, beyond that capacity shrinks."""

    def __init__(self, size, run_job):
        self._size = size
        self._run_job = run_job
        self._tasks = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._abandoned = set()
        self._unreplaced = 0
        self._names = itertools.count(1)
        for _ in range(size):
            self._spawn()

    def _spawn(self):
        threading.Thread(
            target=self._work, name=f"pgqueue-handler-{next(self._names)}", daemon=True
        ).start()

    def submit(self, job):
        self._tasks.put(job)

    def take_nowait(self):
        """The next queued job, or None when there is none (or the pool is
        shutting down: the stop marker is put back for the thread's loop)."""
        try:
            job = self._tasks.get_nowait()
        except queue.Empty:
            return None
        if job is None:
            self._tasks.put(None)
        return job

    def stuck(self):
        return self._unreplaced

    def abandon(self, ident):
        with self._lock:
            if ident is None or ident in self._abandoned:
                return
            self._abandoned.add(ident)
            if len(self._abandoned) > self._size:
                self._unreplaced += 1
                logger.error(
                    "%s handler threads are stuck past their timeouts; "
                    "capacity is reduced until they return",
                    len(self._abandoned),
                )
                return
        self._spawn()

    def shutdown(self):
        for _ in range(self._size + len(self._abandoned)):
            self._tasks.put(None)

    def _work(self):
        ident = threading.get_ident()
        try:
            while True:
                job = self._tasks.get()
                if job is None:
                    break
                self._run_job(job)
                with self._lock:
                    if ident in self._abandoned:
                        self._abandoned.discard(ident)
                        if self._unreplaced:
                            self._unreplaced -= 1
                            continue  # this thread takes its own place again
                        break
        finally:
            connections.close_all()


def _call(spec, message):
    undecodable = message.__dict__.get(lifecycle.UNDECODABLE)
    if undecodable:
        # Another client's SQL stored JSON that Python cannot load: no
        # handler could read it, so it goes to the dead letters as it is.
        raise Permanent(undecodable)
    if spec.is_async:
        # async_to_sync runs the coroutine on an event loop while this thread
        # serves its sync_to_async calls, so ORM work lands in this thread's
        # connection, inside the handler's transaction.
        return async_to_sync(spec.func)(message)
    result = spec.func(message)
    if inspect.iscoroutine(result) or inspect.isgenerator(result):
        # Its body never ran: a success would lose the message's work.
        result.close()  # no "never awaited" warning later
        raise TypeError(
            f"the handler returned a {type(result).__name__} instead of running: "
            "declare it with async def, or make it a plain function"
        )
    return result


def _execute_raw(connection, sql):
    """Run the worker's own bookkeeping ``sql`` on the driver's connection,
    past Django's cursor wrapper (and its execute wrappers): the savepoints
    of atomic batches, once per handler."""
    with connection.wrap_database_errors:
        psycopg.ClientCursor(connection.connection).execute(sql)


def _transaction_failed(connection):
    """Whether the server reported the connection's transaction as aborted
    (read from the driver's state: no round trip)."""
    raw = connection.connection
    return raw is not None and raw.info.transaction_status == psycopg.pq.TransactionStatus.INERROR


def _log_lease_lost_before_commit(job):
    logger.warning(
        "Message id=%s topic=%s attempt=%s: lease lost before the commit; "
        "the handler's database writes were rolled back",
        job.message.pk,
        job.message.topic,
        job.message.attempts,
    )


# What the server (or PgBouncer) says when it takes no more connections.
_REFUSALS = (
    "too many connections",  # the role's or the database's CONNECTION LIMIT
    "too many clients",  # max_connections
    "connection slots are reserved",  # max_connections less the reserved ones
    "no more connections allowed",  # PgBouncer's max_client_conn
)


def _error_hint(exc):
    """A few words on what a database error means for the worker, or ""."""
    text = str(exc)
    if any(refusal in text for refusal in _REFUSALS):
        return (
            " - the database takes no more connections (max_connections or a CONNECTION "
            "LIMIT is reached); the worker waits and tries again"
        )
    if _lock_timed_out(exc):
        return " - a lock held by another transaction outlasted PGQUEUE['LOCK_TIMEOUT']"
    return ""


def _ack_waiting_for_locks(message):
    """``lifecycle.ack``; a lock timeout (another transaction holds the row)
    raises _AckLocked."""
    try:
        return lifecycle.ack(message)
    except DatabaseError as exc:
        if not _lock_timed_out(exc):
            raise
        raise _AckLocked(_first_line(exc)) from exc


def _lock_timed_out(exc):
    """Whether ``exc`` (a Django DatabaseError) is PostgreSQL's lock_timeout:
    the transaction failed, its connection is fine."""
    return isinstance(exc.__cause__, psycopg.errors.LockNotAvailable)


def _first_line(exc):
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _drop_broken_connections():
    """Close this thread's connections that an error left unusable; keep the rest."""
    for connection in connections.all(initialized_only=True):
        if connection.connection is None or not connection.errors_occurred:
            continue
        if connection.in_atomic_block or not connection.is_usable():
            connection.close()
        else:
            connection.errors_occurred = False
