"""django-pgqueue: a reliable message queue in your Django project's PostgreSQL.

The public API is importable from here. It is loaded lazily, so that
``import django_pgqueue`` (from settings, say) never imports models before
Django's app registry is ready.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0.dev0"

_API = {
    "enqueue": "django_pgqueue.enqueuing",
    "enqueue_many": "django_pgqueue.enqueuing",
    "aenqueue": "django_pgqueue.enqueuing_async",
    "aenqueue_many": "django_pgqueue.enqueuing_async",
    "handler": "django_pgqueue.registry",
    "Retry": "django_pgqueue.exceptions",
    "Permanent": "django_pgqueue.exceptions",
    "InvalidMessage": "django_pgqueue.exceptions",
    "DeadLetterError": "django_pgqueue.exceptions",
    "PgQueueError": "django_pgqueue.exceptions",
    "revive": "django_pgqueue.deadletters",
    "resolve": "django_pgqueue.deadletters",
    "categorize": "django_pgqueue.deadletters",
    # run-time control of the queues
    "pause_queue": "django_pgqueue.controls",
    "resume_queue": "django_pgqueue.controls",
    "paused_queues": "django_pgqueue.controls",
    "cancel": "django_pgqueue.lifecycle",
    "acancel": "django_pgqueue.lifecycle",
    "cancel_requested": "django_pgqueue.running",
    "QueueControlError": "django_pgqueue.exceptions",
    # streams (the transactional outbox)
    "publish": "django_pgqueue.streams",
    "subscriber": "django_pgqueue.streams.subscribers",
    "SubscriptionError": "django_pgqueue.exceptions",
    # workflows
    "Workflow": "django_pgqueue.workflows",
    "workflow": "django_pgqueue.workflows",
    "chain": "django_pgqueue.workflows",
    "group": "django_pgqueue.workflows",
    "chord": "django_pgqueue.workflows",
    "step": "django_pgqueue.workflows",
    "WorkflowError": "django_pgqueue.exceptions",
}

__all__ = sorted(_API)


def __getattr__(name: str) -> Any:
    module = _API.get(name)
    if module is None:
        raise AttributeError(f"module 'django_pgqueue' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
