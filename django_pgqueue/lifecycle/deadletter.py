"""Dead-lettering: a message moves to the dead-letter table.

The DeadLetter row is inserted and the Message deleted in one transaction,
so a message is never in both tables and never in neither. This is the only
place that moves one (a dead letter's own states are deadletters.py's).
"""

from __future__ import annotations

import datetime

from django.db import transaction
from django.db.models import Subquery
from django.utils import timezone

from django_pgqueue import conf, policy, registry, signals
from django_pgqueue.lifecycle.guards import UNDECODABLE, log_extra, log_lease_lost, logger
from django_pgqueue.models import DeadLetter, Message, Outcome, Status
from django_pgqueue.sql import history as history_sql
from django_pgqueue.sql import timeouts as timeouts_sql
from django_pgqueue.workflows import bookkeeping

# The fields a dead letter keeps of its message as they are.
_COPIED_TO_DEAD_LETTER = (
    "queue topic priority group_key dedup_key attempts max_attempts partition_key".split()
)


def dead_letter(
    message: Message,
    category: str,
    reason: str,
    traceback: str = "",
    worker: str = "",
    expect: str = Status.PROCESSING,
    now: datetime.datetime | None = None,
) -> DeadLetter | None:
    """Move ``message`` to the dead-letter table: insert the DeadLetter and
    delete the Message in one transaction, if the message is still in state
    ``expect`` (and, when leased, still held by this lease).

    Returns the DeadLetter, or None when the guard matched nothing. The
    ``dead_lettered`` signal is sent after the commit.
    """
    using = conf.database_alias()
    now = now or timezone.now()
    with timeouts_sql.worker_transaction(using):
        # The payload and headers are copied in the server, never loaded
        # here: they are what was stored, even JSON that Python cannot load.
        rows = (
            Message.objects.using(using)
            .select_for_update()
            .defer("payload", "headers")
            .filter(pk=message.pk, status=expect)
        )
        if expect == Status.PROCESSING:
            # A message whose cancellation was asked ends cancelled instead
            # (cancel.cancel_running), never as a dead letter to revive.
            rows = rows.filter(lease_token=message.lease_token, cancel_requested_at__isnull=True)
        row = rows.first()
        if row is None:
            log_lease_lost(message, f"not dead-lettered (no longer {expect})")
            return None
        dead = DeadLetter.objects.using(using).create(
            message_id=row.pk,
            **{name: getattr(row, name) for name in _COPIED_TO_DEAD_LETTER},
            payload={},  # copied below, in the server
            headers={},
            category=category,
            reason=reason,
            traceback=traceback,
            first_failed_at=row.first_failed_at or now,
            last_failed_at=now,
            dead_lettered_at=now,
            worker=worker,
            holds_group=policy.dead_letter_blocks_group(row, registry.lookup(row.topic)),
        )
        stored = Message.objects.using(using).filter(pk=row.pk)
        DeadLetter.objects.using(using).filter(pk=dead.pk).update(
            payload=Subquery(stored.values("payload")), headers=Subquery(stored.values("headers"))
        )
        # What the receivers of dead_lettered see: the message's own values
        # when it has them (the worker's), else loaded when first read.
        for attname in ("payload", "headers"):
            if attname in message.__dict__ and not message.__dict__.get(UNDECODABLE):
                setattr(dead, attname, getattr(message, attname))
            else:
                del dead.__dict__[attname]
        # Into the history before its row goes (KEEP_FINISHED), with the link.
        history_sql.record(
            [row.pk],
            Outcome.DEAD_LETTERED,
            now=now,
            dead_letter_id=dead.pk,
            worker=worker,
            using=using,
        )
        if row.workflow_step_id is not None:
            bookkeeping.dead_lettered([row.pk], using)  # its step waits there too
        Message.objects.using(using).filter(pk=row.pk).delete()
        transaction.on_commit(
            lambda: signals.send(
                signals.dead_lettered, sender=DeadLetter, dead_letter=dead, message_id=row.pk
            ),
            using=using,
        )
    logger.info(
        "Message id=%s topic=%s attempt=%s dead-lettered as %s: %s",
        row.pk,
        row.topic,
        row.attempts,
        category,
        reason.splitlines()[0] if reason else "",
        extra=log_extra(row, state="dead_lettered", category=category, worker=worker),
    )
    return dead
