"""Health: the web endpoint (database reachable, a live worker per configured
queue), the worker's --health-port, and the heartbeats both rest on."""

import collections
import datetime
import json
import signal
import threading
import time
import urllib.request

import pytest
from django.contrib.auth.models import User
from django.db import connections
from django.db.backends import utils as backend_utils
from django.test import override_settings
from django.utils import timezone

from django_pgqueue import liveness, maintenance
from django_pgqueue.models import WorkerHeartbeat
from django_pgqueue.observability.health import WorkerHealthServer
from django_pgqueue.streams import subscribers

from .conftest import raw_connection, running_worker, unreachable, wait_until
from .test_metrics import TOKEN, http_get, worker_port


def beat(worker_id="w1", queues=("default",), alive_for=30.0, **fields):
    liveness.heartbeat(
        liveness.Beat(
            worker_id=worker_id,
            hostname="host",
            pid=1,
            queues=list(queues),
            concurrency=4,
            alive_for=alive_for,
            inflight=fields.get("inflight", 0),
            processed=fields.get("processed", 0),
        )
    )


def health(client, **headers):
    response = client.get("/pgqueue/health", headers=headers)
    body = json.loads(response.content) if response["Content-Type"] == "application/json" else None
    return response.status_code, body


# --- the web endpoint -----------------------------------------------------------


def not_started():
    """The health body's subscriptions while no worker has started any: every
    one the code declares (the demo project's)."""
    return {
        spec.name: {"stream": spec.stream, "state": "not started"}
        for spec in sorted(subscribers.registered(), key=lambda spec: spec.name)
    }


@pytest.mark.django_db
def test_no_live_worker_is_503_with_the_reason(client):
    status, body = health(client)
    assert status == 503
    assert body == {
        "status": "unhealthy",
        "database": "ok",
        "queues": {"default": {"workers_alive": 0}},
        "subscriptions": not_started(),
        "problems": ["no worker with a fresh heartbeat serves queue 'default'"],
    }


@pytest.mark.django_db
def test_a_fresh_heartbeat_for_each_configured_queue_is_200(client):
    beat("w1", queues=["default"])
    assert health(client) == (
        200,
        {
            "status": "ok",
            "database": "ok",
            "queues": {"default": {"workers_alive": 1}},
            "subscriptions": not_started(),
            "problems": [],
        },
    )
    with override_settings(PGQUEUE={"QUEUES": ["default", "mail"]}):
        status, body = health(client)
        assert (status, body["problems"]) == (
            503,
            ["no worker with a fresh heartbeat serves queue 'mail'"],
        )
        beat("w2", queues=["mail", "default"])
        status, body = health(client)
    assert (status, body["queues"]) == (
        200,
        {"default": {"workers_alive": 2}, "mail": {"workers_alive": 1}},
    )


@pytest.mark.django_db
def test_every_declared_subscription_is_listed_those_not_started_as_such(client):
    from django_pgqueue.models import Subscription

    beat("w1")
    Subscription.objects.create(name="test.ledger", stream="test.events", state="blocked")
    Subscription.objects.create(name="gone.from.code", stream="old")  # kept as it is
    status, body = health(client)
    assert status == 200, "subscriptions are shown, not judged"
    expected = {
        **not_started(),
        "test.ledger": {"stream": "test.events", "state": "blocked"},
        "gone.from.code": {"stream": "old", "state": "active"},
    }
    assert body["subscriptions"] == expected
    assert list(body["subscriptions"]) == sorted(expected)


@pytest.mark.django_db
def test_a_stale_heartbeat_does_not_count(client):
    beat("w1", alive_for=0.001)
    time.sleep(0.01)
    assert health(client)[0] == 503
    beat("w1", alive_for=30)  # the same worker beats again
    assert health(client)[0] == 200
    assert WorkerHeartbeat.objects.count() == 1


