"""The worker's stream delivery: a thread that delivers stream events to the
subscriptions a worker serves (``pgqueue_worker --subscriptions``), beside
the message loop.

Threads (both daemons, both started and stopped by ``worker.Worker``):

- ``pgqueue-streams`` creates the served subscriptions' rows, then goes
  round: one probe query tells which subscriptions have deliverable events;
  each of those gets one batch (``delivery.deliver``, one transaction), and
  the next ones at once while each was full, for up to a second, then the
  next round starts. With nothing to do it waits for
  a wake-up, the poll interval, a retrying subscription's next try, or a
  short, growing delay while committed events wait for an older transaction
  to end (the snapshot's xmin holds them back; no notification says when
  that transaction ends). It also runs the maintenance round (retention of
  stream events among its duties) every MAINTENANCE_INTERVAL seconds, since
  an idle worker's heartbeat does not.
- ``pgqueue-streams-listener`` (unless PGQUEUE["NOTIFY"] is False) holds a
  dedicated connection that LISTENs for ``streams.CHANNEL`` and wakes the
  first thread when a served stream gets an event. A hint only: the polls
  find every event anyway.

The worker reads the first thread's state: its health check (``health()``:
dead, stuck outside a subscriber, or failing) and ``--burst``, which exits
once a round's probe found nothing due nor held back (``caught_up``).

Several workers may serve the same subscriptions: each delivery takes the
subscription's lock first, so one worker at a time delivers to it, and the
others skip it (``BUSY``) until their next poll.
"""

from __future__ import annotations

import contextlib
import logging
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from django.db import connections

from django_pgqueue import conf, maintenance, notify
from django_pgqueue.db import Backoff
from django_pgqueue.exceptions import describe
from django_pgqueue.observability.metrics import NullMetrics, WorkerMetrics
from django_pgqueue.streams import CHANNEL, delivery, subscriptions
from django_pgqueue.streams.subscribers import SubscriberSpec
from django_pgqueue.text import first_line
from django_pgqueue.worker import threads

logger = logging.getLogger(__name__)

# Held events (committed above the snapshot's xmin): look again after this
# long, doubling up to the poll interval.
HELD_DELAY = 0.01
# Seconds between maintenance rounds started from this thread.
MAINTENANCE_INTERVAL = 60.0
# Outcomes after which the next round starts at once.
_WORKED = {
    delivery.DELIVERED,
    delivery.RETRYING,
    delivery.BLOCKED,
    delivery.DEAD_LETTERED,
    delivery.MOVED,
}


