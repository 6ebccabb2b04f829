"""django-pgqueue as a backend of Django's Tasks framework (django_pgqueue/tasks/).

The tasks are testproject/demo/tasks.py; TASKS["default"] is our backend,
"retrying" ours with retries in OPTIONS, "immediate" Django's ImmediateBackend.
Workers run in-process (``Worker(burst=True).run()``) or as real
``manage.py pgqueue_worker`` processes, against the real database.
"""

import datetime
import json
import traceback

import django
import pytest

if django.VERSION < (6, 0):
    pytest.skip(
        f"django.tasks exists from Django 6.0 on (installed: {django.get_version()})",
        allow_module_level=True,
    )

from asgiref.sync import async_to_sync
from demo import tasks as demo
from demo.models import Handled
from django.conf import settings
from django.db import transaction
from django.tasks import TaskResultStatus, default_task_backend, task, task_backends
from django.tasks.exceptions import InvalidTask, TaskResultDoesNotExist, TaskResultMismatch
from django.tasks.signals import task_enqueued, task_finished, task_started
from django.test import override_settings
from django.urls import reverse
from django.utils import timezone

from django_pgqueue import lifecycle
from django_pgqueue.exceptions import PgQueueError, WorkerLost
from django_pgqueue.models import Category, DeadLetter, DeadLetterState, Message, TaskRecord
from django_pgqueue.tasks import TASK_TOPIC, PgQueueBackend, PgQueueTask
from django_pgqueue.worker import Worker

from .conftest import raw_connection, running_worker, wait_until

READY, RUNNING = TaskResultStatus.READY, TaskResultStatus.RUNNING
SUCCESSFUL, FAILED = TaskResultStatus.SUCCESSFUL, TaskResultStatus.FAILED

transactional = pytest.mark.django_db(transaction=True)


def run_worker(**options):
    """One in-process worker until nothing is ready; returns its id."""
    worker = Worker(burst=True, concurrency=1, **options)
    worker.run()
    return worker.worker_id


def not_module_level():
    def inner():
        return None

    return inner


@pytest.fixture
def task_signals():
    """(signal name, result id, status) of every framework signal sent."""
    got = []
    receivers = {}
    for name, signal in [
        ("enqueued", task_enqueued),
        ("started", task_started),
        ("finished", task_finished),
    ]:

        def receive(sender, task_result, _name=name, **kwargs):
            got.append((_name, task_result.id, task_result.status))

        receivers[signal] = receive
        signal.connect(receive, weak=False)
    yield got
    for signal, receive in receivers.items():
        signal.disconnect(receive)


# --- the backend contract: declared features and validation ----------------------------


# @task(max_attempts=..., backoff=...): Django 6.1 (6.0's task() takes no
# options of the backend's task_class; there, retries come from OPTIONS).
needs_task_options = pytest.mark.skipif(
    django.VERSION < (6, 1), reason="@task(max_attempts=, backoff=) needs Django 6.1"
)


def test_the_default_backend_is_ours_and_declares_what_it_supports():
    backend = task_backends["default"]
    assert isinstance(backend, PgQueueBackend)
    assert (
        backend.supports_defer,
        backend.supports_async_task,
        backend.supports_get_result,
        backend.supports_priority,
    ) == (True, True, True, True)
    assert backend.task_class is PgQueueTask
    assert isinstance(demo.add, PgQueueTask), "@task builds the backend's task_class"
    if django.VERSION >= (6, 1):
        assert (demo.flaky.max_attempts, demo.flaky.backoff) == (4, demo.no_wait)


@pytest.mark.parametrize(
    "make, error",
    [
        (lambda: task(not_module_level()), "module level"),
        (lambda: demo.add.using(priority=101), "priority must be a whole number"),
        (lambda: demo.add.using(priority=-101), "priority must be a whole number"),
        (lambda: demo.add.using(queue_name="elsewhere"), "not valid for backend"),
        (
            lambda: demo.add.using(run_after=datetime.datetime(2030, 1, 1)),
            "run_after must be an aware datetime",
        ),
        (
            lambda: demo.add.using(run_after=datetime.timedelta(seconds=-1)),
            "negative timedelta",
        ),
        (lambda: demo.add.using(run_after="tomorrow"), "datetime or a timedelta"),
        (lambda: task(takes_context=True)(demo.no_wait), "first argument of 'context'"),
        pytest.param(
            lambda: task(max_attempts=0)(demo.give_up),
            "max_attempts must be",
            marks=needs_task_options,
        ),
        pytest.param(
            lambda: task(backoff=5)(demo.give_up),
            "backoff must be a callable",
            marks=needs_task_options,
        ),
    ],
)
def test_invalid_tasks_are_refused_with_invalid_task(make, error):
    with pytest.raises(InvalidTask, match=error):
        make()