@pytest.mark.django_db(transaction=True, databases=["default", "other"])
def test_an_unreachable_database_is_503_without_its_error_text(client):
    with unreachable("other"), override_settings(PGQUEUE={"DATABASE": "other"}):
        status, body = health(client)
    assert (status, body["database"]) == (503, "unreachable")
    assert body["problems"] == ["the queue database does not answer"]
    assert "127.0.0.1" not in json.dumps(body) and "port" not in json.dumps(body)


@pytest.mark.django_db
def test_health_access_can_be_staff_or_token(client):
    beat()
    with override_settings(PGQUEUE={"HEALTH_ACCESS": "staff"}):
        assert health(client)[0] == 403
    with override_settings(PGQUEUE={"HEALTH_ACCESS": "token", "ENDPOINT_TOKEN": TOKEN}):
        assert health(client)[0] == 401
        assert health(client, Authorization=f"Bearer {TOKEN}")[0] == 200
    client.force_login(User.objects.create_user("operator", is_staff=True))
    with override_settings(PGQUEUE={"HEALTH_ACCESS": "staff"}):
        assert health(client)[0] == 200


# --- heartbeats -----------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_a_running_worker_beats_and_removes_its_row_when_it_stops():
    with (
        override_settings(PGQUEUE={"HEARTBEAT_INTERVAL": 0.2}),
        running_worker(concurrency=3, poll_interval=0.1, queues=["default", "mail"]) as worker,
    ):
        row = wait_until(
            lambda: WorkerHeartbeat.objects.filter(worker_id=worker.worker_id).first(),
            message="the worker's row",
        )
        assert (row.queues, row.concurrency, row.inflight) == (["default", "mail"], 3, 0)
        assert row.expires_at > row.heartbeat_at
        first = row.heartbeat_at
        wait_until(
            lambda: WorkerHeartbeat.objects.get(worker_id=worker.worker_id).heartbeat_at > first,
            message="a second heartbeat",
        )
    assert not WorkerHeartbeat.objects.exists(), "a stopped worker is gone, not dead"


@pytest.mark.django_db(transaction=True)
def test_an_idle_worker_beats_inside_its_poll_without_extra_queries(monkeypatch):
    queries = collections.Counter()
    original = backend_utils.CursorWrapper._execute

    def counting(self, sql, params, *ignore):
        queries[threading.current_thread().name] += 1
        return original(self, sql, params, *ignore)

    with (
        override_settings(PGQUEUE={"HEARTBEAT_INTERVAL": 0.5}),
        running_worker(concurrency=2, poll_interval=0.25) as worker,
    ):
        time.sleep(0.5)
        before = WorkerHeartbeat.objects.get(worker_id=worker.worker_id).heartbeat_at
        monkeypatch.setattr(backend_utils.CursorWrapper, "_execute", counting)
        time.sleep(2.5)
        monkeypatch.undo()
        after = WorkerHeartbeat.objects.get(worker_id=worker.worker_id).heartbeat_at
    assert (after - before).total_seconds() >= 1.5, "the heartbeat stopped"
    polls = 2.5 / (0.25 * 0.9)
    assert sum(queries.values()) <= polls + 1, f"idle worker queries: {dict(queries)}"
    assert set(queries) <= {"test-worker"}, f"only the loop's poll may query: {dict(queries)}"


@pytest.mark.django_db(transaction=True)
def test_a_busy_worker_beats_from_its_heartbeat_thread():
    from django_pgqueue import enqueue

    enqueue("test.sleep", {"seconds": 2})
    with (
        override_settings(PGQUEUE={"HEARTBEAT_INTERVAL": 0.2}),
        running_worker(concurrency=1, poll_interval=60) as worker,
    ):
        wait_until(
            lambda: WorkerHeartbeat.objects.filter(worker_id=worker.worker_id, inflight=1).exists(),
            message="a heartbeat that shows the message in flight",
        )
        first = WorkerHeartbeat.objects.get(worker_id=worker.worker_id).heartbeat_at
        wait_until(
            lambda: WorkerHeartbeat.objects.get(worker_id=worker.worker_id).heartbeat_at > first,
            message="a heartbeat while the handler runs and no poll happens",
        )


