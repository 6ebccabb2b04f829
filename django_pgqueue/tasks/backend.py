"""``PgQueueBackend``: the Django Tasks backend (validation, checks,
enqueue, get_result) and ``PgQueueTask``, the task class it builds."""

from __future__ import annotations

import dataclasses
import datetime
import logging
import uuid
from collections.abc import Callable, Iterator
from typing import Any, cast

from django.apps import apps
from django.conf import settings
from django.core import checks
from django.db import DEFAULT_DB_ALIAS, transaction
from django.tasks.backends.base import BaseTaskBackend
from django.tasks.base import Task, TaskResult, TaskResultStatus
from django.tasks.exceptions import InvalidTask, TaskResultDoesNotExist
from django.tasks.signals import task_enqueued
from django.utils import timezone

from django_pgqueue import conf, enqueuing, validation
from django_pgqueue.exceptions import InvalidMessage
from django_pgqueue.models import Message, TaskRecord
from django_pgqueue.tasks import options
from django_pgqueue.tasks.options import OPTION_NAMES, TASK_TOPIC
from django_pgqueue.tasks.results import result_from_record

logger = logging.getLogger("django_pgqueue.tasks")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class PgQueueTask(Task):
    """``Task`` with retries: ``@task(max_attempts=5, backoff=fn)`` (Django 6.1).

    ``max_attempts``: runs at most this often (the first run included).
    ``backoff(exception, task_result)``: the seconds (a number or a
    timedelta) to wait before the next attempt, or None for no more
    attempts; ``task_result`` shows the failed attempt (its error last).
    Both default to the backend's OPTIONS, then to the PGQUEUE settings.
    As in django/new-features#142, ``.using()`` does not change them.

    ``partition_key``: the partition of the queue its messages go to (see
    ``enqueue()``), per task with ``@task(partition_key=...)`` (Django 6.1)
    or per call with ``.using(partition_key="tenant:42")``; None: the
    queue's default partition.
    """

    max_attempts: int | None = None
    backoff: options.Backoff | None = None
    partition_key: str | None = None

    def using(self, *, partition_key: str | None = None, **changes: Any) -> PgQueueTask:
        """``Task.using()``, and ``partition_key`` (None: unchanged, as
        ``using()`` treats the others)."""
        # Task.using by name: a slots dataclass has no zero-argument super().
        task = cast("PgQueueTask", Task.using(self, **changes))
        if partition_key is None:
            return task
        return dataclasses.replace(task, partition_key=partition_key)


