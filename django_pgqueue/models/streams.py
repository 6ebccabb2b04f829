"""The tables of ordered streams (the transactional outbox).

``StreamEvent`` is append-only: ``streams.publish()`` inserts a row in the
caller's transaction; maintenance deletes the rows that every subscription
of their stream has passed once they are older than
``PGQUEUE["STREAM_RETENTION"]``. Nothing updates a row.

Each event records its position (a bigint identity) and the id of the
transaction that inserted it (``xid8``, ``pg_current_xact_id()``), both
database defaults, so another program can publish with a plain
``INSERT INTO django_pgqueue_streamevent (stream, payload) VALUES (...)``.

Subscriptions read a stream in ``(xid, position)`` order and only below
``pg_snapshot_xmin(pg_current_snapshot())``: every transaction whose id is
below that has ended, so no event can appear there any more, and the order
is append-only (a checkpoint never has a late commit appear behind it).

``Subscription``: one row per subscription, its checkpoint (the last
``(xid, position)`` it passed) and its state. ``streams.subscriptions`` is the
only writer of its state and checkpoint.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django.core.exceptions import ValidationError
from django.core.serializers.json import DjangoJSONEncoder
from django.db import models
from django.db.models import Q
from django.db.models.expressions import RawSQL
from django.db.models.functions import Now

from django_pgqueue import conf
from django_pgqueue.fields import DateTimeField

if TYPE_CHECKING:
    from django.db.backends.base.base import BaseDatabaseWrapper
    from django.db.models.expressions import Expression

# Subscription names travel in queue names, log lines and metric labels.
SUBSCRIPTION_NAME_MAX_LENGTH = conf.QUEUE_MAX_LENGTH
STREAM_NAME_MAX_LENGTH = conf.TOPIC_MAX_LENGTH

# The admin and the metrics count a subscription's lag up to this many
# events (an index-only range scan each); beyond, they show this number.
LAG_COUNT_CAP = 1_000_000


class TransactionIdField(models.Field):
    """A PostgreSQL ``xid8`` (a 64-bit transaction id that never wraps
    around), as a Python int. Values are sent as strings, which Django's
    client-side binding writes as untyped literals that PostgreSQL reads as
    xid8 (there is no xid8 = bigint operator; check E105 keeps the queue's
    database on client-side binding)."""

    description = "PostgreSQL transaction id (xid8)"

    def db_type(self, connection: BaseDatabaseWrapper) -> str:
        return "xid8"

    def get_internal_type(self) -> str:
        return "TransactionIdField"

    def from_db_value(
        self, value: Any, expression: Expression, connection: BaseDatabaseWrapper
    ) -> int | None:
        return None if value is None else int(value)

    def to_python(self, value: Any) -> int | None:
        if value is None or (isinstance(value, int) and not isinstance(value, bool)):
            return value
        try:
            return int(value)
        except (TypeError, ValueError):
            raise ValidationError(f"{value!r} is not a transaction id") from None

    def get_prep_value(self, value: Any) -> str | None:
        value = super().get_prep_value(value)
        return None if value is None else str(self.to_python(value))


class StreamEvent(models.Model):
    position = models.BigAutoField(primary_key=True)
    stream = models.CharField(max_length=STREAM_NAME_MAX_LENGTH)
    key = models.CharField(
        max_length=conf.KEY_MAX_LENGTH,
        null=True,
        blank=True,
        help_text="What the event is about (an order id, say); handed to subscribers.",
    )
    payload = models.JSONField(encoder=DjangoJSONEncoder)
    headers = models.JSONField(encoder=DjangoJSONEncoder, db_default={}, blank=True)
    xid = TransactionIdField(
        db_default=models.Func(function="pg_current_xact_id"),
        help_text="The id of the transaction that published it.",
    )
    created_at = DateTimeField(db_default=Now())

    class Meta:
        verbose_name = "stream event"
        indexes = [
            # Delivery order within a stream: a subscription's next events
            # are a range scan after its checkpoint (and below the snapshot's
            # xmin); lag counts and retention read the same ranges.
            models.Index(fields=["stream", "xid", "position"], name="pgqueue_event_stream_idx"),
        ]
        constraints = [
            models.CheckConstraint(condition=~Q(stream=""), name="pgqueue_event_stream_not_empty"),
        ]

    def __str__(self) -> str:
        return f"{self.stream} @{self.position}"


class SubscriptionState(models.TextChoices):
    ACTIVE = "active"
    RETRYING = "retrying"  # an event failed; tried again at retry_at
    BLOCKED = "blocked"  # an event failed every attempt; an operator acts
    PAUSED = "paused"  # an operator paused it


# The states in which a worker delivers (a retrying one once retry_at is due).
DELIVERING = [SubscriptionState.ACTIVE, SubscriptionState.RETRYING]


class SubscriptionQuerySet(models.QuerySet["Subscription"]):
    def with_lag(self) -> SubscriptionQuerySet:
        """Annotate ``head_position`` (the stream's last event in delivery
        order), ``lag`` (committed events after the checkpoint, at most
        LAG_COUNT_CAP) and ``oldest_pending_at`` (when the first of them was
        published), each read through the stream index."""
        table = self.model._meta.db_table
        events = StreamEvent._meta.db_table
        after = (
            f"FROM {events} e WHERE e.stream = {table}.stream "
            f"AND (e.xid, e.position) > ({table}.checkpoint_xid, {table}.checkpoint_position)"
        )
        return self.annotate(
            head_position=RawSQL(
                f"SELECT e.position FROM {events} e WHERE e.stream = {table}.stream "
                "ORDER BY e.xid DESC, e.position DESC LIMIT 1",
                [],
                output_field=models.BigIntegerField(),
            ),
            lag=RawSQL(
                f"SELECT count(*) FROM (SELECT 1 {after} LIMIT {LAG_COUNT_CAP}) AS behind",
                [],
                output_field=models.BigIntegerField(),
            ),
            oldest_pending_at=RawSQL(
                f"SELECT e.created_at {after} ORDER BY e.xid, e.position LIMIT 1",
                [],
                output_field=DateTimeField(),
            ),
        )


class Subscription(models.Model):
    """One subscriber's place in its stream. Created by the worker (at start,
    for the subscribers it serves) or on first delivery."""

    # int4: the key of the subscription's transaction-scoped advisory lock.
    id = models.AutoField(primary_key=True)
    name = models.CharField(max_length=SUBSCRIPTION_NAME_MAX_LENGTH, unique=True)
    stream = models.CharField(max_length=STREAM_NAME_MAX_LENGTH)
    state = models.CharField(
        max_length=16, choices=SubscriptionState.choices, db_default=SubscriptionState.ACTIVE
    )
    checkpoint_xid = TransactionIdField(
        db_default=0, help_text="Transaction id of the last event passed (0: none yet)."
    )
    checkpoint_position = models.BigIntegerField(
        db_default=0, help_text="Position of the last event passed (0: none yet)."
    )
    attempts = models.IntegerField(db_default=0, help_text="Failed attempts at the next event.")
    failing_position = models.BigIntegerField(
        null=True, blank=True, help_text="The event that failed (retrying or blocked)."
    )
    last_error = models.TextField(db_default="", blank=True)
    retry_at = DateTimeField(null=True, blank=True, help_text="Next try (retrying).")
    delivered = models.BigIntegerField(
        db_default=0, help_text="Events passed (handled or dead-lettered) since it was created."
    )
    delivered_at = DateTimeField(null=True, blank=True, help_text="Last checkpoint move.")
    created_at = DateTimeField(db_default=Now())
    updated_at = DateTimeField(db_default=Now())

    objects = SubscriptionQuerySet.as_manager()

    class Meta:
        constraints = [
            models.CheckConstraint(
                condition=Q(state__in=SubscriptionState.values), name="pgqueue_sub_state_valid"
            ),
            models.CheckConstraint(condition=Q(attempts__gte=0), name="pgqueue_sub_attempts_gte_0"),
            models.CheckConstraint(
                condition=Q(checkpoint_position__gte=0), name="pgqueue_sub_position_gte_0"
            ),
            models.CheckConstraint(
                condition=~Q(name="") & ~Q(stream=""), name="pgqueue_sub_names_not_empty"
            ),
        ]
        permissions = [
            ("pause_subscription", "Can pause and resume subscriptions"),
            ("reset_subscription", "Can reset the checkpoint of subscriptions"),
        ]

    def __str__(self) -> str:
        return f"{self.name} ({self.stream})"
