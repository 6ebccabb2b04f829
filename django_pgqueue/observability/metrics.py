"""Prometheus metrics, through the official ``prometheus_client`` (the
``[prometheus]`` extra).

Two sources, never mixed:

- ``DatabaseCollector`` reads the queue tables at scrape time. Its figures
  are the truth whatever the number of workers, so serve it from one place
  (the web process, ``django_pgqueue.urls``), not from every worker.
- ``WorkerMetrics`` counts what one worker process did (messages by topic
  and outcome, handler durations, claims, start latency, reconnects) in a
  registry of its own, served on the worker's ``--metrics-port``. Prometheus
  adds the ``instance`` label that tells the workers apart.

Both are imported lazily: without prometheus_client installed, everything
else in django-pgqueue works, and asking for metrics says what to install.
"""

import logging
import threading
import time

from django.core.exceptions import ImproperlyConfigured
from django.db import DatabaseError

from django_pgqueue import conf
from django_pgqueue.observability import endpoints, stats

logger = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'django-pgqueue[prometheus]'"

# Outcomes of a handled message, the ``outcome`` label.
DONE, RETRIED, DEAD_LETTERED = "done", "retried", "dead_lettered"

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


def _client():
    try:
        import prometheus_client
    except ImportError as exc:
        raise ImproperlyConfigured(
            f"Metrics need the prometheus_client package: {INSTALL_HINT}"
        ) from exc
    return prometheus_client


class DatabaseCollector:
    """Gauges computed from the queue tables when Prometheus scrapes.

    Every configured queue (``PGQUEUE["QUEUES"]``) is reported even when
    empty, so "no worker" and "backlog" alerts see it. When the database
    cannot be read, only ``pgqueue_database_up 0`` is reported.
    """

    def describe(self):
        # Registering must not query the database; names are checked in tests.
        return []

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        up = GaugeMetricFamily(
            "pgqueue_database_up", "1 if the queue database answered this scrape, else 0."
        )
        try:
            configured = conf.queues()
            messages = stats.messages_by_queue_topic_state()
            oldest = stats.oldest_ready_age()
            dead = stats.dead_letters_by_topic_category_state()
            live = stats.live_workers_by_queue()
            subscriptions = stats.subscriptions_with_lag()  # streams
        except DatabaseError as exc:
            logger.warning("Metrics: the queue database cannot be read: %s", exc)
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up

        family = GaugeMetricFamily(
            "pgqueue_messages",
            "Messages in the queue table by queue, topic and state "
            "(ready, delayed, blocked, processing).",
            labels=["queue", "topic", "state"],
        )
        for queue, topic, state, count in messages:
            family.add_metric([queue, topic, state], count)
        yield family

        family = GaugeMetricFamily(
            "pgqueue_oldest_ready_age_seconds",
            "Seconds the longest-ready message of each queue has waited for a worker "
            "(0 when none is ready).",
            labels=["queue"],
        )
        for queue in sorted(set(configured) | set(oldest)):
            family.add_metric([queue], oldest.get(queue, 0.0))
        yield family

        family = GaugeMetricFamily(
            "pgqueue_dead_letters",
            "Dead letters by topic, category and state (new, revived, resolved).",
            labels=["topic", "category", "state"],
        )
        for topic, category, state, count in dead:
            family.add_metric([topic, category, state], count)
        yield family

        family = GaugeMetricFamily(
            "pgqueue_workers_alive",
            "Workers with a fresh heartbeat that serve each queue.",
            labels=["queue"],
        )
        for queue in sorted(set(configured) | set(live)):
            family.add_metric([queue], live.get(queue, 0))
        yield family
        yield from _subscription_families(subscriptions)


# --- streams (the transactional outbox) -------------------------------------------------


def _subscription_families(subscriptions):
    """Each subscription's lag (events and seconds behind the head of its
    stream) and state."""
    from prometheus_client.core import GaugeMetricFamily

    from django_pgqueue.models.streams import SubscriptionState

    labels = ["subscription", "stream"]
    events = GaugeMetricFamily(
        "pgqueue_subscription_lag_events",
        "Events of the stream after the subscription's checkpoint (counted up to 1,000,000).",
        labels=labels,
    )
    seconds = GaugeMetricFamily(
        "pgqueue_subscription_lag_seconds",
        "Seconds since the oldest event the subscription has not passed was published "
        "(0 when it is caught up).",
        labels=labels,
    )
    states = GaugeMetricFamily(
        "pgqueue_subscription_state",
        "1 for the subscription's state (active, retrying, blocked, paused), else 0.",
        labels=[*labels, "state"],
    )
    for row in subscriptions:
        events.add_metric([row.name, row.stream], row.lag)
        behind = 0.0
        if row.oldest_pending_at is not None:
            behind = max((row.now - row.oldest_pending_at).total_seconds(), 0.0)
        seconds.add_metric([row.name, row.stream], behind)
        for state in SubscriptionState.values:
            states.add_metric([row.name, row.stream, state], int(row.state == state))
    yield events
    yield seconds
    yield states


