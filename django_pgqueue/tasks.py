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
import threading
import traceback
import uuid
from collections import OrderedDict

from django.apps import apps
from django.conf import settings
from django.core import checks
from django.db import DEFAULT_DB_ALIAS, transaction
from django.dispatch import receiver
from django.tasks.backends.base import BaseTaskBackend
from django.tasks.base import Task, TaskContext, TaskError, TaskResult, TaskResultStatus
from django.tasks.exceptions import InvalidTask, TaskResultDoesNotExist
from django.tasks.signals import task_enqueued, task_finished, task_started
from django.utils import timezone
from django.utils.json import normalize_json
from django.utils.module_loading import import_string

from . import conf, policy, producer, registry, signals
from .exceptions import InvalidMessage, Permanent, Retry
from .models import Category, DeadLetter, DeadLetterState, Message, Status, TaskRecord, TaskStatus

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
            producer.check_message(**message)
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
        inserted = producer.enqueue(**message, using=using)
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
    task = _load_task(payload.get("task", record.task_path), record)
    args, kwargs = payload.get("args", record.args), payload.get("kwargs", record.kwargs)
    now = timezone.now()
    attempt = TaskResult(
        task=task,
        id=str(record.pk),
        status=TaskResultStatus.RUNNING,
        enqueued_at=record.enqueued_at,
        started_at=record.started_at or now,
        last_attempted_at=now,
        finished_at=None,
        args=args,
        kwargs=kwargs,
        backend=record.backend,
        errors=_errors(record.errors),
        worker_ids=[*record.worker_ids, message.locked_by],
    )
    backend_class = type(task.get_backend())
    task_started.send(sender=backend_class, task_result=attempt)
    try:
        if task.takes_context:
            value = task.call(TaskContext(task_result=attempt), *args, **kwargs)
        else:
            value = task.call(*args, **kwargs)
        value = normalize_json(value)
    except Exception as exc:
        error = _task_error(exc)
        _stash_error(message, error, now)
        _raise_with_backoff(exc, error, task, attempt, message)
        raise
    finished = timezone.now()
    TaskRecord.objects.using(using).filter(pk=record.pk).update(
        status=TaskStatus.SUCCESSFUL,
        return_value=value,
        started_at=attempt.started_at,
        last_attempted_at=now,
        finished_at=finished,
        worker_ids=attempt.worker_ids,
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
        raise Permanent(f"not retried (backoff returned None) after {_reason(exc)}") from exc
    raise Retry(f"retry after {_reason(exc)}", after=delay) from exc


# --- failures (after the worker recorded them) -----------------------------------------

# The exact error of a failed attempt, from the handler to the receivers
# below (which run after the worker's transaction, in the same process; a
# failure the handler never saw, such as a timeout or a lost worker, is
# described from the worker's record instead). Keyed by (message id, attempt).
_stash = OrderedDict()
_stash_lock = threading.Lock()
_STASH_MAX = 10_000


def _stash_error(message, error, attempted_at):
    with _stash_lock:
        _stash[(message.pk, message.attempts)] = (error, attempted_at, message.locked_by)
        while len(_stash) > _STASH_MAX:
            _stash.popitem(last=False)


def _take_stashed(message_id, attempts):
    with _stash_lock:
        return _stash.pop((message_id, attempts), None)


@receiver(signals.message_retried, dispatch_uid="django_pgqueue.tasks.retried")
def _on_retried(sender, message, reason="", worker="", **kwargs):
    if message.topic != TASK_TOPIC:
        return
    stashed = _take_stashed(message.pk, message.attempts)
    if stashed is None:
        stashed = (_error_from_text(reason, ""), None, worker)
    _record_failed_attempt(message.payload, message.pk, *stashed)


@receiver(signals.dead_lettered, dispatch_uid="django_pgqueue.tasks.dead_lettered")
def _on_dead_lettered(sender, dead_letter, message_id, **kwargs):
    if dead_letter.topic != TASK_TOPIC:
        return
    stashed = _take_stashed(message_id, dead_letter.attempts)
    if stashed is None:
        error = _error_from_text(dead_letter.reason, dead_letter.traceback)
        stashed = (error, dead_letter.last_failed_at, dead_letter.worker)
    record = _record_failed_attempt(
        dead_letter.payload, message_id, *stashed, finished_at=dead_letter.dead_lettered_at
    )
    if record is not None:
        result = _result_from_record(record, conf.get("DATABASE"))
        if result.status == TaskResultStatus.FAILED:
            task_finished.send(sender=type(result.task.get_backend()), task_result=result)


def _record_failed_attempt(payload, message_id, error, attempted_at, worker, finished_at=None):
    """Append a failed attempt to the task's record (FAILED when
    ``finished_at``); returns the record, or None."""
    if not isinstance(payload, dict) or "result_id" not in payload:
        return None
    using = conf.get("DATABASE")
    now = timezone.now()
    attempted_at = attempted_at or now
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
        if worker:  # an attempt ran (not a move to the dead letters by hand)
            record.worker_ids = [*record.worker_ids, worker]
            record.started_at = record.started_at or attempted_at
            record.last_attempted_at = attempted_at
            fields += ["worker_ids", "started_at", "last_attempted_at"]
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
            if message.status == Status.PROCESSING:
                status = TaskStatus.RUNNING
                worker_ids.append(message.locked_by)
                last_attempted_at = message.updated_at  # when it was claimed
                started_at = started_at or last_attempted_at
            elif message.status == Status.WAITING:
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
    from . import exceptions

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


def _error_json(error):
    return {"exception_class_path": error.exception_class_path, "traceback": error.traceback}


def _errors(items):
    return [
        TaskError(exception_class_path=e["exception_class_path"], traceback=e["traceback"])
        for e in items
    ]


def _reason(exc):
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
