"""The admin: look at the queue, triage the dead letters, steer the stream
subscriptions.

Django's admin autodiscovery imports this package; importing the modules
below registers their ModelAdmins. None of them writes queue rows itself:
the actions call the operations (``lifecycle``, ``deadletters``,
``streams.subscriptions``), and each action needs its own permission.

- ``messages``: the queue table (run now, move to the dead letters, cancel);
- ``queues``: the Queues page (depth, pause and resume, limits);
- ``deadletters``: triage, the payload fixed before a revive, and the
  ``summary`` page;
- ``workers``: the workers' heartbeats;
- ``history``: the finished messages, and the queue ``overview`` page
  (its charts drawn by ``charts``);
- ``streams``: subscriptions and stored stream events;
- ``schedules``: the periodic schedules (pause, resume, reset, run now);
- ``workflows``: workflows, each with the graph of its steps
  (``workflow_graph``); cancel, revive the dead-lettered steps;
- ``common`` and ``forms``: what those share.
"""

from django_pgqueue.admin import (
    deadletters,
    history,
    messages,
    queues,
    schedules,
    streams,
    workers,
    workflows,
)

__all__ = [
    "deadletters",
    "history",
    "messages",
    "queues",
    "schedules",
    "streams",
    "workers",
    "workflows",
]
