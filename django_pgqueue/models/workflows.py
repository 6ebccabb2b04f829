"""Workflows: steps that wait for other steps (``django_pgqueue.workflows``).

A ``Workflow`` row counts its steps by where they are, so that its status
changes in the same statement that moves a step, never by counting the
steps again. A ``WorkflowStep`` holds its message's fields until it is
released: a held step is not in the queue table at all (no claim, no index
of the claim sees it), and its release inserts the message, in the
transaction that finished the last step it follows. ``WorkflowDependency``
is one edge: ``step`` runs after ``after``.

The three tables refer to each other by plain ids with foreign keys that
the database does not enforce (``db_constraint=False``): the bookkeeping
runs in SQL on the hot path of the acknowledgement, and maintenance deletes a
finished workflow's rows together (``retention``).
"""

from __future__ import annotations

from django.core.serializers.json import DjangoJSONEncoder
from django.db import models
from django.db.models import Q
from django.db.models.functions import Now

from django_pgqueue import conf
from django_pgqueue.fields import DateTimeField

NAME_MAX_LENGTH = 200


class WorkflowStatus(models.TextChoices):
    RUNNING = "running"
    # A step is dead-lettered and nothing else can run until it is revived
    # or resolved.
    BLOCKED = "blocked"
    DONE = "done"
    # Every step ended, and at least one was given up (resolved, cancelled).
    FAILED = "failed"
    CANCELLED = "cancelled"


FINISHED_STATUSES = [WorkflowStatus.DONE, WorkflowStatus.FAILED, WorkflowStatus.CANCELLED]


class StepState(models.TextChoices):
    # Stored, not in the queue: it waits for the steps it follows.
    HELD = "held"
    # Its message is in the queue (waiting, delayed or processing: the
    # message's own status tells which).
    RELEASED = "released"
    DONE = "done"
    DEAD_LETTERED = "dead_lettered", "Dead-lettered"
    # Cancelled, or given up (its dead letter resolved), or cancelled because
    # a step it follows was: it counts as failed for the steps after it.
    CANCELLED = "cancelled"


class Workflow(models.Model):
    """A workflow and its steps' counts: ``steps_unfinished`` have not
    ended (done, cancelled), ``steps_active`` are in the queue,
    ``steps_dead`` wait in the dead letters, ``steps_failed`` ended other
    than done."""

    id = models.BigAutoField(primary_key=True)
    name = models.CharField(max_length=NAME_MAX_LENGTH, db_default="", blank=True)
    status = models.CharField(
        max_length=16, choices=WorkflowStatus.choices, db_default=WorkflowStatus.RUNNING
    )
    steps_total = models.IntegerField(db_default=0)
    steps_unfinished = models.IntegerField(db_default=0)
    steps_active = models.IntegerField(db_default=0)
    steps_dead = models.IntegerField(db_default=0)
    steps_failed = models.IntegerField(db_default=0)
    created_at = DateTimeField(db_default=Now())
    finished_at = DateTimeField(null=True, blank=True)

    class Meta:
        indexes = [
            models.Index(fields=["status", "-created_at"], name="pgqueue_wf_status_idx"),
            # The finished ones by when: retention deletes the oldest first.
            models.Index(
                fields=["finished_at"],
                condition=Q(finished_at__isnull=False),
                name="pgqueue_wf_finished_idx",
            ),
        ]
        permissions = [
            ("cancel_workflow", "Can cancel workflows"),
            ("revive_workflow", "Can revive the dead-lettered steps of workflows"),
        ]
        constraints = [
            models.CheckConstraint(
                condition=Q(status__in=WorkflowStatus.values), name="pgqueue_wf_status_valid"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.name or 'workflow'} #{self.pk}"

    @property
    def steps_done(self) -> int:
        return self.steps_total - self.steps_unfinished - self.steps_failed


class WorkflowStep(models.Model):
    """One step: its message's fields (inserted into the queue when it is
    released), where it is, how many of the steps it follows have not
    ended, and its handler's result once done. ``message_id`` is its
    current message's id (the dead letter's ``message_id`` while it is
    dead-lettered)."""

    id = models.BigAutoField(primary_key=True)
    # (The unique constraint's index starts with workflow: no index of its own.)
    workflow = models.ForeignKey(
        Workflow,
        on_delete=models.DO_NOTHING,
        db_constraint=False,
        db_index=False,
        related_name="steps",
    )
    name = models.CharField(max_length=NAME_MAX_LENGTH)
    state = models.CharField(max_length=16, choices=StepState.choices, db_default=StepState.HELD)
    # How many of the steps it follows have not ended yet: released at 0.
    waiting_for = models.IntegerField(db_default=0)
    # It runs even when a step it follows failed (else it is cancelled).
    allow_failed = models.BooleanField(db_default=False)
    queue = models.CharField(max_length=conf.QUEUE_MAX_LENGTH)
    topic = models.CharField(max_length=conf.TOPIC_MAX_LENGTH)
    payload = models.JSONField(encoder=DjangoJSONEncoder)
    headers = models.JSONField(encoder=DjangoJSONEncoder, db_default={}, blank=True)
    priority = models.SmallIntegerField(db_default=0)
    # At release: run_at if given, else now + delay_seconds.
    run_at = DateTimeField(null=True, blank=True)
    delay_seconds = models.FloatField(db_default=0.0)
    max_attempts = models.IntegerField(null=True, blank=True)
    group_key = models.CharField(max_length=conf.KEY_MAX_LENGTH, null=True, blank=True)
    message_id = models.BigIntegerField(null=True, blank=True)
    result = models.JSONField(encoder=DjangoJSONEncoder, null=True, blank=True)
    created_at = DateTimeField(db_default=Now())
    finished_at = DateTimeField(null=True, blank=True)
    # Its message's partition (issue 38), copied into the message at release.
    partition_key = models.CharField(max_length=conf.KEY_MAX_LENGTH, null=True, blank=True)

    class Meta:
        indexes = [
            # A message's step when a dead letter is revived or resolved.
            models.Index(
                fields=["message_id"],
                condition=Q(message_id__isnull=False),
                name="pgqueue_wfstep_message_idx",
            ),
        ]
        constraints = [
            models.UniqueConstraint(fields=["workflow", "name"], name="pgqueue_wfstep_name_uniq"),
            models.CheckConstraint(
                condition=Q(state__in=StepState.values), name="pgqueue_wfstep_state_valid"
            ),
            models.CheckConstraint(
                condition=Q(waiting_for__gte=0), name="pgqueue_wfstep_waiting_for_gte_0"
            ),
            models.CheckConstraint(
                condition=~Q(partition_key=""), name="pgqueue_wfstep_partition_key_not_empty"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.name} ({self.topic}) of workflow #{self.workflow_id}"


class WorkflowDependency(models.Model):
    """``step`` runs after ``after`` has ended."""

    id = models.BigAutoField(primary_key=True)
    # (The unique constraint's index starts with step: no index of its own.)
    step = models.ForeignKey(
        WorkflowStep,
        on_delete=models.DO_NOTHING,
        db_constraint=False,
        db_index=False,
        related_name="+",
    )
    # Indexed: the steps after a finished one, what its end may release.
    after = models.ForeignKey(
        WorkflowStep, on_delete=models.DO_NOTHING, db_constraint=False, related_name="+"
    )

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["step", "after"], name="pgqueue_wfdep_uniq"),
        ]

    def __str__(self) -> str:
        return f"step {self.step_id} after step {self.after_id}"
