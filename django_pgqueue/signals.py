"""Signals sent by django-pgqueue.

Every signal is sent after the transaction that caused it has committed, never
before: a receiver never sees a message that a rollback then discards.

Receivers are called robustly (``send_robust``): an exception in one is
logged on the ``django_pgqueue.signals`` logger and the others still run. A
broken receiver never fails an enqueue that has already committed, nor stops
a worker's handler thread.
"""

from __future__ import annotations

import logging
from typing import Any

from django.dispatch import Signal

logger = logging.getLogger(__name__)


def send(signal: Signal, sender: Any, **kwargs: Any) -> None:
    """Send ``signal`` to every receiver; log the ones that raise."""
    for receiver, result in signal.send_robust(sender=sender, **kwargs):
        if isinstance(result, Exception):
            logger.error(
                "Signal receiver %s raised %s: %s",
                getattr(receiver, "__qualname__", receiver),
                type(result).__name__,
                result,
                exc_info=result,
            )


# Sent once per message after the enqueueing transaction commits.
# Arguments: ``message`` (the Message instance), ``using`` (the queue's alias).
message_enqueued = Signal()

# A handler finished and the message was acknowledged.
# Arguments: ``message``, ``duration`` (seconds), ``worker`` (worker id).
message_done = Signal()

# A failed message was scheduled to run again, or maintenance returned a run
# lost with its worker, or a worker handed back a run cut off by its lost
# database connection (``lost=True``, ``worker`` the one that held it,
# ``delay`` 0, ``reason`` starting "worker lost", "lease expired" or
# "connection lost").
# Arguments: ``message``, ``category``, ``reason``, ``delay`` (seconds),
# ``worker``, ``lost``.
message_retried = Signal()

# A message moved to the dead-letter table (from a worker, maintenance's rescue
# or the admin), sent with ``sender=DeadLetter``.
# Arguments: ``dead_letter`` (the DeadLetter instance: topic, category, reason,
# attempts, worker, queue...), ``message_id``. django-pgqueue's webhook alerts
# (``observability/alerts.py``) are one receiver.
dead_lettered = Signal()

# A message was cancelled (``django_pgqueue.cancel``): at once when it was
# waiting, delayed or blocked; when its run ended without finishing when it
# was running (a handler that finishes anyway sends ``message_done``
# instead). Sent once per message, with ``sender=Message``. Arguments:
# ``message``, ``worker`` (the worker id that ran it, "" if it never ran).
message_cancelled = Signal()


# --- streams (the transactional outbox) -------------------------------------------------

# Sent once per event after the publishing transaction commits, with
# ``sender=StreamEvent``. Arguments: ``event`` (the StreamEvent instance),
# ``using`` (the queue's alias). Costs nothing while no receiver is connected.
event_published = Signal()

# A subscription stopped at an event that failed every attempt (its
# on_failure is "block"), with ``sender=Subscription``. Arguments:
# ``subscription`` (its name), ``stream``, ``position`` (the event's),
# ``error`` (the last error's first line). A stream event that goes to the
# dead letters sends ``dead_lettered`` instead, like a message.
subscription_blocked = Signal()
