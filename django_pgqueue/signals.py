"""Signals sent by django-pgqueue.

Every signal is sent after the transaction that caused it has committed, never
before: a receiver never sees a message that a rollback then discards.
"""

from django.dispatch import Signal

# Sent once per message after the enqueueing transaction commits.
# Arguments: ``message`` (the Message instance), ``using`` (the queue's alias).
message_enqueued = Signal()

# A handler finished and the message was acknowledged.
# Arguments: ``message``, ``duration`` (seconds), ``worker`` (worker id).
message_done = Signal()

# A failed message was scheduled to run again.
# Arguments: ``message``, ``category``, ``reason``, ``retry_at``, ``worker``.
message_retried = Signal()

# A message moved to the dead-letter table.
# Arguments: ``dead_letter`` (the DeadLetter instance), ``message_id``.
dead_lettered = Signal()