def render_database_metrics():
    """The database metrics in the Prometheus text format: (body, content type)."""
    client = _client()
    registry = client.CollectorRegistry(auto_describe=False)
    registry.register(DatabaseCollector())
    return client.generate_latest(registry), client.CONTENT_TYPE_LATEST


class WorkerMetrics:
    """One worker process's counters and histograms, in a registry of its own
    (several workers in one process, as in tests, do not collide)."""

    def __init__(self):
        client = _client()
        self.registry = client.CollectorRegistry()
        self._server = None
        self.messages = client.Counter(
            "pgqueue_worker_messages",
            "Messages this worker finished, by topic and outcome (done, retried, dead_lettered).",
            ["topic", "outcome"],
            registry=self.registry,
        )
        self.handler_duration = client.Histogram(
            "pgqueue_worker_handler_duration_seconds",
            "Seconds a handler ran, by topic (successes and failures).",
            ["topic"],
            buckets=DURATION_BUCKETS,
            registry=self.registry,
        )
        self.claim_batch = client.Histogram(
            "pgqueue_worker_claim_batch_size",
            "Messages one claim returned.",
            buckets=BATCH_BUCKETS,
            registry=self.registry,
        )
        self.claim_duration = client.Histogram(
            "pgqueue_worker_claim_duration_seconds",
            "Seconds one claim (a single transaction) took.",
            buckets=CLAIM_BUCKETS,
            registry=self.registry,
        )
        self.start_latency = client.Histogram(
            "pgqueue_worker_start_latency_seconds",
            "Seconds from a message being ready (enqueued, or its run_at when delayed "
            "or retried) to its handler starting, by queue.",
            ["queue"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.reconnects = client.Counter(
            "pgqueue_worker_reconnects",
            "Database errors after which a connection of this worker was reopened, "
            "by connection (loop, listener, heartbeat).",
            ["connection"],
            registry=self.registry,
        )
        self.inflight = client.Gauge(
            "pgqueue_worker_inflight",
            "Messages this worker's handlers hold now.",
            registry=self.registry,
        )

    # --- what the worker reports ---------------------------------------------

    def claimed(self, count, seconds):
        self.claim_batch.observe(count)
        self.claim_duration.observe(seconds)

    def started(self, message):
        waited = time.time() - message.run_at.timestamp()
        self.start_latency.labels(message.queue).observe(max(waited, 0.0))

    def finished(self, message, outcome, duration=None):
        self.messages.labels(message.topic, outcome).inc()
        if duration is not None:
            self.handler_duration.labels(message.topic).observe(duration)

    def reconnected(self, connection):
        self.reconnects.labels(connection).inc()

    def track_inflight(self, count):
        """``count``: a callable returning the number of messages held."""
        self.inflight.set_function(count)

    # --- serving ----------------------------------------------------------------

    def serve(self, port, host=None):
        """Serve this registry over HTTP on a daemon thread; returns the port.

        It listens on ``host`` (default ``PGQUEUE["WORKER_HTTP_HOST"]``,
        loopback) and asks for the bearer token when METRICS_ACCESS is
        "token" (see ``endpoints``). prometheus_client's own server cannot
        check a token, so its WSGI app is served behind that check."""
        app = endpoints.guarded_wsgi_app(_client().make_wsgi_app(self.registry), "METRICS_ACCESS")
        server = endpoints.WorkerWSGIServer(
            (host or conf.get("WORKER_HTTP_HOST"), port), endpoints.QuietWSGIRequestHandler
        )
        server.set_app(app)
        threading.Thread(target=server.serve_forever, name="pgqueue-metrics", daemon=True).start()
        self._server = server
        return server.server_port

    def close(self):
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class NullMetrics:
    """What a worker reports to when no --metrics-port was asked for."""

    def claimed(self, count, seconds):
        pass

    def started(self, message):
        pass

    def finished(self, message, outcome, duration=None):
        pass

    def reconnected(self, connection):
        pass

    def track_inflight(self, count):
        pass
