"""Runs cut off by a lost connection, handed back once the database answers
again.

When the connection under a run dies (a failover, a network cut,
``pg_terminate_backend``), its transaction dies with it: an atomic
handler's writes and acknowledgement roll back, and the retry that would
record the failure cannot be written until the worker reaches the database
again. Such a run used to end *lost*, and its message waited for its lease
to expire (a minute by default) before the rescue returned it. The worker
knows better: it holds the lease and it saw the run die. So it keeps those
messages here, and the main loop, on its first round that reaches the
database, hands them back at once (``maintenance.rescue_cut_off``): due
now, the attempt counted as the rescue counts it, "connection lost"
recorded.

The hand-back is guarded by each message's lease token, on whatever server
now answers (a promoted standby): a run whose commit reached that server
(its acknowledgement deleted the row) is never handed back, so an atomic
handler's writes never commit twice. A row that another transaction holds
locked (the cut-off backend's transaction, still open on the server) is
tried again on the next rounds, until the lease would have brought it back
anyway.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from django_pgqueue import lifecycle, maintenance
from django_pgqueue.models import Message
from django_pgqueue.worker.config import WorkerConfig
from django_pgqueue.worker.job import Job

logger = logging.getLogger(__package__)

# A row still locked by the cut-off transaction is tried again this much later.
RETRY_LOCKED = 1.0

REASON = f"{lifecycle.CONNECTION_LOST}: the worker's connection to the database died under the run"
ORPHAN_REASON = (
    f"{lifecycle.CONNECTION_LOST}: the worker's connection to the database died, and the "
    "worker held no run of it (the claim's reply, or the run's outcome, was lost with it)"
)


class CutOff:
    def __init__(
        self, config: WorkerConfig, wake: Callable[[], None], held_ids: Callable[[], set[int]]
    ) -> None:
        self._worker_id = config.worker_id
        self._lease_seconds = config.lease_seconds
        self._wake = wake  # wakes the main loop
        self._held_ids = held_ids  # the ids of the messages the worker holds (Ledger)
        # A connection died: look once for leases of ours that we do not
        # hold (the sweep), when the database answers again.
        self._sweep = False
        self._lock = threading.Lock()
        # message id -> (the message, time.monotonic() when its run was cut off)
        self._held: dict[int, tuple[Message, float]] = {}
        self._next_try = 0.0  # time.monotonic(): not before (rows still locked)

    def add(self, job: Job) -> None:
        """``job``'s run died with its connection (any thread): hand it back
        once the database answers (``hand_back``, the main loop)."""
        if job.abandoned:
            return  # timed out or handed back already: not ours to return
        with self._lock:
            self._held.setdefault(job.message.pk, (job.message, time.monotonic()))
            self._next_try = 0.0
            self._sweep = True
        self._wake()

    def due(self) -> bool:
        """Whether there is something to hand back now (no lock: the main
        loop asks every round)."""
        return (self._sweep or bool(self._held)) and time.monotonic() >= self._next_try

    def hand_back_if_due(self, after_error: bool = False) -> None:
        """The main loop, each round: hand back what is due; ``after_error``
        (its last round failed on the database), sweep first."""
        if after_error:
            self._sweep = True
        if self.due():
            self.hand_back()

    def hand_back(self) -> None:
        """Return the cut-off runs' messages to the queue (one transaction);
        a DatabaseError (the database is still away) leaves them for the
        next round."""
        if self._sweep:
            self._sweep = False
            try:
                self._hand_back_orphans()
            except BaseException:
                self._sweep = True
                raise
        with self._lock:
            held = dict(self._held)
        if not held:
            return
        result, locked = maintenance.rescue_cut_off([m for m, _ in held.values()], REASON)
        now = time.monotonic()
        with self._lock:
            for pk, (_, since) in held.items():
                # A row still locked is tried again, until the lease would
                # have expired: the rescue takes it from there.
                if pk not in locked or now - since > self._lease_seconds:
                    self._held.pop(pk, None)
            if self._held:
                self._next_try = now + RETRY_LOCKED
        returned = result.requeued + result.dead_lettered + result.cancelled
        if returned or locked:
            logger.warning(
                "Worker %s: handed back %s message(s) whose run died with its database "
                "connection (requeued %s, dead-lettered %s, cancelled %s)%s",
                self._worker_id,
                returned,
                result.requeued,
                result.dead_lettered,
                result.cancelled,
                f"; {len(locked)} still locked by the cut-off transaction, tried again"
                if locked
                else "",
                extra={"state": "handed_back", "count": returned},
            )

    def _hand_back_orphans(self) -> None:
        """The sweep: the leases that the database gives this worker and
        that it does not hold (maintenance.rescue_orphans). Runs on the main
        loop, between its claims: every claimed message is held by then."""
        # (The runs cut off are handed back next, with their own reason.)
        held = self._held_ids() | set(self._held)
        result = maintenance.rescue_orphans(self._worker_id, held, ORPHAN_REASON)
        returned = result.requeued + result.dead_lettered + result.cancelled
        if returned:
            logger.warning(
                "Worker %s: handed back %s message(s) that the database had leased to it and "
                "it did not hold (a claim or an outcome lost with the connection; requeued "
                "%s, dead-lettered %s, cancelled %s)",
                self._worker_id,
                returned,
                result.requeued,
                result.dead_lettered,
                result.cancelled,
                extra={"state": "handed_back", "count": returned},
            )