def test_queue_names_must_be_valid_queue_names_when_any_queue_is_allowed():
    open_backend = {"BACKEND": "django_pgqueue.tasks.PgQueueBackend", "QUEUES": []}
    with override_settings(TASKS={**settings.TASKS, "open": open_backend}):
        assert demo.add.using(backend="open", queue_name="any.name").queue_name == "any.name"
        with pytest.raises(InvalidTask, match="queue 'has space' may contain only"):
            demo.add.using(backend="open", queue_name="has space")


def test_the_backends_system_check_reports_bad_options():
    backend = PgQueueBackend(
        "bad",
        {
            "QUEUES": ["ok", "not ok"],
            "OPTIONS": {"MAX_ATTEMPTS": 0, "BACKOFF": "demo.tasks.nothing", "NOPE": 1},
        },
    )
    errors = backend.check()
    messages = [(e.id, e.msg) for e in errors]
    assert [e.id for e in errors] == ["pgqueue.T002"] + ["pgqueue.T003"] * 3, messages
    text = " ".join(e.msg for e in errors)
    for part in ("'not ok'", "unknown option(s) NOPE", "MAX_ATTEMPTS", "BACKOFF"):
        assert part in text, f"{part!r} not reported: {messages}"
    assert default_task_backend.check() == [], "the test project's TASKS are valid"


# --- enqueue ----------------------------------------------------------------------


@pytest.mark.django_db
def test_enqueue_returns_a_ready_result_that_get_result_reads_back():
    result = demo.echo.enqueue(1, (2, 3), key=("v",))
    assert result.status == READY and not result.is_finished
    assert (result.args, result.kwargs) == ([1, [2, 3]], {"key": ["v"]}), "normalized to JSON"
    assert result.backend == "default" and result.enqueued_at is not None
    assert (result.started_at, result.finished_at, result.errors, result.worker_ids) == (
        None,
        None,
        [],
        [],
    )
    with pytest.raises(ValueError, match="not finished"):
        result.return_value  # noqa: B018  (the property raises)

    read = demo.echo.get_result(result.id)
    assert (read.id, read.status, read.args, read.kwargs) == (
        result.id,
        READY,
        result.args,
        result.kwargs,
    )
    assert read.enqueued_at == result.enqueued_at and read.task.func is demo.echo.func
    assert (read.task.priority, read.task.queue_name) == (10, "tasks")

    message = Message.objects.get()
    assert (message.topic, message.queue, message.priority) == (TASK_TOPIC, "tasks", 10)
    assert message.payload == {
        "result_id": result.id,
        "task": "demo.tasks.echo",
        "args": [1, [2, 3]],
        "kwargs": {"key": ["v"]},
    }
    assert TaskRecord.objects.get().message_id == message.pk


@pytest.mark.django_db
def test_get_result_of_an_unknown_id_or_of_another_task_raises():
    for bad in ["00000000-0000-0000-0000-000000000000", "not-a-uuid", ""]:
        with pytest.raises(TaskResultDoesNotExist):
            default_task_backend.get_result(bad)
    result = demo.add.enqueue(1, 2)
    with pytest.raises(TaskResultMismatch):
        demo.echo.get_result(result.id)


@pytest.mark.django_db
def test_arguments_that_are_not_json_are_refused_like_the_immediate_backend_does():
    for backend in ("default", "immediate"):
        with pytest.raises(TypeError, match="Unsupported type"):
            demo.add.using(backend=backend).enqueue(object(), 1)
    assert not Message.objects.exists() and not TaskRecord.objects.exists()


