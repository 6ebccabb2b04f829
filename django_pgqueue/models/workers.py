"""``WorkerHeartbeat``: the running worker processes, as their heartbeats say."""

from __future__ import annotations

from django.db import models
from django.db.models.functions import Now

from django_pgqueue.fields import DateTimeField


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

    def __str__(self) -> str:
        return self.worker_id
