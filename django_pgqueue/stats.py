"""Read-only aggregates over the queue tables, one query each.

They run on the queue's database (``PGQUEUE["DATABASE"]``), write nothing
and take no locks, so the admin summary (and later the status command,
metrics and health) may call them as often as it likes. Each returns plain
Python values, sorted, so callers and tests need no ORM.
"""

from django.db.models import Count, Min
from django.utils import timezone

from . import conf
from .models import DeadLetter, Message, Status


def _alias():
    return conf.get("DATABASE")


def dead_letters_by_topic_and_category(state=None):
    """``[(topic, category, count), ...]`` of the dead letters, by topic then
    category; only those in ``state`` (a DeadLetterState) when given."""
    rows = DeadLetter.objects.using(_alias())
    if state is not None:
        rows = rows.filter(state=state)
    return [
        (row["topic"], row["category"], row["count"])
        for row in rows.values("topic", "category")
        .annotate(count=Count("id"))
        .order_by("topic", "category")
    ]


def queue_depth_by_status():
    """``[(queue, status, count), ...]`` of the messages in the queue table
    (waiting, delayed or not, and processing), by queue then status."""
    return [
        (row["queue"], row["status"], row["count"])
        for row in Message.objects.using(_alias())
        .values("queue", "status")
        .annotate(count=Count("id"))
        .order_by("queue", "status")
    ]


def oldest_ready_age(now=None):
    """``{queue: seconds}``: for each queue with a ready message (waiting,
    ``run_at <= now``), how long the one ready longest has been ready, that is
    ``now - run_at``: the wait a worker has not yet picked up. A queue with no
    ready message is absent. (A delayed message counts from its ``run_at``,
    not its creation: waiting for its time is not lag.)"""
    now = now or timezone.now()
    rows = (
        Message.objects.using(_alias())
        .filter(status=Status.WAITING, run_at__lte=now)
        .values("queue")
        .annotate(oldest=Min("run_at"))
        .order_by("queue")
    )
    return {row["queue"]: (now - row["oldest"]).total_seconds() for row in rows}