class PgQueueBackend(BaseTaskBackend):
    task_class = PgQueueTask

    supports_defer = True
    supports_async_task = True
    supports_get_result = True
    supports_priority = True

    def __init__(self, alias: str, params: dict[str, Any]) -> None:
        super().__init__(alias, params)
        # MAX_ATTEMPTS / BACKOFF at the top level too: where
        # django/new-features#142 puts them.
        self.max_attempts = self.options.get("MAX_ATTEMPTS", params.get("MAX_ATTEMPTS"))
        self.backoff = self.options.get("BACKOFF", params.get("BACKOFF"))
        # The alias whose transaction enqueue() follows (the queue's own
        # database may be another one, PGQUEUE["DATABASE"]).
        self.using: str = self.options.get("USING") or DEFAULT_DB_ALIAS

    # --- validation ----------------------------------------------------------

    def validate_task(self, task: Task) -> None:
        run_after: object = task.run_after
        if isinstance(run_after, datetime.timedelta):
            # The framework's documentation allows a timedelta, its base
            # validation does not (it asks a timedelta for its utcoffset):
            # it validates the datetime the delay becomes.
            if run_after < datetime.timedelta(0):
                raise InvalidTask("run_after must not be a negative timedelta.")
            task = dataclasses.replace(task, run_after=timezone.now() + run_after)
        elif run_after is not None and not isinstance(run_after, datetime.datetime):
            raise InvalidTask(
                f"run_after must be a datetime or a timedelta, not {type(run_after).__name__}."
            )
        super().validate_task(task)
        problem = conf.name_problem("queue", task.queue_name, conf.QUEUE_MAX_LENGTH)
        if problem:
            raise InvalidTask(problem)
        max_attempts = getattr(task, "max_attempts", None)
        if max_attempts is not None and not (conf.is_int(max_attempts) and max_attempts >= 1):
            raise InvalidTask("max_attempts must be a whole number of at least 1.")
        backoff = getattr(task, "backoff", None)
        if backoff is not None and not callable(backoff):
            raise InvalidTask("backoff must be a callable (exception, task_result) -> seconds.")
        try:
            validation.check_key("partition_key", getattr(task, "partition_key", None))
        except InvalidMessage as exc:
            raise InvalidTask(str(exc)) from None

    def check(self, **kwargs: Any) -> list[checks.CheckMessage]:
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

    def _option_problems(self) -> Iterator[str]:
        unknown = sorted(set(self.options) - OPTION_NAMES)
        if unknown:
            yield f"unknown option(s) {', '.join(unknown)}"
        value = self.max_attempts
        if value is not None and not (conf.is_int(value) and value >= 1):
            yield f"MAX_ATTEMPTS must be a whole number of at least 1, not {value!r}"
        if self.backoff is not None:
            try:
                options.loaded(self.backoff)
            except (ImportError, TypeError) as exc:
                yield f"BACKOFF: {exc}"
        if self.using not in settings.DATABASES:
            yield f"USING: {self.using!r} is not a database alias in DATABASES"

    # --- enqueue --------------------------------------------------------------

    def enqueue(self, task: Task, args: list[Any], kwargs: dict[str, Any]) -> TaskResult:
        task_result, message, now = self._prepare(task, args, kwargs, {})
        queue_alias = conf.queue_database(message["queue"])
        if self.using == queue_alias:
            _insert(task_result, message, queue_alias, now)
        else:
            # The queue is on another database: the task follows the caller's
            # transaction by waiting for its commit (a rollback drops it).
            transaction.on_commit(
                lambda: _insert(task_result, message, queue_alias, now), using=self.using
            )
        return task_result

    def enqueue_with_headers(
        self, task: Task, args: list[Any], kwargs: dict[str, Any], headers: dict[str, Any]
    ) -> tuple[TaskResult, Message]:
        """``enqueue`` inside the transaction open on the queue's database,
        whatever alias the backend follows, with ``headers`` added to the
        task's message: a schedule's tick is recorded and its task enqueued
        so, in one transaction, the message naming its schedule and tick."""
        task_result, message, now = self._prepare(task, args, kwargs, headers)
        return task_result, _insert(
            task_result, message, conf.queue_database(message["queue"]), now
        )

    def workflow_step(
        self, task: Task, args: list[Any], kwargs: dict[str, Any]
    ) -> tuple[TaskResult, dict[str, Any], Callable[[str], None]]:
        """A workflow's task step (``Workflow.add_task``): the task's
        result, the enqueue() keywords of its message, and the writer of its
        task record, which the workflow calls in its own transaction (the
        message is written when the step is released; until then the
        result reads READY)."""
        task_result, message, now = self._prepare(task, args, kwargs, {})
        return task_result, message, lambda using: _record(task_result, using, now, None)

    def _prepare(
        self, task: Task, args: list[Any], kwargs: dict[str, Any], headers: dict[str, Any]
    ) -> tuple[TaskResult, dict[str, Any], datetime.datetime]:
        """(the task's result, the enqueue() keywords of its message, now),
        checked: InvalidTask if they cannot be enqueued."""
        self.validate_task(task)
        now = timezone.now()
        delay: object = task.run_after
        if isinstance(delay, datetime.timedelta):
            task = dataclasses.replace(task, run_after=now + delay)
        task_result: TaskResult[..., Any] = TaskResult(
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
        message = _task_message(task_result, headers)
        try:
            validation.check_message(**message)
        except InvalidMessage as exc:
            raise InvalidTask(str(exc)) from None
        return task_result, message, now

    # --- results --------------------------------------------------------------

    def get_result(self, result_id: str) -> TaskResult:
        try:
            pk = uuid.UUID(str(result_id))
        except ValueError:
            raise TaskResultDoesNotExist(result_id) from None
        # A task's record is on its queue's database; its id (a UUID) is
        # unique across them all.
        for using in conf.databases():
            record = TaskRecord.objects.using(using).filter(pk=pk).first()
            if record is not None:
                return result_from_record(record, using)
        raise TaskResultDoesNotExist(result_id)


def _task_message(task_result: TaskResult, headers: dict[str, Any]) -> dict[str, Any]:
    """The enqueue() keywords of the task's message (with ``headers``)."""
    task = task_result.task
    return {
        "topic": TASK_TOPIC,
        "payload": {
            "result_id": task_result.id,
            "task": task.module_path,
            "args": task_result.args,
            "kwargs": task_result.kwargs,
        },
        "headers": {**headers, "task": task.module_path},
        "priority": task.priority,
        "queue": task.queue_name,
        "run_at": task.run_after,
        "max_attempts": options.max_attempts(task),
        "partition_key": getattr(task, "partition_key", None),
    }


def _insert(
    task_result: TaskResult, message: dict[str, Any], using: str, enqueued_at: datetime.datetime
) -> Message:
    """The task's message and record, in one transaction on the queue's database
    (a savepoint of the caller's, when it is open there); returns the message."""
    with transaction.atomic(using=using):
        inserted = enqueuing.enqueue(**message, using=using)
        _record(task_result, using, enqueued_at, inserted.pk)
    return inserted


def _record(
    task_result: TaskResult, using: str, enqueued_at: datetime.datetime, message_id: int | None
) -> None:
    """The task's record, in the transaction of its message (or workflow)."""
    task = task_result.task
    TaskRecord.objects.using(using).create(
        id=task_result.id,
        task_path=task.module_path,
        backend=task_result.backend,
        queue_name=task.queue_name,
        priority=task.priority,
        run_after=task.run_after,
        args=task_result.args,
        kwargs=task_result.kwargs,
        enqueued_at=enqueued_at,
        message_id=message_id,
    )
    transaction.on_commit(lambda: _send_enqueued(task_result), using=using)


def _send_enqueued(task_result: TaskResult) -> None:
    logger.debug("Task id=%s path=%s enqueued", task_result.id, task_result.task.module_path)
    task_enqueued.send(type(task_result.task.get_backend()), task_result=task_result)
