"""Retention: the maintenance prune deletes, in batches of at most the batch
size per statement, the history past KEEP_FINISHED, the overview's counts
past two days, resolved and revived dead letters past
KEEP_RESOLVED_DEAD_LETTERS, finished Tasks results past KEEP_TASK_RESULTS
and dead workers' rows; pgqueue_prune runs it on demand, and status and
the metrics report the history. Time is fabricated (``now``)."""

import datetime
import io
import json
import re
import uuid

import pytest
from django.core.management import call_command
from django.db import connection
from django.test import override_settings
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from django_pgqueue import maintenance, retention
from django_pgqueue.models import (
    DeadLetterState,
    FinishedMessage,
    OutcomeCount,
    TaskRecord,
    TaskStatus,
    WorkerHeartbeat,
)
from django_pgqueue.observability import metrics, status

pytestmark = pytest.mark.django_db(transaction=True)

NOW = datetime.datetime(2026, 3, 1, 12, 0, tzinfo=datetime.UTC)
DAY = datetime.timedelta(days=1)


def history(n, finished_at, **fields):
    FinishedMessage.objects.bulk_create(
        FinishedMessage(
            message_id=i + 1,
            queue="default",
            topic="test.record",
            payload={"n": i},
            outcome="done",
            attempts=1,
            enqueued_at=finished_at,
            started_at=finished_at,
            finished_at=finished_at,
            worker="w",
            **fields,
        )
        for i in range(n)
    )


def task(status, finished_at):
    return TaskRecord.objects.create(
        id=uuid.uuid4(),
        task_path="demo.tasks.x",
        backend="default",
        queue_name="default",
        status=status,
        finished_at=finished_at,
    )


def deletes(queries, table):
    return [q["sql"] for q in queries if q["sql"].startswith(f'DELETE FROM "{table}"')]


def test_history_older_than_keep_finished_goes_in_batches():
    history(7, NOW - DAY - datetime.timedelta(seconds=1))  # past the default: one day
    history(2, NOW - DAY + datetime.timedelta(minutes=1))  # within it
    with CaptureQueriesContext(connection) as queries:
        result = maintenance.prune(now=NOW, batch_size=3)
    assert result.counts["history"] == 7 and result.complete
    assert FinishedMessage.objects.count() == 2
    statements = deletes(queries, "django_pgqueue_finishedmessage")
    assert len(statements) == 3, statements  # 3 + 3 + 1: the last batch was not full
    assert all("LIMIT 3" in s for s in statements)


@override_settings(PGQUEUE={"KEEP_FINISHED": 3600})
def test_keep_finished_decides_what_is_old():
    history(1, NOW - datetime.timedelta(minutes=61))
    history(1, NOW - datetime.timedelta(minutes=59))
    assert maintenance.prune(now=NOW).counts["history"] == 1
    assert FinishedMessage.objects.count() == 1


def test_resolved_and_revived_dead_letters_go_new_ones_stay(make_dead_letter):
    old = NOW - datetime.timedelta(days=31)
    recent = NOW - datetime.timedelta(days=29)
    gone = [
        make_dead_letter(state=DeadLetterState.RESOLVED, resolved_at=old),
        make_dead_letter(state=DeadLetterState.REVIVED, revived_at=old),
    ]
    kept = [
        make_dead_letter(state=DeadLetterState.NEW, dead_lettered_at=old - 10 * DAY),
        make_dead_letter(state=DeadLetterState.RESOLVED, resolved_at=recent),
        make_dead_letter(state=DeadLetterState.REVIVED, revived_at=recent),
    ]
    result = maintenance.prune(now=NOW, batch_size=1)
    assert result.counts["dead_letters"] == 2
    remaining = set(type(kept[0]).objects.values_list("pk", flat=True))
    assert remaining == {d.pk for d in kept} and not remaining & {d.pk for d in gone}


@override_settings(PGQUEUE={"KEEP_RESOLVED_DEAD_LETTERS": None, "KEEP_TASK_RESULTS": None})
def test_none_keeps_dead_letters_and_task_results(make_dead_letter):
    make_dead_letter(state=DeadLetterState.RESOLVED, resolved_at=NOW - 400 * DAY)
    task(TaskStatus.SUCCESSFUL, NOW - 400 * DAY)
    result = maintenance.prune(now=NOW)
    assert (result.counts["dead_letters"], result.counts["task_results"]) == (0, 0)


def test_finished_task_results_go_running_ones_stay():
    old = NOW - datetime.timedelta(days=15)
    for status_ in (TaskStatus.SUCCESSFUL, TaskStatus.FAILED, TaskStatus.SUCCESSFUL):
        task(status_, old)
    running = task(TaskStatus.RUNNING, None)
    recent = task(TaskStatus.SUCCESSFUL, NOW - datetime.timedelta(days=13))
    with CaptureQueriesContext(connection) as queries:
        result = maintenance.prune(now=NOW, batch_size=2)
    assert result.counts["task_results"] == 3
    assert set(TaskRecord.objects.values_list("pk", flat=True)) == {running.pk, recent.pk}
    assert len(deletes(queries, "django_pgqueue_taskrecord")) == 2


