"""Dead-letter alerts: the suppression window (exact times, racing
connections), the alert message and its payload, the receiver's error
handling, delivery to a real local HTTP server (success, every kind of
failure, no secret leaked), and real worker processes end to end."""

import datetime
import json
import socket
import threading
import traceback
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from demo.models import Handled
from django.db import connections, transaction
from django.db.models import F
from django.test import override_settings

from django_pgqueue import (
    __version__,
    conf,
    enqueue,
    enqueue_many,
    handlers,
    lifecycle,
    policy,
    registry,
    testing,
)
from django_pgqueue.exceptions import Permanent
from django_pgqueue.models import AlertState, Category, DeadLetter, Message, Status
from django_pgqueue.observability import alerts

from .conftest import wait_until

# This module doubles as a URLconf without the admin (see
# test_the_admin_link_is_empty_when_the_admin_cannot_be_reversed).
urlpatterns = []

TOKEN = "tok-4f2a9c1e7b3d5a60"
KEY = "key-8d7c6b5a4e3f2a19"
HEADERS = {"Authorization": f"Bearer {TOKEN}", "X-Alert-Key": KEY}
SECRETS = (TOKEN, KEY)
T0 = datetime.datetime(2030, 1, 1, tzinfo=datetime.UTC)
SECOND = datetime.timedelta(seconds=1)
WINDOW = 300.0


def alert_settings(url="http://127.0.0.1:9/hook", **more):
    return override_settings(PGQUEUE={"ALERT_WEBHOOK_URL": url, **more})


# --- a real local webhook ------------------------------------------------------------


@dataclass
class Received:
    path: str
    headers: dict  # lower-cased names
    body: object


class Webhook:
    """A local HTTP server that records every POST and answers as told:
    ``answers`` are used one per request (a status, (status, reason),
    (status, location) for a redirect, or "hang"), then ``default``."""

    def __init__(self):
        self.requests = []
        self.answers = []
        self.default = 200
        self.released = threading.Event()
        self.lock = threading.Lock()
        webhook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with webhook.lock:
                    webhook.requests.append(
                        Received(
                            self.path,
                            {k.lower(): v for k, v in self.headers.items()},
                            json.loads(body),
                        )
                    )
                    answer = webhook.answers.pop(0) if webhook.answers else webhook.default
                if answer == "hang":
                    webhook.released.wait(30)
                    return  # closes the connection without an answer
                status, extra = answer if isinstance(answer, tuple) else (answer, None)
                if 300 <= status < 400:
                    self.send_response(status)
                    self.send_header("Location", extra)
                else:
                    self.send_response(status, extra)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hooks/alerts"
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self.thread.start()

    def bodies(self, **match):
        with self.lock:
            found = [r.body for r in self.requests]
        return [b for b in found if all(b.get(k) == v for k, v in match.items())]

    def close(self):
        self.released.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def webhook():
    hook = Webhook()
    yield hook
    hook.close()


def assert_no_secret(text, where):
    for secret in SECRETS:
        assert secret not in text, f"a webhook header value leaked into {where}: {text[:2000]}"


# --- the suppression window ------------------------------------------------------------


@pytest.mark.django_db
@override_settings(PGQUEUE={"ALERT_WINDOW": WINDOW})
def test_one_alert_per_topic_and_category_per_window_and_the_next_one_reports_the_rest():
    def verdict(seconds, topic="orders.created", category="dependency"):
        now = T0 + datetime.timedelta(seconds=seconds)
        return alerts.suppression(topic, category, now=now)

    assert verdict(0) == alerts.Verdict(send=True, suppressed=0), "the first one opens a window"
    assert verdict(1) == alerts.Verdict(send=False, suppressed=1)
    assert verdict(WINDOW - 0.000001) == alerts.Verdict(send=False, suppressed=2), "last moment"
    assert verdict(1, category="permanent").send, "another category has a window of its own"
    assert verdict(1, topic="orders.paid").send, "another topic has a window of its own"
    assert verdict(WINDOW) == alerts.Verdict(send=True, suppressed=2), (
        "a whole window later the next alert goes out and reports the two held back"
    )
    assert verdict(WINDOW + 1) == alerts.Verdict(send=False, suppressed=1), "a new window"
    row = AlertState.objects.get(topic="orders.created", category="dependency")
    assert (row.last_sent_at, row.suppressed) == (T0 + WINDOW * SECOND, 1)
    assert AlertState.objects.count() == 3


