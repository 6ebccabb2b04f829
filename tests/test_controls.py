"""Run-time control of the queues against the real database: pause and
resume, cancel, and the limits (concurrency, rate) enforced by the claim.
Rows are fabricated in the state each test needs; the claim runs as the
worker's does (``lifecycle.ack_and_claim_rows``), with a fixed clock where
time matters. Real workers in other processes: test_controls_processes.py."""

import datetime
import time
import uuid

import pytest
from demo.models import Handled
from django.core.management import call_command
from django.test import override_settings
from django.utils import timezone

import django_pgqueue
from django_pgqueue import (
    QueueControlError,
    cancel,
    cancel_requested,
    enqueue,
    lifecycle,
    maintenance,
    pause_queue,
    paused_queues,
    resume_queue,
)
from django_pgqueue import controls as controls_module
from django_pgqueue.conf import Limits, Rate, validate
from django_pgqueue.models import Message as M
from django_pgqueue.models import QueueStart, QueueState, Status
from django_pgqueue.signals import message_cancelled
from django_pgqueue.worker import Worker

from .conftest import raw_connection, running_worker, wait_until

pytestmark = pytest.mark.django_db(transaction=True)

NOW = timezone.now().replace(microsecond=0)


def control_listener():
    conn = raw_connection(autocommit=True)
    conn.execute("LISTEN django_pgqueue_control")
    return conn


def received(conn, timeout=1.0):
    return [n.payload for n in conn.notifies(timeout=timeout, stop_after=10)]


def claim(queue, limit, limits=None, now=None, worker="w"):
    return lifecycle.ack_and_claim_rows(
        [], [queue], limit, worker, 60, now=now, limits=None if limits is None else {queue: limits}
    )


# --- pause and resume -------------------------------------------------------------------


def test_pause_and_resume_are_kept_in_the_database_and_told_to_the_workers():
    with control_listener() as conn:
        assert pause_queue("emails", by="ops") is True
        assert pause_queue("emails") is False, "paused already: nothing changes"
        assert received(conn) == ["queues"], "one NOTIFY, at the commit of the change"
        row = QueueState.objects.get(name="emails")
        assert (row.paused, row.changed_by) == (True, "ops") and row.paused_at is not None
        assert paused_queues() == ["emails"]
        assert resume_queue("emails", by="ops") is True
        assert resume_queue("emails") is False
        assert received(conn) == ["queues"]
    assert paused_queues() == []


@override_settings(PGQUEUE={"NOTIFY": False})
def test_poll_only_mode_sends_no_notification():
    with control_listener() as conn:
        pause_queue("emails")
        assert received(conn, 0.3) == []
    assert paused_queues() == ["emails"]


@pytest.mark.parametrize("name", ["", "bad name", "x" * 101, None])
def test_a_bad_queue_name_is_refused_and_nothing_is_written(name):
    with pytest.raises(QueueControlError):
        pause_queue(name)
    assert not QueueState.objects.exists()


def test_enqueue_into_a_paused_queue_is_accepted_and_waits():
    pause_queue("default")
    message = enqueue("test.record", {}, queue="default")
    assert Worker(burst=True, queues=["default"]).run() == 0
    assert M.objects.get(pk=message.pk).status == Status.WAITING
    resume_queue("default")
    assert Worker(burst=True, queues=["default"]).run() == 1
    assert Handled.objects.filter(message_id=message.pk).exists()


def test_a_worker_claims_from_its_other_queues_while_one_is_paused():
    paused = enqueue("test.record", {}, queue="paused")
    running = enqueue("test.record", {}, queue="running")
    pause_queue("paused")
    assert Worker(burst=True, queues=["paused", "running"]).run() == 1
    assert list(Handled.objects.values_list("message_id", flat=True)) == [running.pk]
    assert M.objects.get(pk=paused.pk).status == Status.WAITING


def test_a_worker_whose_queues_are_all_paused_promotes_groups_and_goes_idle():
    # A released group with every queue paused: no claim to carry the
    # promotion, so the worker promotes on its own instead of coming back
    # for it again and again (a --burst worker exits).
    head = enqueue("test.record", {}, queue="p", group_key="g")
    pause_queue("p")
    started = time.monotonic()
    assert Worker(burst=True, queues=["p"], poll_interval=30).run() == 0
    assert time.monotonic() - started < 10
    assert M.objects.get(pk=head.pk).status == Status.WAITING, "promoted, not run"


