"""Periodic schedules as people and machines see them: the admin (the list,
the change page, pause/resume/reset/run-now with their own permissions),
``manage.py pgqueue_schedules``, ``pgqueue_status`` and the worker's
metrics, and the --no-schedules option of pgqueue_worker."""

import datetime
import io
import json

import pytest
from django.contrib.admin import helpers
from django.contrib.admin.models import CHANGE, LogEntry
from django.contrib.auth.models import Permission, User
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import override_settings
from django.urls import reverse
from prometheus_client import generate_latest

from django_pgqueue.models import Message, Schedule, ScheduleTick
from django_pgqueue.observability.metrics import WorkerMetrics
from django_pgqueue.schedules import configured, runs, state
from django_pgqueue.worker.scheduler import Scheduler

pytestmark = pytest.mark.django_db

SCHEDULES = {
    "nightly-report": {
        "cron": "0 3 * * *",
        "topic": "test.reports.nightly",
        "payload": {"kind": "daily"},
        "timezone": "Europe/Berlin",
    },
    "ping": {"every": 10, "topic": "test.ping", "queue": "monitor"},
    "disabled": {"every": 60, "topic": "test.disabled", "enabled": False},
}
LIST = reverse("admin:django_pgqueue_schedule_changelist")


@pytest.fixture(autouse=True)
def schedules():
    with override_settings(PGQUEUE={"SCHEDULES": SCHEDULES}):
        yield


def run(*args):
    out = io.StringIO()
    call_command("pgqueue_schedules", *args, stdout=out)
    return out.getvalue()


# --- the command ----------------------------------------------------------------------


def test_list_shows_each_schedule_in_words_with_its_next_tick():
    runs.run_round(configured.configured())
    out = run("list").splitlines()
    assert out[0].split()[:3] == ["NAME", "SCHEDULE", "TIME"]
    nightly = next(line for line in out if line.startswith("nightly-report"))
    assert "At 03:00 every day" in nightly and "Europe/Berlin" in nightly and "active" in nightly
    ping = next(line for line in out if line.startswith("ping"))
    assert "Every 10 seconds" in ping and "waiting" in ping  # its last tick's message
    disabled = next(line for line in out if line.startswith("disabled"))
    assert "paused" in disabled  # enabled: False in the settings
    data = {row["name"]: row for row in json.loads(run("list", "--json"))}
    assert data["nightly-report"]["next_tick"].endswith(("T03:00:00+01:00", "T03:00:00+02:00"))
    assert (
        data["ping"]["last_message_state"] == "waiting"
        and data["ping"]["target"] == "topic test.ping"
    )


def test_pause_resume_reset_persist_and_win_over_the_setting():
    assert run("pause", "ping", "nightly-report") == "pause: ping, nightly-report\n"
    row = Schedule.objects.get(name="ping")
    assert row.enabled is False and "pgqueue_schedules" in row.changed_by
    assert {r["name"]: r["paused"] for r in json.loads(run("list", "--json"))}["ping"] is True
    run("resume", "disabled")  # disabled in the settings: the override wins
    assert Schedule.objects.get(name="disabled").enabled is True
    run("reset", "ping")
    assert Schedule.objects.get(name="ping").enabled is None


def test_run_enqueues_one_message_now():
    out = run("run", "nightly-report")
    message = Message.objects.get(topic="test.reports.nightly")
    assert out == f"run: schedule 'nightly-report' enqueued message {message.pk}\n"
    assert message.payload == {"kind": "daily"} and message.headers[runs.RUN_NOW_HEADER] is True
    assert not ScheduleTick.objects.exists()


def test_an_unknown_schedule_is_a_command_error_naming_the_known_ones():
    with pytest.raises(CommandError, match=r"no schedule 'nope' \(configured: disabled, nightly"):
        run("pause", "nope")
    with pytest.raises(CommandError):
        run("run", "a", "b")


# --- pgqueue_status and the metrics ---------------------------------------------------------


def test_status_shows_the_schedules():
    runs.run_round(configured.configured())
    out = io.StringIO()
    call_command("pgqueue_status", stdout=out)
    lines = out.getvalue().splitlines()
    section = lines[lines.index("Schedules") :]
    assert section[1].split()[:2] == ["NAME", "SCHEDULE"]
    assert any(line.startswith("ping") and "Every 10 seconds" in line for line in section)
    out = io.StringIO()
    call_command("pgqueue_status", "--json", stdout=out)
    names = [row["name"] for row in json.loads(out.getvalue())["schedules"]]
    assert names == ["disabled", "nightly-report", "ping"]


