"""The Worker: the main loop that decides what to do next, over the parts
that do it.

Threads of one worker process:

- the main thread runs the loop: flush acknowledgements, claim up to the
  free capacity (``claiming``), hand messages to the handler threads, then
  wait for a notification, a free slot, the next due run_at or the poll
  interval (``wakeup``); when idle, one poll query tells what is ready;
- the listener wakes the loop when a NOTIFY names one of its queues
  (``listener``), and hands on what the control channel says: a queue
  paused, resumed or limited, cancellation asked (``controls``);
- the heartbeat extends the leases of held messages, records the worker's
  liveness (when the polls did not) and runs maintenance (``heartbeat``);
- ``concurrency`` handler threads run the handlers (``executor``, ``pool``,
  ``atomic``) and acknowledge batches (``acks``);
- with async handlers (``async def``, atomic=False), an event loop runs up
  to ``async_concurrency`` of them at once, and settling threads record
  how their runs ended (``event_loop``);
- with stream subscriptions, the delivery threads (``worker.streams``);
- with periodic schedules, the scheduler (``scheduler``), which enqueues
  their ticks (a --burst worker runs one round before it starts).

The parts share what the worker holds through the ``Ledger``.
"""

from __future__ import annotations

import logging
import math
import random
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from django.db import DatabaseError, connections

from django_pgqueue import conf, liveness
from django_pgqueue.db import Backoff, drop_broken_connections, first_line, lock_timed_out
from django_pgqueue.observability.metrics import NullMetrics
from django_pgqueue.schedules.spec import ScheduleSpec
from django_pgqueue.streams.subscribers import select, subscriptions_on
from django_pgqueue.worker import listener, shutdown
from django_pgqueue.worker.acks import Acks
from django_pgqueue.worker.claiming import Claimer
from django_pgqueue.worker.config import Metrics, WorkerConfig
from django_pgqueue.worker.controls import QueueControls
from django_pgqueue.worker.cutoff import CutOff
from django_pgqueue.worker.event_loop import EventLoop
from django_pgqueue.worker.executor import Executor
from django_pgqueue.worker.heartbeat import Heartbeat
from django_pgqueue.worker.ledger import Ledger
from django_pgqueue.worker.outcomes import Outcomes
from django_pgqueue.worker.pool import HandlerPool
from django_pgqueue.worker.scheduler import scheduler_for
from django_pgqueue.worker.streams import StreamWorker, start_for
from django_pgqueue.worker.summary import Summary
from django_pgqueue.worker.wakeup import Wakeup

logger = logging.getLogger(__package__)

# What the server (or PgBouncer) says when it takes no more connections.
_REFUSALS = (
    "too many connections",  # the role's or the database's CONNECTION LIMIT
    "too many clients",  # max_connections
    "connection slots are reserved",  # max_connections less the reserved ones
    "no more connections allowed",  # PgBouncer's max_client_conn
)