def test_counts_older_than_two_days_and_dead_workers_go():
    for minute in (NOW - 3 * DAY, NOW - DAY):
        OutcomeCount.objects.create(minute=minute, queue="default", outcome="done", count=5)
    WorkerHeartbeat.objects.create(
        worker_id="dead", hostname="h", pid=1, queues=["default"], concurrency=1,
        expires_at=NOW - 2 * DAY,
    )  # fmt: skip
    result = maintenance.prune(now=NOW)
    assert (result.counts["counts"], result.counts["workers"]) == (1, 1)
    assert list(OutcomeCount.objects.values_list("minute", flat=True)) == [NOW - DAY]


def test_a_dry_run_counts_and_deletes_nothing(make_dead_letter):
    history(4, NOW - 2 * DAY)
    make_dead_letter(state=DeadLetterState.RESOLVED, resolved_at=NOW - 40 * DAY)
    with CaptureQueriesContext(connection) as queries:
        result = maintenance.prune(now=NOW, dry_run=True)
    assert result.counts["history"] == 4 and result.counts["dead_letters"] == 1
    assert not [q for q in queries if q["sql"].startswith("DELETE")]
    assert FinishedMessage.objects.count() == 4


def test_the_time_budget_stops_a_prune_and_says_so():
    history(5, NOW - 2 * DAY)
    result = maintenance.prune(now=NOW, budget=0)
    assert not result.complete and FinishedMessage.objects.count() == 5


def test_a_prune_stops_when_another_process_holds_the_maintenance_lock(other_connection):
    history(5, NOW - 2 * DAY)
    with other_connection.transaction():
        other_connection.execute(
            "SELECT pg_advisory_xact_lock(%s)", [maintenance.MAINTENANCE_LOCK_KEY]
        )
        result = maintenance.prune(now=NOW)
    assert not result.complete and FinishedMessage.objects.count() == 5


def test_pgqueue_prune_prints_what_it_removed():
    history(3, timezone.now() - 2 * DAY)
    out = io.StringIO()
    call_command("pgqueue_prune", "--dry-run", stdout=out)
    assert "finished messages (history): 3 due (dry run, nothing deleted)" in out.getvalue()
    assert FinishedMessage.objects.count() == 3
    out = io.StringIO()
    call_command("pgqueue_prune", stdout=out)
    assert "finished messages (history): 3 deleted" in out.getvalue()
    assert "resolved or revived dead letters: 0 deleted" in out.getvalue()
    assert not FinishedMessage.objects.exists()


def test_the_worker_metrics_count_the_rows_pruned():
    reporter = metrics.WorkerMetrics()
    reporter.pruned({"history": 7, "dead_letters": 2})
    reporter.pruned({"history": 3})
    value = reporter.registry.get_sample_value
    assert value("pgqueue_worker_pruned_rows_total", {"kind": "history"}) == 10
    assert value("pgqueue_worker_pruned_rows_total", {"kind": "dead_letters"}) == 2


def test_a_maintenance_round_prunes_at_most_every_interval(monkeypatch):
    history(2, timezone.now() - 2 * DAY)
    monkeypatch.setattr(maintenance, "_next_prune", 0.0)
    first = maintenance.run_once()
    assert first.pruned is not None and first.pruned.counts["history"] == 2
    history(2, timezone.now() - 2 * DAY)
    assert maintenance.run_once().pruned is None  # not due again for PRUNE_INTERVAL
    assert FinishedMessage.objects.count() == 2


def test_status_reports_the_history_size_and_age():
    history(3, timezone.now() - datetime.timedelta(hours=2))
    report = status.report(None)["history"]
    assert report["rows"] == 3 and not report["rows_estimated"]
    assert report["oldest_age_seconds"] == pytest.approx(7200, abs=60)
    assert report["keep_finished_seconds"] == 86400
    out = io.StringIO()
    call_command("pgqueue_status", "--json", stdout=out)
    assert json.loads(out.getvalue())["history"]["rows"] == 3
    out = io.StringIO()
    call_command("pgqueue_status", stdout=out)
    assert re.search(r"History\n3 messages finished, \d+ kB, oldest 2h 0\dm ago", out.getvalue())


def test_the_scrape_reports_the_history():
    from django_pgqueue.observability.scrape import render_database_metrics

    history(2, timezone.now() - datetime.timedelta(minutes=10))
    body, _ = render_database_metrics()
    text = body.decode()
    assert 'pgqueue_history_rows{database="default"} 2.0' in text
    pattern = r'^pgqueue_history_oldest_age_seconds\{database="default"\} (\S+)$'
    age = float(re.search(pattern, text, re.M).group(1))
    assert 590 < age < 700


def test_every_kind_has_a_label_in_the_command():
    from django_pgqueue.management.commands.pgqueue_prune import LABELS

    assert set(LABELS) == set(retention.KINDS)


def test_the_round_folds_the_connections_counts_of_past_minutes():
    from django_pgqueue.sql import history as history_sql

    past = NOW.replace(second=0) - datetime.timedelta(minutes=3)
    current = NOW.replace(second=0)
    for shard, count in ((101, 2), (102, 3), (0, 1)):
        OutcomeCount.objects.create(
            minute=past, queue="default", outcome="done", shard=shard, count=count
        )
    OutcomeCount.objects.create(minute=current, queue="default", outcome="done", shard=103, count=1)
    maintenance.run_once(now=NOW)
    rows = sorted(OutcomeCount.objects.values_list("minute", "shard", "count"))
    assert rows == [(past, 0, 6), (current, 103, 1)]
    assert history_sql.fold_counts(NOW) == 0  # nothing left to fold
