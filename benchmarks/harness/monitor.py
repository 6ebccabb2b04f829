"""A queue watched while it drains, from a connection of its own."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from benchmarks.harness.db import connect
from benchmarks.harness.machine import CpuTimes, busy_percent, cpu_times, proc_cpu_seconds

Query = tuple[str, Sequence[Any]]


def wait_until(predicate: Callable[[], bool], timeout: float, poll: float = 0.02) -> bool:
    """Poll ``predicate`` until it is true or ``timeout`` seconds passed; its last answer."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(poll)
    return predicate()


class DrainMonitor:
    """Watches a queue from a connection of its own: when the first job
    leaves the waiting state (``claimed``, a query true from then on) and
    when no job is left (``empty``). It polls every ``interval``; with
    ``adaptive``, once the drain began, every elapsed/200 (at most 100 ms),
    so a long drain's end is still known to within 0.5% for fewer queries.
    ``pid``: a process whose CPU time (and the machine's) is read at both
    moments. ``backends``: also sample the CPU time of the database's other
    server backends (its clients', from /proc/<pid>/stat: the server on this
    machine) at every poll, and every ``interval`` from the queue empty until
    ``stop``; ``backends_cpu_s`` sums each one's last sample (a lower bound:
    a backend's work after its last sample is missed)."""

    def __init__(
        self,
        url: str,
        claimed: Query,
        empty: Query,
        *,
        interval: float = 0.005,
        adaptive: bool = False,
        pid: int | None = None,
        backends: bool = False,
    ) -> None:
        self.conn = connect(url)
        self.backend_pid = int(self.conn.info.backend_pid)
        # Its server backend's CPU seconds when it stopped (None: the server
        # is not on this machine), to leave the monitor out of the server's.
        self.backend_cpu_s: float | None = None
        self.claimed, self.empty_query = claimed, empty
        self.interval = interval
        self.adaptive = adaptive
        self.pid = pid
        self.first_claim: float | None = None  # time.perf_counter()
        self.empty: float | None = None
        self.queries = 0  # one transaction each
        self.cpu: dict[str, tuple[CpuTimes | None, float | None]] = {}
        self.backends = backends
        self.backend_samples: dict[int, float] = {}  # backend pid -> its CPU seconds last seen
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="drain-monitor", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _seen(self, query: Query) -> bool:
        self.queries += 1
        row = self.conn.execute(*query).fetchone()
        return bool(row and row[0])

    def _mark(self, what: str, now: float) -> float:
        if self.pid is not None:
            self.cpu[what] = (cpu_times(), proc_cpu_seconds(self.pid))
        return now

    def _sample_backends(self, query: bool = True) -> None:
        if query:
            self.queries += 1
            rows = self.conn.execute(
                "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
                " AND pid <> pg_backend_pid()"
            ).fetchall()
            for (pid,) in rows:
                self.backend_samples.setdefault(pid, 0.0)
        for pid in self.backend_samples:
            cpu = proc_cpu_seconds(pid)
            if cpu is not None:
                self.backend_samples[pid] = cpu

    @property
    def backends_cpu_s(self) -> float | None:
        """CPU seconds of the database's backends seen (``backends``), or None."""
        if not self.backends or not self.backend_samples:
            return None
        return sum(self.backend_samples.values())

    def _run(self) -> None:
        self._poll()
        while self.backends and not self._stop.is_set():
            self._sample_backends(query=False)  # the workers' last work, until they exit
            self._stop.wait(self.interval)

    def _poll(self) -> None:
        while not self._stop.is_set() and self.empty is None:
            if self.backends:
                self._sample_backends()
            now = time.perf_counter()
            if self.first_claim is None:
                if self._seen(self.claimed):
                    self.first_claim = self._mark("first", now)
            elif self._seen(self.empty_query):
                self.empty = self._mark("empty", now)
            wait = self.interval
            if self.adaptive and self.first_claim is not None:
                wait = min(0.1, max(self.interval, (now - self.first_claim) / 200))
            self._stop.wait(wait)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.backend_cpu_s = proc_cpu_seconds(self.backend_pid)
        self.conn.close()

    @property
    def drain_s(self) -> float | None:
        """First claim to the queue empty, when both were seen."""
        if self.first_claim is None or self.empty is None:
            return None
        return self.empty - self.first_claim

    def process_cpu_percent(self) -> float | None:
        """``pid``'s CPU time over the drain, as a share of one core."""
        first, empty = self.cpu.get("first", (None, None)), self.cpu.get("empty", (None, None))
        a, b = first[1], empty[1]
        drain = self.drain_s
        if a is None or b is None or not drain or drain <= 0:
            return None
        return 100.0 * (b - a) / drain

    def machine_busy_percent(self) -> float | None:
        """How busy all cores were during the drain."""
        return busy_percent(
            self.cpu.get("first", (None, None))[0], self.cpu.get("empty", (None, None))[0]
        )
