"""A worker's view of its queues' run-time state (``controls``): which are
paused, which have limits, and when each of those may be claimed from
again; and the cancellations asked for the messages it holds.

The state is read from the database (one query) before the first claim,
whenever the control channel says it changed, and when the poll's
fingerprint of it changed (``probed``: the fallback, NOTIFY being
at-most-once and poll-only mode having none; it costs the poll a subquery,
not a query). So a pause or a resume reaches every listening worker within
a second. Between reads the paused set and the limits are plain
attributes: the claim of a queue without limits pays a set lookup.

A limited queue whose claim found no free slot is not claimed from until
one may have freed: for the rate, when the oldest start leaves the window
(a time); for the concurrency, when a NOTIFY names the queue (a new
message), when this worker finishes one of its messages, or at the next
read of the state (a slot freed by another worker, a rescued lease).
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Mapping

from django_pgqueue import controls
from django_pgqueue.conf.limits import Limits
from django_pgqueue.lifecycle.cancel import CANCEL_PREFIX
from django_pgqueue.lifecycle.claim import LimitState
from django_pgqueue.lifecycle.guards import log_extra
from django_pgqueue.worker.config import WorkerConfig
from django_pgqueue.worker.ledger import Ledger
from django_pgqueue.worker.wakeup import Wakeup

logger = logging.getLogger(__package__)


# How long a queue whose partitions gave fewer messages than asked waits
# before its next claim when they have no rate of their own in the
# settings (a named partition's rate): a second at most.
PARTITION_RETRY_MAX = 1.0


def partition_retry_seconds(limits: Limits) -> float:
    """The wait after a short claim of a queue with limits per partition:
    the spacing of the partitions' rate (its period / count: when the next
    slot of a full partition frees, on average), at most a second."""
    rate = None if limits.partition is None else limits.partition.rate
    if rate is None:
        return PARTITION_RETRY_MAX
    return min(PARTITION_RETRY_MAX, rate.seconds / rate.count)


class QueueControls:
    def __init__(self, config: WorkerConfig, ledger: Ledger, wakeup: Wakeup) -> None:
        self._config = config
        self._ledger = ledger
        self._wakeup = wakeup
        self._lock = threading.Lock()
        self._stale = True  # read the state before the first claim
        self._version: str | None = None  # the poll's fingerprint of the state last read
        self.paused: frozenset[str] = frozenset()
        self.limits: dict[str, Limits] = {}  # its queues that have limits
        # Its queues with a concurrency limit, or limits per partition: a
        # handler thread that finishes one of their messages frees a slot
        # (``settled``), and a NOTIFY may name a partition with free slots.
        self.concurrency_limited: frozenset[str] = frozenset()
        # Queue -> time.monotonic() from which to claim from it again (inf:
        # when a slot of its concurrency frees).
        self._blocked: dict[str, float] = {}

    # --- the listener thread ------------------------------------------------------

    def notified(self, payload: str) -> None:
        """A notification on the control channel."""
        if payload == controls.QUEUES_CHANGED:
            self.reread()
        elif payload.startswith(CANCEL_PREFIX):
            ids = {int(pk) for pk in payload[len(CANCEL_PREFIX) :].split(",") if pk.isdigit()}
            self.cancel(ids)

    def reread(self) -> None:
        """Read the state again before the next claim (and claim)."""
        with self._lock:
            self._stale = True
        self._wakeup.notify()

    def queue_notified(self, queue: str) -> None:
        """A NOTIFY named ``queue`` (a message is ready): a slot of its
        concurrency may be free by now too."""
        if queue in self.concurrency_limited:
            self._unblock(queue)

    # --- handler threads ------------------------------------------------------------

    def settled(self, queue: str) -> None:
        """This worker finished a message of ``queue`` (a concurrency-limited
        one): claim from it again."""
        self._unblock(queue)
        self._wakeup.notify()

    # --- the heartbeat and the listener ------------------------------------------------

    def cancel(self, ids: set[int]) -> None:
        """Cancellation was asked for the messages ``ids``: tell the handlers
        of those this worker holds (their ``cancel_requested()``)."""
        for job in self._ledger.request_cancel(ids):
            job.interrupt("cancellation asked")  # an async handler's task: cancelled
            message = job.message
            logger.info(
                "Message id=%s topic=%s attempt=%s: cancellation asked; its handler is told",
                message.pk,
                message.topic,
                message.attempts,
                extra=log_extra(message, state="cancel_requested"),
            )

    # --- the main loop --------------------------------------------------------------------

    def probed(self, version: str) -> None:
        """The poll saw the state's fingerprint ``version``: read the state
        again if it changed. And a slot of a queue's concurrency may have
        freed on another worker meanwhile: claim from them again."""
        with self._lock:
            if version != self._version:
                self._stale = True
                self._version = version
            self._blocked = {name: at for name, at in self._blocked.items() if at != math.inf}

    def refresh(self) -> None:
        """Read the state again if it changed."""
        with self._lock:
            due, self._stale = self._stale, False
        if not due:
            return
        try:
            found = controls.current(self._config.queues)
        except BaseException:
            with self._lock:
                self._stale = True  # read again on the next round
            raise
        newly_paused = found.paused - self.paused
        resumed = self.paused - found.paused
        self.paused = found.paused
        self.limits = found.limits
        self.concurrency_limited = frozenset(
            name
            for name, limits in found.limits.items()
            if limits.concurrency is not None or limits.partitioned
        )
        with self._lock:
            self._blocked = {name: at for name, at in self._blocked.items() if name in found.limits}
        if newly_paused or resumed:
            logger.info(
                "Worker %s: paused queues now %s",
                self._config.worker_id,
                ",".join(sorted(self.paused)) or "none",
            )
        if resumed:
            self._wakeup.notify()  # claim from them at once

    def claimable(self, now: float) -> list[str]:
        """Its queues to claim from now, in order: not paused, and not
        waiting for a slot of their limits."""
        paused, blocked = self.paused, self._blocked
        if not paused and not blocked:
            return self._config.queues
        with self._lock:
            waiting = {name for name, at in blocked.items() if at > now}
        return [name for name in self._config.queues if name not in paused and name not in waiting]

    def claim_limits(self) -> Mapping[str, Limits] | None:
        """The limits the claim enforces (None: no queue of its has any)."""
        return self.limits or None

    def claimed(self, limited: Mapping[str, LimitState], now: float) -> None:
        """A claim left the limited queues ``limited`` so: those without a
        free slot wait for one."""
        with self._lock:
            for name, state in limited.items():
                limits = self.limits.get(name)
                if limits is None:
                    continue
                concurrency_full, rate_full = state.full(limits)
                if concurrency_full:
                    self._blocked[name] = math.inf
                elif rate_full:
                    self._blocked[name] = now + state.seconds_to_slot
                elif state.short and limits.partitioned:
                    # Its partitions may be waiting for a slot of their rate,
                    # which no NOTIFY announces: look again a rate's slot
                    # later (a slot of their concurrency: when a message of
                    # the queue finishes, as above).
                    self._blocked[name] = now + partition_retry_seconds(limits)
                else:
                    self._blocked.pop(name, None)

    def next_unblock(self) -> float:
        """When the first queue waiting for its rate may be claimed again
        (time.monotonic(); inf: none is)."""
        with self._lock:
            times = [at for at in self._blocked.values() if at != math.inf]
        return min(times, default=math.inf)

    def take_unblocked(self, now: float) -> bool:
        """Whether a queue that waited for its rate may be claimed from again
        now (it waits no more)."""
        with self._lock:
            due = [name for name, at in self._blocked.items() if at <= now]
            for name in due:
                del self._blocked[name]
        return bool(due)

    def _unblock(self, queue: str) -> None:
        with self._lock:
            self._blocked.pop(queue, None)