@pytest.mark.django_db(transaction=True)
def test_maintenance_deletes_dead_workers_rows_after_a_day():
    beat("alive")
    beat("dead-recently", alive_for=0.001)
    beat("dead-long-ago", alive_for=0.001)
    WorkerHeartbeat.objects.filter(worker_id="dead-long-ago").update(
        expires_at=timezone.now() - datetime.timedelta(days=1, minutes=1)
    )
    result = maintenance.run_once()
    assert result.workers_pruned == 1
    assert set(WorkerHeartbeat.objects.values_list("worker_id", flat=True)) == {
        "alive",
        "dead-recently",
    }


# --- real worker processes ----------------------------------------------------------


@pytest.mark.slow
def test_health_goes_503_when_the_worker_is_stopped_or_killed(start_worker, client):
    settings = {"HEARTBEAT_INTERVAL": 0.3}
    args = ("--poll-interval", "0.2", "--health-port", "0", "--http-host", "127.0.0.1")
    worker = start_worker(*args, pgqueue=settings)
    wait_until(lambda: health(client)[0] == 200, timeout=60, message="a healthy system")
    port = worker_port(worker, "health")
    status, body = http_get(f"http://127.0.0.1:{port}/health")
    assert status == 200, body
    body = json.loads(body)
    assert (body["status"], body["database"], body["loop_alive"]) == ("ok", "ok", True)
    assert http_get(f"http://127.0.0.1:{port}/nope")[0] == 404

    worker.signal(signal.SIGTERM)  # stops cleanly: its row goes at once
    assert worker.wait(timeout=20) == 0
    status, body = health(client)
    assert (status, body["queues"]) == (503, {"default": {"workers_alive": 0}})
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2)

    worker = start_worker(*args, pgqueue=settings)
    wait_until(lambda: health(client)[0] == 200, timeout=60, message="the new worker")
    worker.signal(signal.SIGKILL)  # dies: its row stays, and goes stale
    worker.wait(timeout=60)
    killed_at = time.monotonic()
    wait_until(lambda: health(client)[0] == 503, timeout=5, message="the heartbeat to go stale")
    assert time.monotonic() - killed_at <= 3 * 0.3 + 1
    assert WorkerHeartbeat.objects.filter(pid=worker.pid).exists(), "kept to show what died"


@pytest.mark.django_db(transaction=True)
def test_a_worker_health_port_fails_while_its_database_is_unreachable():
    """Every connection of the test database is cut and new ones are pointed
    at a closed port: the worker's health goes 503; once the database is back
    it returns to 200 by itself."""
    default = connections["default"]
    with running_worker(concurrency=1, poll_interval=0.1) as worker:
        server = WorkerHealthServer(worker, 0, "127.0.0.1")
        server.start()
        url = f"http://127.0.0.1:{server.port}/"
        try:
            wait_until(lambda: http_get(url)[0] == 200, message="a healthy worker")
            port = default.settings_dict["PORT"]
            admin = raw_connection(autocommit=True)
            default.settings_dict["PORT"] = 1
            try:
                with admin:
                    admin.execute(
                        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                        "WHERE datname = current_database() AND pid <> pg_backend_pid()"
                    )
                status, body = wait_until(
                    lambda: (lambda got: got if got[0] == 503 else None)(http_get(url)),
                    message="the health port to notice",
                )
                body = json.loads(body)
                assert (body["status"], body["database"]) == ("unhealthy", "unreachable")
            finally:
                default.settings_dict["PORT"] = port
            wait_until(lambda: http_get(url)[0] == 200, timeout=60, message="recovery")
        finally:
            server.close()
        default.close()


# --- the worker's stream delivery thread ----------------------------------------

LEDGER = "test.ledger"  # testproject/demo/subscribers.py
STREAM_OPTIONS = ("--subscriptions", LEDGER, "--poll-interval", "0.2", "--health-port", "0")
STUCK_AFTER = 0.2 * 2 + 5  # StreamWorker.stuck_after at that poll interval


def worker_health(port):
    status, body = http_get(f"http://127.0.0.1:{port}/health")
    return status, json.loads(body)


