"""A backend for Django's Tasks framework (``django.tasks``, Django 6.0+).

::

    TASKS = {"default": {"BACKEND": "django_pgqueue.tasks.PgQueueBackend"}}

A task is a message of the reserved topic ``pgqueue.task`` (``TASK_TOPIC``)
whose payload names the task and its arguments, plus a ``TaskRecord`` row
that holds its result. Both are written in the caller's transaction on the
queue's database (or, when the queue lives on another alias, together at the
caller's commit), so a task enqueued in a transaction that rolls back never
runs and never existed. ``pgqueue_worker`` runs it like any message: the
failure policy, retries, dead letters and admin triage are the messages'.

States (``get_result``): the record says SUCCESSFUL once the handler's
transaction committed; until then the state is read from the task's message
(waiting: READY, leased: RUNNING) or, once it has left the queue, from its
dead letter (FAILED; a revived dead letter points at the new message, READY
again).

Retries: ``max_attempts`` and ``backoff(exception, task_result) -> seconds |
None`` (the shape of django/new-features#142), given to ``@task`` on Django
6.1 (``PgQueueTask``) or as ``OPTIONS`` ``MAX_ATTEMPTS`` / ``BACKOFF`` of the
backend (every Django 6.x). Without them, the ``PGQUEUE`` settings apply, as
to any message.

This module imports ``django.tasks``: only Django 6.0+ may import it (the
app's ``ready()`` does so when a ``TASKS`` backend is one of ours).
"""

import builtins
import dataclasses
import datetime
import logging
import os
import threading
import traceback
import uuid
from collections import OrderedDict

import psycopg
from django.apps import apps
from django.conf import settings
from django.core import checks
from django.db import DEFAULT_DB_ALIAS, connections, transaction
from django.dispatch import receiver
from django.tasks.backends.base import BaseTaskBackend
from django.tasks.base import Task, TaskContext, TaskError, TaskResult, TaskResultStatus
from django.tasks.exceptions import InvalidTask, TaskResultDoesNotExist
from django.tasks.signals import task_enqueued, task_finished, task_started
from django.utils import timezone
from django.utils.json import normalize_json
from django.utils.module_loading import import_string

from django_pgqueue import conf, enqueuing, lifecycle, policy, registry, signals
from django_pgqueue.exceptions import InvalidMessage, Permanent, Retry, describe
from django_pgqueue.fields import finite_sql
from django_pgqueue.models import (
    Category,
    DeadLetter,
    DeadLetterState,
    Message,
    Status,
    TaskRecord,
    TaskStatus,
)

logger = logging.getLogger(__name__)

# The topic of every task's message (one handler runs them all).
TASK_TOPIC = "pgqueue.task"

# Backend OPTIONS this backend understands.
OPTION_NAMES = frozenset({"MAX_ATTEMPTS", "BACKOFF", "USING"})

# A revive chain longer than this is not followed (a revived dead letter
# points at the next message; each link is one revive).
MAX_REVIVE_CHAIN = 1000


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class PgQueueTask(Task):
    """``Task`` with retries: ``@task(max_attempts=5, backoff=fn)`` (Django 6.1).

    ``max_attempts``: runs at most this often (the first run included).
    ``backoff(exception, task_result)``: the seconds (a number or a
    timedelta) to wait before the next attempt, or None for no more
    attempts; ``task_result`` shows the failed attempt (its error last).
    Both default to the backend's OPTIONS, then to the PGQUEUE settings.
    As in django/new-features#142, ``.using()`` does not change them.
    """

    max_attempts: int | None = None
    backoff: object = None


