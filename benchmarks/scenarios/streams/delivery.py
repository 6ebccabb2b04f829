"""One ``pgqueue_worker --burst`` delivering a backlog of stream events to
the no-op subscription ``bench.stream_noop`` (testproject/demo/subscribers.py).

The backlog is written straight into the event table (``INSERT ... SELECT``
from ``generate_series``, as ``publish()`` would insert each row) by two
connections in turn, whose transactions interleave: the first transaction
of each pair takes positions 1-k, the second k+1-2k, the first again
2k+1-3k, ..., and the second commits first. So the delivery order, by
``(xid, position)``, is not the order of the positions, and the check that
the subscriber saw the events in that order tests the xid8 ordering.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.harness import db
from benchmarks.harness.machine import busy_percent, cpu_times, proc_cpu_seconds
from benchmarks.harness.worker import Bench

STREAM = "bench.stream"
SUBSCRIPTION = "bench.stream_noop"
EVENT_TABLE = "django_pgqueue_streamevent"
SUBSCRIPTION_TABLE = "django_pgqueue_subscription"
# Read by the bench subscriber: where it writes the positions it saw, at exit.
LOG_ENV = "PGQUEUE_BENCH_STREAM_LOG"

INSERT_SQL = (
    f"INSERT INTO {EVENT_TABLE} (stream, key, payload, headers)"
    " SELECT %s, 'k' || n, jsonb_build_object('n', n), '{}'::jsonb"
    " FROM generate_series(%s::bigint, %s::bigint) AS n"
)
# The subscription's row, watched from a connection of its own.
ROW_SQL = f"SELECT delivered, checkpoint_position, state FROM {SUBSCRIPTION_TABLE} WHERE name = %s"


def fill(url: str, events: int, per_transaction: int) -> list[int]:
    """Write ``events`` events of the bench stream, ``per_transaction`` a
    transaction, in interleaved pairs of transactions (the module's
    docstring); returns the positions in delivery order, read back."""
    first, second = db.connect(url, autocommit=False), db.connect(url, autocommit=False)
    try:
        written = 0
        while written < events:
            for conn in (first, second):
                count = min(per_transaction, events - written)
                if count:
                    conn.execute(INSERT_SQL, [STREAM, written + 1, written + count])
                    written += count
            second.commit()  # the later transaction ends first
            first.commit()
    finally:
        first.close()
        second.close()
    with db.connect(url) as conn:
        conn.execute(f"VACUUM ANALYZE {EVENT_TABLE}")
        rows = conn.execute(
            f"SELECT position FROM {EVENT_TABLE} WHERE stream = %s ORDER BY xid, position",
            [STREAM],
        ).fetchall()
    return [row[0] for row in rows]


def reset(url: str) -> None:
    """No events, no subscription row (the worker creates it: from the beginning)."""
    with db.connect(url) as conn:
        conn.execute(f"TRUNCATE {EVENT_TABLE} RESTART IDENTITY")
        conn.execute(f"DELETE FROM {SUBSCRIPTION_TABLE}")


@dataclass
class StreamRun:
    """One delivery run's figures."""

    tree: str
    events: int
    wall_s: float  # worker start to exit
    window_s: float  # first checkpoint move seen to the checkpoint at the last event
    window_events: int  # events delivered in that window (all but the first batch)
    window_cpu_s: float | None  # the worker's CPU time in that window (/proc)
    worker_cpu_s: float  # its whole life (wait4), start-up and exit included
    machine_busy_percent: float | None  # all cores, during the window
    peak_rss_mib: float
    worker_warnings: int
    events_per_s: float = field(init=False)
    cpu_us_per_event: float | None = field(init=False)  # in the window
    cpu_us_per_event_life: float = field(init=False)  # whole life / events

    def __post_init__(self) -> None:
        self.events_per_s = self.window_events / self.window_s
        self.cpu_us_per_event = (
            None if self.window_cpu_s is None else 1e6 * self.window_cpu_s / self.window_events
        )
        self.cpu_us_per_event_life = 1e6 * self.worker_cpu_s / self.events


class RowMonitor:
    """Watches the subscription's row every ``interval`` seconds: the first
    time its ``delivered`` count is above 0 (and that count), the first time
    its checkpoint is at ``last``; the worker's CPU time and the machine's
    at both moments."""

    def __init__(self, url: str, last: int, pid: int, interval: float = 0.005) -> None:
        self.conn = db.connect(url)
        self.last, self.pid, self.interval = last, pid, interval
        self.first: tuple[float, int, float | None, object] | None = None
        self.done: tuple[float, float | None, object] | None = None
        self.state: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stream-monitor", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set() and self.done is None:
            row = self.conn.execute(ROW_SQL, [SUBSCRIPTION]).fetchone()
            now = time.perf_counter()
            if row is not None:
                delivered, position, self.state = row
                if self.first is None and delivered > 0:
                    self.first = (now, delivered, proc_cpu_seconds(self.pid), cpu_times())
                if position == self.last:
                    self.done = (now, proc_cpu_seconds(self.pid), cpu_times())
            self._stop.wait(self.interval)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.conn.close()


def run(bench: Bench, label: str, events: int, per_transaction: int, timeout: float) -> StreamRun:
    """Fill the stream, run one burst worker serving only the bench
    subscription, and check that its subscriber saw every event once, in
    ``(xid, position)`` order, and that the checkpoint reached the last."""
    reset(bench.url)
    expected = fill(bench.url, events, per_transaction)
    log = Path(bench.log_dir) / f"{label}-positions.txt"
    log.unlink(missing_ok=True)
    bench.env = dict(bench.env, **{LOG_ENV: str(log)})
    worker = bench.worker(
        f"streams-{label}",
        ["--burst", "--subscriptions", SUBSCRIPTION, "--concurrency", "1"],
    )
    monitor = RowMonitor(bench.url, expected[-1], worker.pid)
    try:
        worker.finish(timeout)
    finally:
        monitor.stop()
    warnings = worker.check_clean(f"streams {label}")
    if monitor.first is None or monitor.done is None:
        raise db.CheckFailed(
            f"streams {label}: the checkpoint did not reach the last event "
            f"(state {monitor.state})\n{worker.log_tail()}"
        )
    seen = [int(line) for line in log.read_text().split()] if log.exists() else []
    if seen != expected:
        extra = len(seen) - len(set(seen))
        missing = len(set(expected) - set(seen))
        raise db.CheckFailed(
            f"streams {label}: the subscriber saw {len(seen)} events ({extra} repeated, "
            f"{missing} missing) or out of (xid, position) order; expected {len(expected)}"
        )
    log.unlink()
    delivered = db.fetch_row(bench.url, ROW_SQL, [SUBSCRIPTION])[0]
    if delivered != events:
        raise db.CheckFailed(f"streams {label}: the row counts {delivered} delivered, not {events}")
    (start, first_count, cpu_a, box_a), (end, cpu_b, box_b) = monitor.first, monitor.done
    return StreamRun(
        tree=label,
        events=events,
        wall_s=worker.elapsed,
        window_s=end - start,
        window_events=events - first_count,
        window_cpu_s=None if cpu_a is None or cpu_b is None else cpu_b - cpu_a,
        worker_cpu_s=worker.cpu_seconds,
        machine_busy_percent=busy_percent(box_a, box_b),  # type: ignore[arg-type]
        peak_rss_mib=worker.peak_rss_mib,
        worker_warnings=warnings,
    )
