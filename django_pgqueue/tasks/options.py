"""What a task runs with, besides its arguments: the topic of its message,
and its retries (``max_attempts`` and ``backoff``: the task's own, given to
``@task`` on Django 6.1, else the backend's ``OPTIONS``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.tasks.base import Task
from django.utils.module_loading import import_string

# The topic of every task's message (one handler runs them all).
TASK_TOPIC = "pgqueue.task"

# Backend OPTIONS this backend understands.
OPTION_NAMES = frozenset({"MAX_ATTEMPTS", "BACKOFF", "USING"})

# backoff(exception, failed attempt's TaskResult) -> seconds (or a timedelta),
# or None for no more attempts.
Backoff = Callable[..., Any]


def max_attempts(task: Task) -> int | None:
    """How often ``task`` runs at most; None: PGQUEUE's MAX_ATTEMPTS."""
    value = getattr(task, "max_attempts", None)
    if value is None:
        value = getattr(task.get_backend(), "max_attempts", None)
    return value


def backoff(task: Task) -> object:
    """The backoff of ``task``, or None: a callable, or (from OPTIONS) perhaps
    the dotted path of one (see loaded())."""
    return getattr(task, "backoff", None) or getattr(task.get_backend(), "backoff", None)


def loaded(value: object) -> Backoff:
    """``value``, a callable or the dotted path of one (ImportError, TypeError)."""
    if isinstance(value, str):
        value = import_string(value)
    if not callable(value):
        raise TypeError(f"{value!r} is not callable")
    return value
