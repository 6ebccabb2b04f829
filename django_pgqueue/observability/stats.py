"""Read-only aggregates over the queue tables, one query each.

They run on the queue's database (``PGQUEUE["DATABASE"]``), write nothing
and take no locks, so the admin summary (and later the status command,
metrics and health) may call them as often as it likes. Each returns plain
Python values, sorted, so callers and tests need no ORM.
"""

from django.db.models import BooleanField, Case, Count, ExpressionWrapper, Min, Q, Value, When
from django.db.models.functions import Now
from django.utils import timezone

from django_pgqueue import conf
from django_pgqueue.models import DeadLetter, Message, Status, WorkerHeartbeat


def dead_letters_by_topic_and_category(state=None):
    """``[(topic, category, count), ...]`` of the dead letters, by topic then
    category; only those in ``state`` (a DeadLetterState) when given."""
    rows = DeadLetter.objects.using(conf.database_alias())
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
        for row in Message.objects.using(conf.database_alias())
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
        Message.objects.using(conf.database_alias())
        .filter(status=Status.WAITING, run_at__lte=now)
        .values("queue")
        .annotate(oldest=Min("run_at"))
        .order_by("queue")
    )
    return {row["queue"]: (now - row["oldest"]).total_seconds() for row in rows}


# What a message in the queue table is doing, for metrics and status: the
# waiting status split by whether its time has come; blocked (behind an
# earlier message of its group) and processing as they are.
READY, DELAYED, BLOCKED, PROCESSING = "ready", "delayed", "blocked", "processing"


def messages_by_queue_topic_state(now=None):
    """``[(queue, topic, state, count), ...]`` of the queue table, with state
    one of ready (waiting, due), delayed (waiting for its run_at: a delay or a
    retry's backoff), blocked (behind an earlier message of its group) and
    processing (leased), sorted."""
    now = now or timezone.now()
    state = Case(
        When(status=Status.PROCESSING, then=Value(PROCESSING)),
        When(status=Status.BLOCKED, then=Value(BLOCKED)),
        When(run_at__lte=now, then=Value(READY)),
        default=Value(DELAYED),
    )
    rows = (
        Message.objects.using(conf.database_alias())
        .annotate(state=state)
        .values("queue", "topic", "state")
        .annotate(count=Count("id"))
        .order_by("queue", "topic", "state")
    )
    return [(row["queue"], row["topic"], row["state"], row["count"]) for row in rows]


def dead_letters_by_topic_category_state(queues=None):
    """``[(topic, category, state, count), ...]`` of the dead letters, sorted;
    only those of ``queues`` when given."""
    rows = DeadLetter.objects.using(conf.database_alias())
    if queues is not None:
        rows = rows.filter(queue__in=queues)
    rows = (
        rows.values("topic", "category", "state")
        .annotate(count=Count("id"))
        .order_by("topic", "category", "state")
    )
    return [(row["topic"], row["category"], row["state"], row["count"]) for row in rows]


def workers():
    """The worker table's rows, each with ``alive`` (its heartbeat is fresh
    by the database's clock) and ``heartbeat_age`` (seconds), newest first."""
    rows = WorkerHeartbeat.objects.using(conf.database_alias()).annotate(
        alive=ExpressionWrapper(Q(expires_at__gt=Now()), output_field=BooleanField()),
        now=Now(),
    )
    result = list(rows.order_by("-heartbeat_at", "worker_id"))
    for row in result:
        row.heartbeat_age = max((row.now - row.heartbeat_at).total_seconds(), 0.0)
    return result


def live_workers_by_queue():
    """``{queue: number of alive workers serving it}``; queues no alive worker
    serves are absent."""
    counts = {}
    for row in workers():
        if row.alive:
            for queue in row.queues:
                counts[queue] = counts.get(queue, 0) + 1
    return counts


# --- streams (the transactional outbox) -------------------------------------------------


def subscriptions_with_lag():
    """Every subscription, by name, with ``head_position``, ``lag`` (events
    after its checkpoint, at most stream_models.LAG_COUNT_CAP) and
    ``oldest_pending_at`` (when the first of them was published, or None),
    plus ``now`` (the database's clock)."""
    from django_pgqueue.models import Subscription

    return list(
        Subscription.objects.using(conf.database_alias())
        .with_lag()
        .annotate(now=Now())
        .order_by("name")
    )
