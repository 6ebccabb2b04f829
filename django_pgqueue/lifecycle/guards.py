"""What every transition shares: the lease guard and its named outcome.

A transition of a leased message changes its row only if the row is still
``processing`` under the message's lease token (``leased``). A guard that
matches no row is a named outcome, the lease was lost (the message was
rescued, timed out or finished elsewhere): ``log_lease_lost`` logs it, and
the transition returns False or None, never raises.
"""

from __future__ import annotations

import datetime
import logging
from typing import Any

from django.db.models import QuerySet
from django.db.models.functions import Now

from django_pgqueue.models import Message, Status

# One logger for the whole state machine, whichever module of it logs.
logger = logging.getLogger("django_pgqueue.lifecycle")

# The first words of the error a lost run records (requeue_lost, and the
# reason of a dead letter whose last run was lost): its worker stopped
# beating; its worker beats but the lease ran out; the row had no lease; or
# its worker's connection to the database died under the run, and the worker
# handed it back once connected again (maintenance.rescue_cut_off).
WORKER_LOST = "worker lost"
LEASE_EXPIRED = "lease expired"
LEASE_MISSING = "lease missing"
CONNECTION_LOST = "connection lost"
LOST_RUN_REASONS = (WORKER_LOST, LEASE_EXPIRED, LEASE_MISSING, CONNECTION_LOST)

# The attribute of a claimed Message whose payload or headers Python could
# not load: why (see claim.message_from_row).
UNDECODABLE = "_pgqueue_undecodable"

# A row back to waiting holds no lease.
NO_LEASE: dict[str, Any] = {"lease_token": None, "lease_expires_at": None, "locked_by": ""}


def leased(message: Message, using: str) -> QuerySet[Message]:
    """The message's row, if this lease still holds it."""
    return Message.objects.using(using).filter(
        pk=message.pk, status=Status.PROCESSING, lease_token=message.lease_token
    )


def now_or_db(now: datetime.datetime | None) -> datetime.datetime | Now:
    """``now``, or the database's clock when None."""
    return Now() if now is None else now


def log_extra(message: Message, **fields: object) -> dict[str, object]:
    """The ``extra`` of a log line about ``message``."""
    return {"message_id": message.pk, "topic": message.topic, "attempt": message.attempts, **fields}


def log_lease_lost(message: Message, what: str) -> None:
    """The named outcome of a guard that matched no row."""
    logger.warning(
        "Message id=%s topic=%s attempt=%s %s: lease lost",
        message.pk,
        message.topic,
        message.attempts,
        what,
        extra=log_extra(message, state="lease_lost"),
    )
