"""The wake-ups sent with NOTIFY for changes that are not inserts (the
insert trigger sends its own), and the control channel's notices."""

from __future__ import annotations

# The wake-up the insert trigger sends, for changes that are not inserts.
NOTIFY_SQL = "SELECT pg_notify('django_pgqueue', queue) FROM unnest(%s::text[]) AS queue"
# The control channel (notify.CONTROL_CHANNEL): a queue was paused, resumed
# or given limits ("queues"), cancellation was asked for running messages
# ("cancel:<id>,<id>..."). Sent in the transaction of the change, so
# delivered at its commit, and only then.
CONTROL_NOTIFY_SQL = (
    "SELECT pg_notify('django_pgqueue_control', payload) FROM unnest(%s::text[]) AS payload"
)