def test_a_running_worker_follows_pause_and_resume_without_a_restart():
    with running_worker(concurrency=2, queues=["live"], poll_interval=30) as worker:
        first = enqueue("test.record", {}, queue="live")
        wait_until(lambda: Handled.objects.filter(message_id=first.pk).exists(), timeout=60)
        pause_queue("live")
        wait_until(lambda: worker._controls.paused == {"live"}, timeout=20, message="the pause")
        held = enqueue("test.record", {}, queue="live")
        # The insert's NOTIFY wakes the worker; it claims nothing from a paused queue.
        with pytest.raises(AssertionError):
            wait_until(lambda: Handled.objects.filter(message_id=held.pk).exists(), timeout=1)
        resume_queue("live")
        wait_until(
            lambda: Handled.objects.filter(message_id=held.pk).exists(),
            timeout=20,
            message="the resumed queue's message",
        )


# --- the settings -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "queues",
    [
        ["default", "emails"],
        {"default": {}, "payments": {"concurrency": 3}, "emails": {"rate": "100/m"}},
        {"a": {"concurrency": 1, "rate": "20/s"}, "b": None, "c": {"rate": "1/h"}},
    ],
)
def test_queues_takes_a_list_or_a_dict_of_limits(queues):
    with override_settings(PGQUEUE={"QUEUES": queues}):
        assert validate() == []
        assert django_pgqueue.conf.queues() == list(queues)


@pytest.mark.parametrize(
    ("queues", "says"),
    [
        ({"a": {"concurrency": 0}}, "concurrency must be a whole number from 1"),
        ({"a": {"concurrency": True}}, "concurrency must be a whole number"),
        ({"a": {"rate": "100/d"}}, "rate must be a rate like '20/s'"),
        ({"a": {"rate": "0/s"}}, "rate must be a rate like"),
        ({"a": {"rate": 100}}, "rate must be a rate like"),
        ({"a": {"concurency": 3}}, "unknown limit 'concurency'"),
        ({"a": 3}, "must be a dict of limits"),
        ({"bad name": {}}, "may contain only letters"),
        ({}, "must be a non-empty list"),
    ],
)
def test_bad_limits_in_queues_are_a_system_check_error(queues, says):
    with override_settings(PGQUEUE={"QUEUES": queues}):
        problems = validate()
    assert [p[0] for p in problems] == ["pgqueue.E003"]
    assert says in problems[0][1]


def test_run_time_limits_override_the_settings_until_cleared():
    with override_settings(PGQUEUE={"QUEUES": {"a": {"concurrency": 3}, "b": {"rate": "5/s"}}}):
        assert controls_module.current().limits == {
            "a": Limits(3, None),
            "b": Limits(None, Rate(5, 1)),
        }
        controls_module.set_limits("a", concurrency=None, rate="10/m", by="ops")
        controls_module.set_limits("c", concurrency=2)
        assert controls_module.current().limits == {
            "a": Limits(None, Rate(10, 60)),
            "b": Limits(None, Rate(5, 1)),
            "c": Limits(2, None),
        }
        controls_module.set_limits("b")  # both None: no limits, whatever the settings say
        assert "b" not in controls_module.current().limits
        controls_module.clear_limits("a")
        controls_module.clear_limits("b")
        assert controls_module.current(["a", "b"]).limits == {
            "a": Limits(3, None),
            "b": Limits(None, Rate(5, 1)),
        }
    with pytest.raises(QueueControlError, match="rate must be"):
        controls_module.set_limits("a", rate="fast")
    with pytest.raises(QueueControlError, match="concurrency must be"):
        controls_module.set_limits("a", concurrency=0)


# --- the concurrency limit, in the claim ---------------------------------------------------


