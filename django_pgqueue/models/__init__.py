"""The app's tables, one module per family; every model is importable from
here (``django_pgqueue.models.Message``), as Django and the migrations expect.

- ``messages``: the queue (``Message``), its statuses and the failure categories;
- ``deadletters``: the messages that failed for good (``DeadLetter``);
- ``groups``: the hand-off of message groups (``GroupRelease``);
- ``workers``: the running workers' heartbeats (``WorkerHeartbeat``);
- ``alerts``: the suppression of dead-letter alerts (``AlertState``);
- ``tasks``: the ``django.tasks`` records (``TaskRecord``);
- ``queues``: the queues' run-time state and the starts of rate-limited
  ones, and the same for named partitions (``QueueState``, ``QueueStart``,
  ``PartitionLimit``, ``PartitionStart``);
- ``streams``: the ordered streams (``StreamEvent``, ``Subscription``);
- ``schedules``: the periodic schedules' tick ledger and run-time state
  (``Schedule``, ``ScheduleTick``);
- ``history``: finished messages and the per-minute outcome counts
  (``FinishedMessage``, ``OutcomeCount``, ``Outcome``);
- ``workflows``: workflows, their steps and the steps' dependencies
  (``Workflow``, ``WorkflowStep``, ``WorkflowDependency``).
"""

from django_pgqueue.fields import timestamp_from_text
from django_pgqueue.models.alerts import AlertState
from django_pgqueue.models.deadletters import DeadLetter, DeadLetterState
from django_pgqueue.models.groups import GroupRelease
from django_pgqueue.models.history import FinishedMessage, Outcome, OutcomeCount
from django_pgqueue.models.messages import GROUP_HEAD, UNFINISHED, Category, Message, Status
from django_pgqueue.models.queues import PartitionLimit, PartitionStart, QueueStart, QueueState
from django_pgqueue.models.schedules import Schedule, ScheduleTick
from django_pgqueue.models.streams import StreamEvent, Subscription, SubscriptionState
from django_pgqueue.models.tasks import TaskRecord, TaskStatus
from django_pgqueue.models.workers import WorkerHeartbeat
from django_pgqueue.models.workflows import (
    StepState,
    Workflow,
    WorkflowDependency,
    WorkflowStatus,
    WorkflowStep,
)

__all__ = [
    "GROUP_HEAD",
    "UNFINISHED",
    "AlertState",
    "Category",
    "DeadLetter",
    "DeadLetterState",
    "FinishedMessage",
    "GroupRelease",
    "Message",
    "Outcome",
    "OutcomeCount",
    "PartitionLimit",
    "PartitionStart",
    "QueueStart",
    "QueueState",
    "Schedule",
    "ScheduleTick",
    "Status",
    "StepState",
    "StreamEvent",
    "Subscription",
    "SubscriptionState",
    "TaskRecord",
    "TaskStatus",
    "WorkerHeartbeat",
    "Workflow",
    "WorkflowDependency",
    "WorkflowStatus",
    "WorkflowStep",
    "timestamp_from_text",
]
