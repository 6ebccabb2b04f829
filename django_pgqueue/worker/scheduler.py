"""The worker's scheduler: the ``pgqueue-scheduler`` thread that enqueues the
ticks of the periodic schedules (``schedules.runs.run_round``).

Every worker runs one (``pgqueue_worker --no-schedules`` turns it off), and
there is no leader: each round locks the schedules it works on, and the tick
ledger's unique (schedule, tick) makes a tick one message whoever gets to it
first. A worker that dies (even by kill -9) holds nothing the others need:
its open round rolls back with its connection, and the next round of any
other worker enqueues the tick.

Each round tells, by the database's clock, when the next tick of any
schedule falls due; the thread sleeps until then (at most MAX_WAIT), so it
wakes once per tick and not on a poll. Between rounds it prunes the ledger
every PRUNE_EVERY seconds.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

from django.db import DatabaseError, connections

from django_pgqueue.db import Backoff, drop_broken_connections, first_line
from django_pgqueue.schedules import runs, state, ticks
from django_pgqueue.schedules.configured import configured, schedules_on
from django_pgqueue.schedules.spec import ScheduleSpec
from django_pgqueue.worker import threads
from django_pgqueue.worker.config import Metrics, WorkerConfig

logger = logging.getLogger(__package__)

# The longest sleep between rounds: a round at least this often, whatever
# the schedules (their pauses and resumes need no round to take effect).
MAX_WAIT = 60.0
# A round starts this long after the tick by the database's clock, so that
# a round is never a hair early for it.
MARGIN = 0.01
PRUNE_EVERY = 600.0  # seconds between prunings of the tick ledger
# A round that found a schedule locked by another scheduler looks again this
# soon: should that one die in its round, its tick is still on time here.
BUSY_WAIT = 1.0


class Scheduler:
    def __init__(
        self,
        worker_id: str,
        specs: Sequence[ScheduleSpec],
        metrics: Metrics,
        exit: threading.Event,
    ) -> None:
        self._worker_id = worker_id
        self._specs = list(specs)
        self._metrics = metrics
        self._exit = exit  # set when the worker's helper threads end
        self._wake = threading.Event()
        self._next_prune = time.monotonic() + PRUNE_EVERY
        self.error: str | None = None  # the database error it is recovering from
        self.rounds = 0

    @property
    def names(self) -> list[str]:
        return [spec.name for spec in self._specs]

    def health(self) -> tuple[bool, dict[str, object]]:
        """``(healthy, details)``: unhealthy while its last round failed on
        the database (it retries; no tick is enqueued meanwhile)."""
        details: dict[str, object] = {"schedules": self.names, "rounds": self.rounds}
        if self.error:
            details["error"] = self.error
        return not self.error, details

    def start(self) -> threading.Thread:
        logger.info(
            "Worker %s: scheduler runs %s schedule(s): %s",
            self._worker_id,
            len(self._specs),
            ", ".join(self.names),
        )
        return threads.start(self._run, "pgqueue-scheduler")

    def stop(self) -> None:
        """Wake the thread to see that ``exit`` is set."""
        self._wake.set()

    def run_once(self) -> runs.RoundResult:
        """One round now, in this thread (a --burst worker runs one before it
        starts claiming, so that due ticks are worked off too), backfills
        included."""
        while True:
            result = self._round()
            if not result.more:
                return result

    def _round(self) -> runs.RoundResult:
        result = runs.run_round(self._specs)
        self.rounds += 1
        for name in set(result.enqueued) | set(result.skipped):
            self._metrics.scheduled(name, result.enqueued.get(name, 0), result.skipped.get(name, 0))
        return result

    def _run(self) -> None:
        backoff = Backoff()
        while not self._exit.is_set():
            try:
                started = time.monotonic()
                result = self._round()
                if time.monotonic() >= self._next_prune:
                    self._prune(result)
                wait = self._wait(result, time.monotonic() - started)
                self.error = None
                backoff.reset()
            except DatabaseError as exc:
                drop_broken_connections()
                self.error = first_line(exc)
                self._metrics.reconnected("scheduler")
                wait = backoff.next()
                logger.warning(
                    "Worker %s scheduler: database error (%s); retrying in %.1fs",
                    self._worker_id,
                    self.error,
                    wait,
                )
            except Exception:
                # Never let the thread die on a bug: no schedule would tick.
                wait = backoff.next()
                logger.exception("Worker %s scheduler: round failed", self._worker_id)
            self._wake.wait(wait)
            self._wake.clear()
        connections.close_all()

    @staticmethod
    def _wait(result: runs.RoundResult, elapsed: float) -> float:
        """Seconds until the next round: at once while a backfill goes on,
        else until the next tick by the database's clock (the round's
        ``now``, ``elapsed`` seconds ago), at most MAX_WAIT (BUSY_WAIT when
        another scheduler held a schedule)."""
        if result.more:
            return 0.0
        longest = BUSY_WAIT if result.busy else MAX_WAIT
        if result.next_tick is None:
            return longest
        until = (result.next_tick - result.now).total_seconds() - elapsed + MARGIN
        return min(max(until, MARGIN), longest)

    def _prune(self, result: runs.RoundResult) -> None:
        self._next_prune = time.monotonic() + PRUNE_EVERY
        horizons = {spec.name: result.now - ticks.window(spec) for spec in self._specs}
        deleted = state.prune(horizons, result.now)
        if deleted:
            logger.debug("Worker %s scheduler: pruned %s ledger row(s)", self._worker_id, deleted)


def scheduler_for(
    schedules: bool | Sequence[ScheduleSpec],
    config: WorkerConfig,
    metrics: Metrics,
    exit: threading.Event,
) -> Scheduler | None:
    """The scheduler of a worker's engine: of ``schedules`` (True: the
    project's, ImproperlyConfigured if one is bad; False: none; or these
    specs), those whose queue is on its database; None when none is."""
    specs = configured() if schedules is True else list(schedules or ())
    specs = schedules_on(specs, config.database)
    return Scheduler(config.worker_id, specs, metrics, exit) if specs else None
