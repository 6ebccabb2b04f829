"""A worker's options, resolved once: its constructor's arguments over the
PGQUEUE settings. Every part of the worker reads them from here."""

from __future__ import annotations

from dataclasses import dataclass

from django_pgqueue.observability.metrics import NullMetrics, WorkerMetrics

# What a worker reports its counters and histograms to.
Metrics = WorkerMetrics | NullMetrics

# Default --batch-size: this many messages per handler thread.
BATCH_PER_THREAD = 4


@dataclass(frozen=True)
class WorkerConfig:
    worker_id: str
    hostname: str
    queues: list[str]
    concurrency: int  # handler threads
    batch_size: int  # messages per claim, at most
    # Messages claimed ahead of the running ones, so that a claim can be a
    # batch while every thread is busy (their leases are extended like the
    # running ones', and shutdown hands them back at once).
    prefetch: int
    burst: bool  # exit once nothing is ready
    max_messages: int | None  # exit after claiming this many
    shutdown_timeout: float
    poll_interval: float
    lease_seconds: float
    listen: bool  # PGQUEUE["NOTIFY"]: a listener wakes the loop
    heartbeat_interval: float

    @property
    def capacity(self) -> int:
        """Messages it holds at most: one per thread, and the prefetched."""
        return self.concurrency + self.prefetch

    @property
    def thread_beat_after(self) -> float:
        """Seconds after the last heartbeat when the heartbeat thread writes
        one. It beats only when the polls have not: later than a poll that
        was due could (interval + a jittered poll, with room to spare), yet
        within two intervals, so the row (alive for three) never goes stale
        while the worker polls rarely or is busy."""
        interval = self.heartbeat_interval
        return min(max(1.5 * interval, interval + 1.5 * self.poll_interval), 2 * interval)

    @property
    def alive_for(self) -> float:
        """Seconds the worker's row counts as alive after a heartbeat."""
        return self.heartbeat_interval * 3