@pytest.mark.parametrize("existing", [None, 7], ids=["first-dead-letter", "expired-window"])
def test_two_connections_racing_for_one_window_send_exactly_one_alert(
    transactional_db, other_connection, existing
):
    """The first statement holds its row lock until its transaction ends; the
    second waits for it, then sees the first one's window and holds back."""
    if existing is not None:
        AlertState.objects.create(
            topic="t.race", category="unknown", last_sent_at=T0 - 3600 * SECOND, suppressed=existing
        )
    verdicts = {}
    first_done, release = threading.Event(), threading.Event()

    def first():
        try:
            with transaction.atomic():
                verdicts["first"] = alerts.suppression("t.race", "unknown", now=T0)
                first_done.set()
                release.wait(10)
        finally:
            connections.close_all()

    def second():
        try:
            verdicts["second"] = alerts.suppression("t.race", "unknown", now=T0 + SECOND)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=first)]
    threads[0].start()
    assert first_done.wait(10), "the first statement did not finish"
    threads.append(threading.Thread(target=second))
    threads[1].start()
    try:
        wait_until(
            lambda: other_connection.execute(
                "SELECT count(*) FROM pg_stat_activity "
                "WHERE datname = current_database() AND wait_event_type = 'Lock'"
            ).fetchone()[0],
            timeout=60,
            message="the second statement to wait for the first one's lock",
        )
    finally:
        release.set()
        for thread in threads:
            thread.join(10)
    assert verdicts["first"] == alerts.Verdict(send=True, suppressed=existing or 0)
    assert verdicts["second"] == alerts.Verdict(send=False, suppressed=1), (
        "the second connection must see the first one's new window and hold back"
    )
    row = AlertState.objects.get(topic="t.race", category="unknown")
    assert (row.last_sent_at, row.suppressed) == (T0, 1)


def test_many_threads_hammering_one_window_send_one_alert_and_count_the_rest(transactional_db):
    threads, per_thread = 8, 10
    barrier = threading.Barrier(threads)
    verdicts, errors = [], []

    def run():
        try:
            barrier.wait(10)
            for _ in range(per_thread):
                verdicts.append(alerts.suppression("t.storm", "transient"))
        except Exception as exc:  # noqa: BLE001  (reported below)
            errors.append(exc)
        finally:
            connections.close_all()

    workers = [threading.Thread(target=run) for _ in range(threads)]
    for thread in workers:
        thread.start()
    for thread in workers:
        thread.join(30)
    assert not errors, errors
    assert sum(v.send for v in verdicts) == 1, "exactly one alert per window"
    held = sorted(v.suppressed for v in verdicts if not v.send)
    assert held == list(range(1, threads * per_thread)), "each held-back one counted once"
    assert AlertState.objects.get(topic="t.storm").suppressed == threads * per_thread - 1


# --- the alert message -------------------------------------------------------------------


@pytest.mark.django_db
def test_a_dead_letter_queues_one_alert_message_with_everything_an_alert_needs(
    make_message, django_capture_on_commit_callbacks
):
    message = make_message(
        topic="orders.created", queue="billing", status=Status.PROCESSING, attempts=4
    )
    settings = alert_settings(ALERT_WEBHOOK_RETRIES=2, ALERT_SITE_URL="https://ops.example.com/")
    with settings, django_capture_on_commit_callbacks(execute=True):
        dead = lifecycle.dead_letter(
            message, Category.DEPENDENCY, "ConnectionError: payment down\nsecond line", worker="w-1"
        )
    [alert] = testing.assert_enqueued(conf.ALERT_TOPIC, count=1)
    assert (alert.queue, alert.max_attempts) == ("billing", 3), "its queue, 1 + retries tries"
    assert alert.payload == {
        "event": "dead_lettered",
        "topic": "orders.created",
        "category": "dependency",
        "queue": "billing",
        "reason": "ConnectionError: payment down",
        "dead_letter_id": dead.pk,
        "message_id": message.pk,
        "attempts": 4,
        "worker": "w-1",
        "dead_lettered_at": dead.dead_lettered_at.isoformat(),
        "count": 1,
        "suppressed": 0,
        "window_seconds": conf.DEFAULTS["ALERT_WINDOW"],
        "admin_url": f"https://ops.example.com/admin/django_pgqueue/deadletter/{dead.pk}/change/",
        "text": "Dead letter in orders.created (dependency) on queue billing: ConnectionError: "
        f"payment down https://ops.example.com/admin/django_pgqueue/deadletter/{dead.pk}/change/",
    }


