"""The dead-letter table, ``DeadLetter``: the messages that failed for good,
kept for triage (revive, resolve, set the category).

A message lives in exactly one of the queue and dead-letter tables:
``lifecycle.dead_letter()`` moves it in one transaction. ``deadletters``
is the only writer of ``DeadLetter.state``.
"""

from __future__ import annotations

from django.core.serializers.json import DjangoJSONEncoder
from django.db import models
from django.db.models import Q
from django.db.models.functions import Now

from django_pgqueue import conf
from django_pgqueue.fields import DateTimeField, FiniteDatesManager
from django_pgqueue.models.messages import Category


class DeadLetterState(models.TextChoices):
    NEW = "new"
    REVIVED = "revived"
    RESOLVED = "resolved"


class DeadLetter(models.Model):
    id = models.BigAutoField(primary_key=True)
    message_id = models.BigIntegerField(db_index=True, help_text="The id it had in the queue.")
    queue = models.CharField(max_length=conf.QUEUE_MAX_LENGTH)
    topic = models.CharField(max_length=conf.TOPIC_MAX_LENGTH)
    payload = models.JSONField(encoder=DjangoJSONEncoder)
    headers = models.JSONField(encoder=DjangoJSONEncoder, db_default={}, blank=True)
    priority = models.SmallIntegerField(db_default=0)
    group_key = models.CharField(max_length=conf.KEY_MAX_LENGTH, null=True, blank=True)
    dedup_key = models.CharField(max_length=conf.KEY_MAX_LENGTH, null=True, blank=True)
    category = models.CharField(max_length=16, choices=Category.choices)
    reason = models.TextField()
    traceback = models.TextField(db_default="", blank=True)
    attempts = models.IntegerField(db_default=0)
    max_attempts = models.IntegerField(null=True, blank=True)
    first_failed_at = DateTimeField(null=True, blank=True)
    last_failed_at = DateTimeField(null=True, blank=True)
    dead_lettered_at = DateTimeField(db_default=Now())
    worker = models.CharField(max_length=255, db_default="", blank=True)
    state = models.CharField(
        max_length=16, choices=DeadLetterState.choices, db_default=DeadLetterState.NEW
    )
    revived_at = DateTimeField(null=True, blank=True)
    revive_count = models.IntegerField(db_default=0)
    revived_message_id = models.BigIntegerField(null=True, blank=True)
    revived_by = models.CharField(max_length=150, db_default="", blank=True)
    resolved_at = DateTimeField(null=True, blank=True)
    resolved_by = models.CharField(max_length=150, db_default="", blank=True)
    category_set_by = models.CharField(max_length=150, db_default="", blank=True)
    category_set_at = DateTimeField(null=True, blank=True)
    notes = models.TextField(db_default="", blank=True)
    holds_group = models.BooleanField(
        db_default=False,
        help_text="Its group stays blocked until it is revived, resolved or deleted.",
    )
    # Its message's partition (issue 38); a revived one goes back into it.
    partition_key = models.CharField(max_length=conf.KEY_MAX_LENGTH, null=True, blank=True)

    objects = FiniteDatesManager()  # the admin's date hierarchy

    class Meta:
        indexes = [
            models.Index(fields=["state", "-dead_lettered_at"], name="pgqueue_dl_state_idx"),
            models.Index(fields=["topic", "category"], name="pgqueue_dl_topic_cat_idx"),
            models.Index(
                fields=["group_key"],
                condition=Q(holds_group=True),
                name="pgqueue_dl_holds_group_idx",
            ),
        ]
        constraints = [
            models.CheckConstraint(
                condition=Q(state__in=DeadLetterState.values), name="pgqueue_dl_state_valid"
            ),
            models.CheckConstraint(
                condition=Q(category__in=Category.values), name="pgqueue_dl_category_valid"
            ),
            models.CheckConstraint(
                condition=~Q(partition_key=""), name="pgqueue_dl_partition_key_not_empty"
            ),
        ]
        permissions = [
            ("revive_deadletter", "Can revive dead letters"),
            ("resolve_deadletter", "Can resolve dead letters"),
            ("categorize_deadletter", "Can set the category of dead letters"),
        ]

    def __str__(self) -> str:
        return f"{self.topic} dead letter #{self.pk}"
