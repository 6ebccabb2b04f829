"""Reading a task's result: its ``TaskRecord`` as a ``TaskResult``, with the
live state read from the queue while it is unfinished."""

from __future__ import annotations

import dataclasses
import datetime

from django.tasks.base import Task, TaskResult, TaskResultStatus
from django.utils.module_loading import import_string

from django_pgqueue.exceptions import Permanent
from django_pgqueue.models import (
    DeadLetter,
    DeadLetterState,
    Message,
    Status,
    TaskRecord,
    TaskStatus,
)
from django_pgqueue.tasks import errors

# A revive chain longer than this is not followed (a revived dead letter
# points at the next message; each link is one revive).
MAX_REVIVE_CHAIN = 1000


def result_from_record(record: TaskRecord, using: str) -> TaskResult:
    """The TaskResult of ``record``, its live state read from the queue."""
    status = TaskStatus(record.status)
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
    task = load_task(record.task_path, record)
    result = task_result(record, task, TaskResultStatus(status.value), finished_at)
    if status == TaskStatus.SUCCESSFUL:
        # Not a field TaskResult takes: set as Django's own backends do.
        object.__setattr__(result, "_return_value", record.return_value)
    return result


def task_result(
    record: TaskRecord,
    task: Task,
    status: TaskResultStatus,
    finished_at: datetime.datetime | None,
) -> TaskResult:
    """``record`` as a TaskResult of ``task`` in ``status``."""
    return TaskResult(
        task=task,
        id=str(record.pk),
        status=status,
        enqueued_at=record.enqueued_at,
        started_at=record.started_at,
        last_attempted_at=record.last_attempted_at,
        finished_at=finished_at,
        args=record.args,
        kwargs=record.kwargs,
        backend=record.backend,
        errors=errors.from_json(record.errors),
        worker_ids=list(record.worker_ids),
    )


def load_task(path: str, record: TaskRecord) -> Task:
    """The task at ``path`` with the options it was enqueued with (the
    record's), on the backend it was enqueued through."""
    try:
        task = import_string(path)
    except ImportError:
        raise  # the module may not be deployed here yet: retried
    if not isinstance(task, Task):
        raise Permanent(f"{path!r} is not a task (@task-decorated function)")
    return dataclasses.replace(
        task,
        priority=record.priority,
        queue_name=record.queue_name,
        run_after=record.run_after,
        backend=record.backend,
    )


def _current(message_id: int, using: str) -> tuple[Message | None, DeadLetter | None]:
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