def test_the_claim_takes_only_the_free_slots_of_the_concurrency(make_message):
    for _ in range(2):
        make_message(queue="pay", status=Status.PROCESSING, locked_by="other-worker")
    make_message(queue="other", status=Status.PROCESSING)  # another queue's: not counted
    for _ in range(10):
        make_message(queue="pay")
    result = claim("pay", 10, Limits(concurrency=3))
    assert len(result.rows) == 1, "3 allowed, 2 already running on another worker"
    assert result.limited["pay"].processing == 3
    assert result.limited["pay"].full(Limits(concurrency=3)) == (True, False)
    assert claim("pay", 10, Limits(concurrency=3)).rows == []


def test_a_rescued_lease_stops_counting(make_message):
    expired = NOW - datetime.timedelta(seconds=5)
    for _ in range(3):
        make_message(queue="pay", status=Status.PROCESSING, lease_expires_at=expired)
    make_message(queue="pay")
    assert claim("pay", 5, Limits(concurrency=3), now=NOW).rows == []
    assert maintenance.rescue_expired(now=NOW).requeued == 3
    assert len(claim("pay", 5, Limits(concurrency=3), now=NOW).rows) == 3


def test_a_queue_without_limits_takes_the_plain_claim(make_message):
    for _ in range(5):
        make_message(queue="free")
    result = claim("free", 10)
    assert len(result.rows) == 5 and result.limited == {}
    assert not QueueStart.objects.exists()


# --- the rate limit, in the claim -----------------------------------------------------------


def test_the_rate_counts_the_starts_in_its_window(make_message):
    rate = Limits(rate=Rate(5, 60))
    QueueStart.objects.create(
        queue="mail", started_at=NOW - datetime.timedelta(seconds=59), count=3
    )
    # Just out of the window (exactly 60 s ago), and another queue's: not counted.
    QueueStart.objects.create(
        queue="mail", started_at=NOW - datetime.timedelta(seconds=60), count=9
    )
    QueueStart.objects.create(queue="sms", started_at=NOW, count=9)
    for _ in range(10):
        make_message(queue="mail", run_at=NOW - datetime.timedelta(seconds=1))
    result = claim("mail", 10, rate, now=NOW)
    assert len(result.rows) == 2, "5 per minute, 3 started 59 s ago"
    state = result.limited["mail"]
    assert (state.started, state.full(rate)) == (5, (False, True))
    assert state.seconds_to_slot == pytest.approx(1.0), "the 59 s old starts leave in 1 s"
    assert claim("mail", 10, rate, now=NOW).rows == []
    later = NOW + datetime.timedelta(seconds=1)
    assert len(claim("mail", 10, rate, now=later).rows) == 3, "the 3 left the window"
    starts = list(QueueStart.objects.filter(queue="mail").values_list("count", flat=True))
    assert sorted(starts) == [2, 3, 3, 9], "one row per claim; none older than an hour: kept"


def test_the_claim_prunes_starts_older_than_the_longest_window(make_message):
    QueueStart.objects.create(queue="mail", started_at=NOW - datetime.timedelta(hours=2), count=1)
    QueueStart.objects.create(queue="sms", started_at=NOW - datetime.timedelta(hours=2), count=1)
    make_message(queue="mail", run_at=NOW)
    claim("mail", 1, Limits(rate=Rate(5, 1)), now=NOW)
    assert list(QueueStart.objects.values_list("queue", "count")) == [("sms", 1), ("mail", 1)]
    maintenance.prune_cancelled(now=NOW)  # also the starts of queues no claim prunes
    assert list(QueueStart.objects.values_list("queue", flat=True)) == ["mail"]


def test_both_limits_take_the_smaller(make_message):
    make_message(queue="q", status=Status.PROCESSING)
    for _ in range(10):
        make_message(queue="q", run_at=NOW)
    limits = Limits(concurrency=4, rate=Rate(2, 1))
    assert len(claim("q", 10, limits, now=NOW).rows) == 2
    later = NOW + datetime.timedelta(seconds=1)
    assert len(claim("q", 10, limits, now=later).rows) == 1, "the concurrency: 3 running"


# --- cancel -----------------------------------------------------------------------------


@pytest.fixture
def cancelled_signals():
    received = []

    def receiver(sender, message, worker, **kwargs):
        received.append((message.pk, worker))

    message_cancelled.connect(receiver)
    yield received
    message_cancelled.disconnect(receiver)


