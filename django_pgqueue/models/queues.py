"""The run-time state of the queues: paused or not, and limits that override
``PGQUEUE["QUEUES"]`` (``QueueState``); the starts of rate-limited queues
(``QueueStart``); limits of named partitions that override the queue's
``"partition"`` settings (``PartitionLimit``) and the starts of partitions
with a rate (``PartitionStart``). Changed only through
``django_pgqueue.controls`` (and the limited claim, for the starts)."""

from __future__ import annotations

from django.db import models
from django.db.models import Q
from django.db.models.functions import Now

from django_pgqueue import conf
from django_pgqueue.conf.limits import CONCURRENCY_MAX
from django_pgqueue.fields import DateTimeField


def limit_constraints(prefix: str) -> list[models.BaseConstraint]:
    """The checks of a row's limits (QueueState's, PartitionLimit's): a
    concurrency from 1 to CONCURRENCY_MAX or none, a rate "N/s|m|h" or ""."""
    return [
        models.CheckConstraint(
            condition=Q(concurrency__isnull=True)
            | Q(concurrency__gte=1, concurrency__lte=CONCURRENCY_MAX),
            name=f"{prefix}_concurrency_range",
        ),
        models.CheckConstraint(
            condition=Q(rate="") | Q(rate__regex=r"^[1-9][0-9]{0,8}/[smh]$"),
            name=f"{prefix}_rate_format",
        ),
    ]


class QueueState(models.Model):
    """One row per queue whose state was ever changed at run time. A queue
    without a row is running, with the limits of the settings.

    Every worker keeps the paused queues and the limits in memory, read
    again when a NOTIFY says they changed (within a second) and on its poll
    interval: the claim of a queue without limits never reads this table.
    """

    name = models.CharField(max_length=conf.QUEUE_MAX_LENGTH, primary_key=True)
    paused = models.BooleanField(db_default=False)
    paused_at = DateTimeField(null=True, blank=True)
    # Who paused or resumed it last (a user name, a login name), for the record.
    changed_by = models.CharField(max_length=150, db_default="", blank=True)
    # True: the limits below hold, not those of PGQUEUE["QUEUES"] (an empty
    # one meaning "none"); False: the settings' hold.
    limits_set = models.BooleanField(db_default=False)
    concurrency = models.IntegerField(null=True, blank=True)
    rate = models.CharField(max_length=16, db_default="", blank=True)
    updated_at = DateTimeField(db_default=Now())

    class Meta:
        verbose_name = "queue"
        permissions = [("pause_queuestate", "Can pause and resume queues")]
        constraints = limit_constraints("pgqueue_queue")

    def __str__(self) -> str:
        return self.name


class QueueStart(models.Model):
    """How many messages of a rate-limited queue one claim started, and
    when: the limited claim counts the starts in the rate's window from
    here, and deletes those older than the longest window (an hour)."""

    id = models.BigAutoField(primary_key=True)
    queue = models.CharField(max_length=conf.QUEUE_MAX_LENGTH)
    started_at = DateTimeField()
    count = models.IntegerField()

    class Meta:
        verbose_name = "queue start"
        indexes = [models.Index(fields=["queue", "started_at"], name="pgqueue_start_window_idx")]

    def __str__(self) -> str:
        return f"{self.count} of {self.queue} at {self.started_at}"


class PartitionLimit(models.Model):
    """The limits of one named partition of a queue, in place of those the
    queue's ``"partition"`` settings give every partition (a paying
    tenant's higher rate). Empty: no limit of that kind. The partition ""
    is the queue's default one (messages without a key)."""

    queue = models.CharField(max_length=conf.QUEUE_MAX_LENGTH)
    partition_key = models.CharField(max_length=conf.KEY_MAX_LENGTH, blank=True)
    concurrency = models.IntegerField(null=True, blank=True)
    rate = models.CharField(max_length=16, db_default="", blank=True)
    changed_by = models.CharField(max_length=150, db_default="", blank=True)
    updated_at = DateTimeField(db_default=Now())

    class Meta:
        verbose_name = "partition limit"
        constraints = [
            models.UniqueConstraint(
                fields=["queue", "partition_key"], name="pgqueue_partition_limit_uniq"
            ),
            *limit_constraints("pgqueue_partition"),
        ]

    def __str__(self) -> str:
        return f"{self.queue}: {self.partition_key or '(default partition)'}"


class PartitionStart(models.Model):
    """How many messages of one partition of a queue one claim started, and
    when (a queue whose partitions have a rate): as QueueStart, per
    partition ("": the default partition)."""

    id = models.BigAutoField(primary_key=True)
    queue = models.CharField(max_length=conf.QUEUE_MAX_LENGTH)
    partition_key = models.CharField(max_length=conf.KEY_MAX_LENGTH, blank=True)
    started_at = DateTimeField()
    count = models.IntegerField()

    class Meta:
        verbose_name = "partition start"
        indexes = [models.Index(fields=["queue", "started_at"], name="pgqueue_pstart_window_idx")]

    def __str__(self) -> str:
        return f"{self.count} of {self.queue}/{self.partition_key} at {self.started_at}"