class Worker:
    """One worker process's engine. ``run()`` blocks until stopped (or, in
    burst mode, until nothing is ready and the subscriptions it serves have
    delivered every due event); ``stop()`` may be called from any
    thread or a signal handler."""

    def __init__(
        self,
        queues: Iterable[str] | Mapping[str, int] | None = None,
        concurrency: int = 4,
        batch_size: int | None = None,
        prefetch: int | None = None,
        burst: bool = False,
        max_messages: int | None = None,
        shutdown_timeout: float = 30.0,
        poll_interval: float | None = None,
        lease_seconds: float | None = None,
        worker_id: str | None = None,
        metrics: Metrics | None = None,
        subscriptions: str | Sequence[str] | None = None,
        schedules: bool | Sequence[ScheduleSpec] = True,
        async_concurrency: int | None = None,
        database: str | None = None,
    ) -> None:
        self.config = WorkerConfig.resolve(
            queues=queues,
            concurrency=concurrency,
            batch_size=batch_size,
            prefetch=prefetch,
            burst=burst,
            max_messages=max_messages,
            shutdown_timeout=shutdown_timeout,
            poll_interval=poll_interval,
            lease_seconds=lease_seconds,
            worker_id=worker_id,
            async_concurrency=async_concurrency,
            database=database,
        )
        self.metrics = metrics or NullMetrics()
        # Streams: the subscriptions it delivers to ("all", "none"/None, or
        # names; an unknown name is a ValueError) whose stream is on its database.
        self.subscriptions = subscriptions_on(select(subscriptions), self.config.database)
        self._streams: StreamWorker | None = None
        config, metrics = self.config, self.metrics
        self._wakeup = Wakeup()
        self._pool = HandlerPool(concurrency)
        self._ledger = Ledger(config, self._pool.stuck)
        self._controls = QueueControls(config, self._ledger, self._wakeup)
        self._summary = Summary(config.worker_id, config.log_summary_interval, self._ledger.count)
        cut = self._cut_off = CutOff(config, self._wakeup.set, self._ledger.held_ids)
        outcomes = Outcomes(config.worker_id, metrics, self._controls, None, self._summary, cut.add)
        self._acks = Acks(config.worker_id, self._ledger, self._wakeup, outcomes)
        self._executor = Executor(
            config, self._ledger, self._pool, self._wakeup, self._acks, outcomes, metrics
        )
        if config.async_concurrency:  # an async handler (atomic=False) is registered
            self._executor.event_loop = EventLoop(config, self._executor)
        parts = (self._ledger, self._wakeup, self._acks, self._executor.dispatch, metrics)
        self._claimer = Claimer(config, *parts, self._controls)
        self._stopping = threading.Event()  # no more claims
        self._exit = threading.Event()  # helper threads end
        self._heartbeat = Heartbeat(config, self._ledger, metrics, self._exit, self._controls)
        # Periodic schedules: True runs the project's (settings and handlers;
        # ImproperlyConfigured if one is bad), False none, or these specs.
        self._scheduler = scheduler_for(schedules, config, metrics, self._exit)
        self._threads: list[threading.Thread] = []
        # For health checks: when the main loop last went round, and the
        # database error it is recovering from, if any.
        self._loop_seen = time.monotonic()
        self.loop_error: str | None = None

    @property
    def worker_id(self) -> str:
        return self.config.worker_id

    @property
    def queues(self) -> list[str]:
        return self.config.queues

    @property
    def processed(self) -> int:
        """Messages acknowledged, retried or dead-lettered by this worker."""
        return self._ledger.processed

    @property
    def claimed(self) -> int:
        return self._claimer.claimed

    # --- public ---------------------------------------------------------------

    def run(self, install_signals: bool = False) -> int:
        """Run until stopped; returns how many messages it processed."""
        with conf.on_database(self.config.database):  # so do the threads it starts
            return self._run(install_signals)

    def _run(self, install_signals: bool) -> int:
        _refuse_a_transaction()
        config = self.config
        previous = shutdown.install_signals(self.worker_id, self.stop) if install_signals else None
        _log_start(config)
        self._pool.start(self._executor.run_job)
        if self._executor.event_loop is not None:
            self._executor.event_loop.start()
        self.metrics.track_inflight(self._ledger.count)
        self._threads.append(self._heartbeat.start())
        if self._scheduler is not None and not config.burst:
            self._threads.append(self._scheduler.start())
        if config.listen:
            self._threads.append(
                listener.start(config, self._wakeup, self.metrics, self._exit, self._controls)
            )
        self._streams = start_for(  # None when it serves no subscription
            self.subscriptions,
            self.worker_id,
            config.poll_interval,
            config.listen,
            self.metrics,
            wake_worker=self._wakeup.set if config.burst else None,
        )
        try:
            if self._scheduler is not None and config.burst:
                self._scheduler.run_once()  # what is due now; the loop works it off
            self._loop()
        finally:
            self._shutdown()
            shutdown.restore_signals(previous)
        self._summary.log_if_due(time.monotonic(), final=True)
        logger.info("Worker %s stopped after %s message(s)", self.worker_id, self.processed)
        return self.processed

    def stop(self) -> None:
        """Stop claiming; in-flight handlers get ``shutdown_timeout`` to finish."""
        self._stopping.set()
        self._wakeup.set()

    def health(self) -> tuple[bool, dict[str, Any]]:
        """``(healthy, details)`` for the --health-port: healthy while the main loop goes
        round (it wakes at least once per poll interval) and its last database work
        succeeded, and, when it delivers to stream subscriptions, while its delivery thread
        lives and goes round (``StreamWorker.health``, under "streams"); with schedules,
        while its scheduler's last round reached the database (under "scheduler")."""
        loop_age = time.monotonic() - self._loop_seen
        loop_alive = not self._stopping.is_set() and loop_age < self.config.poll_interval * 2 + 5
        details: dict[str, Any] = {
            "worker_id": self.worker_id,
            "queues": self.queues,
            "loop_alive": loop_alive,
            "loop_age_seconds": round(loop_age, 3),
            "inflight": self._ledger.count(),
            "processed": self.processed,
        }
        if self.loop_error:
            details["loop_error"] = self.loop_error
        healthy = loop_alive and not self.loop_error
        if self._scheduler is not None:
            scheduler_healthy, details["scheduler"] = self._scheduler.health()
            healthy = healthy and scheduler_healthy
        if self._streams is not None:
            streams_healthy, details["streams"] = self._streams.health()
            healthy = healthy and streams_healthy
        return healthy, details

    @property
    def stream_delivery_died(self) -> str | None:
        """Why its stream delivery thread died (None while it lives, or when
        it delivers to no subscription)."""
        streams = self._streams
        return streams.error if streams is not None and streams.dead else None

    # --- the loop -------------------------------------------------------------

    def _loop(self) -> None:
        config, claimer, ledger = self.config, self._claimer, self._ledger
        ready = True  # messages may be ready: catch up on whatever is at start
        probe = False  # poll the database: what is ready, when is the next due
        due_at: float | None = None  # time.monotonic() when a delayed message is due
        next_poll = time.monotonic() + self._poll_delay()
        backoff = Backoff()
        while not self._stopping.is_set():
            self._loop_seen = time.monotonic()
            self._summary.log_if_due(self._loop_seen)
            try:
                self._cut_off.hand_back_if_due(self.loop_error is not None)  # (cut-off runs)
                self._controls.refresh()  # paused queues, limits: when they changed
                claim = claimer.wanted(ready)
                if not claim:
                    self._acks.flush()  # else the claim carries them
                self._executor.expire_timeouts()
                if claimer.limit_reached() and not ledger.busy():
                    break
                if config.burst and not ready and not ledger.busy():
                    probe = True  # all done: exit unless more is ready
                if claim:
                    asked, got = claimer.claim()
                    # A full batch: more may be waiting; so may more groups.
                    ready = got == asked or self._wakeup.groups_released
                    probe = probe or got < asked
                if probe:
                    probe = False
                    # --burst exits only on a probe that began with no handler
                    # running: one that ran beside a handler can predate the
                    # retry it records, due at once.
                    idle = not ledger.busy()
                    found = self._probe()
                    if found.ready or found.groups_released:
                        ready = True
                    elif config.burst and idle and self._streams_caught_up():
                        if self._controls.next_unblock() == math.inf:  # (no rate's window)
                            break
                    until_due = found.seconds_until_due()
                    due_at = None if until_due is None else time.monotonic() + until_due
                backoff.reset()
                self.loop_error = None
            except DatabaseError as exc:
                drop_broken_connections()
                self.loop_error = first_line(exc)
                self.metrics.reconnected("loop")
                logger.warning(
                    "Worker %s: database %s error (%s)%s; retrying in %.1fs",
                    self.worker_id,
                    config.database,
                    self.loop_error,
                    _error_hint(exc),
                    backoff.delay,
                )
                self._stopping.wait(backoff.next())
                ready = probe = True
                continue
            if claimer.wanted(ready):
                continue
            # A handler that starts while the wake-up is reckoned wakes the
            # loop (its deadline may be missing from it); one that starts
            # after compares its deadline with the wake-up (Executor.start).
            ledger.loop_wakes_at = math.inf
            now = time.monotonic()
            wake_at = min(
                next_poll,
                due_at or math.inf,
                ledger.next_deadline(),
                ledger.ack_due or math.inf,
                self._controls.next_unblock(),
            )
            ledger.loop_wakes_at = wake_at
            if self._wakeup.wait(max(0.0, wake_at - now)):
                ready = True
            now = time.monotonic()
            if self._controls.take_unblocked(now):  # a slot of a queue's rate is free
                ready = True
            if due_at is not None and now >= due_at:
                due_at = None
                ready = True
            if now >= next_poll:
                next_poll = now + self._poll_delay()
                probe = True

    def _probe(self) -> liveness.Probe:
        """One query: what is ready, when the next message is due, whether a
        lease expired or groups were released (and the heartbeat, when due)."""
        beat = self._heartbeat.due_beat()
        found = liveness.probe(self._controls.claimable(time.monotonic()), beat)
        if beat is not None:
            self._heartbeat.recorded()
        if found.lease_expired:  # a worker died: rescue now
            self._heartbeat.want_maintenance()
        if found.groups_released:
            self._wakeup.release_groups()
        self._controls.probed(found.controls_version)
        return found

    def _poll_delay(self) -> float:
        return self.config.poll_interval * random.uniform(0.9, 1.1)

    def _streams_caught_up(self) -> bool:
        """--burst: every served subscription has delivered what is due (or
        the delivery thread has died: it delivers nothing more)."""
        streams = self._streams
        return streams is None or streams.caught_up or not streams.alive

    # --- the end ----------------------------------------------------------------

    def _shutdown(self) -> None:
        self._stopping.set()
        shutdown.hand_back_unstarted(self._ledger, self.worker_id)
        deadline = time.monotonic() + self.config.shutdown_timeout
        shutdown.drain(self._ledger, self._acks, self._executor, self._wakeup, deadline)
        if self._streams is not None:  # streams: let the batch in hand finish
            self._streams.stop(max(0.0, deadline - time.monotonic()))
        shutdown.hand_back_leftover(self._ledger, self.worker_id)
        if self._executor.event_loop is not None:
            # Its coroutines still running were handed back: cancelled now.
            self._executor.event_loop.stop()
        self._exit.set()
        self._heartbeat.stop()
        if self._scheduler is not None:
            self._scheduler.stop()
        self._pool.shutdown()
        for thread in self._threads:
            thread.join(timeout=5)
        shutdown.unregister(self.worker_id)
        connections.close_all()