def test_cancel_counts_each_outcome(make_message, cancelled_signals):
    waiting = make_message()
    delayed = make_message(run_at=NOW + datetime.timedelta(hours=1))
    running = make_message(status=Status.PROCESSING)
    done_before = make_message(status=Status.CANCELLED)
    with control_listener() as conn:
        result = cancel([waiting.pk, delayed, running, done_before.pk, 999_999], by="ops")
        assert received(conn) == [f"cancel:{running.pk}"]
    assert result.as_dict() == {"cancelled": 2, "requested": 1, "already": 1, "finished": 1}
    statuses = dict(M.objects.values_list("pk", "status"))
    assert statuses[waiting.pk] == statuses[delayed.pk] == Status.CANCELLED
    assert statuses[running.pk] == Status.PROCESSING
    assert M.objects.get(pk=running.pk).cancel_requested_at is not None
    assert sorted(cancelled_signals) == sorted([(waiting.pk, ""), (delayed.pk, "")])
    again = cancel(M.objects.all())
    assert again.as_dict() == {"cancelled": 0, "requested": 0, "already": 4, "finished": 0}


def test_cancel_refuses_bad_input_before_changing_anything(make_message):
    message = make_message()
    for bad in ([message.pk, "x"], [0], Handled.objects.all()):
        with pytest.raises(QueueControlError):
            cancel(bad)
    assert M.objects.get(pk=message.pk).status == Status.WAITING


def test_a_cancelled_message_frees_its_dedup_key_and_never_runs():
    first = enqueue("test.record", {}, dedup_key="k")
    cancel([first])
    second = enqueue("test.record", {}, dedup_key="k")
    assert second.created and second.pk != first.pk
    assert Worker(burst=True).run() == 1
    assert list(Handled.objects.values_list("message_id", flat=True)) == [second.pk]
    assert M.objects.get(pk=first.pk).status == Status.CANCELLED


def test_cancelling_a_groups_head_releases_its_next_message():
    head = enqueue("test.record", {}, group_key="g")
    following = enqueue("test.record", {}, group_key="g")
    lifecycle.ack_and_claim_rows([], ["default"], 0, "w", 60, promote=True)  # head promoted
    assert M.objects.get(pk=head.pk).status == Status.WAITING
    assert M.objects.get(pk=following.pk).status == Status.BLOCKED
    cancel([head])
    assert M.objects.get(pk=following.pk).status == Status.WAITING, "released at once"
    blocked_one = enqueue("test.record", {}, group_key="g")
    cancel([blocked_one])  # a blocked message: cancelled, its group unchanged
    assert M.objects.get(pk=following.pk).status == Status.WAITING


def test_a_running_message_asked_to_stop_is_never_retried_nor_dead_lettered(make_message):
    running = make_message(status=Status.PROCESSING)
    cancel([running])
    assert lifecycle.retry_later(running, 1, "transient", "boom") is False
    assert lifecycle.dead_letter(running, "permanent", "boom") is None
    assert lifecycle.cancel_running(running, "RuntimeError: boom", worker="w") is True
    row = M.objects.get(pk=running.pk)
    assert (row.status, row.lease_token, row.last_error) == (
        Status.CANCELLED,
        None,
        "RuntimeError: boom",
    )
    other = make_message(status=Status.PROCESSING)
    other.lease_token = uuid.uuid4()  # another lease: the guard holds
    assert lifecycle.cancel_running(other) is False


def test_the_rescue_and_the_hand_back_cancel_what_was_asked_to_stop(make_message):
    lost = make_message(
        status=Status.PROCESSING, lease_expires_at=NOW - datetime.timedelta(seconds=1)
    )
    handed_back = make_message(status=Status.PROCESSING)
    kept = make_message(status=Status.PROCESSING)
    cancel([lost, handed_back])
    assert maintenance.rescue_expired(now=NOW).cancelled == 1
    assert lifecycle.release([handed_back, kept]) == 2
    statuses = dict(M.objects.values_list("pk", "status"))
    assert statuses == {
        lost.pk: Status.CANCELLED,
        handed_back.pk: Status.CANCELLED,
        kept.pk: Status.WAITING,
    }


