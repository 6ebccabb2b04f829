"""The app's tables, one module per family; every model is importable from
here (``django_pgqueue.models.Message``), as Django and the migrations expect.

- ``messages``: the queue (``Message``), its statuses and the failure categories;
- ``deadletters``: the messages that failed for good (``DeadLetter``);
- ``groups``: the hand-off of message groups (``GroupRelease``);
- ``workers``: the running workers' heartbeats (``WorkerHeartbeat``);
- ``alerts``: the suppression of dead-letter alerts (``AlertState``);
- ``tasks``: the ``django.tasks`` records (``TaskRecord``);
- ``streams``: the ordered streams (``StreamEvent``, ``Subscription``).
"""

from django_pgqueue.fields import timestamp_from_text
from django_pgqueue.models.alerts import AlertState
from django_pgqueue.models.deadletters import DeadLetter, DeadLetterState
from django_pgqueue.models.groups import GroupRelease
from django_pgqueue.models.messages import GROUP_HEAD, UNFINISHED, Category, Message, Status
from django_pgqueue.models.streams import StreamEvent, Subscription, SubscriptionState
from django_pgqueue.models.tasks import TaskRecord, TaskStatus
from django_pgqueue.models.workers import WorkerHeartbeat

__all__ = [
    "GROUP_HEAD",
    "UNFINISHED",
    "AlertState",
    "Category",
    "DeadLetter",
    "DeadLetterState",
    "GroupRelease",
    "Message",
    "Status",
    "StreamEvent",
    "Subscription",
    "SubscriptionState",
    "TaskRecord",
    "TaskStatus",
    "WorkerHeartbeat",
    "timestamp_from_text",
]
