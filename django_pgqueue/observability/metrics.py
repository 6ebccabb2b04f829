"""What a worker reports as Prometheus metrics, through the official
``prometheus_client`` (the ``[prometheus]`` extra).

``WorkerMetrics`` counts what one worker process did (messages by topic and
outcome, handler durations, claims, start latency, reconnects) in a
registry of its own, served on the worker's ``--metrics-port``
(``endpoints.MetricsServer``). Prometheus adds the ``instance`` label that
tells the workers apart. ``NullMetrics`` takes the same reports and keeps
nothing: what a worker reports to without ``--metrics-port``.

The worker and the stream thread report here, so this module stands below
them and imports nothing of django-pgqueue but ``conf`` (a reconnect is
counted with the database of the engine that reports it). The figures read from the queue
tables at scrape time are ``scrape.py``'s.

prometheus_client is imported when a WorkerMetrics is made: without it,
everything else in django-pgqueue works, and asking for metrics says what
to install.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from types import ModuleType
from typing import Any, Protocol

from django.core.exceptions import ImproperlyConfigured

from django_pgqueue import conf

INSTALL_HINT = "pip install 'django-pgqueue[prometheus]'"

# Outcomes of a handled message, the ``outcome`` label.
DONE, RETRIED, DEAD_LETTERED = "done", "retried", "dead_lettered"
# A running message whose cancellation was asked, its run ended without finishing.
CANCELLED = "cancelled"
# What became of a schedule's tick: enqueued, or skipped (missed for good).
ENQUEUED, SKIPPED = "enqueued", "skipped"

# Seconds. Handlers run from a millisecond to minutes.
DURATION_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, float("inf"),
)  # fmt: skip
# Seconds. A claim is one statement: sub-millisecond to a few hundred ms.
CLAIM_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, float("inf"),
)  # fmt: skip
# Seconds from ready to started: milliseconds when keeping up, up to hours
# in a backlog.
LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0, float("inf"),
)  # fmt: skip
BATCH_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, float("inf"))


def client() -> ModuleType:
    """The prometheus_client module, or ImproperlyConfigured that says what to install."""
    try:
        import prometheus_client
    except ImportError as exc:
        raise ImproperlyConfigured(
            f"Metrics need the prometheus_client package: {INSTALL_HINT}"
        ) from exc
    return prometheus_client


class Reporter(Protocol):
    """What a worker reports, whether or not anything keeps it."""

    def claimed(self, count: int, seconds: float) -> None: ...

    def started(self, message: Any) -> None: ...

    def finished(self, message: Any, outcome: str, duration: float | None = None) -> None: ...

    def reconnected(self, connection: str) -> None: ...

    def track_inflight(self, count: Callable[[], int]) -> None: ...

    def scheduled(self, schedule: str, enqueued: int, skipped: int) -> None: ...

    def pruned(self, counts: dict[str, int]) -> None: ...

    def workflows(self, released: int, finished: list[str]) -> None: ...


class WorkerMetrics:
    """One worker process's counters and histograms, in a registry of its own
    (several workers in one process, as in tests, do not collide)."""

    def __init__(self) -> None:
        prometheus = client()
        self.registry = prometheus.CollectorRegistry()
        self._inflight_counts: list[Callable[[], int]] = []
        self.messages = prometheus.Counter(
            "pgqueue_worker_messages",
            "Messages this worker finished, by topic and outcome (done, retried, dead_lettered, "
            "cancelled).",
            ["topic", "outcome"],
            registry=self.registry,
        )
        self.handler_duration = self._histogram(
            "pgqueue_worker_handler_duration_seconds",
            "Seconds a handler ran, by topic (successes and failures).",
            DURATION_BUCKETS,
            labels=("topic",),
        )
        self.claim_batch = self._histogram(
            "pgqueue_worker_claim_batch_size", "Messages one claim returned.", BATCH_BUCKETS
        )
        self.claim_duration = self._histogram(
            "pgqueue_worker_claim_duration_seconds",
            "Seconds one claim (a single transaction) took.",
            CLAIM_BUCKETS,
        )
        self.start_latency = self._histogram(
            "pgqueue_worker_start_latency_seconds",
            "Seconds from a message being ready (enqueued, or its run_at when delayed "
            "or retried) to its handler starting, by queue.",
            LATENCY_BUCKETS,
            labels=("queue",),
        )
        self.reconnects = prometheus.Counter(
            "pgqueue_worker_reconnects",
            "Database errors after which a connection of this worker was reopened, "
            "by connection (loop, listener, heartbeat, scheduler, streams) and database "
            "alias (a worker serving queues on several databases has one engine each).",
            ["connection", "database"],
            registry=self.registry,
        )
        self.inflight = prometheus.Gauge(
            "pgqueue_worker_inflight",
            "Messages this worker's handlers hold now (on all its databases).",
            registry=self.registry,
        )
        self.schedule_ticks = prometheus.Counter(
            "pgqueue_worker_schedule_ticks",
            "Ticks of periodic schedules that this worker's scheduler handled, by schedule "
            "and outcome: enqueued (one message each), or skipped (missed for good, older "
            "than the schedule's backfill after downtime). Each tick is counted by one "
            "worker only: the sum over the workers is the schedule's.",
            ["schedule", "outcome"],
            registry=self.registry,
        )
        self.pruned_rows = prometheus.Counter(
            "pgqueue_worker_pruned_rows",
            "Rows that this worker's maintenance deleted past their retention, by kind "
            "(history, counts, dead_letters, task_results, workers, workflows). Each prune "
            "runs in one worker at a time: the sum over the workers is the total.",
            ["kind"],
            registry=self.registry,
        )
        self.workflow_steps_released = prometheus.Counter(
            "pgqueue_worker_workflow_steps_released",
            "Workflow steps that this worker's acknowledgements released (put in the queue "
            "once every step they follow had ended).",
            registry=self.registry,
        )
        self.workflows_finished = prometheus.Counter(
            "pgqueue_worker_workflows_finished",
            "Workflows that this worker's acknowledgements finished (their last steps), by "
            "outcome (done, failed, cancelled).",
            ["outcome"],
            registry=self.registry,
        )

    def _histogram(
        self,
        name: str,
        documentation: str,
        buckets: tuple[float, ...],
        labels: tuple[str, ...] = (),
    ) -> Any:
        return client().Histogram(
            name, documentation, labels, buckets=buckets, registry=self.registry
        )

    def claimed(self, count: int, seconds: float) -> None:
        self.claim_batch.observe(count)
        self.claim_duration.observe(seconds)

    def started(self, message: Any) -> None:
        waited = time.time() - message.run_at.timestamp()
        self.start_latency.labels(message.queue).observe(max(waited, 0.0))

    def finished(self, message: Any, outcome: str, duration: float | None = None) -> None:
        self.messages.labels(message.topic, outcome).inc()
        if duration is not None:
            self.handler_duration.labels(message.topic).observe(duration)

    def reconnected(self, connection: str) -> None:
        # In the reporting thread: its engine's database (conf.on_database).
        self.reconnects.labels(connection, conf.database_alias()).inc()

    def track_inflight(self, count: Callable[[], int]) -> None:
        """``count``: a callable returning the number of messages an engine
        holds; the gauge is the sum over the engines that called it."""
        counts = self._inflight_counts
        counts.append(count)
        self.inflight.set_function(lambda: sum(held() for held in counts))

    def scheduled(self, schedule: str, enqueued: int, skipped: int) -> None:
        if enqueued:
            self.schedule_ticks.labels(schedule, ENQUEUED).inc(enqueued)
        if skipped:
            self.schedule_ticks.labels(schedule, SKIPPED).inc(skipped)

    def pruned(self, counts: dict[str, int]) -> None:
        for kind, count in counts.items():
            self.pruned_rows.labels(kind).inc(count)

    def workflows(self, released: int, finished: list[str]) -> None:
        if released:
            self.workflow_steps_released.inc(released)
        for outcome in finished:
            self.workflows_finished.labels(outcome).inc()


class NullMetrics:
    """What a worker reports to when no --metrics-port was asked for."""

    def claimed(self, count: int, seconds: float) -> None:
        pass

    def started(self, message: Any) -> None:
        pass

    def finished(self, message: Any, outcome: str, duration: float | None = None) -> None:
        pass

    def reconnected(self, connection: str) -> None:
        pass

    def track_inflight(self, count: Callable[[], int]) -> None:
        pass

    def scheduled(self, schedule: str, enqueued: int, skipped: int) -> None:
        pass

    def pruned(self, counts: dict[str, int]) -> None:
        pass

    def workflows(self, released: int, finished: list[str]) -> None:
        pass