@pytest.mark.django_db
def test_the_alert_after_a_window_links_the_dead_letters_it_stands_for(
    make_dead_letter, admin_client
):
    topic = "orders/created:v2"  # characters that must be encoded in the link
    with alert_settings(ALERT_WINDOW=WINDOW):
        ours = [make_dead_letter(topic=topic, category=Category.BUSINESS) for _ in range(4)]
        make_dead_letter(topic=topic, category=Category.PERMANENT)
        make_dead_letter(topic="orders.paid", category=Category.BUSINESS)
        assert alerts.raise_alert(ours[0], now=T0) is not None
        assert alerts.raise_alert(ours[1], now=T0 + SECOND) is None
        assert alerts.raise_alert(ours[2], now=T0 + 2 * SECOND) is None
        alert = alerts.raise_alert(ours[3], now=T0 + WINDOW * SECOND)
    assert (alert.payload["count"], alert.payload["suppressed"]) == (3, 2)
    assert alert.payload["text"].startswith(
        "3 dead letters in orders/created:v2 (business) since the last alert"
    )
    url = alert.payload["admin_url"]
    assert url == (
        "/admin/django_pgqueue/deadletter/?topic__exact=orders%2Fcreated%3Av2"
        "&category__exact=business"
    )
    response = admin_client.get(url)
    assert response.status_code == 200, "the admin refused the link's filter parameters"
    assert {d.pk for d in response.context["cl"].result_list} == {d.pk for d in ours}


@pytest.mark.django_db
def test_the_admin_link_is_empty_when_the_admin_cannot_be_reversed(make_dead_letter):
    dead = make_dead_letter()
    with override_settings(ROOT_URLCONF=__name__):
        payload = alerts.build_payload(dead, suppressed=0)
    assert payload["admin_url"] == ""
    assert payload["text"].endswith("ConnectionError: downstream is down"), payload["text"]


@pytest.mark.django_db
def test_no_alerts_without_a_url_and_never_about_an_undeliverable_alert(make_dead_letter):
    assert alerts.raise_alert(make_dead_letter()) is None, "ALERT_WEBHOOK_URL is None by default"
    with alert_settings():
        assert alerts.raise_alert(make_dead_letter(topic=conf.ALERT_TOPIC)) is None
    assert not AlertState.objects.exists(), "no window was opened or counted"
    testing.assert_not_enqueued()  # no alert was queued


@pytest.mark.django_db
def test_the_receiver_logs_and_swallows_its_errors_and_the_dead_letter_stands(
    make_message, django_capture_on_commit_callbacks, monkeypatch, caplog
):
    # A real database error inside the receiver's transaction (a broken statement).
    monkeypatch.setattr(alerts, "SUPPRESS_SQL", "SELECT no_such_column FROM {table}")
    message = make_message(status=Status.PROCESSING)
    with alert_settings(), django_capture_on_commit_callbacks(execute=True):
        dead = lifecycle.dead_letter(message, Category.UNKNOWN, "RuntimeError: odd")
    assert DeadLetter.objects.filter(pk=dead.pk).exists()
    assert not Message.objects.exists(), "no alert, and the message itself is gone"
    errors = [r for r in caplog.records if r.levelname == "ERROR"]
    assert [r.getMessage() for r in errors] == [
        f"Dead letter id={dead.pk} topic=test.record: the alert could not be raised"
    ]
    assert "no_such_column" in str(errors[0].exc_info[1])


# --- delivery ------------------------------------------------------------------------------


PAYLOAD = {"event": "dead_lettered", "topic": "orders.created", "category": "business", "count": 1}


def test_autodiscovery_registers_the_alert_handler_outside_the_database_transaction():
    spec = registry.lookup(conf.ALERT_TOPIC)
    assert spec is not None and spec.func is handlers.deliver_alert
    assert spec.atomic is False, "an HTTP request is no database work"
    assert spec.timeout > handlers.HTTP_TIMEOUT_MAX, "the HTTP timeout ends first"


def test_delivery_posts_the_payload_as_json_with_the_configured_headers(webhook, caplog):
    caplog.set_level("INFO", logger="django_pgqueue")
    with alert_settings(webhook.url, ALERT_WEBHOOK_HEADERS=HEADERS):
        assert handlers.deliver(PAYLOAD) == 200
    [request] = webhook.requests
    assert request.path == "/hooks/alerts"
    assert request.body == PAYLOAD
    assert request.headers["content-type"] == "application/json"
    assert request.headers["user-agent"] == f"django-pgqueue/{__version__}"
    assert request.headers["authorization"] == f"Bearer {TOKEN}"
    assert request.headers["x-alert-key"] == KEY
    logged = caplog.text
    assert "delivered to http://127.0.0.1:" in logged and "HTTP 200" in logged
    assert "/hooks/alerts" not in logged, "a webhook URL may hold a token: log the host only"
    assert_no_secret(logged, "the log")