class PgQueueBackend(BaseTaskBackend):
    task_class = PgQueueTask

    supports_defer = True
    supports_async_task = True
    supports_get_result = True
    supports_priority = True

    def __init__(self, alias, params):
        super().__init__(alias, params)
        # MAX_ATTEMPTS / BACKOFF at the top level too: where
        # django/new-features#142 puts them.
        self.max_attempts = self.options.get("MAX_ATTEMPTS", params.get("MAX_ATTEMPTS"))
        self.backoff = self.options.get("BACKOFF", params.get("BACKOFF"))
        # The alias whose transaction enqueue() follows (the queue's own
        # database may be another one, PGQUEUE["DATABASE"]).
        self.using = self.options.get("USING") or DEFAULT_DB_ALIAS

    # --- validation ----------------------------------------------------------

    def validate_task(self, task):
        run_after = task.run_after
        if isinstance(run_after, datetime.timedelta):
            # The framework's documentation allows a timedelta, its base
            # validation does not (it asks a timedelta for its utcoffset).
            if run_after < datetime.timedelta(0):
                raise InvalidTask("run_after must not be a negative timedelta.")
            super().validate_task(_with_run_after(task, None))
        elif run_after is not None and not isinstance(run_after, datetime.datetime):
            raise InvalidTask(
                f"run_after must be a datetime or a timedelta, not {type(run_after).__name__}."
            )
        else:
            super().validate_task(task)
        problem = conf.name_problem("queue", task.queue_name, conf.QUEUE_MAX_LENGTH)
        if problem:
            raise InvalidTask(problem)
        max_attempts = getattr(task, "max_attempts", None)
        if max_attempts is not None and not (
            isinstance(max_attempts, int) and not isinstance(max_attempts, bool)
        ):
            raise InvalidTask("max_attempts must be a whole number of at least 1.")
        if max_attempts is not None and max_attempts < 1:
            raise InvalidTask("max_attempts must be a whole number of at least 1.")
        backoff = getattr(task, "backoff", None)
        if backoff is not None and not callable(backoff):
            raise InvalidTask("backoff must be a callable (exception, task_result) -> seconds.")

    def check(self, **kwargs):
        errors = list(super().check(**kwargs))
        if not apps.is_installed("django_pgqueue"):
            errors.append(
                checks.Error(
                    f"TASKS[{self.alias!r}] uses PgQueueBackend, but django_pgqueue is not "
                    "installed.",
                    hint="Add 'django_pgqueue' to INSTALLED_APPS.",
                    id="pgqueue.T001",
                )
            )
        for queue in sorted(self.queues):
            problem = conf.name_problem("queue", queue, conf.QUEUE_MAX_LENGTH)
            if problem:
                errors.append(
                    checks.Error(
                        f"TASKS[{self.alias!r}]['QUEUES']: {problem}",
                        hint="Queue names are letters, digits and _ . : / - .",
                        id="pgqueue.T002",
                    )
                )
        for problem in self._option_problems():
            errors.append(
                checks.Error(
                    f"TASKS[{self.alias!r}]['OPTIONS']: {problem}",
                    hint=f"Known options: {', '.join(sorted(OPTION_NAMES))}.",
                    id="pgqueue.T003",
                )
            )
        return errors

    def _option_problems(self):
        unknown = sorted(set(self.options) - OPTION_NAMES)
        if unknown:
            yield f"unknown option(s) {', '.join(unknown)}"
        value = self.max_attempts
        if value is not None and not (
            isinstance(value, int) and not isinstance(value, bool) and value >= 1
        ):
            yield f"MAX_ATTEMPTS must be a whole number of at least 1, not {value!r}"
        if self.backoff is not None:
            try:
                _callable(self.backoff)
            except (ImportError, TypeError) as exc:
                yield f"BACKOFF: {exc}"
        if self.using not in settings.DATABASES:
            yield f"USING: {self.using!r} is not a database alias in DATABASES"

    # --- enqueue --------------------------------------------------------------

    def enqueue(self, task, args, kwargs):
        self.validate_task(task)
        now = timezone.now()
        if isinstance(task.run_after, datetime.timedelta):
            task = _with_run_after(task, now + task.run_after)
        task_result = TaskResult(
            task=task,
            id=str(uuid.uuid4()),
            status=TaskResultStatus.READY,
            enqueued_at=now,
            started_at=None,
            last_attempted_at=None,
            finished_at=None,
            args=args,  # normalized to JSON types here (TypeError if it cannot be)
            kwargs=kwargs,
            backend=self.alias,
            errors=[],
            worker_ids=[],
        )
        message = _task_message(task_result)
        try:
            enqueuing.check_message(**message)
        except InvalidMessage as exc:
            raise InvalidTask(str(exc)) from None
        queue_alias = conf.get("DATABASE")
        if self.using == queue_alias:
            _insert(task_result, message, queue_alias)
        else:
            # The queue is on another database: the task follows the caller's
            # transaction by waiting for its commit (a rollback drops it).
            transaction.on_commit(
                lambda: _insert(task_result, message, queue_alias), using=self.using
            )
        return task_result

    # --- results --------------------------------------------------------------

    def get_result(self, result_id):
        try:
            pk = uuid.UUID(str(result_id))
        except ValueError:
            raise TaskResultDoesNotExist(result_id) from None
        using = conf.get("DATABASE")
        record = TaskRecord.objects.using(using).filter(pk=pk).first()
        if record is None:
            raise TaskResultDoesNotExist(result_id)
        return _result_from_record(record, using)


