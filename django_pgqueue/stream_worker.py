"""The worker's stream delivery: a thread that delivers stream events to the
subscriptions a worker serves (``pgqueue_worker --subscriptions``), beside
the message loop.

Threads (both daemons, both started and stopped by ``worker.Worker``):

- ``pgqueue-streams`` creates the served subscriptions' rows, then goes
  round: one probe query tells which subscriptions have deliverable events;
  each of those gets one batch (``stream_delivery.deliver``, one
  transaction), then the next round starts. With nothing to do it waits for
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

Several workers may serve the same subscriptions: each delivery takes the
subscription's lock first, so one worker at a time delivers to it, and the
others skip it (``BUSY``) until their next poll.
"""

import logging
import random
import threading
import time

import psycopg
from django.db import connections

from . import conf, maintenance, stream_delivery, subscriptions
from .notify import listen_connection
from .streams import CHANNEL

logger = logging.getLogger(__name__)

RECONNECT_DELAY = 0.5
RECONNECT_DELAY_CAP = 30.0
# Held events (committed above the snapshot's xmin): look again after this
# long, doubling up to the poll interval.
HELD_DELAY = 0.01
# Seconds between maintenance rounds started from this thread.
MAINTENANCE_INTERVAL = 60.0
# Outcomes after which the next round starts at once.
_WORKED = {
    stream_delivery.DELIVERED,
    stream_delivery.RETRYING,
    stream_delivery.BLOCKED,
    stream_delivery.DEAD_LETTERED,
    stream_delivery.MOVED,
}


class StreamWorker:
    def __init__(self, specs, worker_id, poll_interval, listen, metrics=None):
        self.specs = list(specs)
        self.worker_id = worker_id
        self.poll_interval = poll_interval
        self.listen = listen
        self.metrics = metrics
        self.streams = {spec.stream for spec in self.specs}
        self.delivered = 0
        self._ids = None  # name -> row id, once ensured
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._threads = []
        self._held_delay = HELD_DELAY

    def start(self):
        logger.info(
            "Worker %s: delivering to subscription(s) %s",
            self.worker_id,
            ", ".join(spec.name for spec in self.specs),
        )
        self._start_thread(self._run, "pgqueue-streams")
        if self.listen:
            self._start_thread(self._listen_loop, "pgqueue-streams-listener")
        return self

    def stop(self, timeout):
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

    def _start_thread(self, target, name):
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    # --- delivery -------------------------------------------------------------

    def _run(self):
        delay = RECONNECT_DELAY
        next_maintenance = time.monotonic() + MAINTENANCE_INTERVAL
        try:
            while not self._stop.is_set():
                try:
                    wait = self._round()
                    if time.monotonic() >= next_maintenance:
                        next_maintenance = time.monotonic() + MAINTENANCE_INTERVAL
                        if conf.get("STREAM_RETENTION") is not None:
                            maintenance.run_once()
                    delay = RECONNECT_DELAY
                except Exception as exc:  # noqa: BLE001  the thread must go on
                    connections.close_all()  # this thread's: reopened on next use
                    self._ids = None
                    if self.metrics is not None:
                        self.metrics.reconnected("streams")
                    logger.warning(
                        "Worker %s streams: %s: %s; retrying in %.1fs",
                        self.worker_id,
                        type(exc).__name__,
                        str(exc).strip().splitlines()[0] if str(exc).strip() else "",
                        delay,
                    )
                    wait = delay * random.uniform(0.8, 1.2)
                    delay = min(delay * 2, RECONNECT_DELAY_CAP)
                if wait > 0 and not self._stop.is_set():
                    self._wake.wait(wait)
                    self._wake.clear()
        finally:
            connections.close_all()

    def _round(self):
        """Deliver one batch to each due subscription; returns the seconds to
        wait before the next round (0: at once)."""
        if self._ids is None:
            self._ids = subscriptions.ensure(self.specs)
        by_id = {pk: spec for spec in self.specs if (pk := self._ids.get(spec.name))}
        probes = stream_delivery.probe(by_id)
        if len(probes) < len(by_id):
            self._ids = None  # a row was deleted: created again next round
            return 0
        wait = self.poll_interval * random.uniform(0.9, 1.1)
        worked = held = False
        for found in probes:
            if self._stop.is_set():
                return 0
            if found.due:
                delivery = stream_delivery.deliver(by_id[found.id], found.id, self.worker_id)
                self.delivered += delivery.delivered
                worked = worked or delivery.outcome in _WORKED
                if delivery.outcome == stream_delivery.GONE:
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

    # --- wake-ups -------------------------------------------------------------

    def _listen_loop(self):
        delay = RECONNECT_DELAY
        while not self._stop.is_set():
            try:
                with listen_connection(subscriptions.alias()) as conn:
                    conn.execute(f"LISTEN {CHANNEL}")
                    delay = RECONNECT_DELAY
                    self._wake.set()  # notifications missed while away are gone: poll
                    while not self._stop.is_set():
                        for notification in conn.notifies(timeout=0.25):
                            if notification.payload in self.streams:
                                self._wake.set()
            except psycopg.Error as exc:
                if self._stop.is_set():
                    break
                if self.metrics is not None:
                    self.metrics.reconnected("streams")
                logger.warning(
                    "Worker %s streams listener: %s; reconnecting in %.1fs",
                    self.worker_id,
                    str(exc).strip() or type(exc).__name__,
                    delay,
                )
                self._stop.wait(delay * random.uniform(0.8, 1.2))
                delay = min(delay * 2, RECONNECT_DELAY_CAP)


def start_for(worker):
    """Start delivering to ``worker.subscriptions`` (SubscriberSpecs) for a
    ``worker.Worker``; returns the StreamWorker, or None when it serves none."""
    if not worker.subscriptions:
        return None
    return StreamWorker(
        worker.subscriptions, worker.worker_id, worker.poll_interval, worker.listen, worker.metrics
    ).start()
