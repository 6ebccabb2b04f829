"""``GroupRelease``: the hand-off of message groups (``group_key``)."""

from __future__ import annotations

from django.db import models
from django.db.models.functions import Now

from django_pgqueue import conf
from django_pgqueue.fields import DateTimeField


class GroupRelease(models.Model):
    """A message group that may need its next message promoted.

    Written by triggers (migration 0009) in the same transaction as the
    change that may have left the group without a head: a grouped message
    inserted (it arrives blocked) or deleted (acknowledged, dead-lettered,
    removed), a dead letter that held its group revived, resolved or
    deleted. Workers consume the rows (``groups.promote_groups``): for
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

    def __str__(self) -> str:
        return f"release of group {self.group_key}"
