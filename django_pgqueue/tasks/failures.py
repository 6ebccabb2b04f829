"""Recording a task's failed attempts, once the worker has recorded the
failure of its message: the receivers of ``message_retried`` and
``dead_lettered`` (they run after the worker's transaction, in its
process), which append the attempt's error to the task's record and, when
the message is dead-lettered, mark the task FAILED."""

from __future__ import annotations

import datetime
from typing import Any

from django.db import transaction
from django.dispatch import receiver
from django.tasks.base import TaskError, TaskResultStatus
from django.tasks.signals import task_finished

from django_pgqueue import conf, lifecycle, signals
from django_pgqueue.models import DeadLetter, Message, TaskRecord, TaskStatus
from django_pgqueue.tasks import errors
from django_pgqueue.tasks.options import TASK_TOPIC
from django_pgqueue.tasks.results import result_from_record


@receiver(signals.message_retried, dispatch_uid="django_pgqueue.tasks.retried")
def on_retried(
    sender: type[Message],
    message: Message,
    reason: str = "",
    worker: str = "",
    lost: bool = False,
    **kwargs: Any,
) -> None:
    if message.topic != TASK_TOPIC:
        return
    error = errors.attached(message)
    if error is None:
        error = errors.lost_run(reason, worker) if lost else errors.from_text(reason, "")
    record_failed_attempt(message.payload, message.pk, error)


@receiver(signals.dead_lettered, dispatch_uid="django_pgqueue.tasks.dead_lettered")
def on_dead_lettered(
    sender: type[DeadLetter], dead_letter: DeadLetter, message_id: int, **kwargs: Any
) -> None:
    if dead_letter.topic != TASK_TOPIC:
        return
    if dead_letter.reason.startswith(lifecycle.LOST_RUN_REASONS):
        error = errors.lost_run(dead_letter.reason, dead_letter.worker)
    else:
        error = errors.from_dead_letter(dead_letter.reason, dead_letter.traceback)
    record = record_failed_attempt(
        dead_letter.payload, message_id, error, finished_at=dead_letter.dead_lettered_at
    )
    if record is not None:
        result = result_from_record(record, conf.database_alias())
        if result.status == TaskResultStatus.FAILED:
            task_finished.send(sender=type(result.task.get_backend()), task_result=result)


def record_failed_attempt(
    payload: object,
    message_id: int,
    error: TaskError,
    finished_at: datetime.datetime | None = None,
) -> TaskRecord | None:
    """Append a failed attempt's error to the task's record (FAILED when
    ``finished_at``); returns the record, or None. (The run's worker and
    times were recorded when it began: runner.mark_started.)"""
    if not isinstance(payload, dict) or "result_id" not in payload:
        return None
    using = conf.database_alias()
    with transaction.atomic(using=using):
        record = (
            TaskRecord.objects.using(using)
            .select_for_update()
            .filter(pk=payload["result_id"])
            .first()
        )
        if record is None:
            return None
        record.errors = [*record.errors, errors.to_json(error)]
        record.message_id = message_id
        fields = ["errors", "message_id"]
        if finished_at is not None and record.status != TaskStatus.SUCCESSFUL:
            record.status, record.finished_at = TaskStatus.FAILED, finished_at
            fields += ["status", "finished_at"]
        record.save(using=using, update_fields=fields)
    return record
