"""A message's ``partition_key`` (issue 38), stored and carried everywhere:
enqueue() and each of enqueue_many()'s INSERTs, workflow steps (released
with their key), the Tasks backend, the dead letters and their revival,
plain SQL, the admin, and migration 0019. Bad keys are refused before
anything is written. (How the claim uses the key is tested with the claim.)"""

import re

import django
import pytest
from django.db import IntegrityError, connection, transaction
from django.urls import reverse

from django_pgqueue import InvalidMessage, Workflow, enqueue, enqueue_many, enqueuing, revive
from django_pgqueue.models import DeadLetter, Message, Status, WorkflowStep

from .conftest import running_worker, wait_until

pytestmark = pytest.mark.django_db(transaction=True)

WORKER = {"concurrency": 2, "batch_size": 10, "poll_interval": 0.1}
KEY = "tenant:42"


def stored_keys(**filters):
    """{message id: partition_key} of the stored messages."""
    return dict(Message.objects.filter(**filters).values_list("pk", "partition_key"))


def nothing_written():
    return not Message.objects.exists() and not WorkflowStep.objects.exists()


# --- enqueue() and enqueue_many() -------------------------------------------------


@pytest.mark.parametrize(
    "options",
    [
        {},  # only the key: not the plain INSERT (that one leaves the column out)
        {"priority": 3, "headers": {"h": 1}},
        {"dedup_key": "d-1"},
        {"group_key": "g-1"},
    ],
    ids=["key only", "other options", "with a dedup_key", "with a group_key"],
)
def test_enqueue_stores_the_key_and_returns_it(options):
    message = enqueue("test.record", {"n": 1}, partition_key=KEY, **options)
    assert message.partition_key == KEY and message.created is True
    assert stored_keys() == {message.pk: KEY}


def test_a_message_without_a_key_is_in_the_default_partition_null():
    plain = enqueue("test.record", {"n": 1})
    optioned = enqueue("test.record", {"n": 2}, priority=5)
    assert plain.partition_key is None and optioned.partition_key is None
    assert stored_keys() == {plain.pk: None, optioned.pk: None}


def test_the_one_message_insert_keeps_the_key_once_prepared():
    """psycopg prepares the repeated one-message INSERT after a few runs: the
    key comes out of the prepared statement as from the first runs."""
    messages = [enqueue("test.record", {"n": n}, partition_key=f"t{n}") for n in range(8)]
    assert stored_keys() == {m.pk: f"t{n}" for n, m in enumerate(messages)}


def test_a_dedup_hit_returns_the_existing_message_with_its_key():
    first = enqueue("test.record", {"n": 1}, dedup_key="same", partition_key="a")
    again = enqueue("test.record", {"n": 2}, dedup_key="same", partition_key="b")
    assert (again.created, again.pk, again.partition_key) == (False, first.pk, "a")
    assert stored_keys() == {first.pk: "a"}


def test_enqueue_many_takes_the_key_per_message_and_as_a_default():
    # Each dict its own options: the INSERT of a JSON array of rows.
    each = enqueue_many(
        [
            {"topic": "test.record", "payload": 1, "partition_key": "a"},
            {"topic": "test.record", "payload": 2},
            {"topic": "test.record", "payload": 3, "partition_key": "c", "priority": 2},
        ]
    )
    # Payloads only, the key given once: the INSERT of shared options.
    shared = enqueue_many(
        [{"payload": n} for n in range(3)], topic="test.record", partition_key=KEY
    )
    # A default that one message overrides.
    mixed = enqueue_many(
        [{"payload": 1}, {"payload": 2, "partition_key": "own"}],
        topic="test.record",
        partition_key=KEY,
    )
    # One message: the one-message INSERT; with dedup keys: the ON CONFLICT forms.
    single = enqueue_many([{"topic": "test.record", "partition_key": "one"}])
    deduped = enqueue_many(
        [{"payload": n, "dedup_key": f"k{n}"} for n in range(2)],
        topic="test.record",
        partition_key="dedup",
    )
    expected = ["a", None, "c", KEY, KEY, KEY, KEY, "own", "one", "dedup", "dedup"]
    returned = each + shared + mixed + single + deduped
    assert [m.partition_key for m in returned] == expected
    assert [stored_keys()[m.pk] for m in returned] == expected


def test_a_large_enqueue_many_sent_in_chunks_keeps_each_key(monkeypatch):
    monkeypatch.setattr(enqueuing, "STREAM_CHUNK", 3)  # 7 rows: three pipelined INSERTs
    rows = [{"payload": n, "partition_key": f"t{n % 2}"} for n in range(7)]
    messages = enqueue_many(rows, topic="test.record")
    assert stored_keys() == {m.pk: f"t{n % 2}" for n, m in enumerate(messages)}


