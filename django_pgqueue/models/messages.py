"""The queue table, ``Message``: one row per message that is not finished yet.

Every column that a plain SQL ``INSERT`` may leave out has a database-level
default (``db_default``), so another program can enqueue with
``INSERT INTO django_pgqueue_message (topic, payload) VALUES (...)``.

A message lives in exactly one of the queue and dead-letter tables:
``lifecycle.dead_letter()`` moves it in one transaction.
"""

from __future__ import annotations

from typing import Any

from django.core.serializers.json import DjangoJSONEncoder
from django.db import models
from django.db.models import Q
from django.db.models.base import ModelState
from django.db.models.functions import Now
from django.db.models.signals import post_init, pre_init

from django_pgqueue import conf
from django_pgqueue.fields import TIMESTAMP_MAX, DateTimeField


class Status(models.TextChoices):
    # Waiting covers ready, delayed and waiting-to-retry: run_at tells them apart.
    WAITING = "waiting"
    # Behind an earlier message of its group (group_key): no worker claims it
    # until it becomes its group's next message (see GroupRelease).
    BLOCKED = "blocked", "Blocked (behind its group)"
    PROCESSING = "processing"
    DONE = "done"
    # Cancelled (``django_pgqueue.cancel``): it never runs (again). The row
    # stays for the record until CANCELLED_RETENTION has passed; no index of
    # the claim holds it, and its dedup key and group are free.
    CANCELLED = "cancelled"


class Category(models.TextChoices):
    """What a failure is, which decides its policy (policy.py): a message's
    last failure and a dead letter's cause."""

    TRANSIENT = "transient"
    DEPENDENCY = "dependency"
    PERMANENT = "permanent"
    BUSINESS = "business"
    UNKNOWN = "unknown"


# The statuses a message has until it is finished; dedup keys are unique among them.
UNFINISHED = [Status.WAITING, Status.BLOCKED, Status.PROCESSING]
# A group's head: the one message of a group that may be claimed or run.
GROUP_HEAD = [Status.WAITING, Status.PROCESSING]