def test_the_worker_counts_ticks_enqueued_and_skipped_per_schedule():
    metrics = WorkerMetrics()
    specs = [configured.get("ping")]
    state.ensure(["ping"])
    state.record_ticks("ping", [datetime.datetime(2020, 1, 1, tzinfo=datetime.UTC)])
    Scheduler("w", specs, metrics, exit=None).run_once()  # type: ignore[arg-type]
    text = generate_latest(metrics.registry).decode()
    enqueued = 'pgqueue_worker_schedule_ticks_total{outcome="enqueued",schedule="ping"}'
    skipped = [line for line in text.splitlines() if 'outcome="skipped",schedule="ping"' in line]
    assert f"{enqueued} 3.0" in text or f"{enqueued} 4.0" in text  # 30 s on time, every 10 s
    assert float(skipped[0].split()[-1]) > 190_000  # six years of ticks every 10 s


@pytest.mark.django_db(transaction=True)
def test_pgqueue_worker_no_schedules_runs_no_scheduler(caplog):
    with caplog.at_level("INFO", logger="django_pgqueue"):
        call_command("pgqueue_worker", "--burst", "--no-schedules", "--queues", "monitor")
    assert not ScheduleTick.objects.exists() and not Message.objects.exists()
    call_command("pgqueue_worker", "--burst", "--queues", "nothing-here")
    assert set(ScheduleTick.objects.values_list("schedule", flat=True)) == {"ping"}


# --- the admin --------------------------------------------------------------------------


@pytest.fixture
def staff(client):
    """Log in a staff user with the given permissions (codenames)."""

    def login(*codenames):
        user = User.objects.create_user(f"op{User.objects.count()}", password="x", is_staff=True)
        user.user_permissions.set(
            Permission.objects.filter(
                content_type__app_label="django_pgqueue", codename__in=codenames
            )
        )
        client.force_login(user)
        return client

    return login


def actions(response):
    form = response.context["action_form"]
    return set() if form is None else {name for name, _ in form.fields["action"].choices if name}


def act(client, name, *names):
    data = {"action": name, "index": 0, helpers.ACTION_CHECKBOX_NAME: list(names)}
    return client.post(LIST, data, follow=True)


def test_the_list_shows_every_configured_schedule_even_before_a_worker_ran(staff):
    client = staff("view_schedule")
    response = client.get(LIST)
    assert response.status_code == 200
    html = response.content.decode()
    for text in ("At 03:00 every day", "Every 10 seconds", "Europe/Berlin", "topic test.ping"):
        assert text in html
    assert actions(response) == set()  # no action permission: no action shown
    assert set(Schedule.objects.values_list("name", flat=True)) == set(SCHEDULES)


def test_each_action_needs_its_own_permission(staff):
    assert actions(staff("view_schedule", "pause_schedule").get(LIST)) == {"pause"}
    assert actions(staff("view_schedule", "resume_schedule").get(LIST)) == {"resume"}
    assert actions(staff("view_schedule", "run_schedule").get(LIST)) == {"run_now"}
    both = staff("view_schedule", "pause_schedule", "resume_schedule")
    assert actions(both.get(LIST)) == {"pause", "resume", "reset"}


def test_pause_resume_reset_and_run_now_from_the_admin(staff):
    client = staff("view_schedule", "pause_schedule", "resume_schedule", "run_schedule")
    client.get(LIST)  # the rows exist
    response = act(client, "pause", "ping")
    assert "Paused: 1 schedule(s)." in [str(m) for m in response.context["messages"]]
    row = Schedule.objects.get(name="ping")
    assert row.enabled is False and row.changed_by.startswith("op")
    entries = LogEntry.objects.filter(object_id="ping", action_flag=CHANGE)
    assert [e.change_message for e in entries] == ["Paused (admin action)"]
    act(client, "resume", "ping")
    assert Schedule.objects.get(name="ping").enabled is True
    act(client, "reset", "ping")
    assert Schedule.objects.get(name="ping").enabled is None
    response = act(client, "run_now", "nightly-report")
    message = Message.objects.get(topic="test.reports.nightly")
    assert f"Enqueued: nightly-report (message {message.pk})." in [
        str(m) for m in response.context["messages"]
    ]


def test_the_change_page_shows_the_recent_ticks_and_nothing_can_be_edited(staff):
    client = staff("view_schedule")
    runs.run_round(configured.configured())
    response = client.get(reverse("admin:django_pgqueue_schedule_change", args=["ping"]))
    html = response.content.decode()
    assert response.status_code == 200
    tick = ScheduleTick.objects.filter(schedule="ping").latest("tick")
    assert f"#{tick.message_id}" in html and "waiting" in html and "recent ticks" in html.lower()
    assert 'name="_save"' not in html


def test_only_the_row_of_a_schedule_no_longer_configured_can_be_deleted(admin_client):
    state.ensure(["gone", "ping"])
    url = reverse("admin:django_pgqueue_schedule_delete", args=["ping"])
    assert admin_client.get(url).status_code == 403
    url = reverse("admin:django_pgqueue_schedule_delete", args=["gone"])
    assert admin_client.post(url, {"post": "yes"}).status_code == 302
    assert not Schedule.objects.filter(name="gone").exists()