@transactional
def test_enqueue_in_a_transaction_is_visible_at_commit_and_signalled_then(
    other_connection, task_signals
):
    def committed():
        return other_connection.execute(
            "SELECT (SELECT count(*) FROM django_pgqueue_message WHERE topic = %s),"
            " (SELECT count(*) FROM django_pgqueue_taskrecord)",
            [TASK_TOPIC],
        ).fetchone()

    with transaction.atomic():
        result = demo.add.enqueue(1, 2)
        assert committed() == (0, 0), "visible before the commit"
        assert task_signals == [], "task_enqueued sent before the commit"
    assert committed() == (1, 1)
    assert task_signals == [("enqueued", result.id, READY)]


@transactional
def test_enqueue_in_a_transaction_that_rolls_back_leaves_nothing(task_signals):
    with transaction.atomic():
        kept = demo.add.enqueue(1, 1)
        try:
            with transaction.atomic():
                dropped = demo.add.enqueue(2, 2)
                raise RuntimeError("roll the savepoint back")
        except RuntimeError:
            pass
    with pytest.raises(TaskResultDoesNotExist):
        default_task_backend.get_result(dropped.id)
    assert default_task_backend.get_result(kept.id).status == READY
    assert Message.objects.count() == 1
    assert task_signals == [("enqueued", kept.id, READY)]

    with pytest.raises(RuntimeError), transaction.atomic():
        gone = demo.add.enqueue(3, 3)
        raise RuntimeError("roll back")
    with pytest.raises(TaskResultDoesNotExist):
        default_task_backend.get_result(gone.id)
    assert Message.objects.count() == 1 and TaskRecord.objects.count() == 1


@pytest.mark.django_db(transaction=True, databases=["default", "other"])
@override_settings(PGQUEUE={"DATABASE": "other"})
def test_queue_on_another_alias_enqueues_at_the_callers_commit(task_signals):
    with transaction.atomic():
        result = demo.add.enqueue(2, 2)
        assert not TaskRecord.objects.using("other").exists(), "inserted before the commit"
        assert not Message.objects.using("other").exists()
    record = TaskRecord.objects.using("other").get()
    assert Message.objects.using("other").get().pk == record.message_id
    assert task_signals == [("enqueued", result.id, READY)]

    with pytest.raises(RuntimeError), transaction.atomic():
        demo.add.enqueue(3, 3)
        raise RuntimeError("roll back")
    assert TaskRecord.objects.using("other").count() == 1, "a rolled back enqueue was inserted"

    run_worker()
    result.refresh()
    assert (result.status, result.return_value) == (SUCCESSFUL, 4)
    assert not TaskRecord.objects.using("default").exists()


@transactional
def test_aenqueue_and_aget_result():
    result = async_to_sync(demo.add.aenqueue)(20, 22)
    assert result.status == READY
    run_worker()
    read = async_to_sync(demo.add.aget_result)(result.id)
    assert (read.status, read.return_value) == (SUCCESSFUL, 42)
    async_to_sync(result.arefresh)()
    assert result.return_value == 42


# --- deferral, priority, queues ----------------------------------------------------


@transactional
def test_run_after_takes_an_aware_datetime_or_a_timedelta():
    later = timezone.now() + datetime.timedelta(hours=1)
    at = demo.add.using(run_after=later).enqueue(1, 1)
    before = timezone.now()
    after = demo.add.using(run_after=datetime.timedelta(minutes=30)).enqueue(2, 2)
    assert at.task.run_after == later
    delta = after.task.run_after - before
    assert isinstance(after.task.run_after, datetime.datetime), "timedelta resolved at enqueue"
    assert datetime.timedelta(minutes=30) <= delta < datetime.timedelta(minutes=31), delta
    runs_at = dict(Message.objects.values_list("payload__result_id", "run_at"))
    assert runs_at == {at.id: later, after.id: after.task.run_after}
    assert default_task_backend.get_result(after.id).task.run_after == after.task.run_after

    now = demo.add.enqueue(3, 3)
    run_worker()
    assert [r.refresh() or r.status for r in (at, after, now)] == [READY, READY, SUCCESSFUL]


