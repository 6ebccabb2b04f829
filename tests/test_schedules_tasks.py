"""A schedule whose ticks enqueue a Django Task (Django 6.x): through
PgQueueBackend, so that each run has a result; and the system check of a
task that cannot be a schedule's."""

import datetime

import django
import pytest

if django.VERSION < (6, 0):
    pytest.skip(
        f"django.tasks exists from Django 6.0 on (installed: {django.get_version()})",
        allow_module_level=True,
    )

from django.tasks import TaskResultStatus, default_task_backend, task
from django.test import override_settings

from django_pgqueue.checks import check_schedules
from django_pgqueue.models import Message, ScheduleTick, TaskRecord
from django_pgqueue.schedules import runs
from django_pgqueue.schedules.spec import parse
from django_pgqueue.tasks import TASK_TOPIC
from django_pgqueue.worker import Worker

UTC = datetime.UTC


@task(backend="immediate")
def elsewhere(a, b):
    """A task of Django's ImmediateBackend: no result would be kept here."""
    return a + b


not_a_task = len


@pytest.mark.django_db(transaction=True)
def test_a_tasks_tick_is_enqueued_through_the_backend_and_has_a_result():
    s = parse(
        "adder",
        {
            "every": 60,
            "task": "demo.tasks.add",
            "kwargs": {"a": 2, "b": 3},
            "queue": "tasks",
            "priority": 7,
            "timezone": "Europe/Berlin",
        },
    )
    # A new schedule takes its latest tick only while it is on time (30 s):
    # the round runs 5 s after this minute's tick, whenever the test runs.
    tick = datetime.datetime.now(UTC).replace(second=0, microsecond=0)
    now = tick + datetime.timedelta(seconds=5)
    result = runs.run_round([s], now=now)
    assert result.enqueued == {"adder": 1}
    (ledger,) = ScheduleTick.objects.filter(schedule="adder")
    message = Message.objects.get(pk=ledger.message_id)
    assert (message.topic, message.queue, message.priority) == (TASK_TOPIC, "tasks", 7)
    assert message.run_at == ledger.tick == tick
    assert message.headers == {
        "pgqueue-schedule": "adder",
        "pgqueue-scheduled-at": tick.astimezone(s.zone).isoformat(),
        "task": "demo.tasks.add",
    }
    record = TaskRecord.objects.get(message_id=message.pk)
    assert (record.kwargs, record.run_after) == ({"a": 2, "b": 3}, tick)
    Worker(queues=["tasks"], burst=True, schedules=False).run()
    task_result = default_task_backend.get_result(str(record.pk))
    assert task_result.status == TaskResultStatus.SUCCESSFUL
    assert task_result.return_value == 5


@pytest.mark.django_db
def test_run_now_of_a_task_schedule_has_a_result_too():
    s = parse("adder", {"cron": "@daily", "task": "demo.tasks.add", "args": [1, 1]})
    message = runs.run_now(s)
    record = TaskRecord.objects.get(message_id=message.pk)
    assert record.args == [1, 1] and record.run_after is None
    assert (
        message.headers[runs.RUN_NOW_HEADER] is True and message.headers["task"] == "demo.tasks.add"
    )


@pytest.mark.parametrize(
    "path, words",
    [
        ("demo.tasks.no_such_task", "cannot be imported"),
        ("no_such_module.task", "cannot be imported"),
        ("tests.test_schedules_tasks.not_a_task", "not a Task (decorate it with @task)"),
        ("tests.test_schedules_tasks.elsewhere", "not PgQueueBackend"),
    ],
)
def test_a_task_that_cannot_be_a_schedules_is_a_check_error(path, words):
    with override_settings(PGQUEUE={"SCHEDULES": {"job": {"every": 60, "task": path}}}):
        (error,) = check_schedules()
    assert error.id == "pgqueue.E111"
    assert error.msg.startswith(f"PGQUEUE['SCHEDULES']['job']['task']: {path!r}")
    assert words in error.msg and error.hint


def test_a_good_task_schedule_passes_the_checks():
    with override_settings(
        PGQUEUE={"SCHEDULES": {"job": {"every": 60, "task": "demo.tasks.add", "args": [1, 2]}}}
    ):
        assert check_schedules() == []