class StreamWorker:
    def __init__(
        self,
        specs: Sequence[SubscriberSpec],
        worker_id: str,
        poll_interval: float,
        listen: bool,
        metrics: WorkerMetrics | NullMetrics | None = None,
        wake_worker: Callable[[], None] | None = None,
    ) -> None:
        self.specs = list(specs)
        self.worker_id = worker_id
        self.poll_interval = poll_interval
        self.listen = listen
        self.metrics = metrics
        self.streams = {spec.stream for spec in self.specs}
        self.delivered = 0
        self._ids: dict[str, int] | None = None  # name -> row id, once ensured
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._threads: list[threading.Thread] = []
        self._delivery: threading.Thread | None = None  # the pgqueue-streams thread
        self._held_delay = HELD_DELAY
        # For health checks (health()): when the delivery thread last went
        # round or returned from a subscriber, what it runs now that may
        # legitimately take long (a subscriber, maintenance), and the error
        # of its last round (or what killed it). Its rounds are at most a
        # poll interval apart, as the main loop's.
        self._seen = time.monotonic()
        # (what, since): {"subscription": ..., "position": ...}
        self._running: tuple[dict[str, Any], float] | None = None
        self.error: str | None = None
        self.dead = False  # the delivery thread died of an exception
        self.stuck_after = poll_interval * 2 + 5
        # For --burst: whether the last probe found nothing due nor held back
        # in any served subscription. The worker's main loop waits for it (or
        # for the thread's death) before exiting: ``wake_worker`` is called
        # when either happens.
        self.caught_up = False
        self.wake_worker = wake_worker

    def start(self) -> StreamWorker:
        logger.info(
            "Worker %s: delivering to subscription(s) %s",
            self.worker_id,
            ", ".join(spec.name for spec in self.specs),
        )
        self._delivery = self._start_thread(self._run, "pgqueue-streams")
        if self.listen:
            self._start_thread(self._listen_loop, "pgqueue-streams-listener")
        return self

    def stop(self, timeout: float) -> None:
        """Stop after the batch in hand (waiting at most ``timeout`` seconds
        for it; an unfinished batch rolls back when the process exits)."""
        self._stop.set()
        self._wake.set()
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        if any(thread.is_alive() for thread in self._threads):
            logger.warning(
                "Worker %s: a subscriber was still running after %ss; its batch rolls back "
                "and is delivered again",
                self.worker_id,
                timeout,
            )

    def _start_thread(self, target: Callable[[], None], name: str) -> threading.Thread:
        thread = threads.start(target, name)
        self._threads.append(thread)
        return thread

    # --- health ---------------------------------------------------------------

    @property
    def alive(self) -> bool:
        return self._delivery is not None and self._delivery.is_alive() and not self.dead

    def health(self) -> tuple[bool, dict[str, Any]]:
        """``(healthy, details)``: healthy while the delivery thread lives,
        goes round (a subscriber that runs long is busy, not stuck: there is
        no subscriber timeout to say when it would be) and its last round
        succeeded."""
        now = time.monotonic()
        running = self._running
        alive = self.alive
        # Rounded before the comparison: a reader of the details sees the
        # age that made it stuck, above stuck_after.
        age = round(now - self._seen, 3)
        stuck = alive and running is None and age > self.stuck_after
        details = {
            "alive": alive,
            "stuck": stuck,
            "loop_age_seconds": age,
            "subscriptions": [spec.name for spec in self.specs],
            "delivered": self.delivered,
        }
        if running is not None:
            what, since = running
            details["running"] = {**what, "seconds": round(now - since, 3)}
        if self.error:
            details["last_error"] = self.error
        return alive and not stuck and not self.error, details

    @contextlib.contextmanager
    def _runs(self, **what: Any) -> Iterator[None]:
        """Around a subscriber's call (or maintenance): time that is not the
        thread's own and may take long."""
        self._running = (what, time.monotonic())
        try:
            yield
        finally:
            self._running = None
            self._seen = time.monotonic()

    def _watch(self, event: delivery.Event) -> contextlib.AbstractContextManager[None]:
        return self._runs(subscription=event.subscription, position=event.position)

    def _set_caught_up(self, caught_up: bool) -> None:
        was, self.caught_up = self.caught_up, caught_up
        if caught_up and not was and self.wake_worker is not None:
            self.wake_worker()

    # --- delivery -------------------------------------------------------------

    def _run(self) -> None:
        backoff = Backoff()
        next_maintenance = time.monotonic() + MAINTENANCE_INTERVAL
        try:
            while not self._stop.is_set():
                self._seen = time.monotonic()
                try:
                    wait = self._round()
                    if time.monotonic() >= next_maintenance:
                        next_maintenance = time.monotonic() + MAINTENANCE_INTERVAL
                        if conf.get("STREAM_RETENTION") is not None:
                            with self._runs(maintenance=True):
                                maintenance.run_once()
                    backoff.reset()
                    self.error = None
                except Exception as exc:  # noqa: BLE001  the thread must go on
                    connections.close_all()  # this thread's: reopened on next use
                    self._ids = None
                    self._set_caught_up(False)
                    self.error = _first_line(exc)
                    if self.metrics is not None:
                        self.metrics.reconnected("streams")
                    logger.warning(
                        "Worker %s streams: %s; retrying in %.1fs",
                        self.worker_id,
                        self.error,
                        backoff.delay,
                    )
                    wait = backoff.next()
                if wait > 0 and not self._stop.is_set():
                    self._wake.wait(wait)
                    self._wake.clear()
        except BaseException as exc:  # noqa: BLE001  a receiver's SystemExit, say
            # (A subscriber's is its event's failure: delivery records it.)
            # Ends the thread (as it would anyway), but not silently: the
            # health check and --burst need to know.
            self.error = f"the delivery thread died: {_first_line(exc)}"
            self.dead = True
            logger.critical(
                "Worker %s streams: %s; no more deliveries until the worker restarts",
                self.worker_id,
                self.error,
                exc_info=True,
            )
            if self.wake_worker is not None:
                self.wake_worker()
        finally:
            connections.close_all()

    def _round(self) -> float:
        """Deliver one batch to each due subscription; returns the seconds to
        wait before the next round (0: at once)."""
        if self._ids is None:
            self._ids = subscriptions.ensure(self.specs)
        by_id = {pk: spec for spec in self.specs if (pk := self._ids.get(spec.name))}
        probes = delivery.probe(by_id)
        if len(probes) < len(by_id):
            self._ids = None  # a row was deleted: created again next round
            return 0
        # Held events count as not caught up: they are committed, and
        # delivered once the older transaction that holds them back ends.
        self._set_caught_up(not any(found.due or found.held for found in probes))
        wait = self.poll_interval * random.uniform(0.9, 1.1)
        worked = held = False
        for found in probes:
            if self._stop.is_set():
                return 0
            if found.due:
                result = self._deliver(by_id[found.id], found.id)
                worked = worked or result.outcome in _WORKED
                if result.outcome == delivery.GONE:
                    self._ids = None  # deleted meanwhile: created again next round
            elif found.ready and found.retry_at is not None:
                wait = min(wait, (found.retry_at - found.now).total_seconds())
            held = held or found.held
        if worked:
            return 0
        if held:
            wait = min(wait, self._held_delay)
            self._held_delay = min(self._held_delay * 2, self.poll_interval)
        else:
            self._held_delay = HELD_DELAY
        return max(wait, 0.0)

    def _deliver(self, spec: SubscriberSpec, subscription_id: int) -> delivery.Delivery:
        """Batches to one subscription, the next at once (no probe first)
        while the last was full, for up to delivery.BATCH_SECONDS: then the
        round goes on to the other subscriptions. Returns the last batch's
        Delivery."""
        until = time.monotonic() + delivery.BATCH_SECONDS
        while True:
            result = delivery.deliver(spec, subscription_id, self.worker_id, watch=self._watch)
            self.delivered += result.delivered
            if not result.more or self._stop.is_set() or time.monotonic() >= until:
                return result

    # --- wake-ups -------------------------------------------------------------

    def _listen_loop(self) -> None:
        notify.listen(
            [CHANNEL],
            self._notified,
            on_connect=self._wake.set,  # notifications missed while away are gone: poll
            stop=self._stop,
            name=f"Worker {self.worker_id} streams listener",
            log=logger,
            reconnected=self._reconnected,
        )

    def _notified(self, channel: str, payload: str) -> None:
        if payload in self.streams:
            self._wake.set()

    def _reconnected(self) -> None:
        if self.metrics is not None:
            self.metrics.reconnected("streams")


def start_for(
    specs: Sequence[SubscriberSpec],
    worker_id: str,
    poll_interval: float,
    listen: bool,
    metrics: WorkerMetrics | NullMetrics | None,
    wake_worker: Callable[[], None] | None,
) -> StreamWorker | None:
    """Start delivering to ``specs`` for the worker ``worker_id`` (its poll
    interval, whether it listens, its metrics; ``wake_worker`` wakes its main
    loop, for --burst); returns the StreamWorker, or None when it serves none."""
    if not specs:
        return None
    return StreamWorker(specs, worker_id, poll_interval, listen, metrics, wake_worker).start()


def _first_line(exc: BaseException) -> str:
    """``Type: message`` of an exception, its first line only (for a log line
    and the health check's details)."""
    return first_line(describe(exc))
