"""Prometheus metrics: the database collector behind the metrics URL, and a
real worker process's --metrics-port, scraped after a real workload."""

import re
import sys
import urllib.request

import pytest
from demo.models import Handled
from django.contrib.auth.models import User
from django.core.exceptions import ImproperlyConfigured
from django.core.management import CommandError, call_command
from django.db import connections
from django.test import override_settings
from prometheus_client.parser import text_string_to_metric_families

from django_pgqueue import enqueue, enqueue_many
from django_pgqueue.models import DeadLetter, Message
from django_pgqueue.observability import metrics

from .claiming import claim
from .conftest import wait_until

TOKEN = "a-token-of-at-least-16-characters"


def parse(text):
    """``{(sample name, ((label, value), ...)): value}`` of a Prometheus text page."""
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


# The families the web process reads from the queue tables: each sample
# labelled with its database ("default" unless a test says otherwise).
def value(samples, name, **labels):
    if not name.startswith("pgqueue_worker_"):
        labels.setdefault("database", "default")
    return samples.get((name, tuple(sorted(labels.items()))))


def scrape_web(client, **headers):
    response = client.get("/pgqueue/metrics", headers=headers)
    assert response.status_code == 200, response.content
    assert response["Content-Type"].startswith("text/plain; version=")
    assert "no-cache" in response["Cache-Control"]
    return parse(response.content.decode())


def worker_port(worker, kind):
    """The port a worker started with ``--<kind>-port 0`` logged."""
    pattern = re.compile(rf"{kind} on http://[^:]+:(\d+)/")
    found = wait_until(
        lambda: pattern.search(worker.log()), timeout=60, message=f"the worker's {kind} port"
    )
    return int(found.group(1))


def http_get(url):
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


@pytest.mark.slow
@override_settings(PGQUEUE={"METRICS_ACCESS": "open"})
def test_both_endpoints_after_a_real_workload(start_worker, client):
    enqueue_many([{"payload": {"n": n}} for n in range(10)], topic="test.record")
    enqueue_many([{"payload": {"raise": "Permanent"}}] * 2, topic="test.fail")
    enqueue("test.fail", {"raise": "ConnectionError", "times": 1})  # retried once, then done
    enqueue_many([{"payload": {}, "delay": 3600}] * 3, topic="test.record")  # stays delayed
    enqueue("test.record", {}, queue="reports")  # no worker serves "reports"
    worker = start_worker(
        "--metrics-port", "0", "--http-host", "127.0.0.1", "--poll-interval", "0.2",
        pgqueue={"QUEUES": ["default"], "HEARTBEAT_INTERVAL": 1},
    )  # fmt: skip
    port = worker_port(worker, "metrics")
    wait_until(
        lambda: Handled.objects.count() == 11 and DeadLetter.objects.count() == 2,
        timeout=60,
        message="the workload to finish",
    )

    status, text = http_get(f"http://127.0.0.1:{port}/metrics")
    assert status == 200
    own = parse(text)
    total = "pgqueue_worker_messages_total"
    assert value(own, total, topic="test.record", outcome="done") == 10
    assert value(own, total, topic="test.fail", outcome="dead_lettered") == 2
    assert value(own, total, topic="test.fail", outcome="retried") == 1
    assert value(own, total, topic="test.fail", outcome="done") == 1
    duration = "pgqueue_worker_handler_duration_seconds_count"
    assert value(own, duration, topic="test.record") == 10
    assert value(own, duration, topic="test.fail") == 4  # every attempt, failed or not
    # 14 handler runs: each was claimed once and started once.
    assert value(own, "pgqueue_worker_claim_batch_size_sum") == 14
    claims = value(own, "pgqueue_worker_claim_batch_size_count")
    assert value(own, "pgqueue_worker_claim_duration_seconds_count") == claims >= 1
    assert value(own, "pgqueue_worker_start_latency_seconds_count", queue="default") == 14
    assert value(own, "pgqueue_worker_start_latency_seconds_sum", queue="default") >= 0
    assert value(own, "pgqueue_worker_inflight") == 0
    assert not [key for key in own if key[0] == "pgqueue_worker_reconnects_total"]

    web = scrape_web(client)
    assert value(web, "pgqueue_database_up") == 1
    assert (
        value(web, "pgqueue_messages", queue="default", topic="test.record", state="delayed") == 3
    )
    assert value(web, "pgqueue_messages", queue="reports", topic="test.record", state="ready") == 1
    assert not [k for k in web if k[0] == "pgqueue_messages" and ("topic", "test.fail") in k[1]]
    assert value(web, "pgqueue_oldest_ready_age_seconds", queue="default") == 0
    assert value(web, "pgqueue_oldest_ready_age_seconds", queue="reports") > 0
    assert (
        value(web, "pgqueue_dead_letters", topic="test.fail", category="permanent", state="new")
        == 2
    )
    assert value(web, "pgqueue_workers_alive", queue="default") == 1
    assert value(web, "pgqueue_workers_alive", queue="reports") is None  # not configured

    with override_settings(PGQUEUE={"METRICS_ACCESS": "open", "QUEUES": ["default", "reports"]}):
        web = scrape_web(client)
    assert value(web, "pgqueue_workers_alive", queue="reports") == 0


