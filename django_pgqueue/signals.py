"""Signals sent by django-pgqueue.

Every signal is sent after the transaction that caused it has committed, never
before: a receiver never sees a message that a rollback then discards.
"""

from django.dispatch import Signal

# Sent once per message after the enqueueing transaction commits.
# Arguments: ``message`` (the Message instance), ``using`` (the queue's alias).
message_enqueued = Signal()