@override_settings(PGQUEUE={"CANCELLED_RETENTION": 3600})
def test_cancelled_messages_are_pruned_after_their_retention(make_message):
    old = make_message(status=Status.CANCELLED)
    young = make_message(status=Status.CANCELLED)
    waiting = make_message()
    M.objects.filter(pk=old.pk).update(updated_at=NOW - datetime.timedelta(seconds=3601))
    M.objects.filter(pk__in=[young.pk, waiting.pk]).update(
        updated_at=NOW - datetime.timedelta(seconds=3599)
    )
    assert maintenance.prune_cancelled(now=NOW) == 1
    assert set(M.objects.values_list("pk", flat=True)) == {young.pk, waiting.pk}
    with override_settings(PGQUEUE={"CANCELLED_RETENTION": None}):
        M.objects.filter(pk=young.pk).update(updated_at=NOW - datetime.timedelta(days=999))
        assert maintenance.prune_cancelled(now=NOW) == 0


def test_cancel_requested_is_false_outside_a_handler():
    assert cancel_requested() is False


@pytest.mark.parametrize("ignore", [False, True])
def test_a_handler_told_mid_run_stops_and_ends_cancelled_or_finishes(ignore, cancelled_signals):
    message = enqueue("test.cancellable", {"seconds": 10, "ignore": ignore})
    with running_worker(concurrency=2, poll_interval=30) as worker:
        # Running, not only claimed: told before its thread starts it, a
        # message ends cancelled without running (a loaded machine showed it).
        wait_until(
            lambda: any(job.started is not None for job in worker._ledger.leased()),
            message="the handler started",
        )
        cancel([message])
        if ignore:
            wait_until(lambda: not M.objects.filter(pk=message.pk).exists(), timeout=60)
        else:
            wait_until(
                lambda: M.objects.filter(pk=message.pk, status=Status.CANCELLED).exists(),
                timeout=60,
                message="the run to end cancelled",
            )
    if ignore:  # it finished anyway: its outcome stands
        assert Handled.objects.filter(message_id=message.pk).count() == 1
        assert cancelled_signals == []
    else:
        row = M.objects.get(pk=message.pk)
        assert (row.status, row.attempts) == (Status.CANCELLED, 1)
        assert "stopped early" in row.last_error
        assert not Handled.objects.exists(), "the atomic handler's write was rolled back"
        assert len(cancelled_signals) == 1 and cancelled_signals[0][0] == message.pk


# --- observability ------------------------------------------------------------------------


def test_metrics_show_paused_queues_and_health_does_not_mind(client):
    from django_pgqueue.observability import health
    from django_pgqueue.observability.scrape import render_database_metrics

    pause_queue("emails")
    with override_settings(PGQUEUE={"QUEUES": ["default", "emails"]}):
        body = render_database_metrics()[0].decode()
        assert 'pgqueue_queue_paused{database="default",queue="emails"} 1.0' in body
        assert 'pgqueue_queue_paused{database="default",queue="default"} 0.0' in body
        with running_worker(queues=["default", "emails"], poll_interval=30):
            wait_until(lambda: health.system_health()[0], timeout=60, message="healthy")


def test_status_reports_the_paused_queues_and_their_limits():
    pause_queue("emails")
    controls_module.set_limits("emails", rate="100/m")
    with override_settings(PGQUEUE={"QUEUES": {"default": {"concurrency": 2}, "emails": {}}}):
        from django_pgqueue.observability.status import report

        queues = report(None)["queues"]
    assert (queues["emails"]["paused"], queues["emails"]["rate"]) == (True, "100/m")
    assert (queues["default"]["paused"], queues["default"]["concurrency"]) == (False, 2)


def test_cancelled_rows_are_not_counted_as_queue_depth(make_message):
    from django_pgqueue.observability import stats

    make_message(status=Status.CANCELLED)
    make_message()
    assert stats.messages_by_queue_topic_state() == [("default", "test.record", "ready", 1)]


# --- commands ----------------------------------------------------------------------------------


def run(*args):
    import io

    out = io.StringIO()
    call_command(*args, stdout=out)
    return out.getvalue()