@pytest.mark.slow
def test_a_worker_counts_its_reconnects(start_worker):
    worker = start_worker(
        "--metrics-port", "0", "--http-host", "127.0.0.1", "--poll-interval", "0.2"
    )  # fmt: skip
    port = worker_port(worker, "metrics")
    wait_until(lambda: lifecycle_rows(), timeout=60, message="the worker's heartbeat")
    names = [f"pgqueue_worker#{worker.pid}", f"pgqueue_listener#{worker.pid}"]

    def backends():
        with connections["default"].cursor() as cursor:
            cursor.execute(
                "SELECT count(DISTINCT application_name) FROM pg_stat_activity "
                "WHERE application_name IN (%s, %s)",
                names,
            )
            return cursor.fetchone()[0] == 2

    # The heartbeat is up before the listener may have connected: terminate
    # both once both are there (a listener not yet connected has nothing to
    # reconnect).
    wait_until(backends, message="the worker's and its listener's connections")
    with connections["default"].cursor() as cursor:
        cursor.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE application_name IN (%s, %s)",
            names,
        )
    wait_until(
        lambda: value(
            parse(http_get(f"http://127.0.0.1:{port}/")[1]),
            "pgqueue_worker_reconnects_total",
            connection="listener",
            database="default",
        ),
        timeout=60,
        message="the listener's reconnect to be counted",
    )


def lifecycle_rows():
    from django_pgqueue.models import WorkerHeartbeat

    return WorkerHeartbeat.objects.exists()


@pytest.mark.django_db
def test_the_database_collector_reports_every_configured_queue_even_when_empty(client):
    with override_settings(PGQUEUE={"METRICS_ACCESS": "open", "QUEUES": ["default", "mail"]}):
        web = scrape_web(client)
    for queue in ("default", "mail"):
        assert value(web, "pgqueue_oldest_ready_age_seconds", queue=queue) == 0
        assert value(web, "pgqueue_workers_alive", queue=queue) == 0
    assert not [key for key in web if key[0] == "pgqueue_messages"]


@pytest.mark.django_db
def test_message_states_split_waiting_into_ready_and_delayed(client):
    enqueue("a.topic", {})
    enqueue("a.topic", {}, delay=60)
    enqueue("a.topic", {})
    claim(["default"], 1, "tester", 60)
    with override_settings(PGQUEUE={"METRICS_ACCESS": "open"}):
        web = scrape_web(client)
    for state in ("ready", "delayed", "processing"):
        assert value(web, "pgqueue_messages", queue="default", topic="a.topic", state=state) == 1