@transactional
def test_priority_orders_and_queue_names_route_the_tasks():
    low = demo.add.using(priority=-5).enqueue(1, 0)
    high = demo.add.using(priority=50).enqueue(2, 0)
    other_queue = demo.echo.enqueue("routed")  # queue "tasks"
    run_worker(queues=["default"])
    for result in (low, high, other_queue):
        result.refresh()
    assert other_queue.status == READY, "ran from a queue the worker does not serve"
    assert high.started_at < low.started_at, "the higher priority did not run first"
    run_worker(queues=["tasks"])
    other_queue.refresh()
    assert other_queue.return_value == {"args": ["routed"], "kwargs": {}}


# --- running ------------------------------------------------------------------------


@transactional
def test_the_worker_runs_a_task_and_its_result_is_retrievable(task_signals):
    result = demo.add.enqueue(2, 3)
    worker_id = run_worker()
    assert result.status == READY, "the object changes only on refresh()"
    result.refresh()
    assert (result.status, result.return_value, result.errors) == (SUCCESSFUL, 5, [])
    assert (result.worker_ids, result.attempts) == ([worker_id], 1)
    assert result.enqueued_at <= result.started_at <= result.finished_at
    assert result.last_attempted_at == result.started_at
    assert not Message.objects.exists(), "the message was not acknowledged"
    assert task_signals == [
        ("enqueued", result.id, READY),
        ("started", result.id, RUNNING),
        ("finished", result.id, SUCCESSFUL),
    ]


@transactional
def test_async_tasks_and_tasks_that_take_the_context_run():
    summed = demo.async_add.enqueue(3, 4)
    context = demo.whoami.enqueue("me")
    run_worker()
    summed.refresh()
    context.refresh()
    assert summed.return_value == 7
    assert context.return_value == {
        "label": "me",
        "attempt": 1,
        "id": context.id,
        "status": "RUNNING",
    }


@transactional
def test_a_failing_task_is_failed_with_its_error_and_a_dead_letter(task_signals):
    result = demo.fail.enqueue("boom")
    worker_id = run_worker()
    result.refresh()
    assert result.status == FAILED and result.is_finished
    with pytest.raises(ValueError, match="Task failed"):
        result.return_value  # noqa: B018  (the property raises)
    assert [e.exception_class_path for e in result.errors] == ["builtins.ValueError"]
    assert result.errors[0].exception_class is ValueError
    assert "ValueError: boom" in result.errors[0].traceback
    assert "demo/tasks.py" in result.errors[0].traceback
    assert (result.worker_ids, result.attempts) == ([worker_id], 1)
    assert result.started_at <= result.finished_at
    dead = DeadLetter.objects.get()
    assert (dead.topic, dead.category, dead.payload["result_id"]) == (
        TASK_TOPIC,
        Category.PERMANENT,  # ValueError: the same policy as for messages
        result.id,
    )
    assert task_signals[-1] == ("finished", result.id, FAILED)
    assert [s[0] for s in task_signals] == ["enqueued", "started", "finished"]


@transactional
def test_a_tasks_database_writes_commit_with_its_success_and_roll_back_with_its_failure():
    ok = demo.record.enqueue(1)
    bad = demo.record.enqueue(2, then_fail=True)
    run_worker()
    ok.refresh()
    bad.refresh()
    assert (ok.status, bad.status) == (SUCCESSFUL, FAILED)
    assert list(Handled.objects.values_list("message_id", flat=True)) == [1], (
        "the failed task's write was committed, or the successful one's twice"
    )


# --- retries -----------------------------------------------------------------------


@needs_task_options
@transactional
def test_task_decorator_retries_with_its_backoff_until_it_succeeds():
    result = demo.flaky.enqueue(2)
    assert Message.objects.get().max_attempts == 4
    worker_id = run_worker()
    result.refresh()
    assert (result.status, result.return_value, result.attempts) == (SUCCESSFUL, 3, 3)
    assert result.worker_ids == [worker_id] * 3
    assert [e.exception_class_path for e in result.errors] == ["builtins.ConnectionError"] * 2
    assert "down on attempt 2" in result.errors[1].traceback
    assert not DeadLetter.objects.exists()


@needs_task_options
@transactional
def test_retries_end_with_max_attempts_and_keep_the_errors_category():
    result = demo.flaky.enqueue(10)  # more failures than its 4 attempts
    run_worker()
    result.refresh()
    assert (result.status, result.attempts, len(result.errors)) == (FAILED, 4, 4)
    dead = DeadLetter.objects.get()
    assert (dead.category, dead.attempts) == (Category.DEPENDENCY, 4)
    assert dead.reason == "ConnectionError: down on attempt 4"