def test_pgqueue_queues_pause_resume_limit_and_list():
    enqueue("test.record", {}, queue="emails")
    assert run("pgqueue_queues", "pause", "emails", "--by", "ops") == "queue emails paused\n"
    assert "paused already" in run("pgqueue_queues", "pause", "emails")
    out = run("pgqueue_queues", "limit", "emails", "--concurrency", "3", "--rate", "100/m")
    assert out == "queue emails: limits concurrency 3, rate 100/m\n"
    listing = run("pgqueue_queues", "list")
    line = next(line for line in listing.splitlines() if line.startswith("emails"))
    assert line.split()[:3] == ["emails", "paused", "1"]
    assert "concurrency 3, rate 100/m (run time)" in line
    assert run("pgqueue_queues", "limit", "emails", "--settings").endswith("limits none\n")
    assert run("pgqueue_queues", "resume", "emails") == "queue emails resumed\n"
    import json

    (row,) = [
        r for r in json.loads(run("pgqueue_queues", "list", "--json")) if r["queue"] == "emails"
    ]
    assert (row["paused"], row["ready"], row["rate"]) == (False, 1, None)


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (("limit", "emails", "--rate", "fast"), "must be a rate like"),
        (("limit", "emails", "--concurrency", "0"), "must be a whole number from 1"),
        (("limit", "emails"), "give --concurrency and/or --rate, or --none, or --settings"),
        (("limit", "emails", "--none", "--settings"), "one of the three"),
        (("pause", "bad name"), "may contain only letters"),
    ],
)
def test_pgqueue_queues_refuses_bad_input(args, says):
    from django.core.management import CommandError

    with pytest.raises(CommandError, match=says):
        run("pgqueue_queues", *args)
    assert not QueueState.objects.exists()


def test_pgqueue_messages_cancel_by_ids_and_by_topic(make_message):
    a = make_message(topic="orders.sync", queue="default")
    b = make_message(topic="orders.sync", queue="bulk")
    c = make_message(topic="other")
    dry = run(
        "pgqueue_messages", "cancel", "--topic", "orders.sync", "--queue", "bulk", "--dry-run"
    )
    assert dry == "dry run: would cancel 1 at once, ask 0 running to stop\n"
    assert M.objects.get(pk=b.pk).status == Status.WAITING
    out = run("pgqueue_messages", "cancel", "--topic", "orders.sync", "--queue", "bulk")
    assert out.startswith("cancelled 1, asked 0 running to stop")
    out = run("pgqueue_messages", "cancel", "--ids", f"{a.pk},{c.pk},999999")
    assert out == (
        "cancelled 2, asked 0 running to stop, 0 already cancelled, 1 finished or unknown\n"
    )
    assert set(M.objects.values_list("status", flat=True)) == {Status.CANCELLED}


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (("cancel",), "one of the arguments --ids --topic is required"),
        (("cancel", "--ids", "1,x"), "'x' is not a whole number"),
        (("cancel", "--ids", "1", "--queue", "q"), "--queue goes with --topic"),
        (("cancel", "--topic", "a", "--ids", "1"), "not allowed with argument"),
    ],
)
def test_pgqueue_messages_refuses_bad_input(args, says, make_message):
    from django.core.management import CommandError

    message = make_message()
    with pytest.raises(CommandError, match=says):
        run("pgqueue_messages", *args)
    assert M.objects.get(pk=message.pk).status == Status.WAITING


# --- the admin ---------------------------------------------------------------------------


QUEUES_PAGE = "/admin/django_pgqueue/queuestate/"


@pytest.fixture
def staff():
    """A client logged in as the staff user "ops" with exactly the given
    permissions (codenames); called again, the same user with others."""
    from django.contrib.auth.models import Permission, User
    from django.test import Client

    def make(*codenames):
        user, _ = User.objects.get_or_create(username="ops", defaults={"is_staff": True})
        user.user_permissions.set(
            Permission.objects.filter(
                content_type__app_label="django_pgqueue", codename__in=codenames
            )
        )
        client = Client()
        client.force_login(user)
        return client

    return make


def logged(name_or_pk, model):
    from django.contrib.admin.models import LogEntry
    from django.contrib.contenttypes.models import ContentType

    return list(
        LogEntry.objects.filter(
            content_type=ContentType.objects.get_for_model(model), object_id=str(name_or_pk)
        ).values_list("change_message", flat=True)
    )


