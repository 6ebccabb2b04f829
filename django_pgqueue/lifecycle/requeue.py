"""Back to waiting: a failed run retried later (``retry_later``), a lost run
requeued (``requeue_lost``, maintenance's rescue), leased messages handed
back at shutdown (``release``), and delayed messages made due (``run_now``).
"""

from __future__ import annotations

import datetime
import functools
from collections.abc import Iterable, Sequence
from typing import Any

from django.db import connections, transaction
from django.db.models import F, QuerySet, Value
from django.db.models.functions import Coalesce, Greatest, Now

from django_pgqueue import conf, signals
from django_pgqueue.lifecycle.cancel import cancel_running
from django_pgqueue.lifecycle.guards import (
    NO_LEASE,
    leased,
    log_extra,
    log_lease_lost,
    logger,
    now_or_db,
)
from django_pgqueue.models import Category, Message, Status
from django_pgqueue.sql import acks as acks_sql
from django_pgqueue.sql import history as history_sql
from django_pgqueue.sql import timeouts as timeouts_sql
from django_pgqueue.sql import wakeups as wakeups_sql


def _requeue(
    message: Message,
    using: str,
    run_at: datetime.datetime | Any,
    category: str,
    error: str,
    clock: datetime.datetime | Now,
) -> int:
    """Back to waiting, due at ``run_at``, the failure recorded and the
    attempt counted, if this lease still holds the row and its cancellation
    was not asked (a cancelled message never runs again: cancel_running is
    its way out): 1, else 0."""
    return (
        leased(message, using)
        .filter(cancel_requested_at__isnull=True)
        .update(
            status=Status.WAITING,
            run_at=run_at,
            **NO_LEASE,
            last_error=error,
            last_error_category=category,
            first_failed_at=Coalesce("first_failed_at", clock),
            updated_at=clock,
        )
    )


def retry_later(
    message: Message,
    delay: float,
    category: str,
    error: str,
    now: datetime.datetime | None = None,
) -> bool:
    """Put ``message`` back to wait ``delay`` seconds, recording the failure.

    The attempt stays counted. False: the lease was lost.
    """
    using = conf.database_alias()
    clock = now_or_db(now)
    with timeouts_sql.worker_transaction(using):
        run_at = clock + datetime.timedelta(seconds=delay)
        updated = _requeue(message, using, run_at, category, error, clock)
        if updated:
            history_sql.count_retry(message.queue, now, using)
    if not updated:
        log_lease_lost(message, "retry not recorded")
    return bool(updated)


def requeue_lost(message: Message, reason: str, now: datetime.datetime | None = None) -> bool:
    """Return ``message``, whose run was lost (its lease expired: see
    maintenance.rescue_expired), to the queue, due ``now``, with ``reason``
    recorded as a transient failure and the attempt counted. Runs in the
    rescue's transaction, which holds the row locked since it found it
    expired. Sends ``message_retried`` with ``lost=True`` after the commit:
    a lost run is an attempt, and every receiver sees it. False: the row is
    no longer under that lease."""
    using = conf.database_alias()
    clock = now_or_db(now)
    # One of many in the rescue's transaction.
    with timeouts_sql.worker_transaction(using, savepoint=False):
        if not _requeue(message, using, clock, Category.TRANSIENT, reason, clock):
            log_lease_lost(message, "not rescued")
            return False
        history_sql.count_retry(message.queue, now, using)
        retried = functools.partial(
            signals.send,
            signals.message_retried,
            sender=Message,
            message=message,
            category=Category.TRANSIENT,
            reason=reason,
            delay=0.0,
            worker=message.locked_by,
            lost=True,
        )
        transaction.on_commit(retried, using=using)
    logger.warning(
        "Message id=%s topic=%s attempt=%s rescued: %s",
        message.pk,
        message.topic,
        message.attempts,
        reason,
        extra=log_extra(message, state="rescued", worker=message.locked_by),
    )
    return True


def release(messages: Sequence[Message]) -> int:
    """Hand leased messages back without counting the attempt (graceful
    shutdown). Returns how many were still held. Those whose cancellation
    was asked end cancelled instead (they never run again)."""
    using = conf.database_alias()
    released = 0
    with timeouts_sql.worker_transaction(using):
        for token, ids in acks_sql.ids_by_token(messages).items():
            held = Message.objects.using(using).filter(
                pk__in=ids, status=Status.PROCESSING, lease_token=token
            )
            to_cancel = set(
                held.filter(cancel_requested_at__isnull=False).values_list("pk", flat=True)
            )
            for message in messages:
                if message.pk in to_cancel:
                    released += cancel_running(message, "cancelled: its worker stopped")
            released += held.filter(cancel_requested_at__isnull=True).update(
                status=Status.WAITING,
                attempts=Greatest(F("attempts") - 1, Value(0)),
                **NO_LEASE,
                updated_at=Now(),
            )
    return released


def run_now(
    messages: QuerySet[Message] | Iterable[Message | int], now: datetime.datetime | None = None
) -> int:
    """Clear the delay of waiting messages (a queryset, messages or ids):
    those due later become due ``now``. One UPDATE guarded by ``status =
    'waiting'``; leased and already due messages are left alone. Returns how
    many changed."""
    using = conf.database_alias()
    selected: Any  # a subquery of ids, or the ids
    if isinstance(messages, QuerySet):
        selected = messages.using(using).values("pk")
    else:
        selected = [getattr(m, "pk", m) for m in messages]
    clock = now_or_db(now)
    delayed = Message.objects.using(using).filter(
        pk__in=selected, status=Status.WAITING, run_at__gt=clock
    )
    with transaction.atomic(using=using):
        queues = list(delayed.values_list("queue", flat=True).distinct())
        updated = delayed.update(run_at=clock, updated_at=clock)
        if updated and conf.get("NOTIFY"):
            # An UPDATE does not fire the insert trigger: wake the workers of
            # these queues the same way (delivered at commit).
            with connections[using].cursor() as cursor:
                cursor.execute(wakeups_sql.NOTIFY_SQL, [queues])
    logger.info("Messages run now: %s", updated, extra={"state": "run_now", "count": updated})
    return updated