def _refuse_a_transaction() -> None:
    if connections[conf.database_alias()].in_atomic_block:
        # Claims would become savepoints of the caller's transaction and
        # stay invisible to every other worker until it commits.
        raise RuntimeError("Worker.run() cannot be called inside a transaction")


def _log_start(config: WorkerConfig) -> None:
    logger.info(
        "Worker %s starting: database=%s queues=%s concurrency=%s%s batch=%s prefetch=%s "
        "notify=%s lease=%ss",
        config.worker_id,
        config.database,
        config.queues_text,
        config.concurrency,
        f" async_concurrency={config.async_concurrency}" if config.async_concurrency else "",
        config.batch_size,
        f"auto(<={config.prefetch})" if config.prefetch_auto else config.prefetch,
        config.listen,
        config.lease_seconds,
    )


def _error_hint(exc: DatabaseError) -> str:
    """A few words on what a database error means for the worker, or ""."""
    text = str(exc)
    if any(refusal in text for refusal in _REFUSALS):
        return (
            " - the database takes no more connections (max_connections or a CONNECTION "
            "LIMIT is reached); the worker waits and tries again"
        )
    if lock_timed_out(exc):
        return " - a lock held by another transaction outlasted PGQUEUE['LOCK_TIMEOUT']"
    return ""