# --- writing ---------------------------------------------------------------------


def _task_message(task_result):
    task = task_result.task
    return {
        "topic": TASK_TOPIC,
        "payload": {
            "result_id": task_result.id,
            "task": task.module_path,
            "args": task_result.args,
            "kwargs": task_result.kwargs,
        },
        "headers": {"task": task.module_path},
        "priority": task.priority,
        "queue": task.queue_name,
        "run_at": task.run_after,
        "max_attempts": _max_attempts(task),
    }


def _insert(task_result, message, using):
    """The task's message and record, in one transaction on the queue's database
    (a savepoint of the caller's, when it is open there)."""
    task = task_result.task
    with transaction.atomic(using=using):
        inserted = enqueuing.enqueue(**message, using=using)
        TaskRecord.objects.using(using).create(
            id=task_result.id,
            task_path=task.module_path,
            backend=task_result.backend,
            queue_name=task.queue_name,
            priority=task.priority,
            run_after=task.run_after,
            args=task_result.args,
            kwargs=task_result.kwargs,
            enqueued_at=task_result.enqueued_at,
            message_id=inserted.pk,
        )
        transaction.on_commit(lambda: _send_enqueued(task_result), using=using)


def _send_enqueued(task_result):
    logger.debug("Task id=%s path=%s enqueued", task_result.id, task_result.task.module_path)
    task_enqueued.send(type(task_result.task.get_backend()), task_result=task_result)


# --- running (the worker) -----------------------------------------------------------


@registry.handler(TASK_TOPIC, atomic=True)
def run_task(message):
    """Run the task of ``message``; its result is written in the handler's
    transaction, with the acknowledgement. A failure is raised to the
    worker (the failure policy decides), after the task's own ``backoff``,
    if it has one, has chosen the delay."""
    using = conf.get("DATABASE")
    payload = message.payload if isinstance(message.payload, dict) else {}
    try:
        record = TaskRecord.objects.using(using).get(pk=payload["result_id"])
    except (KeyError, ValueError, TaskRecord.DoesNotExist):
        raise Permanent(
            f"task message without a task record (result_id={payload.get('result_id')!r})"
        ) from None
    try:
        # Committed at once, outside the handler's transaction: from here on
        # readers see RUNNING, and a run lost with this worker still counts.
        worker_ids, started_at, now = _mark_started(record.pk, message, using)
        task = _load_task(payload.get("task", record.task_path), record)
    except BaseException as exc:
        _stash_error(message, _task_error(exc))
        raise
    args, kwargs = payload.get("args", record.args), payload.get("kwargs", record.kwargs)
    attempt = TaskResult(
        task=task,
        id=str(record.pk),
        status=TaskResultStatus.RUNNING,
        enqueued_at=record.enqueued_at,
        started_at=started_at,
        last_attempted_at=now,
        finished_at=None,
        args=args,
        kwargs=kwargs,
        backend=record.backend,
        errors=_errors(record.errors),
        worker_ids=worker_ids,
    )
    backend_class = type(task.get_backend())
    task_started.send(sender=backend_class, task_result=attempt)
    try:
        if task.takes_context:
            value = task.call(TaskContext(task_result=attempt), *args, **kwargs)
        else:
            value = task.call(*args, **kwargs)
        value = normalize_json(value)
    except BaseException as exc:  # noqa: BLE001  (SystemExit & co. are failures too)
        error = _task_error(exc)
        _stash_error(message, error)
        _raise_with_backoff(exc, error, task, attempt, message)
        raise
    finished = timezone.now()
    TaskRecord.objects.using(using).filter(pk=record.pk).update(
        status=TaskStatus.SUCCESSFUL,
        return_value=value,
        finished_at=finished,
        args=attempt.args,
        kwargs=attempt.kwargs,
        message_id=message.pk,
    )
    object.__setattr__(attempt, "status", TaskResultStatus.SUCCESSFUL)
    object.__setattr__(attempt, "finished_at", finished)
    object.__setattr__(attempt, "_return_value", value)
    transaction.on_commit(
        lambda: task_finished.send(sender=backend_class, task_result=attempt), using=using
    )