@pytest.mark.parametrize(
    "answer, raised, category",
    [
        (500, handlers.WebhookUnavailable, Category.DEPENDENCY),
        (503, handlers.WebhookUnavailable, Category.DEPENDENCY),
        (408, handlers.WebhookUnavailable, Category.DEPENDENCY),
        (429, handlers.WebhookUnavailable, Category.DEPENDENCY),
        (400, Permanent, Category.PERMANENT),
        (401, Permanent, Category.PERMANENT),
        (404, Permanent, Category.PERMANENT),
        ((302, "http://127.0.0.1:9/elsewhere"), Permanent, Category.PERMANENT),
        ((500, f"echoing {TOKEN}"), handlers.WebhookUnavailable, Category.DEPENDENCY),
    ],
)
def test_a_failed_delivery_raises_what_the_policy_retries_or_not(webhook, answer, raised, category):
    webhook.default = answer
    with alert_settings(webhook.url, ALERT_WEBHOOK_HEADERS=HEADERS):
        with pytest.raises(raised) as caught:
            handlers.deliver(PAYLOAD)
        assert policy.classify(caught.value) == category
    status = answer[0] if isinstance(answer, tuple) else answer
    assert f"webhook answered HTTP {status}" in str(caught.value)
    assert len(webhook.requests) == 1, "one request per attempt; redirects are not followed"
    assert_no_secret("".join(traceback.format_exception(caught.value)), "the exception")


def test_a_webhook_that_hangs_times_out_as_a_retried_failure(webhook):
    webhook.default = "hang"
    with alert_settings(webhook.url, ALERT_WEBHOOK_TIMEOUT=0.2, ALERT_WEBHOOK_HEADERS=HEADERS):
        with pytest.raises(handlers.WebhookUnavailable, match=r"timed out after 0\.2s") as caught:
            handlers.deliver(PAYLOAD)
        assert policy.classify(caught.value) == Category.DEPENDENCY
    assert_no_secret("".join(traceback.format_exception(caught.value)), "the exception")


def test_a_webhook_that_is_not_listening_is_a_retried_failure():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # closed again: nothing listens there
    with alert_settings(f"http://127.0.0.1:{port}/hook", ALERT_WEBHOOK_HEADERS=HEADERS):
        with pytest.raises(handlers.WebhookUnavailable, match="webhook unreachable") as caught:
            handlers.deliver(PAYLOAD)
        assert policy.classify(caught.value) == Category.DEPENDENCY
    assert_no_secret("".join(traceback.format_exception(caught.value)), "the exception")


def test_an_alert_queued_before_the_url_was_unset_is_dropped(webhook, caplog):
    caplog.set_level("INFO", logger="django_pgqueue")
    assert handlers.deliver(PAYLOAD) is None
    assert not webhook.requests
    assert "dropped: ALERT_WEBHOOK_URL is no longer set" in caplog.text


# --- real worker processes ------------------------------------------------------------------


def worker_settings(webhook, **more):
    return {
        "ALERT_WEBHOOK_URL": webhook.url,
        "ALERT_WEBHOOK_HEADERS": HEADERS,
        "ALERT_WINDOW": 60,
        "BACKOFF_BASE": 0.05,
        "BACKOFF_CAP": 0.2,
        "DEPENDENCY_BACKOFF_FACTOR": 1,
        **more,
    }


def fail(how, topic="test.fail"):
    return enqueue(topic, {"raise": how})


def windows():
    return {(s.topic, s.category): s.suppressed for s in AlertState.objects.all()}