@needs_task_options
@transactional
def test_a_backoff_that_returns_none_stops_the_retries():
    result = demo.refused.enqueue()
    run_worker()
    result.refresh()
    assert (result.status, result.attempts) == (FAILED, 1)
    assert result.errors[0].exception_class_path == "builtins.ConnectionError"
    dead = DeadLetter.objects.get()
    assert dead.category == Category.PERMANENT
    assert "backoff returned None" in dead.reason and "ConnectionError" in dead.traceback


@transactional
def test_backend_options_give_retries_to_tasks_that_set_none():
    retried = demo.down.using(backend="retrying").enqueue()
    plain = demo.down.enqueue()
    limits = dict(Message.objects.values_list("payload__result_id", "max_attempts"))
    assert limits == {retried.id: 3, plain.id: None}, "None: PGQUEUE's MAX_ATTEMPTS applies"
    Message.objects.filter(pk=TaskRecord.objects.get(pk=plain.id).message_id).delete()
    run_worker()
    retried.refresh()
    assert retried.backend == "retrying"
    assert (retried.status, retried.attempts, len(retried.errors)) == (FAILED, 3, 3)


# --- live states: a real worker process ------------------------------------------------


@pytest.mark.slow
def test_a_worker_process_runs_tasks_and_running_is_visible(start_worker):
    result = demo.sleepy.enqueue(1.5)
    quick = demo.add.enqueue(1, 1)
    worker = start_worker("--concurrency", "1", "--poll-interval", "0.2")
    wait_until(
        lambda: result.refresh() or result.status == RUNNING,
        timeout=60,
        message=f"the task to be RUNNING; worker log:\n{worker.log()}",
    )
    assert len(result.worker_ids) == 1 and result.worker_ids[0].count(":") == 2
    assert result.started_at is not None and result.finished_at is None
    wait_until(
        lambda: quick.refresh() or quick.is_finished,
        timeout=60,
        message=f"the second task to finish; worker log:\n{worker.log()}",
    )
    result.refresh()
    assert (result.status, result.return_value) == (SUCCESSFUL, 1)
    assert (quick.status, quick.return_value) == (SUCCESSFUL, 2)
    assert result.worker_ids == [result.worker_ids[0]] and result.finished_at is not None


@transactional
def test_a_claimed_task_reads_ready_until_its_function_begins():
    # One claim of two (batch 2, one thread): while the first task runs, the
    # second waits in the worker's local batch, leased but not begun.
    first = demo.whoami.enqueue("first")
    second = demo.add.enqueue(1, 2)
    seen = {}

    def on_started(sender, task_result, **kwargs):
        backend = default_task_backend
        seen[task_result.id] = {
            "itself": backend.get_result(task_result.id),
            "others": {
                other.id: backend.get_result(other.id)
                for other in (first, second)
                if other.id != task_result.id
            },
            "second_message": Message.objects.get(
                pk=TaskRecord.objects.get(pk=second.id).message_id
            ).status,
        }

    task_started.connect(on_started, weak=False)
    try:
        worker_id = run_worker(batch_size=2, prefetch=2)
    finally:
        task_started.disconnect(on_started)
    during_first = seen[first.id]
    assert during_first["second_message"] == "processing", "not claimed in the same batch"
    waiting = during_first["others"][second.id]
    assert (waiting.status, waiting.started_at, waiting.last_attempted_at) == (READY, None, None)
    assert (waiting.worker_ids, waiting.attempts) == ([], 0)
    running = during_first["itself"]
    assert (running.status, running.worker_ids) == (RUNNING, [worker_id])
    assert running.started_at is not None and running.started_at == running.last_attempted_at
    # When the second begins, it reads RUNNING; the first has finished.
    own = seen[second.id]["itself"]
    assert (own.status, own.worker_ids) == (RUNNING, [worker_id])
    assert own.started_at is not None
    assert seen[second.id]["others"][first.id].status == SUCCESSFUL
    second.refresh()
    assert (second.status, second.return_value, second.attempts) == (SUCCESSFUL, 3, 1)