# Marks a run as begun (see _mark_started). The worker's id is appended once
# per lease, however often the handler runs under it (an atomic batch that
# rolls back runs its handlers again, one by one).
MARK_STARTED_SQL = """
UPDATE {table} SET
    worker_ids = CASE WHEN started_lease IS NOT DISTINCT FROM %(lease)s THEN worker_ids
                      ELSE worker_ids || jsonb_build_array(%(worker)s::text) END,
    started_at = COALESCE(started_at, %(now)s),
    last_attempted_at = CASE WHEN started_lease IS NOT DISTINCT FROM %(lease)s
                             THEN last_attempted_at ELSE %(now)s END,
    started_lease = %(lease)s
WHERE id = %(id)s
RETURNING worker_ids, {started_at}, {last_attempted_at}
""".format(
    table="{table}",
    # Read clamped as the ORM reads them (a value written by hand may be 'infinity').
    started_at=finite_sql("started_at"),
    last_attempted_at=finite_sql("last_attempted_at"),
)

# A handler's own transaction is open while its start is marked: the mark
# waits at most this long for the record's row lock (held only by another
# transaction writing the same record), then fails the attempt (retried)
# rather than hang.
MARK_STARTED_LOCK_TIMEOUT_MS = 10_000


def _mark_started(record_id, message, using):
    """Record, committed at once, that the task's function of ``message``
    begins now under its lease, on a connection of the thread's own (the
    handler's transaction would show it only at its end). Returns
    (worker_ids, started_at, last_attempted_at) as they now are."""
    now = timezone.now()
    params = {
        "id": record_id,
        "lease": message.lease_token,
        "worker": message.locked_by,
        "now": now,
    }
    sql = MARK_STARTED_SQL.format(table=_quoted_table(using))
    for attempt in (1, 2):
        conn = _side_connection(using)
        try:
            row = conn.execute(sql, params).fetchone()
            break
        except psycopg.OperationalError:
            if not conn.broken or attempt == 2:
                raise  # a lock timeout, or the server is gone: the attempt fails (retried)
            _close_side_connection(using)  # dropped (a restart, a terminated backend): again
    if row is None:
        raise Permanent(f"the task record {record_id} was deleted while its task was claimed")
    return row


_side = threading.local()


class _SideConnection:
    """A thread's own autocommit connection to the queue's database, closed
    when the thread ends (its thread-local slot is freed)."""

    def __init__(self, using):
        params = connections[using].get_connection_params()
        params.pop("cursor_factory", None)
        params.pop("context", None)
        params["application_name"] = f"pgqueue_tasks#{os.getpid()}"
        self.conn = psycopg.connect(**params, autocommit=True)
        self.conn.execute(f"SET lock_timeout = {MARK_STARTED_LOCK_TIMEOUT_MS}")

    def __del__(self):
        self.conn.close()


def _side_connection(using):
    held = getattr(_side, "connections", None)
    if held is None:
        held = _side.connections = {}
    side = held.get(using)
    if side is None or side.conn.closed:
        side = held[using] = _SideConnection(using)
    return side.conn


def _close_side_connection(using):
    side = getattr(_side, "connections", {}).pop(using, None)
    if side is not None:
        side.conn.close()


def _quoted_table(using):
    return connections[using].ops.quote_name(TaskRecord._meta.db_table)


def _load_task(path, record):
    try:
        task = import_string(path)
    except ImportError:
        raise  # the module may not be deployed here yet: retried
    if not isinstance(task, Task):
        raise Permanent(f"{path!r} is not a task (@task-decorated function)")
    # The options it was enqueued with (the record's), on the backend it was
    # enqueued through.
    return dataclasses.replace(
        task,
        priority=record.priority,
        queue_name=record.queue_name,
        run_after=record.run_after,
        backend=record.backend,
    )


