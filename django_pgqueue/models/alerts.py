"""``AlertState``: the suppression of dead-letter alerts (observability/alerts.py)."""

from __future__ import annotations

from django.db import models

from django_pgqueue import conf
from django_pgqueue.fields import DateTimeField
from django_pgqueue.models.messages import Category


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

    def __str__(self) -> str:
        return f"{self.topic} / {self.category}"