@transactional
@pytest.mark.parametrize(
    "kind, path",
    [
        ("exit", "builtins.SystemExit"),
        ("interrupt", "builtins.KeyboardInterrupt"),
        ("halt", "demo.tasks.Halt"),
    ],
)
def test_a_base_exception_is_recorded_with_its_traceback_on_every_attempt(kind, path):
    result = demo.halt.using(backend="retrying").enqueue(kind)  # 3 attempts, no wait
    worker_id = run_worker()
    result.refresh()
    assert (result.status, result.attempts) == (FAILED, 3)
    assert [e.exception_class_path for e in result.errors] == [path] * 3, result.errors
    for error in result.errors:
        assert error.traceback.startswith("Traceback (most recent call last):"), error.traceback
        assert "demo/tasks.py" in error.traceback and "in halt" in error.traceback
    assert result.worker_ids == [worker_id] * 3
    assert DeadLetter.objects.get().attempts == 3


@transactional
def test_a_dropped_bookkeeping_connection_is_replaced_for_the_next_task():
    dropper = demo.drop_task_connections.enqueue()
    after = demo.add.enqueue(2, 2)
    worker_id = run_worker()
    dropper.refresh()
    after.refresh()
    assert (dropper.status, dropper.return_value) == (SUCCESSFUL, 1), "it dropped its own"
    assert (after.status, after.return_value, after.worker_ids) == (SUCCESSFUL, 4, [worker_id])


def _record_locked_by_another_transaction(conn, result_id):
    conn.execute("SELECT 1 FROM django_pgqueue_taskrecord WHERE id = %s FOR UPDATE", [result_id])


def _start_mark_waits(conn):
    """Whether this process's start mark waits for a lock (pg_stat_activity)."""
    import os

    return conn.execute(
        "SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE application_name = %s"
        " AND wait_event_type = 'Lock')",
        [f"pgqueue_tasks#{os.getpid()}"],
    ).fetchone()[0]


@transactional
def test_a_start_mark_that_waits_past_its_lock_timeout_fails_the_attempt(monkeypatch):
    from django_pgqueue.tasks import runner

    monkeypatch.setattr(runner, "MARK_STARTED_LOCK_TIMEOUT_MS", 200)
    result = demo.add.enqueue(1, 1)
    with raw_connection() as holder, running_worker(concurrency=1, poll_interval=0.2):
        # A long admin edit of the record, say: the first attempt's mark gives up.
        _record_locked_by_another_transaction(holder, result.id)
        wait_until(
            lambda: "LockNotAvailable" in (Message.objects.get().last_error or ""),
            message="the first attempt to fail on the lock",
        )
        holder.rollback()  # the failure's bookkeeping, then the retry, go on
        wait_until(lambda: result.refresh() or result.is_finished, message="the retry")
    assert (result.status, result.return_value) == (SUCCESSFUL, 2)
    assert result.attempts == 1, "only the run whose function began counts"
    assert [e.exception_class_path for e in result.errors] == ["psycopg.errors.LockNotAvailable"]


@transactional
def test_a_task_record_deleted_while_its_start_is_marked_dead_letters_the_task():
    result = demo.add.enqueue(1, 1)
    with raw_connection() as deleter:
        deleter.execute("DELETE FROM django_pgqueue_taskrecord WHERE id = %s", [result.id])
        with (
            running_worker(concurrency=1, poll_interval=0.2),
            raw_connection(
                autocommit=True  # pg_stat_activity is read once per transaction
            ) as watcher,
        ):
            wait_until(lambda: _start_mark_waits(watcher), message="the start mark to wait")
            deleter.commit()  # the mark finds no row
            wait_until(lambda: DeadLetter.objects.exists(), message="the task dead-lettered")
    dead = DeadLetter.objects.get()
    assert dead.category == Category.PERMANENT
    assert dead.reason == (
        f"Permanent: the task record {result.id} was deleted while its task was claimed"
    )