@override_settings(PGQUEUE={"QUEUES": {"default": {}, "pay": {"concurrency": 3}}})
def test_the_queues_page_shows_depth_state_and_limits(staff, make_message):
    make_message(queue="pay")
    make_message(queue="pay", status=Status.PROCESSING)
    make_message(queue="elsewhere", run_at=NOW + datetime.timedelta(hours=1))
    pause_queue("pay", by="ops")
    page = staff("view_queuestate").get(QUEUES_PAGE)
    assert page.status_code == 200
    rows = {row.name: row for row, _age in page.context["rows"]}
    assert list(rows) == ["default", "pay", "elsewhere"]
    pay = rows["pay"]
    assert (pay.ready, pay.processing, pay.paused, str(pay.limits)) == (1, 1, True, "concurrency 3")
    assert rows["elsewhere"].delayed == 1
    html = page.content.decode()
    assert "paused</span> by ops" in html
    assert "/pause/" not in html and "/resume/" not in html, "buttons need their permission"


def test_pause_and_resume_need_their_own_permission_and_are_logged(staff):
    client = staff("view_queuestate")
    assert client.post(f"{QUEUES_PAGE}emails/pause/").status_code == 403
    assert paused_queues() == []
    client = staff("view_queuestate", "pause_queuestate")
    assert client.get(f"{QUEUES_PAGE}emails/pause/").status_code == 405, "POST only"
    response = client.post(f"{QUEUES_PAGE}emails/pause/", follow=True)
    assert [str(m) for m in response.context["messages"]] == ["Queue emails paused."]
    assert paused_queues() == ["emails"]
    assert 'action="/admin/django_pgqueue/queuestate/emails/resume/"' in response.content.decode()
    client.post(f"{QUEUES_PAGE}emails/resume/")
    assert paused_queues() == []
    assert logged("emails", QueueState) == ["Resumed (admin)", "Paused (admin)"]


def test_the_limits_form_sets_and_clears_run_time_limits(staff):
    client = staff("view_queuestate")
    assert client.get(f"{QUEUES_PAGE}pay/limits/").status_code == 403
    client = staff("view_queuestate", "change_queuestate")
    form = client.get(f"{QUEUES_PAGE}pay/limits/")
    assert form.status_code == 200 and form.context["form"]["source"].value() == "settings"
    bad = client.post(f"{QUEUES_PAGE}pay/limits/", {"source": "set", "rate": "lots"})
    assert "The rate must be a rate like" in bad.content.decode()
    assert not QueueState.objects.exists()
    client.post(f"{QUEUES_PAGE}pay/limits/", {"source": "set", "concurrency": "2", "rate": "9/m"})
    assert controls_module.current().limits == {"pay": Limits(2, Rate(9, 60))}
    client.post(f"{QUEUES_PAGE}pay/limits/", {"source": "settings"})
    assert controls_module.current().limits == {}
    assert len(logged("pay", QueueState)) == 2


def test_the_cancel_action_asks_first_needs_its_permission_and_is_logged(staff, make_message):
    from django.contrib.admin import helpers

    waiting = make_message()
    running = make_message(status=Status.PROCESSING)
    url = "/admin/django_pgqueue/message/"
    post = {"action": "cancel", "index": 0, helpers.ACTION_CHECKBOX_NAME: [waiting.pk, running.pk]}
    client = staff("view_message", "change_message")
    page = client.get(url)
    assert "cancel" not in dict(page.context["action_form"].fields["action"].choices)
    client.post(url, post)
    assert M.objects.get(pk=waiting.pk).status == Status.WAITING, "no permission, no cancel"

    client = staff("view_message", "change_message", "cancel_message")
    confirm = client.post(url, post)
    assert confirm.status_code == 200 and "1 being processed are asked to stop" in (
        confirm.content.decode()
    )
    assert M.objects.get(pk=waiting.pk).status == Status.WAITING, "the page asks first"
    done = client.post(url, {**post, "apply": "yes"}, follow=True)
    assert [str(m) for m in done.context["messages"]] == [
        "Cancelled 1, asked 1 running to stop, 0 already cancelled, 0 finished or unknown."
    ]
    assert M.objects.get(pk=waiting.pk).status == Status.CANCELLED
    assert M.objects.get(pk=running.pk).cancel_requested_at is not None
    assert logged(waiting.pk, M) == logged(running.pk, M) == ["Cancelled (admin action)"]
