"""manage.py pgqueue_demo, the quick start's command: run for real against the
test database, with its in-process worker, and judged by the database."""

import io
from collections import Counter

import pytest
from demo.models import Handled
from django.core.management import CommandError, call_command
from django.test import override_settings

from django_pgqueue.models import DeadLetter, Message, Workflow, WorkflowStep

MIX_TOPICS = ["demo.welcome_email", "demo.charge_card", "demo.import_row", "demo.reserve_stock"]
WORKFLOW_TOPICS = ["demo.import_fetch", "demo.import_part", "demo.import_report"]


# The worker's handler threads use connections of their own: they must see
# committed rows, hence transaction=True. A lower DEPENDENCY_BACKOFF_FACTOR
# makes charge_card's retries come sooner (the outcome is the same).
@pytest.mark.django_db(transaction=True)
@override_settings(PGQUEUE={"DEPENDENCY_BACKOFF_FACTOR": 1.0})
def test_demo_works_off_its_messages():
    out = io.StringIO()
    call_command("pgqueue_demo", "--count", "2", stdout=out)

    # The mix, apart from the workflow's steps and the schedule's ticks.
    mix = Handled.objects.filter(topic__in=MIX_TOPICS)
    handled = Counter(mix.values_list("topic", flat=True))
    assert handled == {
        "demo.welcome_email": 16,
        "demo.charge_card": 6,
        "demo.import_row": 6,
        "demo.reserve_stock": 6,
    }
    # Each message was handled once; charge_card's only after failed attempts.
    assert mix.count() == 34
    assert mix.values("message_id").distinct().count() == 34
    retried = Handled.objects.filter(attempt__gt=1)
    assert set(retried.values_list("topic", flat=True)) == {"demo.charge_card"}
    assert retried.count() == 6

    dead = Counter(DeadLetter.objects.values_list("topic", "category"))
    assert dead == {
        ("demo.import_row", "permanent"): 2,
        ("demo.reserve_stock", "business"): 2,
        ("demo.charge_card", "dependency"): 2,
    }
    assert set(
        DeadLetter.objects.filter(category="dependency").values_list("attempts", flat=True)
    ) == {3}
    assert not Message.objects.exists()  # nothing waiting, nothing processing

    report = out.getvalue()
    assert "Enqueued 40 demo messages" in report
    assert "Handled:       34 (6 of them after retries)" in report
    assert "Dead letters:  6 (business: 2, dependency: 2, permanent: 2)" in report
    assert "Still queued:  0" in report
    assert "http://127.0.0.1:8000/admin/" in report

    # The workflow: fetch, 3 parts after it, a report after them, each once,
    # in that order; the report added up the parts' results.
    workflow = Workflow.objects.get(name="demo.import")
    assert (workflow.status, workflow.steps_total, workflow.steps_done) == ("done", 5, 5)
    steps = list(
        Handled.objects.filter(topic__in=WORKFLOW_TOPICS)
        .order_by("pk")
        .values_list("topic", flat=True)
    )
    assert steps == ["demo.import_fetch"] + ["demo.import_part"] * 3 + ["demo.import_report"]
    assert "fetch: done, part-1: done, part-2: done, part-3: done, report: done" in report
    report_step = WorkflowStep.objects.get(workflow=workflow, name="report")
    assert report_step.result == {"parts": 3, "rows": 30}
    assert f"status: done; the report's result: {report_step.result}" in report

    # The periodic schedule: for 3.5 s, every second, one message per tick, handled once.
    ticks = Handled.objects.filter(topic="demo.clock")
    assert 3 <= ticks.count() <= 6
    assert ticks.values("message_id").distinct().count() == ticks.count()
    assert f"{ticks.count()} ticks, one message each, {ticks.count()} handled" in report
    assert "PGQUEUE['SCHEDULES'] = {'demo.clock': {'every': 1" in report


@pytest.mark.parametrize("value", ["0", "-3", "many", "1.5", "1001"])
def test_bad_count_is_a_command_error(value):
    with pytest.raises(CommandError, match="--count"):
        call_command("pgqueue_demo", "--count", value)


@pytest.mark.parametrize("value", [0, "x", None])
def test_bad_count_given_as_keyword_is_a_command_error(value):
    # call_command(count=...) bypasses argparse; the command checks it again.
    with pytest.raises(CommandError, match="--count"):
        call_command("pgqueue_demo", count=value)
