"""Queues on several databases: a queue names its database in QUEUES, a
stream in STREAMS, and everything that writes a message, a workflow, a
task, an event or a queue's controls writes to that database, in the
caller's transaction when it is on that alias, else at its commit. The
router migrates the app's tables on those databases, and a check finds one
that lacks them. (The worker serving several databases, and the admin and
commands showing them, are tested in their own files.)"""

import contextlib
import json
import os
import subprocess
import sys
import uuid

import django
import psycopg
import pytest
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.db import transaction
from django.test import override_settings

import django_pgqueue
from django_pgqueue import checks, conf, controls
from django_pgqueue.exceptions import QueueControlError, WorkflowError
from django_pgqueue.models import Message, QueueState, Status
from django_pgqueue.models.streams import StreamEvent
from django_pgqueue.routers import QueueRouter

from .conftest import MANAGE, database_url, raw_connection

pytestmark = pytest.mark.django_db(databases=["default", "other"], transaction=True)

TWO_DATABASES = {
    "DATABASE": "default",
    "QUEUES": {"default": {}, "bulk": {"database": "other"}},
    "STREAMS": {"audit": {"database": "other"}},
}


@pytest.fixture(autouse=True)
def two_databases():
    with override_settings(PGQUEUE=TWO_DATABASES):
        yield


def committed(alias, queue=None):
    """The (queue, topic) of the messages committed on ``alias``, seen by
    another client, in id order."""
    with raw_connection(alias, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT queue, topic FROM django_pgqueue_message ORDER BY id"
        ).fetchall()
    return [tuple(row) for row in rows if queue is None or row[0] == queue]


# --- settings -----------------------------------------------------------------


def test_each_queue_and_stream_has_its_database():
    assert conf.queue_database("bulk") == "other"
    assert conf.queue_database("default") == "default"
    assert conf.queue_database("unnamed") == "default", "a queue QUEUES does not name"
    assert conf.queue_database() == "default", "the default queue"
    assert conf.stream_database("audit") == "other"
    assert conf.stream_database("orders") == "default"
    assert conf.databases() == ["default", "other"]
    assert conf.queues_by_database(["bulk", "default", "x"]) == {
        "default": ["default", "x"],
        "other": ["bulk"],
    }


def test_one_database_is_the_default():
    with override_settings(PGQUEUE={}):
        assert conf.databases() == ["default"]
        assert conf.queue_database("bulk") == "default"


@pytest.mark.parametrize(
    ("pgqueue", "problem"),
    [
        ({"QUEUES": {"bulk": {"database": "nowhere"}}}, "queue 'bulk': database names the alias"),
        ({"QUEUES": {"bulk": {"database": 3}}}, "queue 'bulk': database must be a database alias"),
        ({"STREAMS": {"audit": {"database": "nowhere"}}}, "stream 'audit': database names"),
        ({"STREAMS": {"audit": {"db": "other"}}}, 'whose one key is "database"'),
        ({"STREAMS": ["audit"]}, "must be a dict of stream names"),
    ],
)
def test_a_bad_database_setting_is_a_check_error(pgqueue, problem):
    with override_settings(PGQUEUE=pgqueue):
        errors = checks.check_settings()
    assert any(problem in error.msg for error in errors), [e.msg for e in errors]


def test_on_database_scopes_the_database_code_works_on():
    assert conf.database_alias() == "default"
    with conf.on_database("other"):
        assert conf.database_alias() == "other"
        assert conf.queue_database("default") == "default", "a queue's home is a setting"
    assert conf.database_alias() == "default"
    with pytest.raises(ImproperlyConfigured, match="'nowhere'"):
        with conf.on_database("nowhere"):
            pass


# --- enqueue --------------------------------------------------------------------


def test_enqueue_writes_to_the_queues_database():
    message = django_pgqueue.enqueue("t.bulk", {"n": 1}, queue="bulk")
    assert message.pk is not None and message._state.db == "other"
    django_pgqueue.enqueue("t.default", {"n": 2})
    assert committed("other") == [("bulk", "t.bulk")]
    assert committed("default") == [("default", "t.default")]


