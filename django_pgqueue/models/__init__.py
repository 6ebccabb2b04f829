"""The queue table (``Message``) and the dead-letter table (``DeadLetter``).

Every column that a plain SQL ``INSERT`` may leave out has a database-level
default (``db_default``), so another program can enqueue with
``INSERT INTO django_pgqueue_message (topic, payload) VALUES (...)``.

A message lives in exactly one of the two tables: ``lifecycle.dead_letter()``
moves it in one transaction.
"""

import datetime
import functools

from django.conf import settings
from django.core.serializers.json import DjangoJSONEncoder
from django.db import models
from django.db.models import Q
from django.db.models.functions import Now

from django_pgqueue import conf
from django_pgqueue.fields import TIMESTAMP_MAX, TIMESTAMP_MIN, DateTimeField, FiniteDatesQuerySet

# PostgreSQL's infinite timestamps as the datetimes every read gives them (fields.py).
_INFINITE = {"infinity": TIMESTAMP_MAX, "-infinity": TIMESTAMP_MIN}


@functools.lru_cache(maxsize=1024)
def timestamp_from_text(text):
    """A timestamptz column read as text (``col::text``) as Django would
    return it: aware in UTC with USE_TZ (the session's time zone then is
    UTC), naive local time without. The hot paths (claim, enqueue_many) read
    timestamps this way: many repeat (one now() per statement), and
    ``fromisoformat`` is far cheaper than Django's timestamptz loader."""
    if text is None:
        return None
    if text in _INFINITE:  # only another client's raw SQL writes these
        value = _INFINITE[text]
    elif text.endswith(" BC"):  # so do these, and years past 9999 ("10000-01-01 ...")
        value = TIMESTAMP_MIN
    elif text.index("-", 1) > 4:
        value = TIMESTAMP_MAX
    else:
        value = min(max(datetime.datetime.fromisoformat(text), TIMESTAMP_MIN), TIMESTAMP_MAX)
    return value if settings.USE_TZ else value.replace(tzinfo=None)


class Status(models.TextChoices):
    # Waiting covers ready, delayed and waiting-to-retry: run_at tells them apart.
    WAITING = "waiting", "Waiting"
    # Behind an earlier message of its group (group_key): no worker claims it
    # until it becomes its group's next message (see GroupRelease).
    BLOCKED = "blocked", "Blocked (behind its group)"
    PROCESSING = "processing", "Processing"
    DONE = "done", "Done"


class Category(models.TextChoices):
    TRANSIENT = "transient", "Transient"
    DEPENDENCY = "dependency", "Dependency"
    PERMANENT = "permanent", "Permanent"
    BUSINESS = "business", "Business"
    UNKNOWN = "unknown", "Unknown"


class DeadLetterState(models.TextChoices):
    NEW = "new", "New"
    REVIVED = "revived", "Revived"
    RESOLVED = "resolved", "Resolved"


# The statuses a message has until it is finished; dedup keys are unique among them.
UNFINISHED = [Status.WAITING, Status.BLOCKED, Status.PROCESSING]
# A group's head: the one message of a group that may be claimed or run.
GROUP_HEAD = [Status.WAITING, Status.PROCESSING]


class Message(models.Model):
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

    class Meta:
        indexes = [
            # Exactly the claimable rows, in claim order: the claim reads the
            # head of this index, whatever else the table holds.
            models.Index(
                fields=["queue", "-priority", "run_at", "id"],
                condition=Q(status=Status.WAITING),
                name="pgqueue_msg_claim_idx",
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
        ]
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
            # A leased row always has its lease: the rescue finds a dead
            # worker's rows by their expiry, and a row without one would wait
            # in "processing" forever (migration 0013 expires any it finds).
            models.CheckConstraint(
                condition=~Q(status=Status.PROCESSING)
                | Q(lease_token__isnull=False, lease_expires_at__isnull=False),
                name="pgqueue_msg_processing_has_lease",
            ),
        ]

    def __str__(self):
        return f"{self.topic} #{self.pk}"


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

    objects = FiniteDatesQuerySet.as_manager()  # the admin's date hierarchy

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
        ]
        permissions = [
            ("revive_deadletter", "Can revive dead letters"),
            ("resolve_deadletter", "Can resolve dead letters"),
            ("categorize_deadletter", "Can set the category of dead letters"),
        ]

    def __str__(self):
        return f"{self.topic} dead letter #{self.pk}"


class GroupRelease(models.Model):
    """A message group that may need its next message promoted.

    Written by triggers (migration 0009) in the same transaction as the
    change that may have left the group without a head: a grouped message
    inserted (it arrives blocked) or deleted (acknowledged, dead-lettered,
    removed), a dead letter that held its group revived, resolved or
    deleted. Workers consume the rows (``lifecycle.promote_groups``): for
    each group, under a transaction-scoped advisory lock, if no message of
    the group is waiting or processing and no dead letter holds it, its
    oldest blocked message becomes waiting. A row is a hint that is always
    safe to act on; duplicates cost a lookup.
    """

    id = models.BigAutoField(primary_key=True)
    group_key = models.CharField(max_length=conf.KEY_MAX_LENGTH)
    created_at = DateTimeField(db_default=Now())

    class Meta:
        verbose_name = "group release"

    def __str__(self):
        return f"release of group {self.group_key}"


class WorkerHeartbeat(models.Model):
    """One row per running worker process, written by its heartbeat.

    A worker counts as alive while ``expires_at`` (its last heartbeat plus
    three heartbeat intervals, as the worker itself computed it) is in the
    future. A worker that stops cleanly deletes its row; maintenance deletes
    rows of dead workers a day after their last heartbeat.
    """

    worker_id = models.CharField(max_length=255, primary_key=True)
    hostname = models.CharField(max_length=255)
    pid = models.IntegerField()
    queues = models.JSONField(help_text="The queues it serves, in claim order.")
    concurrency = models.IntegerField()
    started_at = DateTimeField(db_default=Now())
    heartbeat_at = DateTimeField(db_default=Now())
    expires_at = DateTimeField()
    inflight = models.IntegerField(db_default=0, help_text="Messages its handlers hold.")
    processed = models.BigIntegerField(db_default=0, help_text="Messages it has finished.")

    class Meta:
        verbose_name = "worker"
        indexes = [models.Index(fields=["expires_at"], name="pgqueue_worker_expires_idx")]

    def __str__(self):
        return self.worker_id


class AlertState(models.Model):
    """Alert suppression, shared by every process: when the last alert for a
    topic and category went out, and how many were held back since."""

    topic = models.CharField(max_length=conf.TOPIC_MAX_LENGTH)
    category = models.CharField(max_length=16, choices=Category.choices)
    last_sent_at = DateTimeField()
    suppressed = models.IntegerField(db_default=0)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["topic", "category"], name="pgqueue_alert_uniq"),
        ]

    def __str__(self):
        return f"{self.topic} / {self.category}"


class TaskStatus(models.TextChoices):
    # The values of django.tasks.TaskResultStatus (this module imports no
    # django.tasks: it must load on Django 5.2 too).
    READY = "READY", "Ready"
    RUNNING = "RUNNING", "Running"
    FAILED = "FAILED", "Failed"
    SUCCESSFUL = "SUCCESSFUL", "Successful"


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

    def __str__(self):
        return f"{self.task_path} {self.pk}"


# --- streams (the transactional outbox): their models live in stream_models.py ---------

from django_pgqueue.models.streams import (  # noqa: E402, F401
    StreamEvent,
    Subscription,
    SubscriptionState,
)
