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
    """Gauges computed from the queue tables when Prometheus scrapes, of
    every database that holds them (``conf.databases()``), each sample
    labelled with its ``database``.

    Every queue configured on a database (``PGQUEUE["QUEUES"]``) is reported
    even when empty. A database that cannot be read reports only its
    ``pgqueue_database_up{database=...} 0``; the others report as usual.
    """

    def describe(self) -> list[Any]:
        # Registering must not query the database; names are checked in tests.
        return []

    def collect(self) -> Iterator[Any]:
        read: dict[str, dict[str, list[Sample]]] = {}
        for alias in conf.databases():
            try:
                with conf.on_database(alias):
                    read[alias] = _read()
            except DatabaseError as exc:
                logger.warning("Metrics: the queue database %r cannot be read: %s", alias, exc)

        def each(key: str) -> list[Sample]:
            """The samples of ``key`` of every database read, led by its alias."""
            return [(alias, *sample) for alias, found in read.items() for sample in found[key]]

        yield _gauge(
            "pgqueue_database_up",
            "1 if the queue database answered this scrape, else 0.",
            ["database"],
            [(alias, int(alias in read)) for alias in conf.databases()],
        )
        yield _gauge(
            "pgqueue_messages",
            "Messages in the queue table by queue, topic and state "
            "(ready, delayed, blocked, processing).",
            ["database", "queue", "topic", "state"],
            each("messages"),
        )
        yield _gauge(
            "pgqueue_oldest_ready_age_seconds",
            "Seconds the longest-ready message of each queue has waited for a worker "
            "(0 when none is ready).",
            ["database", "queue"],
            each("oldest"),
        )
        yield _gauge(
            "pgqueue_dead_letters",
            "Dead letters by topic, category and state (new, revived, resolved).",
            ["database", "topic", "category", "state"],
            each("dead"),
        )
        yield _gauge(
            "pgqueue_queue_paused",
            "1 while the queue is paused (no worker claims from it; its depth grows by "
            "design), else 0.",
            ["database", "queue"],
            each("paused"),
        )
        yield _gauge(
            "pgqueue_workers_alive",
            "Workers with a fresh heartbeat that serve each queue.",
            ["database", "queue"],
            each("live"),
        )
        labels = ["database", "subscription", "stream"]
        yield _gauge(
            "pgqueue_subscription_lag_events",
            "Events of the stream after the subscription's checkpoint (counted up to 1,000,000).",
            labels,
            each("lag_events"),
        )
        yield _gauge(
            "pgqueue_subscription_lag_seconds",
            "Seconds since the oldest event the subscription has not passed was published "
            "(0 when it is caught up).",
            labels,
            each("lag_seconds"),
        )
        yield _gauge(
            "pgqueue_subscription_state",
            "1 for the subscription's state (active, retrying, blocked, paused), else 0.",
            [*labels, "state"],
            each("subscription_state"),
        )
        yield _gauge(
            "pgqueue_history_rows",
            "Finished messages kept in the history (KEEP_FINISHED); PostgreSQL's estimate "
            "once the table is large.",
            ["database"],
            each("history_rows"),
        )
        yield _gauge(
            "pgqueue_workflows",
            "Workflows by status (running, blocked, done, failed, cancelled); finished ones "
            "count until retention prunes them.",
            ["database", "status"],
            each("workflows"),
        )
        yield _gauge(
            "pgqueue_history_oldest_age_seconds",
            "Seconds since the oldest message kept in the history finished (0 when it is empty).",
            ["database"],
            each("history_oldest"),
        )


def _read() -> dict[str, list[Sample]]:
    """The samples of each family (by a short key) of the database the code
    works on, without the ``database`` label; one query each."""
    alias = conf.database_alias()
    configured = [queue for queue in conf.queues() if conf.queue_database(queue) == alias]
    paused = [name for name, state in controls.states().items() if state.paused]
    subscriptions = stats.subscriptions_with_lag()  # streams
    history = outcomes.history_summary()
    oldest = history["oldest_age_seconds"]
    return {
        "messages": list(stats.messages_by_queue_topic_state()),
        "oldest": _per_queue(configured, stats.oldest_ready_age(), 0.0),
        "dead": list(stats.dead_letters_by_topic_category_state()),
        "paused": _per_queue(configured, dict.fromkeys(paused, 1), 0),
        "live": _per_queue(configured, stats.live_workers_by_queue(), 0),
        "lag_events": [(row.name, row.stream, row.lag) for row in subscriptions],
        "lag_seconds": [(row.name, row.stream, _behind(row)) for row in subscriptions],
        "subscription_state": [
            (row.name, row.stream, state, int(row.state == state))
            for row in subscriptions
            for state in SubscriptionState.values
        ],
        "history_rows": [(history["rows"],)],
        "workflows": list(stats.workflows_by_status().items()),
        "history_oldest": [(0.0 if oldest is None else oldest,)],
    }


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