def test_enqueue_joins_the_callers_transaction_on_the_queues_alias():
    with transaction.atomic(using="other"):
        message = django_pgqueue.enqueue("t.in", queue="bulk", using="other")
        assert message.pk is not None, "inserted in the caller's transaction"
        assert committed("other") == [], "not visible before the commit"
    assert committed("other") == [("bulk", "t.in")]
    with contextlib.suppress(RuntimeError), transaction.atomic(using="other"):
        django_pgqueue.enqueue("t.rolled-back", queue="bulk", using="other")
        raise RuntimeError
    assert committed("other") == [("bulk", "t.in")]


def test_enqueue_from_another_alias_waits_for_the_callers_commit():
    with transaction.atomic():
        message = django_pgqueue.enqueue("t.after", queue="bulk")
        assert message.pk is None, "waits for the commit of the caller on default"
    assert message.pk is not None and committed("other") == [("bulk", "t.after")]
    with contextlib.suppress(RuntimeError), transaction.atomic():
        django_pgqueue.enqueue("t.dropped", queue="bulk")
        raise RuntimeError
    assert committed("other") == [("bulk", "t.after")], "a rollback drops it"


def test_enqueue_many_splits_the_messages_by_database_in_input_order():
    with transaction.atomic():
        messages = django_pgqueue.enqueue_many(
            [
                {"topic": "a", "queue": "bulk"},
                {"topic": "b"},
                {"topic": "c", "queue": "bulk"},
                {"topic": "d", "queue": "default"},
            ]
        )
        assert [m.topic for m in messages] == ["a", "b", "c", "d"]
        assert [m.pk is None for m in messages] == [True, False, True, False], (
            "default's rows join the caller's transaction, bulk's wait for its commit"
        )
    assert all(m.pk is not None and m.created for m in messages)
    assert [m._state.db for m in messages] == ["other", "default", "other", "default"]
    assert committed("other") == [("bulk", "a"), ("bulk", "c")]
    assert committed("default") == [("default", "b"), ("default", "d")]


def test_enqueue_many_keeps_dedup_per_database():
    first = django_pgqueue.enqueue_many([{"topic": "k", "queue": "bulk", "dedup_key": "x"}])
    again = django_pgqueue.enqueue_many(
        [{"topic": "k", "queue": "bulk", "dedup_key": "x"}, {"topic": "k", "dedup_key": "x"}]
    )
    assert again[0].pk == first[0].pk and again[0].created is False
    assert again[1].created is True, "another database, another key space"


# --- workflows, tasks, streams, controls ------------------------------------------


def test_a_workflow_is_written_to_its_queues_database():
    flow = django_pgqueue.Workflow("wf")
    first = flow.add("wf.a", queue="bulk")
    flow.add("wf.b", queue="bulk", after=[first])
    run = flow.enqueue(using="other")
    assert run.using == "other" and run.pk is not None
    assert committed("other") == [("bulk", "wf.a")], "the first step is released at once"
    assert committed("default") == []


def test_a_step_added_on_a_queue_of_another_database_is_refused():
    from django_pgqueue.models.workflows import WorkflowStep
    from django_pgqueue.workflows import WorkflowRun

    flow = django_pgqueue.Workflow("grows")
    flow.add("wf.a", queue="bulk")
    run = flow.enqueue(using="other")
    step = WorkflowStep.objects.using("other").get(workflow_id=run.pk)
    handle = WorkflowRun.of_step(step.pk, "other")  # as the step's handler finds it
    with pytest.raises(WorkflowError, match="queue 'default', whose database is 'default'"):
        handle.add("wf.b", queue="default")
    added = handle.add("wf.c", queue="bulk")  # its own database's queue
    assert [s.topic for s in handle.added] == ["wf.c"] and handle.added == [added]


def test_a_workflow_on_queues_of_two_databases_is_refused():
    flow = django_pgqueue.Workflow("split")
    flow.add("wf.a", queue="bulk")
    flow.add("wf.b", queue="default")
    with pytest.raises(
        WorkflowError, match="queue 'bulk' on 'other'.*queue 'default' on 'default'"
    ):
        flow.enqueue()
    assert committed("other") == [] and committed("default") == []