@pytest.mark.django_db(transaction=True, databases=["default", "other"])
def test_an_unreachable_database_is_reported_as_down_not_as_an_error(client):
    other = connections["other"]
    port = other.settings_dict["PORT"]
    other.close()
    other.settings_dict["PORT"] = 1  # nothing listens there
    try:
        with override_settings(PGQUEUE={"METRICS_ACCESS": "open", "DATABASE": "other"}):
            web = scrape_web(client)
    finally:
        other.close()
        other.settings_dict["PORT"] = port
    assert value(web, "pgqueue_database_up", database="other") == 0
    assert {key[0] for key in web} == {"pgqueue_database_up"}


# --- who may read it ------------------------------------------------------------


@pytest.mark.django_db
def test_metrics_are_staff_only_by_default(client):
    assert client.get("/pgqueue/metrics").status_code == 403
    client.force_login(User.objects.create_user("someone"))
    assert client.get("/pgqueue/metrics").status_code == 403
    client.force_login(User.objects.create_user("operator", is_staff=True))
    assert client.get("/pgqueue/metrics").status_code == 200
    client.force_login(User.objects.create_user("former", is_staff=True, is_active=False))
    assert client.get("/pgqueue/metrics").status_code == 403


@pytest.mark.django_db
@override_settings(PGQUEUE={"METRICS_ACCESS": "token", "ENDPOINT_TOKEN": TOKEN})
def test_token_access_needs_the_exact_bearer_token(client):
    refused = client.get("/pgqueue/metrics")
    assert refused.status_code == 401
    assert refused["WWW-Authenticate"].startswith("Bearer")
    for header in (f"Bearer {TOKEN}x", f"Basic {TOKEN}", TOKEN, "Bearer "):
        assert client.get("/pgqueue/metrics", headers={"Authorization": header}).status_code == 401
    client.force_login(User.objects.create_user("operator", is_staff=True))
    assert client.get("/pgqueue/metrics").status_code == 401, "staff is not a token"
    scrape_web(client, Authorization=f"Bearer {TOKEN}")
    scrape_web(client, Authorization=f"bearer {TOKEN}")


@pytest.mark.django_db
@override_settings(PGQUEUE={"METRICS_ACCESS": "open"})
def test_the_metrics_url_only_answers_reads(client):
    assert client.post("/pgqueue/metrics").status_code == 405
    assert client.head("/pgqueue/metrics").status_code == 200


# --- without prometheus_client ----------------------------------------------------


@pytest.mark.django_db
def test_without_prometheus_client_the_error_says_what_to_install(monkeypatch, client):
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # import fails
    with pytest.raises(ImproperlyConfigured, match=r"pip install 'django-pgqueue\[prometheus\]'"):
        metrics.WorkerMetrics()
    with pytest.raises(CommandError, match=r"--metrics-port: .*\[prometheus\]"):
        call_command("pgqueue_worker", "--burst", "--metrics-port", "0")
    with (
        override_settings(PGQUEUE={"METRICS_ACCESS": "open"}),
        pytest.raises(ImproperlyConfigured, match="prometheus"),
    ):
        client.get("/pgqueue/metrics")
    assert not Message.objects.exists()


@pytest.mark.parametrize("port", ["-1", "65536", "http", "1.5"])
def test_bad_ports_are_refused(port):
    for option in ("--metrics-port", "--health-port"):
        with pytest.raises(CommandError, match="port"):
            call_command("pgqueue_worker", "--burst", option, port)


@pytest.mark.django_db(transaction=True)
def test_a_port_in_use_is_a_clear_error():
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        for option in ("--metrics-port", "--health-port"):
            with pytest.raises(CommandError, match=f"{option}: cannot listen"):
                call_command("pgqueue_worker", "--burst", "--http-host", "127.0.0.1", option, port)