BAD_KEYS = [
    ("", "partition_key must be a non-empty string or None, not ''"),
    (42, "partition_key must be a non-empty string or None, not 42"),
    (["tenant"], "partition_key must be a non-empty string"),
    ("k" * 256, "partition_key is 256 characters long; the limit is 255"),
    ("a\x00b", "partition_key must not contain a NUL character"),
    ("a\ud800b", "partition_key must be valid Unicode text (it holds a lone surrogate)"),
]


@pytest.mark.parametrize(("key", "error"), BAD_KEYS, ids=[e for _, e in BAD_KEYS])
def test_a_bad_key_is_refused_before_anything_is_written(key, error):
    with pytest.raises(InvalidMessage, match=re.escape(error)):
        enqueue("test.record", {}, partition_key=key)
    with pytest.raises(InvalidMessage, match=re.escape(f"message 1: {error}")):
        enqueue_many([{"payload": 1}, {"payload": 2, "partition_key": key}], topic="test.record")
    with pytest.raises(InvalidMessage, match=re.escape(error)):
        enqueue_many([{"payload": 1}], topic="test.record", partition_key=key)
    with pytest.raises(InvalidMessage, match=re.escape(error)):
        Workflow().add("wf.value", {}, partition_key=key)
    assert nothing_written()


def test_the_longest_key_is_accepted():
    message = enqueue("test.record", {}, partition_key="k" * 255)
    assert stored_keys() == {message.pk: "k" * 255}


# --- plain SQL --------------------------------------------------------------------


def test_a_plain_sql_insert_may_leave_the_key_out_or_give_one_but_not_an_empty_one():
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO django_pgqueue_message (topic, payload) VALUES ('test.record', '{}'),"
            " ('test.record', '{}') RETURNING id"
        )
        without = [row[0] for row in cursor.fetchall()]
        cursor.execute(
            "INSERT INTO django_pgqueue_message (topic, payload, partition_key)"
            " VALUES ('test.record', '{}', %s) RETURNING id",
            [KEY],
        )
        (given,) = cursor.fetchone()
    assert stored_keys() == {without[0]: None, without[1]: None, given: KEY}
    with pytest.raises(IntegrityError, match="pgqueue_msg_partition_key_not_empty"):
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute(
                "INSERT INTO django_pgqueue_message (topic, payload, partition_key)"
                " VALUES ('test.record', '{}', '')"
            )


# --- workflows --------------------------------------------------------------------


def test_a_workflow_steps_messages_are_released_with_their_keys():
    wf = Workflow()
    first = wf.add("wf.value", {"value": 1}, name="first", partition_key=KEY)
    # Released by the first one's acknowledgement; delayed, so it stays to be read.
    wf.add("wf.value", {"value": 2}, name="later", after=first, partition_key="b", delay=3600)
    wf.add("wf.value", {"value": 3}, name="keyless", after=first, delay=3600)
    run = wf.enqueue()
    steps = dict(WorkflowStep.objects.values_list("name", "partition_key"))
    assert steps == {"first": KEY, "later": "b", "keyless": None}
    released = Message.objects.get()  # released at once: it follows no step
    assert (released.partition_key, released.workflow_step_id) == (
        KEY,
        WorkflowStep.objects.get(name="first").pk,
    )
    with running_worker(**WORKER):
        wait_until(lambda: run.steps()["later"] == "waiting", message="the later steps released")
    names = dict(WorkflowStep.objects.values_list("pk", "name"))
    assert {
        names[step]: key
        for step, key in Message.objects.values_list("workflow_step_id", "partition_key")
    } == {"later": "b", "keyless": None}


def test_a_dead_lettered_step_keeps_its_key_and_its_revival_runs_in_it():
    wf = Workflow()
    wf.add("wf.value", {"value": 1, "fail_times": -1}, name="bad", partition_key=KEY)
    run = wf.enqueue()
    with running_worker(**WORKER):
        wait_until(lambda: run.status() == "blocked", message="the step dead-lettered")
    dead = DeadLetter.objects.get()
    assert dead.partition_key == KEY
    assert revive(DeadLetter.objects.all()).done == 1
    message = Message.objects.get()
    assert (message.partition_key, message.workflow_step_id) == (
        KEY,
        WorkflowStep.objects.get().pk,
    )


# --- dead letters -----------------------------------------------------------------


def test_a_failed_message_keeps_its_key_in_the_dead_letters_and_comes_back_with_it():
    keyed = enqueue("test.fail", {"raise": "Permanent"}, partition_key=KEY)
    keyless = enqueue("test.fail", {"raise": "Permanent"})
    with running_worker(**WORKER):
        wait_until(lambda: DeadLetter.objects.count() == 2, message="both dead-lettered")
    assert dict(DeadLetter.objects.values_list("message_id", "partition_key")) == {
        keyed.pk: KEY,
        keyless.pk: None,
    }
    assert revive(DeadLetter.objects.all(), topic="test.record").done == 2
    revived = dict(DeadLetter.objects.values_list("partition_key", "revived_message_id"))
    assert stored_keys() == {revived[KEY]: KEY, revived[None]: None}
    assert set(Message.objects.values_list("status", flat=True)) == {Status.WAITING}