class Message(models.Model):
    """A message in the queue, what a handler is called with. ``topic`` picks
    the handler, ``payload`` and ``headers`` are its JSON; ``attempts`` counts
    the runs so far (this one included, inside a handler), ``last_error`` and
    ``last_error_category`` tell why the previous one failed. An acknowledged
    message's row is deleted; one that failed for good moves to
    ``DeadLetter``."""

    id = models.BigAutoField(primary_key=True)
    queue = models.CharField(max_length=conf.QUEUE_MAX_LENGTH, db_default="default")
    topic = models.CharField(max_length=conf.TOPIC_MAX_LENGTH)
    payload = models.JSONField(encoder=DjangoJSONEncoder)
    headers = models.JSONField(encoder=DjangoJSONEncoder, db_default={}, blank=True)
    status = models.CharField(max_length=16, choices=Status.choices, db_default=Status.WAITING)
    priority = models.SmallIntegerField(db_default=0, help_text="Higher runs first.")
    run_at = DateTimeField(db_default=Now(), help_text="Not before this time.")
    attempts = models.IntegerField(db_default=0)
    max_attempts = models.IntegerField(
        null=True, blank=True, help_text="Empty: the handler's or the global limit."
    )
    lease_expires_at = DateTimeField(null=True, blank=True)
    locked_by = models.CharField(max_length=255, db_default="", blank=True)
    lease_token = models.UUIDField(null=True, blank=True)
    dedup_key = models.CharField(max_length=conf.KEY_MAX_LENGTH, null=True, blank=True)
    group_key = models.CharField(max_length=conf.KEY_MAX_LENGTH, null=True, blank=True)
    last_error = models.TextField(db_default="", blank=True)
    last_error_category = models.CharField(
        max_length=16, choices=Category.choices, db_default="", blank=True
    )
    first_failed_at = DateTimeField(null=True, blank=True)
    created_at = DateTimeField(db_default=Now())
    updated_at = DateTimeField(db_default=Now())
    # When cancellation was asked for while the message was processing: its
    # worker is told (its handler's cancel_requested() turns True), and the
    # run may end no other way than done or cancelled (never retried). Last,
    # so the columns before it keep their positions (migration 0015).
    cancel_requested_at = DateTimeField(null=True, blank=True)
    # The workflow step it runs (models.workflows.WorkflowStep), if any: its
    # acknowledgement, dead letter or cancellation moves the step too.
    workflow_step_id = models.BigIntegerField(null=True, blank=True)
    # Its partition of the queue (issue 38), e.g. a tenant: messages without
    # one share the queue's default partition. Last, so the columns before
    # it keep their positions (migration 0019).
    partition_key = models.CharField(max_length=conf.KEY_MAX_LENGTH, null=True, blank=True)
    # The round of the fair claim a waiting message is in (sql.claim): its
    # partition's previous round + 1, or the queue's current round if that
    # is later. enqueue() gives it to a keyed message due at once; the claim
    # to those it read without one and did not take (keyed ones that became
    # ready later: a delay, a retry, a release, plain SQL; and in a queue
    # with partitions, the default partition's). NULL on every other row: a
    # queue without partitions never has one. The claim clears it.
    fair_tag = models.BigIntegerField(null=True, blank=True, editable=False)

    # Not a column: in a workflow step's handler, the worker sets it to the
    # handle on the step's workflow (django_pgqueue.workflows.WorkflowRun);
    # None for a message outside one.
    workflow: Any = None

    # Not a column: set on the messages that enqueue() and enqueue_many()
    # return. True when the row was inserted, False when an unfinished
    # message held its dedup_key (that message is returned), None while the
    # insert waits for the caller's commit on another database alias.
    created: bool | None

    class Meta:
        indexes = [
            # Exactly the claimable rows of the queue's default partition (no
            # key) without a round, in claim order: the claim reads the head
            # of this index, whatever else the table holds. The rows with a
            # round, and the keyed ones, are in the next two, so that no
            # stream of the claim walks past another's rows.
            models.Index(
                fields=["queue", "-priority", "run_at", "id"],
                condition=Q(
                    status=Status.WAITING, partition_key__isnull=True, fair_tag__isnull=True
                ),
                name="pgqueue_msg_claim_idx",
            ),
            # Rows with a round, in the fair claim's order (round by round,
            # oldest first within one): keyed rows, and in a queue with
            # partitions, rows of the default partition the claim ranked.
            models.Index(
                fields=["queue", "-priority", "fair_tag", "id"],
                condition=Q(status=Status.WAITING, fair_tag__isnull=False),
                name="pgqueue_msg_fair_idx",
            ),
            # Keyed rows without a round, oldest first (by run_at alone, so
            # that a claim's scan stops at the first not yet due).
            models.Index(
                fields=["queue", "run_at", "id"],
                condition=Q(
                    status=Status.WAITING, partition_key__isnull=False, fair_tag__isnull=True
                ),
                name="pgqueue_msg_keyed_idx",
            ),
            # A partition's last round: where enqueue() puts its next message.
            models.Index(
                fields=["queue", "partition_key", "fair_tag"],
                condition=Q(status=Status.WAITING, fair_tag__isnull=False),
                name="pgqueue_msg_round_idx",
            ),
            # Waiting rows by due time: the next run_at a worker sleeps until,
            # and the claim's way in when most waiting rows are delayed.
            models.Index(
                fields=["queue", "run_at"],
                condition=Q(status=Status.WAITING),
                name="pgqueue_msg_due_idx",
            ),
            # Leased rows by expiry: the rescue of crashed workers' messages
            # (lease_expires_at < now) and the probe's next expiry (min()).
            # "IS NOT NULL" in the condition keeps the statements that find
            # leased rows by id and token (acknowledgements, lease
            # extensions) on the primary key: with "status = 'processing'"
            # alone they could use this index too, and statistics taken
            # while nothing was leased made the planner read all of it,
            # every worker's leases, for each acknowledgement (migration 0011).
            models.Index(
                fields=["lease_expires_at"],
                condition=Q(status=Status.PROCESSING, lease_expires_at__isnull=False),
                name="pgqueue_msg_lease_idx",
            ),
            # A group's blocked messages in enqueue order: the next one to
            # promote when its head leaves.
            models.Index(
                fields=["group_key", "id"],
                condition=Q(status=Status.BLOCKED),
                name="pgqueue_msg_group_next_idx",
            ),
            # Cancelled rows by when they were cancelled: maintenance deletes
            # those past CANCELLED_RETENTION (migration 0015).
            models.Index(
                fields=["updated_at"],
                condition=Q(status=Status.CANCELLED),
                name="pgqueue_msg_cancelled_idx",
            ),
        ]
        permissions = [("cancel_message", "Can cancel messages")]
        constraints = [
            models.UniqueConstraint(
                fields=["topic", "dedup_key"],
                # Only rows with a key: the others (nearly all) cost no index
                # entry on every insert and claim.
                condition=Q(status__in=UNFINISHED, dedup_key__isnull=False),
                name="pgqueue_msg_dedup_uniq",
            ),
            # At most one message of a group is claimable or running: the
            # database itself refuses a second head, whatever a client does.
            models.UniqueConstraint(
                fields=["group_key"],
                condition=Q(status__in=GROUP_HEAD, group_key__isnull=False),
                name="pgqueue_msg_group_head_uniq",
            ),
            models.CheckConstraint(
                condition=Q(status__in=Status.values), name="pgqueue_msg_status_valid"
            ),
            models.CheckConstraint(
                condition=Q(priority__gte=conf.PRIORITY_MIN, priority__lte=conf.PRIORITY_MAX),
                name="pgqueue_msg_priority_range",
            ),
            models.CheckConstraint(condition=Q(attempts__gte=0), name="pgqueue_msg_attempts_gte_0"),
            models.CheckConstraint(
                condition=Q(max_attempts__isnull=True) | Q(max_attempts__gte=1),
                name="pgqueue_msg_max_attempts_gte_1",
            ),
            models.CheckConstraint(
                condition=~Q(topic="") & ~Q(queue=""), name="pgqueue_msg_names_not_empty"
            ),
            # NULL is the default partition; '' would be a second one by another name.
            models.CheckConstraint(
                condition=~Q(partition_key=""), name="pgqueue_msg_partition_key_not_empty"
            ),
            # A leased row always has its lease: the rescue finds a dead
            # worker's rows by their expiry, and a row without one would wait
            # in "processing" forever (migration 0013 expires any it finds).
            models.CheckConstraint(
                condition=~Q(status=Status.PROCESSING)
                | Q(lease_token__isnull=False, lease_expires_at__isnull=False),
                name="pgqueue_msg_processing_has_lease",
            ),
            # ... and the lease ends at a date: one at 'infinity' (or past
            # year 9999) would never expire, and the rescue never return the
            # row. Refused rather than rescued: a worker never writes one, and
            # a live worker's row is not taken from it on the say-so of
            # another client's bad write (migration 0017 expires any it finds).
            models.CheckConstraint(
                condition=~Q(status=Status.PROCESSING) | Q(lease_expires_at__lte=TIMESTAMP_MAX),
                name="pgqueue_msg_processing_lease_finite",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.topic} #{self.pk}"

    @classmethod
    def from_db(cls, db: str | None, field_names: Any, values: Any, **kwargs: Any) -> Message:
        """Django's documented hook for loading a row, made cheap for the
        common case: the worker builds one Message per claimed row (and every
        queryset of messages goes through here too), and ``Model.__init__``
        with its per-field ``setattr`` is a large share of the worker's CPU
        per message (``benchmarks/instructions.py`` counts it). The result is
        the instance Django builds: the fields' values in ``__dict__`` (where
        the fields' descriptors read them), a ``ModelState`` with
        ``adding=False`` and ``db``. Django's own path is taken whenever the
        shortcut could differ: a row without every column
        (``only()``/``defer()``), receivers of ``pre_init`` or ``post_init``
        for Message (they must see ``__init__`` run), or any extra argument a
        newer Django passes (6.1's ``fetch_mode``).
        """
        if (
            kwargs
            or len(values) != len(_ATTNAMES)
            # Receivers for any model first (two list reads), then for
            # Message (two calls): most projects have none at all.
            or ((pre_init.receivers or post_init.receivers) and _init_receivers(cls))
        ):
            return super().from_db(db, field_names, values, **kwargs)
        new = cls.__new__(cls)
        # Positional, in the concrete fields' order, as Model.from_db passes
        # a full row to __init__; no field of Message has a setter descriptor
        # (no foreign key), so this is what __init__'s setattr does.
        new.__dict__.update(zip(_ATTNAMES, values, strict=False))  # lengths checked above
        state = ModelState()
        state.adding = False
        state.db = db
        new._state = state
        return new


# Message's columns in the model's order (Model.from_db's positional order).
_ATTNAMES = [field.attname for field in Message._meta.concrete_fields]


def _init_receivers(model: type[models.Model]) -> bool:
    return pre_init.has_listeners(model) or post_init.has_listeners(model)