def streams_health_when(port, condition):
    """Poll the worker's health until ``condition(status, streams details)``."""
    return wait_until(
        lambda: (
            (got := worker_health(port))[1].get("streams") is not None
            and condition(got[0], got[1]["streams"])
            and got
        ),
        timeout=60,
        message="the worker's health to report it",
    )


def ledger():
    from demo.models import Handled

    return list(
        Handled.objects.filter(topic=LEDGER).order_by("id").values_list("message_id", flat=True)
    )


@pytest.mark.slow
def test_worker_health_a_long_running_subscriber_is_busy_not_stuck(start_worker, tmp_path):
    from django_pgqueue import publish

    position = publish("test.events", {"sleep": 600, "once": str(tmp_path / "slept")}).position
    worker = start_worker(*STREAM_OPTIONS)
    port = worker_port(worker, "health")
    # There is no subscriber timeout: however long it runs, it is at work.
    status, body = streams_health_when(
        port, lambda _, streams: streams.get("running", {}).get("seconds", 0) > STUCK_AFTER
    )
    assert status == 200, body
    streams = body["streams"]
    assert (streams["alive"], streams["stuck"]) == (True, False)
    assert streams["running"]["subscription"] == LEDGER
    assert streams["running"]["position"] == position
    assert (streams["subscriptions"], streams["delivered"]) == ([LEDGER], 0)
    assert "last_error" not in streams and body["loop_alive"] is True


@pytest.mark.slow
def test_worker_health_is_503_while_its_delivery_thread_is_stuck(start_worker):
    from django_pgqueue import publish

    position = publish("test.events", {}).position
    # Without the worker's limits its statements wait for a lock as long as
    # it is held (with them, they give up and the thread reports the error:
    # test_streams' test of a held lock).
    worker = start_worker(
        *STREAM_OPTIONS, pgqueue={"LOCK_TIMEOUT": None, "STATEMENT_TIMEOUT": None}
    )
    port = worker_port(worker, "health")
    wait_until(lambda: ledger() == [position], timeout=60, message="the first delivery")
    status, body = streams_health_when(port, lambda status, _: status == 200)
    assert body["streams"]["delivered"] == 1
    with raw_connection() as locker:
        # What a migration does: the thread's next poll waits for the lock,
        # in its own code, not in a subscriber.
        locker.execute("LOCK TABLE django_pgqueue_subscription IN ACCESS EXCLUSIVE MODE")
        status, body = streams_health_when(port, lambda status, _: status == 503)
        streams = body["streams"]
        assert (streams["alive"], streams["stuck"]) == (True, True), body
        assert streams["loop_age_seconds"] > STUCK_AFTER and "running" not in streams
        assert body["loop_alive"] is True and "loop_error" not in body, "the message loop is fine"
        locker.rollback()
    streams_health_when(port, lambda status, streams: status == 200 and not streams["stuck"])


@pytest.mark.slow
def test_worker_health_is_503_once_its_delivery_thread_has_died(start_worker):
    from django_pgqueue import publish
    from django_pgqueue.models import Subscription

    worker = start_worker(*STREAM_OPTIONS)
    port = worker_port(worker, "health")
    streams_health_when(port, lambda status, _: status == 200)
    # A receiver of subscription_blocked that calls sys.exit() (the demo's):
    # SystemExit is no Exception, and it is no subscriber's failure.
    publish("test.events", {"raise": "Permanent", "receiver_exit": 3})
    status, body = streams_health_when(port, lambda status, _: status == 503)
    streams = body["streams"]
    assert (streams["alive"], streams["stuck"]) == (False, False), body
    assert streams["last_error"] == "the delivery thread died: SystemExit: 3"
    assert body["loop_alive"] is True, "the message loop goes on"
    assert ledger() == [] and Subscription.objects.get(name=LEDGER).state == "blocked"
    assert "no more deliveries until the worker restarts" in worker.log()
    worker.signal(signal.SIGTERM)
    assert worker.wait(timeout=30) == 0, worker.log()
