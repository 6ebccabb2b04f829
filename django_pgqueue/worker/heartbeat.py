"""The heartbeat: the worker's row in the worker table (its liveness), the
leases of the messages it holds, and maintenance.

An idle worker's poll carries its heartbeat (``due_beat``), so idling costs
one query per poll interval; the ``pgqueue-heartbeat`` thread writes one
only when the polls did not, because the worker is busy or polls less often
than it beats. While messages are held, the thread extends their leases, looks for
cancellations asked meanwhile (should their NOTIFY have been missed) and
runs maintenance on a schedule; an idle poll that saw an expired lease asks
for maintenance at once (``want_maintenance``)."""

from __future__ import annotations

import logging
import os
import threading
import time

from django.db import DatabaseError, connections

from django_pgqueue import liveness, maintenance, vacuum
from django_pgqueue.db import drop_broken_connections
from django_pgqueue.worker import threads
from django_pgqueue.worker.config import Metrics, WorkerConfig
from django_pgqueue.worker.controls import QueueControls
from django_pgqueue.worker.ledger import Ledger

logger = logging.getLogger(__package__)


class Heartbeat:
    def __init__(
        self,
        config: WorkerConfig,
        ledger: Ledger,
        metrics: Metrics,
        exit: threading.Event,
        controls: QueueControls,
    ) -> None:
        self._config = config
        self._ledger = ledger
        self._controls = controls
        self._metrics = metrics
        self._exit = exit  # set when the worker's helper threads end
        self._wake = threading.Event()  # exit, or maintenance wanted
        self._maintenance_wanted = False
        self._last_beat: float | None = None  # time.monotonic() of the last recorded heartbeat

    def start(self) -> threading.Thread:
        return threads.start(self._run, "pgqueue-heartbeat")

    def stop(self) -> None:
        """Wake the thread to see that ``exit`` is set."""
        self._wake.set()

    def want_maintenance(self) -> None:
        """A worker died (a lease expired): rescue its messages now."""
        self._maintenance_wanted = True
        self._wake.set()

    def due_beat(self) -> liveness.Beat | None:
        """The heartbeat for the main loop's poll to carry, if one is due
        (call ``recorded()`` once the poll succeeded)."""
        return self._beat() if self._due(self._config.heartbeat_interval) else None

    def recorded(self) -> None:
        """A heartbeat was written."""
        self._last_beat = time.monotonic()

    def _due(self, seconds: float) -> bool:
        """Whether ``seconds`` passed since the last beat."""
        last = self._last_beat
        return last is None or time.monotonic() - last >= seconds

    def _beat(self) -> liveness.Beat:
        config = self._config
        return liveness.Beat(
            worker_id=config.worker_id,
            hostname=config.hostname,
            pid=os.getpid(),
            queues=config.queues,
            concurrency=config.concurrency,
            alive_for=config.alive_for,
            inflight=self._ledger.count(),
            processed=self._ledger.processed,
        )

    def _run(self) -> None:
        """Extend leases while handlers run; run maintenance on a schedule while
        busy, and at once when an idle poll saw an expired lease. An idle
        worker so issues no query here: its poll is its only one."""
        config = self._config
        maintenance_every = min(config.lease_seconds / 4, 15.0)
        tick = min(maintenance_every, config.heartbeat_interval / 2)
        next_maintenance = time.monotonic()
        next_tick = next_vacuum = 0.0  # the lease work's next turn; the vacuum check's
        busy = False
        while not self._exit.is_set():
            try:
                woken = self._wake.is_set()
                self._wake.clear()
                now = time.monotonic()
                busy = self._ledger.busy()
                if woken or now >= next_tick:
                    next_tick = now + tick
                    if self._due(config.thread_beat_after):
                        liveness.heartbeat(self._beat())
                        self.recorded()
                    if self._maintenance_wanted or (busy and now >= next_maintenance):
                        self._maintenance_wanted = False
                        self._report(maintenance.run_once())  # it checks the vacuum too
                        next_maintenance = time.monotonic() + maintenance_every
                        next_vacuum = time.monotonic() + vacuum.CHECK_SECONDS
                    if busy:
                        self._extend_leases()
                        # The fallback of the control channel's "cancel" (a
                        # NOTIFY is at-most-once; poll-only mode has none).
                        self._controls.cancel(liveness.cancel_requested(self._ledger.leased()))
                if busy and time.monotonic() >= next_vacuum:
                    # Between rounds and lease extensions too (one statistics
                    # query a second): a busy worker leaves some 50,000 dead
                    # rows a second.
                    next_vacuum = time.monotonic() + vacuum.CHECK_SECONDS
                    vacuum.vacuum_if_due()
            except DatabaseError as exc:
                drop_broken_connections()
                self._metrics.reconnected("heartbeat")
                logger.warning("Worker %s heartbeat: database error (%s)", config.worker_id, exc)
            # Idle, it still looks every CHECK_SECONDS (no query) whether the
            # worker got busy: the vacuum check must not wait for the next tick.
            now = time.monotonic()
            wake_at = min(next_tick, next_vacuum if busy else now + vacuum.CHECK_SECONDS)
            self._wake.wait(max(0.0, wake_at - now))
        connections.close_all()

    def _report(self, result: maintenance.MaintenanceResult | None) -> None:
        """Count the rows a round deleted (the pgqueue_worker_pruned_rows metric)."""
        if result is None:
            return
        counts = dict(result.pruned.counts) if result.pruned is not None else {}
        counts["workers"] = counts.get("workers", 0) + result.workers_pruned
        self._metrics.pruned(counts)

    def _extend_leases(self) -> None:
        jobs = self._ledger.leased()
        if not jobs:
            return
        lost = liveness.extend_leases([j.message for j in jobs], self._config.lease_seconds)
        for job in jobs:
            if job.message.pk in lost and not job.lease_lost:
                job.lease_lost = True
                logger.warning(
                    "Message id=%s topic=%s attempt=%s: lease lost while the handler ran",
                    job.message.pk,
                    job.message.topic,
                    job.message.attempts,
                )
