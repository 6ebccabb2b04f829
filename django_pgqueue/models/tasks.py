"""``TaskRecord``: the ``django.tasks`` tasks enqueued through
``django_pgqueue.tasks.PgQueueBackend``, and how they ended.

This module imports no ``django.tasks``: it must load on Django 5.2 too.
"""

from __future__ import annotations

from django.db import models
from django.db.models import Q
from django.db.models.functions import Now

from django_pgqueue import conf
from django_pgqueue.fields import DateTimeField


class TaskStatus(models.TextChoices):
    # The values of django.tasks.TaskResultStatus.
    READY = "READY"
    RUNNING = "RUNNING"
    FAILED = "FAILED"
    SUCCESSFUL = "SUCCESSFUL"


class TaskRecord(models.Model):
    """One ``django.tasks`` task enqueued through ``tasks.PgQueueBackend``:
    what was asked for and, once it is known, how it ended.

    Written with the task's message (in the same transaction), then by the
    worker: a success in the handler's transaction (with the message's
    acknowledgement), a failure after the worker has recorded it. While the
    task is unfinished, its live state (waiting, running, dead-lettered,
    revived) is read from ``Message`` and ``DeadLetter`` through
    ``message_id``: this row's ``status`` is authoritative only when it is
    SUCCESSFUL.
    """

    id = models.UUIDField(primary_key=True)
    task_path = models.CharField(max_length=255)
    backend = models.CharField(max_length=100, help_text="The TASKS alias it was enqueued with.")
    queue_name = models.CharField(max_length=conf.QUEUE_MAX_LENGTH)
    priority = models.SmallIntegerField(db_default=0)
    run_after = DateTimeField(null=True, blank=True)
    args = models.JSONField(db_default=[], blank=True)
    kwargs = models.JSONField(db_default={}, blank=True)
    status = models.CharField(
        max_length=16, choices=TaskStatus.choices, db_default=TaskStatus.READY
    )
    enqueued_at = DateTimeField(db_default=Now())
    started_at = DateTimeField(null=True, blank=True)
    last_attempted_at = DateTimeField(null=True, blank=True)
    finished_at = DateTimeField(null=True, blank=True)
    return_value = models.JSONField(null=True, blank=True)
    errors = models.JSONField(
        db_default=[], blank=True, help_text="[{exception_class_path, traceback}], oldest first."
    )
    worker_ids = models.JSONField(db_default=[], blank=True)
    message_id = models.BigIntegerField(
        null=True, blank=True, help_text="Its message (the latest one, after a revive)."
    )
    started_lease = models.UUIDField(
        null=True,
        blank=True,
        help_text="The lease of the latest run whose task function began: its message "
        "reads RUNNING only while it holds this lease (a claimed run that has not "
        "begun is still READY).",
    )

    class Meta:
        verbose_name = "task result"
        indexes = [
            models.Index(fields=["status", "finished_at"], name="pgqueue_task_status_idx"),
        ]
        constraints = [
            models.CheckConstraint(
                condition=Q(status__in=TaskStatus.values), name="pgqueue_task_status_valid"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.task_path} {self.pk}"
