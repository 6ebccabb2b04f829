"""The history of finished messages (``FinishedMessage``) and the per-minute
counts of outcomes (``OutcomeCount``) that the admin's queue overview draws.

Both are written by the statements that finish a message, in the same
transaction (``sql_history``): an acknowledgement (done), a move to the
dead-letter table (dead-lettered), a cancellation (cancelled); a retry only
counts. Neither is written when ``PGQUEUE["KEEP_FINISHED"]`` is 0. The
maintenance round deletes history rows older than KEEP_FINISHED and counts
older than two days (``retention``).
"""

from __future__ import annotations

from django.core.serializers.json import DjangoJSONEncoder
from django.db import models
from django.db.models import Q

from django_pgqueue import conf
from django_pgqueue.fields import BrinIndex, DateTimeField


class Outcome(models.TextChoices):
    """How a message ended (and, for the counts, ``retried``: a failed run
    that goes back to wait)."""

    DONE = "done"
    CANCELLED = "cancelled"
    DEAD_LETTERED = "dead_lettered", "Dead-lettered"
    RETRIED = "retried"


class FinishedMessage(models.Model):
    """A message that finished, as it was when it did. ``started_at`` is when
    its last run was claimed (None: cancelled before any run),
    ``finished_at`` when the statement that finished it ran (the worker
    sends acknowledgements in batches: up to a few milliseconds after the
    handler returned). ``dead_letter_id`` names the DeadLetter row of a
    dead-lettered message (no foreign key: each table is pruned on its own
    schedule)."""

    id = models.BigAutoField(primary_key=True)
    message_id = models.BigIntegerField(help_text="The id it had in the queue.")
    queue = models.CharField(max_length=conf.QUEUE_MAX_LENGTH)
    topic = models.CharField(max_length=conf.TOPIC_MAX_LENGTH)
    payload = models.JSONField(encoder=DjangoJSONEncoder)
    headers = models.JSONField(encoder=DjangoJSONEncoder, db_default={}, blank=True)
    outcome = models.CharField(max_length=16, choices=Outcome.choices)
    attempts = models.IntegerField()
    dedup_key = models.CharField(max_length=conf.KEY_MAX_LENGTH, null=True, blank=True)
    dead_letter_id = models.BigIntegerField(null=True, blank=True)
    enqueued_at = DateTimeField()
    started_at = DateTimeField(null=True, blank=True)
    finished_at = DateTimeField()
    worker = models.CharField(max_length=255, blank=True)

    class Meta:
        verbose_name = "finished message"
        # Every acknowledgement inserts here, so each B-tree costs every
        # message a WAL record and an index descent: the only one is the
        # primary key, whose order is the order the rows were written in,
        # that is when the messages finished (the admin's newest first, the
        # pruning's oldest first). finished_at and message_id grow with it,
        # so BRIN indexes (a summary per range of pages, nothing written per
        # row) find a time range or a message id by reading the few page
        # ranges that can hold it.
        indexes = [
            # Date filters; the pruning's range of old rows.
            BrinIndex(
                fields=["finished_at"], pages_per_range=32, name="pgqueue_hist_finished_brin"
            ),
            # "What became of message 42?": the search and the dead letter's link.
            BrinIndex(fields=["message_id"], pages_per_range=32, name="pgqueue_hist_message_brin"),
            # Search by dedup key: only the rows that have one pay for an entry.
            models.Index(
                fields=["dedup_key"],
                condition=Q(dedup_key__isnull=False),
                name="pgqueue_hist_dedup_idx",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.topic} #{self.message_id} ({self.outcome})"

    @property
    def duration(self) -> float | None:
        """Seconds from the claim of its last run to its end (None: it never ran)."""
        if self.started_at is None:
            return None
        return max((self.finished_at - self.started_at).total_seconds(), 0.0)


class OutcomeCount(models.Model):
    """How many messages of ``queue`` ended with ``outcome`` (or were
    retried) in the minute starting at ``minute``, added to by each batch
    that finishes messages (an upsert), so the overview reads at most a
    day's worth of small rows, never the history itself.

    ``shard``: the server process (``pg_backend_pid()``) of the connection
    that counted, so that no two connections ever update the same row: an
    upsert holds its row lock until its transaction commits, and an atomic
    batch's commit waits for the WAL flush; with one row per minute and
    queue, every worker's commits would queue behind each other's flush.
    The maintenance round folds the rows of past minutes into shard 0 (one
    row per minute, queue and outcome)."""

    id = models.BigAutoField(primary_key=True)
    minute = DateTimeField()
    queue = models.CharField(max_length=conf.QUEUE_MAX_LENGTH)
    outcome = models.CharField(max_length=16, choices=Outcome.choices)
    shard = models.IntegerField(db_default=0)
    count = models.BigIntegerField()

    class Meta:
        verbose_name = "outcome count"
        constraints = [
            # The upsert's conflict target; also the overview's range scan.
            models.UniqueConstraint(
                fields=["minute", "queue", "outcome", "shard"], name="pgqueue_count_minute_uniq"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.minute:%Y-%m-%d %H:%M} {self.queue} {self.outcome}: {self.count}"