@pytest.mark.skipif(django.VERSION < (6, 0), reason="django.tasks exists from Django 6.0 on")
def test_a_task_goes_to_its_queues_database_and_its_result_is_found():
    from demo.tasks import add

    routed = {"BACKEND": "django_pgqueue.tasks.PgQueueBackend", "QUEUES": ["default", "bulk"]}
    with override_settings(TASKS={**settings.TASKS, "routed": routed}):
        bulk_task = add.using(queue_name="bulk", backend="routed")
        result = bulk_task.enqueue(3, 4)
        assert committed("other") == [("bulk", "pgqueue.task")]
        found = bulk_task.get_result(result.id)
        assert found.id == result.id and found.status == "READY"


def test_publish_writes_to_the_streams_database():
    with transaction.atomic(using="other"):
        event = django_pgqueue.publish("audit", {"n": 1}, using="other")
        assert event.position is not None
    django_pgqueue.publish("orders", {"n": 2})
    assert StreamEvent.objects.using("other").filter(stream="audit").count() == 1
    assert not StreamEvent.objects.using("default").filter(stream="audit").exists()
    assert StreamEvent.objects.using("default").filter(stream="orders").count() == 1


def test_pausing_a_queue_writes_its_database():
    django_pgqueue.pause_queue("bulk")
    assert QueueState.objects.using("other").get(name="bulk").paused
    assert not QueueState.objects.using("default").filter(name="bulk").exists()
    assert django_pgqueue.paused_queues() == ["bulk"]
    controls.set_limits("bulk", concurrency=3)
    assert QueueState.objects.using("other").get(name="bulk").concurrency == 3
    django_pgqueue.resume_queue("bulk")
    assert django_pgqueue.paused_queues() == []


def test_cancel_finds_the_messages_database():
    on_other = django_pgqueue.enqueue("c", queue="bulk")
    on_default = django_pgqueue.enqueue("c")
    assert django_pgqueue.cancel(Message.objects.using("other").filter(topic="c")).cancelled == 1
    assert Message.objects.using("other").get(pk=on_other.pk).status == Status.CANCELLED
    assert Message.objects.using("default").get(pk=on_default.pk).status == Status.WAITING
    again = django_pgqueue.enqueue("c2", queue="bulk")
    assert django_pgqueue.cancel([again.pk], database="other").cancelled == 1
    assert django_pgqueue.cancel(on_default).cancelled == 1, "a message knows its database"
    with pytest.raises(QueueControlError, match="several databases"):
        django_pgqueue.cancel([Message.objects.using("other").get(pk=again.pk), on_default])
    with pytest.raises(QueueControlError, match="'nowhere', which is not in DATABASES"):
        django_pgqueue.cancel([1], database="nowhere")


# --- migrate ---------------------------------------------------------------------


def test_the_router_migrates_the_app_on_queue_databases_only():
    router = QueueRouter()
    assert router.allow_migrate("default", "django_pgqueue") is True
    assert router.allow_migrate("other", "django_pgqueue", "message") is True
    assert router.allow_migrate("other", "auth") is None, "no opinion on other apps"
    with override_settings(PGQUEUE={}):
        assert router.allow_migrate("other", "django_pgqueue") is False