# --- the Tasks backend ------------------------------------------------------------


# django.tasks (and so the demo's tasks) exists from Django 6.0 on.
needs_tasks = pytest.mark.skipif(django.VERSION < (6, 0), reason="django.tasks needs Django 6.0")


@needs_tasks
def test_a_task_takes_its_key_from_using_and_validates_it():
    from demo import tasks as demo
    from django.tasks.exceptions import InvalidTask

    keyed = demo.add.using(partition_key=KEY)
    assert (keyed.partition_key, demo.add.partition_key) == (KEY, None)
    assert keyed.using(priority=3).partition_key == KEY, "using() keeps what it is not given"
    result = keyed.enqueue(1, 2)
    plain = demo.add.enqueue(3, 4)
    assert dict(Message.objects.values_list("payload__result_id", "partition_key")) == {
        result.id: KEY,
        plain.id: None,
    }
    for bad in ["", "k" * 256, 7]:
        with pytest.raises(InvalidTask, match="partition_key"):
            demo.add.using(partition_key=bad)
    assert Message.objects.count() == 2


@pytest.mark.skipif(django.VERSION < (6, 1), reason="@task(partition_key=) needs Django 6.1")
def test_a_task_may_name_its_key_when_it_is_declared():
    from demo import tasks as demo
    from django.tasks import task
    from django.tasks.exceptions import InvalidTask

    declared = task(partition_key=KEY)(demo.add.func)
    declared.enqueue(1, 2)
    assert Message.objects.get().partition_key == KEY
    with pytest.raises(InvalidTask, match="partition_key must be a non-empty string"):
        task(partition_key="")(demo.add.func)


@needs_tasks
def test_a_task_step_of_a_workflow_carries_the_tasks_key():
    from demo import tasks as demo

    wf = Workflow()
    wf.add_task(demo.add.using(partition_key=KEY), 1, 2, name="add")
    wf.enqueue()
    assert WorkflowStep.objects.get().partition_key == KEY
    assert Message.objects.get().partition_key == KEY


# --- the admin --------------------------------------------------------------------


def test_the_admin_shows_and_searches_the_key(admin_client, make_dead_letter):
    keyed = enqueue("test.record", {}, partition_key=KEY)
    enqueue("test.record", {})
    dead = make_dead_letter(partition_key=KEY)
    make_dead_letter()
    for model, obj in [("message", keyed), ("deadletter", dead)]:
        changelist = reverse(f"admin:django_pgqueue_{model}_changelist")
        response = admin_client.get(changelist, {"q": KEY})
        assert response.status_code == 200
        assert [o.pk for o in response.context["cl"].result_list] == [obj.pk]
        page = admin_client.get(reverse(f"admin:django_pgqueue_{model}_change", args=[obj.pk]))
        assert "partition_key" in page.context["adminform"].readonly_fields
        assert KEY in page.content.decode(), f"the {model} page does not show the key"


# --- migration 0019 ---------------------------------------------------------------


def test_the_migration_adds_the_columns_and_its_reverse_restores_0018s_function():
    import importlib

    from django.db.migrations.executor import MigrationExecutor

    def function_source():
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT prosrc FROM pg_proc WHERE proname = 'pgqueue_workflow_insert_messages'"
            )
            return cursor.fetchone()[0]

    def columns():
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT table_name FROM information_schema.columns"
                " WHERE column_name = 'partition_key' AND table_name LIKE 'django_pgqueue_%%'"
                " AND table_name NOT LIKE 'django_pgqueue_partition%%'"  # 0020's own tables
            )
            return sorted(row[0] for row in cursor.fetchall())

    tables = ["django_pgqueue_deadletter", "django_pgqueue_message", "django_pgqueue_workflowstep"]
    assert columns() == tables
    assert "s.partition_key" in function_source()
    created = importlib.import_module("django_pgqueue.migrations.0018_workflows").CREATE
    original = re.search(
        r"pgqueue_workflow_insert_messages\(step_ids bigint\[\]\) RETURNS void\n"
        r"LANGUAGE plpgsql AS \$\$(.*?)\$\$;",
        created,
        re.DOTALL,
    )
    executor = MigrationExecutor(connection)
    latest = executor.loader.graph.leaf_nodes("django_pgqueue")
    executor.migrate([("django_pgqueue", "0018_workflows")])
    try:
        assert columns() == []
        assert function_source() == original.group(1), "the reverse is not 0018's function"
    finally:
        executor = MigrationExecutor(connection)
        executor.loader.build_graph()
        executor.migrate(latest)
    assert columns() == tables
    # Released steps get their key again.
    wf = Workflow()
    wf.add("wf.value", {}, partition_key=KEY)
    wf.enqueue()
    assert Message.objects.get().partition_key == KEY