@pytest.mark.slow
def test_runs_lost_with_killed_workers_are_attempts_of_the_task(start_worker):
    # The task kills its worker process (SIGKILL) on its first two attempts.
    result = demo.kill_own_process.enqueue(2)
    options = ("--concurrency", "1", "--lease", "2", "--poll-interval", "0.3")
    first, second = start_worker(*options), start_worker(*options)
    wait_until(
        lambda: first.popen.poll() is not None and second.popen.poll() is not None,
        timeout=60,
        message=f"both workers to be killed by the task; logs:\n{first.log()}\n{second.log()}",
    )
    result.refresh()
    # The second run's lease outlives its worker until a worker rescues it.
    assert result.status == RUNNING
    assert len(result.worker_ids) == 2 and len(set(result.worker_ids)) == 2
    assert [e.exception_class_path for e in result.errors] == [
        "django_pgqueue.exceptions.WorkerLost"
    ], "the second run is rescued only once a worker runs again"
    third = start_worker(*options)
    wait_until(
        lambda: result.refresh() or result.is_finished,
        timeout=60,
        message=f"the third attempt to finish; log:\n{third.log()}",
    )
    assert (result.status, result.return_value) == (SUCCESSFUL, 3), "TaskContext.attempt"
    assert result.attempts == 3 and len(result.worker_ids) == 3
    third_id = third.log().split("Worker ", 1)[1].split(" ", 1)[0]
    assert result.worker_ids[2] == third_id
    assert {first.pid, second.pid} == {int(w.split(":")[1]) for w in result.worker_ids[:2]}
    assert [e.exception_class_path for e in result.errors] == [
        "django_pgqueue.exceptions.WorkerLost"
    ] * 2
    for error, worker_id in zip(result.errors, result.worker_ids, strict=False):
        assert error.exception_class is WorkerLost
        assert f"lost with its worker {worker_id}" in error.traceback
        assert "No traceback exists" in error.traceback
    assert not Message.objects.exists() and not DeadLetter.objects.exists()


# --- dead letters and the admin -------------------------------------------------------


@transactional
def test_a_failed_task_is_fixed_and_revived_from_the_admin(admin_client):
    result = demo.add.enqueue("1", 2)  # TypeError: str + int
    run_worker()
    result.refresh()
    assert result.status == FAILED
    assert result.errors[0].exception_class_path == "builtins.TypeError"
    dead = DeadLetter.objects.get()

    change = reverse("admin:django_pgqueue_deadletter_change", args=[dead.pk])
    payload = {**dead.payload, "args": [1, 2]}
    response = admin_client.post(change, {"payload": json.dumps(payload)})
    assert response.status_code == 302, response.content[:500]
    response = admin_client.post(
        reverse("admin:django_pgqueue_deadletter_changelist"),
        {"action": "revive", "index": 0, "_selected_action": [dead.pk]},
    )
    assert response.status_code == 302, response.content[:500]
    dead.refresh_from_db()
    assert dead.state == DeadLetterState.REVIVED
    result.refresh()
    assert (result.status, result.finished_at) == (READY, None), "revived: ready again"

    run_worker()
    result.refresh()
    assert (result.status, result.return_value) == (SUCCESSFUL, 3)
    assert result.attempts == 2 and len(result.errors) == 1
    assert default_task_backend.get_result(result.id).args == [1, 2], "the arguments it ran with"


@transactional
def test_a_task_moved_to_the_dead_letters_unrun_is_failed(task_signals):
    # The admin's "Move to dead letters" action: no handler ran, no exception.
    result = demo.add.enqueue(1, 2)
    message = Message.objects.get()
    assert lifecycle.dead_letter(message, Category.BUSINESS, "moved by admin", expect="waiting")
    result.refresh()
    assert (result.status, result.attempts) == (FAILED, 0)
    assert (result.started_at, result.last_attempted_at) == (None, None), "it never started"
    assert result.finished_at == DeadLetter.objects.get().dead_lettered_at
    assert [(e.exception_class_path, e.traceback) for e in result.errors] == [
        ("django_pgqueue.exceptions.PgQueueError", "moved by admin")
    ]
    assert result.errors[0].exception_class is PgQueueError
    assert task_signals[-1] == ("finished", result.id, FAILED)


class Outer:
    class Inner(Exception):
        """An exception class nested in a class: its qualname has a dot."""


def raised(exc, during=None):
    """``exc`` as raised (with a traceback), while handling ``during`` if given."""
    try:
        if during is None:
            raise exc
        try:
            raise during
        except BaseException:
            raise exc  # noqa: B904  (its __context__ is ``during``)
    except BaseException as caught:
        return caught


