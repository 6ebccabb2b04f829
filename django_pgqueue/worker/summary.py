"""The worker's periodic summary at INFO: what it finished in the last
interval, with the rate, instead of a line per message (those are DEBUG).

Handler threads and the main loop count (``count``); the main loop logs
(``log_if_due``) once per ``PGQUEUE["LOG_SUMMARY_INTERVAL"]`` seconds in
which anything was finished. An idle worker writes no summary: its start
line and its heartbeat say it lives."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from django_pgqueue.observability.metrics import CANCELLED, DEAD_LETTERED, DONE, RETRIED

logger = logging.getLogger(__package__)

# The outcomes a summary counts (the metrics' labels), in the order its line names them.
OUTCOMES = (DONE, RETRIED, DEAD_LETTERED, CANCELLED)


class Summary:
    def __init__(self, worker_id: str, interval: float, inflight: Callable[[], int]) -> None:
        self._worker_id = worker_id
        self._interval = interval  # seconds; 0: no summary
        self._inflight = inflight
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(OUTCOMES, 0)
        self._since = time.monotonic()

    def count(self, outcome: str, n: int = 1) -> None:
        """``n`` messages ended with ``outcome`` (one of OUTCOMES)."""
        with self._lock:
            self._counts[outcome] += n

    def log_if_due(self, now: float, final: bool = False) -> None:
        """Log the interval's line when it is over, or (``final``) the part
        of it before the worker stops. Nothing when nothing was finished in
        it: the next interval starts then all the same."""
        if not self._interval or (now - self._since < self._interval and not final):
            return
        with self._lock:
            counts, self._counts = self._counts, dict.fromkeys(OUTCOMES, 0)
            elapsed, self._since = now - self._since, now
        if not any(counts.values()) or elapsed <= 0:
            return
        finished = sum(counts.values())
        logger.info(
            "Worker %s: %s done (%.1f/s), %s retried, %s dead-lettered, %s cancelled in the "
            "last %.0fs; %s in flight",
            self._worker_id,
            counts[DONE],
            counts[DONE] / elapsed,
            counts[RETRIED],
            counts[DEAD_LETTERED],
            counts[CANCELLED],
            elapsed,
            self._inflight(),
            extra={
                "state": "summary",
                "worker": self._worker_id,
                "seconds": round(elapsed, 3),
                "finished": finished,
                "rate": round(finished / elapsed, 3),
                **counts,
            },
        )