def _raise_with_backoff(exc, error, task, attempt, message):
    """Raise Retry(after=<the task's backoff>) or Permanent (backoff said no)
    from ``exc``; return (the worker then applies the policy to ``exc`` as
    it is) when there is no backoff, the policy would not retry, or the
    attempts are used up."""
    backend = task.get_backend()
    backoff = getattr(task, "backoff", None) or getattr(backend, "backoff", None)
    if backoff is None or (isinstance(exc, Retry) and exc.after is not None):
        return  # no backoff, or the task chose its own delay
    backoff = _callable(backoff)
    category = policy.classify(exc, message)
    if category in (Category.PERMANENT, Category.BUSINESS):
        return
    if message.attempts >= policy.max_attempts_for(message, registry.lookup(TASK_TOPIC)):
        return
    failed = dataclasses.replace(
        attempt, status=TaskResultStatus.FAILED, errors=[*attempt.errors, error]
    )
    delay = backoff(exc, failed)
    if delay is None:
        raise Permanent(f"not retried (backoff returned None) after {describe(exc)}") from exc
    raise Retry(f"retry after {describe(exc)}", after=delay) from exc


# --- failures (after the worker recorded them) -----------------------------------------

# The exact error of a failed attempt, from the handler to the receivers
# below (which run after the worker's transaction, in the same process; a
# failure the handler never saw, such as a timeout or a lost worker, is
# described from the worker's record instead). Keyed by (message id, attempt).
_stash = OrderedDict()
_stash_lock = threading.Lock()
_STASH_MAX = 10_000


def _stash_error(message, error):
    with _stash_lock:
        _stash[(message.pk, message.attempts)] = error
        while len(_stash) > _STASH_MAX:
            _stash.popitem(last=False)


def _take_stashed(message_id, attempts):
    with _stash_lock:
        return _stash.pop((message_id, attempts), None)


@receiver(signals.message_retried, dispatch_uid="django_pgqueue.tasks.retried")
def _on_retried(sender, message, reason="", worker="", lost=False, **kwargs):
    if message.topic != TASK_TOPIC:
        return
    error = _take_stashed(message.pk, message.attempts)
    if error is None:
        error = _lost_run_error(reason, worker) if lost else _error_from_text(reason, "")
    _record_failed_attempt(message.payload, message.pk, error)


@receiver(signals.dead_lettered, dispatch_uid="django_pgqueue.tasks.dead_lettered")
def _on_dead_lettered(sender, dead_letter, message_id, **kwargs):
    if dead_letter.topic != TASK_TOPIC:
        return
    error = _take_stashed(message_id, dead_letter.attempts)
    if error is None:
        if dead_letter.reason.startswith(lifecycle.LOST_RUN_REASONS):
            error = _lost_run_error(dead_letter.reason, dead_letter.worker)
        else:
            error = _error_from_text(dead_letter.reason, dead_letter.traceback)
    record = _record_failed_attempt(
        dead_letter.payload, message_id, error, finished_at=dead_letter.dead_lettered_at
    )
    if record is not None:
        result = _result_from_record(record, conf.get("DATABASE"))
        if result.status == TaskResultStatus.FAILED:
            task_finished.send(sender=type(result.task.get_backend()), task_result=result)


def _record_failed_attempt(payload, message_id, error, finished_at=None):
    """Append a failed attempt's error to the task's record (FAILED when
    ``finished_at``); returns the record, or None. (The run's worker and
    times were recorded when it began: _mark_started.)"""
    if not isinstance(payload, dict) or "result_id" not in payload:
        return None
    using = conf.get("DATABASE")
    with transaction.atomic(using=using):
        record = (
            TaskRecord.objects.using(using)
            .select_for_update()
            .filter(pk=payload["result_id"])
            .first()
        )
        if record is None:
            return None
        record.errors = [*record.errors, _error_json(error)]
        record.message_id = message_id
        fields = ["errors", "message_id"]
        if finished_at is not None and record.status != TaskStatus.SUCCESSFUL:
            record.status, record.finished_at = TaskStatus.FAILED, finished_at
            fields += ["status", "finished_at"]
        record.save(using=using, update_fields=fields)
    return record


# --- reading ------------------------------------------------------------------------