@pytest.mark.slow
def test_end_to_end_one_alert_per_window_and_the_next_one_counts_the_held_back(
    start_worker, webhook
):
    worker = start_worker(
        "--concurrency",
        "2",
        "--poll-interval",
        "0.2",
        pgqueue=worker_settings(webhook, ALERT_SITE_URL="https://ops.example.com"),
    )
    first = fail("Permanent")
    wait_until(lambda: webhook.requests, timeout=60, message="the first alert")
    dead = DeadLetter.objects.get(message_id=first.pk)
    [request] = webhook.requests
    assert request.headers["authorization"] == f"Bearer {TOKEN}"
    assert request.headers["x-alert-key"] == KEY
    body = request.body
    assert (body["topic"], body["category"], body["reason"]) == (
        "test.fail",
        "permanent",
        "Permanent: cannot ever work",
    )
    assert (body["count"], body["suppressed"], body["dead_letter_id"]) == (1, 0, dead.pk)
    assert (body["message_id"], body["worker"]) == (first.pk, dead.worker)
    assert body["admin_url"] == (
        f"https://ops.example.com/admin/django_pgqueue/deadletter/{dead.pk}/change/"
    )

    # Inside the window: two more of the same are held back; another category
    # and another topic (no handler: permanent) get an alert each.
    for how, topic in [("Permanent", "test.fail")] * 2 + [
        ("ValidationError", "test.fail"),
        ("x", "test.nohandler"),
    ]:
        fail(how, topic)
    expected = {
        ("test.fail", "permanent"): 2,
        ("test.fail", "business"): 0,
        ("test.nohandler", "permanent"): 0,
    }
    wait_until(
        lambda: windows() == expected,
        timeout=60,
        message="two held back and two new windows",
    )
    wait_until(lambda: not Message.objects.exists(), timeout=60, message="the alerts delivered")
    assert sorted((b["topic"], b["category"], b["count"]) for b in webhook.bodies()) == [
        ("test.fail", "business", 1),
        ("test.fail", "permanent", 1),
        ("test.nohandler", "permanent", 1),
    ]

    # The window has passed (fabricated): the next one reports the two held back.
    AlertState.objects.filter(topic="test.fail", category="permanent").update(
        last_sent_at=F("last_sent_at") - datetime.timedelta(hours=1)
    )
    last = fail("Permanent")
    wait_until(lambda: len(webhook.requests) == 4, timeout=60, message="the fourth alert")
    body = webhook.requests[-1].body
    assert (body["count"], body["suppressed"]) == (3, 2)
    assert body["dead_letter_id"] == DeadLetter.objects.get(message_id=last.pk).pk
    assert body["admin_url"] == (
        "https://ops.example.com/admin/django_pgqueue/deadletter/"
        "?topic__exact=test.fail&category__exact=permanent"
    )
    assert_no_secret(worker.log(), "the worker's log")


@pytest.mark.slow
def test_a_failing_webhook_is_retried_then_dead_lettered_and_never_holds_up_other_messages(
    start_worker, webhook
):
    worker = start_worker(
        "--concurrency",
        "2",
        "--poll-interval",
        "0.2",
        pgqueue=worker_settings(webhook, ALERT_WEBHOOK_RETRIES=3, ALERT_WEBHOOK_TIMEOUT=2),
    )

    # Two failures, then the webhook is back: delivered on the third try.
    webhook.answers = [500, 503]
    fail("Permanent")
    wait_until(lambda: len(webhook.requests) == 3, timeout=60, message="three tries")
    wait_until(lambda: not Message.objects.exists(), timeout=60, message="the alert delivered")
    assert len({r.body["dead_letter_id"] for r in webhook.requests}) == 1, "one alert, retried"
    assert not DeadLetter.objects.filter(topic=conf.ALERT_TOPIC).exists()

    # The webhook keeps failing: 1 + 3 tries, then the alert is a dead letter
    # itself, and no alert is raised about it.
    webhook.default = 500
    fail("ValidationError")
    wait_until(
        lambda: "topic=pgqueue.alert attempt=4 dead-lettered as dependency" in worker.log(),
        timeout=60,
        message="the undeliverable alert to be dead-lettered (logged after its receivers ran)",
    )
    dead_alert = DeadLetter.objects.get(topic=conf.ALERT_TOPIC)
    assert (dead_alert.attempts, dead_alert.category) == (4, Category.DEPENDENCY)
    assert (
        dead_alert.reason == "WebhookUnavailable: webhook answered HTTP 500 Internal Server Error"
    )
    assert len(webhook.bodies(category="business")) == 4
    assert not Message.objects.exists() and conf.ALERT_TOPIC not in {t for t, _ in windows()}

    # The webhook hangs: the alert holds one handler slot until its timeout;
    # the other slot keeps the queue moving meanwhile.
    webhook.answers, webhook.default = ["hang"], 200
    fail("x", "test.nohandler")
    wait_until(lambda: webhook.bodies(topic="test.nohandler"), timeout=60, message="the alert")
    records = enqueue_many([{"payload": {"n": n}} for n in range(20)], topic="test.record")
    wait_until(
        lambda: Handled.objects.count() == len(records), timeout=60, message="the records handled"
    )
    assert len(webhook.bodies(topic="test.nohandler")) == 1, (
        "the records were handled only after the hanging request timed out"
    )
    wait_until(
        lambda: len(webhook.bodies(topic="test.nohandler")) == 2 and not Message.objects.exists(),
        timeout=60,
        message="the alert retried after its timeout and delivered",
    )
    assert "WebhookUnavailable: webhook unreachable: timed out after 2s" in worker.log()

    assert_no_secret(worker.log(), "the worker's log")
    assert_no_secret(dead_alert.reason + dead_alert.traceback, "the dead letter")
