"""The metrics read from the queue tables when Prometheus scrapes
(``/metrics`` of ``django_pgqueue.urls``).

``DatabaseCollector``'s figures are the truth whatever the number of
workers, so serve them from one place (the web process), not from every
worker; a worker's own counters are ``metrics.WorkerMetrics``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from django.db import DatabaseError

from django_pgqueue import conf, controls
from django_pgqueue.models import SubscriptionState
from django_pgqueue.observability import outcomes, stats
from django_pgqueue.observability.metrics import client

logger = logging.getLogger(__name__)

Sample = Sequence[Any]  # the label values, then the value


def _gauge(name: str, documentation: str, labels: list[str], samples: Iterable[Sample]) -> Any:
    """A gauge family with one sample per item of ``samples``."""
    from prometheus_client.core import GaugeMetricFamily

    family = GaugeMetricFamily(name, documentation, labels=labels)
    for *values, value in samples:
        family.add_metric(values, value)
    return family


def _per_queue(configured: list[str], values: Mapping[str, float], empty: float) -> list[Sample]:
    """``(queue, value)`` for every configured queue (``empty`` when it has no
    value: "no worker" and "backlog" alerts see it) and every other queue
    with a value, sorted."""
    return [(queue, values.get(queue, empty)) for queue in sorted(set(configured) | set(values))]


class DatabaseCollector:
    """Gauges computed from the queue tables when Prometheus scrapes.

    Every configured queue (``PGQUEUE["QUEUES"]``) is reported even when
    empty. When the database cannot be read, only ``pgqueue_database_up 0``
    is reported.
    """

    def describe(self) -> list[Any]:
        # Registering must not query the database; names are checked in tests.
        return []

    def collect(self) -> Iterator[Any]:
        try:
            configured = conf.queues()
            messages = stats.messages_by_queue_topic_state()
            oldest = stats.oldest_ready_age()
            dead = stats.dead_letters_by_topic_category_state()
            live = stats.live_workers_by_queue()
            paused = set(controls.paused_queues())
            subscriptions = stats.subscriptions_with_lag()  # streams
            history = outcomes.history_summary()
            workflows = stats.workflows_by_status()
        except DatabaseError as exc:
            logger.warning("Metrics: the queue database cannot be read: %s", exc)
            yield _up(0)
            return
        yield _up(1)
        yield _gauge(
            "pgqueue_messages",
            "Messages in the queue table by queue, topic and state "
            "(ready, delayed, blocked, processing).",
            ["queue", "topic", "state"],
            messages,
        )
        yield _gauge(
            "pgqueue_oldest_ready_age_seconds",
            "Seconds the longest-ready message of each queue has waited for a worker "
            "(0 when none is ready).",
            ["queue"],
            _per_queue(configured, oldest, 0.0),
        )
        yield _gauge(
            "pgqueue_dead_letters",
            "Dead letters by topic, category and state (new, revived, resolved).",
            ["topic", "category", "state"],
            dead,
        )
        yield _gauge(
            "pgqueue_queue_paused",
            "1 while the queue is paused (no worker claims from it; its depth grows by "
            "design), else 0.",
            ["queue"],
            _per_queue(configured, dict.fromkeys(paused, 1), 0),
        )
        yield _gauge(
            "pgqueue_workers_alive",
            "Workers with a fresh heartbeat that serve each queue.",
            ["queue"],
            _per_queue(configured, live, 0),
        )
        yield from _subscription_families(subscriptions)
        yield _gauge(
            "pgqueue_history_rows",
            "Finished messages kept in the history (KEEP_FINISHED); PostgreSQL's estimate "
            "once the table is large.",
            [],
            [(history["rows"],)],
        )
        yield _gauge(
            "pgqueue_workflows",
            "Workflows by status (running, blocked, done, failed, cancelled); finished ones "
            "count until retention prunes them.",
            ["status"],
            list(workflows.items()),
        )
        oldest = history["oldest_age_seconds"]
        yield _gauge(
            "pgqueue_history_oldest_age_seconds",
            "Seconds since the oldest message kept in the history finished (0 when it is empty).",
            [],
            [(0.0 if oldest is None else oldest,)],
        )


def _up(value: int) -> Any:
    return _gauge(
        "pgqueue_database_up",
        "1 if the queue database answered this scrape, else 0.",
        [],
        [(value,)],
    )


def _subscription_families(subscriptions: list[Any]) -> Iterator[Any]:
    """Each subscription's lag (events and seconds behind the head of its
    stream) and state."""
    labels = ["subscription", "stream"]
    yield _gauge(
        "pgqueue_subscription_lag_events",
        "Events of the stream after the subscription's checkpoint (counted up to 1,000,000).",
        labels,
        [(row.name, row.stream, row.lag) for row in subscriptions],
    )
    yield _gauge(
        "pgqueue_subscription_lag_seconds",
        "Seconds since the oldest event the subscription has not passed was published "
        "(0 when it is caught up).",
        labels,
        [(row.name, row.stream, _behind(row)) for row in subscriptions],
    )
    yield _gauge(
        "pgqueue_subscription_state",
        "1 for the subscription's state (active, retrying, blocked, paused), else 0.",
        [*labels, "state"],
        [
            (row.name, row.stream, state, int(row.state == state))
            for row in subscriptions
            for state in SubscriptionState.values
        ],
    )


def _behind(row: Any) -> float:
    """Seconds since the oldest event ``row`` has not passed was published."""
    if row.oldest_pending_at is None:
        return 0.0
    return max((row.now - row.oldest_pending_at).total_seconds(), 0.0)


def render_database_metrics() -> tuple[bytes, str]:
    """The database metrics in the Prometheus text format: (body, content type)."""
    prometheus = client()
    registry = prometheus.CollectorRegistry(auto_describe=False)
    registry.register(DatabaseCollector())
    return prometheus.generate_latest(registry), prometheus.CONTENT_TYPE_LATEST