def _result_from_record(record, using):
    """The TaskResult of ``record``, its live state read from the queue."""
    status = TaskStatus(record.status)
    worker_ids = list(record.worker_ids)
    started_at, last_attempted_at = record.started_at, record.last_attempted_at
    finished_at = record.finished_at
    if status != TaskStatus.SUCCESSFUL and record.message_id is not None:
        message, dead = _current(record.message_id, using)
        if message is not None:
            finished_at = None
            if (
                message.status == Status.PROCESSING
                and record.started_lease is not None
                and message.lease_token == record.started_lease
            ):
                # Its function began under the lease the message still holds
                # (a claimed message waiting in a worker's batch is READY).
                status = TaskStatus.RUNNING
            else:
                status = TaskStatus.READY
        elif dead is not None:
            status = TaskStatus.FAILED
            finished_at = finished_at or dead.dead_lettered_at
    task = _load_task(record.task_path, record)
    result = TaskResult(
        task=task,
        id=str(record.pk),
        status=TaskResultStatus(status.value),
        enqueued_at=record.enqueued_at,
        started_at=started_at,
        last_attempted_at=last_attempted_at,
        finished_at=finished_at,
        args=record.args,
        kwargs=record.kwargs,
        backend=record.backend,
        errors=_errors(record.errors),
        worker_ids=worker_ids,
    )
    if status == TaskStatus.SUCCESSFUL:
        object.__setattr__(result, "_return_value", record.return_value)
    return result


def _current(message_id, using):
    """(the unfinished message, None) or (None, its dead letter) or (None, None),
    following revives from ``message_id``."""
    for _ in range(MAX_REVIVE_CHAIN):
        message = Message.objects.using(using).filter(pk=message_id).first()
        if message is not None:
            return message, None
        dead = DeadLetter.objects.using(using).filter(message_id=message_id).order_by("-pk").first()
        if dead is None:
            return None, None
        if dead.state != DeadLetterState.REVIVED or dead.revived_message_id is None:
            return None, dead
        message_id = dead.revived_message_id
    return None, None


# --- helpers ------------------------------------------------------------------------


def _with_run_after(task, run_after):
    """``task`` with another run_after, without validating it (``replace``
    would validate, and the point is to validate a stand-in)."""
    copy = object.__new__(type(task))
    for field in dataclasses.fields(task):
        object.__setattr__(copy, field.name, getattr(task, field.name))
    object.__setattr__(copy, "run_after", run_after)
    return copy


def _max_attempts(task):
    value = getattr(task, "max_attempts", None)
    if value is None:
        value = getattr(task.get_backend(), "max_attempts", None)
    return value


def _callable(value):
    if isinstance(value, str):
        value = import_string(value)
    if not callable(value):
        raise TypeError(f"{value!r} is not callable")
    return value


def _task_error(exc):
    cls = type(exc)
    return TaskError(
        exception_class_path=f"{cls.__module__}.{cls.__qualname__}",
        traceback="".join(traceback.format_exception(exc)),
    )


def _error_from_text(reason, trace):
    """A TaskError for a failure the handler did not see (a timeout, a lost
    worker, a move to the dead letters from the admin): its class from the
    reason ("ClassName: text") when that names one of our exceptions or a
    builtin one, else ``PgQueueError`` (there was no exception)."""
    from django_pgqueue import exceptions

    name = (reason or "").split(":", 1)[0].strip()
    if isinstance(getattr(exceptions, name, None), type):
        path = f"django_pgqueue.exceptions.{name}"
    elif isinstance(getattr(builtins, name, None), type) and issubclass(
        getattr(builtins, name), BaseException
    ):
        path = f"builtins.{name}"
    else:
        path = "django_pgqueue.exceptions.PgQueueError"
    return TaskError(exception_class_path=path, traceback=trace or reason or "")


def _lost_run_error(reason, worker):
    """The error of a run that ended with no outcome (its worker was killed,
    or lost its lease): there is no exception and no traceback."""
    return TaskError(
        exception_class_path="django_pgqueue.exceptions.WorkerLost",
        traceback=(
            f"The run was lost with its worker {worker or '(unknown)'}: {reason}\n"
            "No traceback exists: the task's function never returned or raised in a "
            "process that could report it."
        ),
    )


def _error_json(error):
    return {"exception_class_path": error.exception_class_path, "traceback": error.traceback}


def _errors(items):
    return [
        TaskError(exception_class_path=e["exception_class_path"], traceback=e["traceback"])
        for e in items
    ]
