"""The end of a run: SIGTERM and SIGINT, and the steps of a shutdown, in the
order ``Worker`` runs them:

1. stop claiming; hand back at once the claimed messages no thread started
   (``hand_back_unstarted``: no attempt counted);
2. let the running handlers finish, up to ``shutdown_timeout`` (``drain``);
3. hand back what is still held (``hand_back_leftover``);
4. stop the helper threads and remove the worker's row (``unregister``).

A second signal exits at once; leases then expire and maintenance returns
the messages.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

from django.db import DatabaseError

from django_pgqueue import lifecycle, liveness
from django_pgqueue.db import drop_broken_connections
from django_pgqueue.worker.acks import Acks
from django_pgqueue.worker.executor import Executor
from django_pgqueue.worker.ledger import Ledger
from django_pgqueue.worker.wakeup import Wakeup

logger = logging.getLogger(__package__)

SignalHandlers = dict[int, Any]  # what signal.signal() returned, to put back


def install_signals(worker_id: str, stop: Callable[[], None]) -> SignalHandlers | None:
    """On the main thread: SIGTERM and SIGINT call ``stop()``, a second one
    exits at once. Returns the handlers they replace (``restore_signals``)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    received: list[int] = []

    def on_signal(signum: int, frame: FrameType | None) -> None:
        if received:
            logger.warning("Worker %s: second signal, exiting at once", worker_id)
            os._exit(1)
        received.append(signum)
        logger.info(
            "Worker %s: %s received, finishing in-flight messages",
            worker_id,
            signal.Signals(signum).name,
        )
        stop()

    return {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}


def restore_signals(previous: SignalHandlers | None) -> None:
    for signum, handler in (previous or {}).items():
        signal.signal(signum, handler)


def hand_back_unstarted(ledger: Ledger, worker_id: str) -> None:
    """Claimed but not started: hand back at once (no attempt counted)."""
    unstarted = ledger.unstarted()
    if not unstarted:
        return
    try:
        lifecycle.release([job.message for job in unstarted])
    except DatabaseError:
        drop_broken_connections()
        logger.warning(
            "Worker %s: could not hand back %s prefetched message(s); "
            "they return when their lease expires",
            worker_id,
            len(unstarted),
        )


def drain(ledger: Ledger, acks: Acks, executor: Executor, wakeup: Wakeup, deadline: float) -> None:
    """Until ``deadline`` (time.monotonic()): let the running handlers
    finish, flushing their acknowledgements and expiring their timeouts."""
    while ledger.busy() and time.monotonic() < deadline:
        try:
            acks.flush()
            executor.expire_timeouts()
        except DatabaseError:
            drop_broken_connections()
        if not ledger.busy():
            break
        wakeup.wait(min(0.1, max(0.0, deadline - time.monotonic())))


def hand_back_leftover(ledger: Ledger, worker_id: str) -> None:
    """Hand back what did not finish in time (no attempt counted)."""
    leftover = ledger.leftover()
    if not leftover:
        return
    try:
        released = lifecycle.release([job.message for job in leftover])
        logger.warning(
            "Worker %s: handed back %s unfinished message(s) without counting the attempt",
            worker_id,
            released,
        )
    except DatabaseError:
        logger.exception(
            "Worker %s: could not hand back unfinished messages; "
            "they return when their lease expires",
            worker_id,
        )


def unregister(worker_id: str) -> None:
    """Remove the worker's row: it is gone, not dead."""
    try:
        liveness.unregister(worker_id)
    except DatabaseError:
        logger.warning(
            "Worker %s: could not remove its row from the worker table; "
            "it shows as dead once its heartbeat is stale",
            worker_id,
        )