def with_note(exc, note):
    exc.add_note(note)
    return exc


@pytest.mark.parametrize(
    "exc",
    [
        raised(ValueError("boom")),
        raised(ValueError()),
        raised(ValueError("two\nlines: with a colon")),
        raised(KeyError("key")),
        raised(demo.Halt("halted")),
        raised(Outer.Inner("nested")),
        raised(with_note(RuntimeError("noted"), "Halt: a note that looks like an exception")),
        raised(TypeError("during"), during=ValueError("first")),
        raised(ExceptionGroup("several", [ValueError("a"), TypeError("b")])),
        raised(BaseExceptionGroup("halts", [demo.Halt("b")])),
        raised(PgQueueError("ours")),
    ],
    ids=repr,
)
def test_a_dead_letters_error_names_the_class_its_task_raised(exc):
    """The dead-lettered attempt's error is read from what the dead letter
    stores of the exception: its reason and its traceback."""
    from django_pgqueue.exceptions import describe
    from django_pgqueue.tasks import errors

    trace = "".join(traceback.format_exception(exc))
    error = errors.from_dead_letter(describe(exc), trace)
    expected = errors.from_exception(exc)
    assert (error.exception_class_path, error.traceback) == (
        expected.exception_class_path,
        expected.traceback,
    )


def test_a_dead_letters_error_after_the_backoff_stopped_is_the_tasks_own():
    from django_pgqueue.exceptions import Permanent, describe
    from django_pgqueue.tasks import errors

    task_exc = raised(ConnectionError("down"))
    expected = errors.from_exception(task_exc)
    stopped = raised_from(Permanent(f"{errors.STOPPED_AFTER}{describe(task_exc)}"), task_exc)
    trace = "".join(traceback.format_exception(stopped))
    error = errors.from_dead_letter(describe(stopped), trace)
    assert (error.exception_class_path, error.traceback) == (
        "builtins.ConnectionError",
        expected.traceback,
    ), "the error of the task's exception, not of the Permanent raised from it"


def raised_from(exc, cause):
    try:
        raise exc from cause
    except BaseException as caught:
        return caught


# --- the same task code on Django's ImmediateBackend ---------------------------------

SCENARIOS = {
    "return value": (demo.add, (2, 3), {}),
    "JSON normalization": (demo.echo, (1, (2, 3)), {"key": ("v", None)}),
    "async": (demo.async_add, (1, 2), {}),
    "context": (demo.whoami, ("me",), {}),
    "ValueError": (demo.fail, ("boom",), {}),
    "TypeError": (demo.add, ("1", 2), {}),
}


def observed(result):
    """What a caller can see of a finished result, ids aside."""
    try:
        value = result.return_value
    except ValueError as exc:
        value = f"raised {exc}"
    if isinstance(value, dict) and "id" in value:
        assert value["id"] == result.id, "the context's result is not the task's"
        value = {k: v for k, v in value.items() if k != "id"}
    return {
        "status": result.status,
        "value": value,
        "args": result.args,
        "kwargs": result.kwargs,
        "attempts": result.attempts,
        "errors": [e.exception_class_path for e in result.errors],
        "last lines": [e.traceback.strip().splitlines()[-1] for e in result.errors],
        "timestamps": [
            t is not None
            for t in (
                result.enqueued_at,
                result.started_at,
                result.last_attempted_at,
                result.finished_at,
            )
        ],
        "ordered": result.enqueued_at <= result.started_at <= result.finished_at,
    }


@transactional
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_the_same_task_gives_the_same_result_as_on_the_immediate_backend(scenario, task_signals):
    the_task, args, kwargs = SCENARIOS[scenario]
    immediate = the_task.using(backend="immediate").enqueue(*args, **kwargs)
    immediate_signals = [(name, status) for name, _, status in task_signals]
    del task_signals[:]

    ours = the_task.enqueue(*args, **kwargs)
    run_worker(queues=["default", "tasks"])
    ours.refresh()
    assert observed(ours) == observed(immediate)
    assert [(name, status) for name, _, status in task_signals] == immediate_signals
    assert task_backends["immediate"].supports_get_result is False, (
        "Django's ImmediateBackend now stores results: compare get_result too"
    )