@contextlib.contextmanager
def fresh_database():
    """The URL of a new, empty database on the test server, dropped afterwards."""
    name = f"pgqueue_fresh_{os.getpid()}_{uuid.uuid4().hex[:6]}"
    with raw_connection("default", autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield database_url("default").rsplit("/", 1)[0] + "/" + name
    finally:
        with raw_connection("default", autocommit=True) as conn:
            conn.execute(f'DROP DATABASE "{name}" WITH (FORCE)')


def manage(*args, other_url, pgqueue, status=0):
    """``manage.py *args`` in a process of its own whose alias "other" is
    ``other_url``, with the router and ``pgqueue`` as PGQUEUE."""
    env = {
        **os.environ,
        "DATABASE_URL": database_url("default"),
        "OTHER_DATABASE_URL": other_url,
        "PGQUEUE_JSON": json.dumps(pgqueue),
        "DATABASE_ROUTERS": "django_pgqueue.routers.QueueRouter",
    }
    run = subprocess.run(
        [sys.executable, str(MANAGE), *args], env=env, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == status, run.stderr
    return run.stdout + run.stderr


def tables(url):
    with psycopg.connect(url, autocommit=True) as conn:
        return {row[0] for row in conn.execute("SELECT tablename FROM pg_tables")}


def test_a_queue_database_without_the_tables_is_found_and_migrate_makes_them():
    pgqueue = {"QUEUES": {"default": {}, "bulk": {"database": "other"}}}
    with fresh_database() as url:
        check = ("check", "--deploy", "--database", "other")
        found = manage(*check, other_url=url, pgqueue=pgqueue)
        assert "pgqueue.W108" in found
        assert "'other' has no django-pgqueue tables: its queues (bulk)" in found
        assert "manage.py migrate --database other" in found
        refused = manage(
            "pgqueue_worker", "--burst", "--queues", "default,bulk",
            other_url=url, pgqueue=pgqueue, status=1,
        )  # fmt: skip
        assert "The queue database 'other' has no django-pgqueue tables: run manage.py " in refused
        migrated = manage("migrate", "--database", "other", other_url=url, pgqueue=pgqueue)
        assert "W108" not in migrated, "migrate does not warn of the tables it makes"
        assert "django_pgqueue_message" in tables(url)
        assert "pgqueue.W108" not in manage(*check, other_url=url, pgqueue=pgqueue)


def test_the_router_keeps_the_tables_off_databases_without_queues():
    with fresh_database() as url:
        manage("migrate", "--database", "other", other_url=url, pgqueue={})
        made = tables(url)
    assert "django_migrations" in made, "migrate ran"
    assert not {t for t in made if t.startswith("django_pgqueue")}


# --- the test helpers ----------------------------------------------------------------


def test_the_test_helpers_see_and_drain_every_database():
    from django_pgqueue import testing

    django_pgqueue.enqueue("demo.welcome_email", {"to": "a"}, queue="bulk")
    django_pgqueue.enqueue("demo.welcome_email", {"to": "b"})
    assert [m.payload["to"] for m in testing.enqueued()] == ["b", "a"], "DATABASE first"
    testing.assert_enqueued("demo.welcome_email", {"to": "a"}, queue="bulk")
    drained = testing.drain()
    assert sorted(m.payload["to"] for m in drained.messages) == ["a", "b"]
    assert drained.done == 2 and testing.enqueued() == []


# --- dead letters ------------------------------------------------------------------


def dead_letter(alias, queue, topic="dl.topic"):
    from django_pgqueue.models import Category, DeadLetter

    return DeadLetter.objects.using(alias).create(
        message_id=1, queue=queue, topic=topic, payload={"n": 1},
        category=Category.TRANSIENT, reason="ConnectionError: down", attempts=5,
    )  # fmt: skip


def test_dead_letter_triage_works_on_the_dead_letters_database():
    from django_pgqueue.exceptions import DeadLetterError
    from django_pgqueue.models import DeadLetter, DeadLetterState

    there = dead_letter("other", "bulk")
    here = dead_letter("default", "default")
    result = django_pgqueue.revive(DeadLetter.objects.using("other").filter(pk=there.pk))
    assert result.done == 1
    there.refresh_from_db()
    assert there.state == DeadLetterState.REVIVED
    revived = Message.objects.using("other").get(pk=there.revived_message_id)
    assert (revived.queue, revived.topic) == ("bulk", "dl.topic"), "revived where it lives"
    assert django_pgqueue.resolve([here], note="handled by hand").done == 1, "its own database"
    assert DeadLetter.objects.using("default").get(pk=here.pk).state == DeadLetterState.RESOLVED
    other = dead_letter("other", "bulk", topic="dl.two")
    assert django_pgqueue.categorize([other], "permanent", by="ops").done == 1
    with pytest.raises(DeadLetterError, match="several databases"):
        django_pgqueue.resolve([other, here], note="x")
    with pytest.raises(DeadLetterError, match="queue 'default' is on the database 'default'"):
        django_pgqueue.revive([other], queue="default")
    assert DeadLetter.objects.using("other").get(pk=other.pk).state == DeadLetterState.NEW
