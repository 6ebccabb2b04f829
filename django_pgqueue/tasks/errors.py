"""The errors of a task's attempts (``TaskResult.errors``): from the
exception its function raised, or, for a failure it never saw (a timeout, a
lost worker, a move to the dead letters), from what the queue recorded.

The worker records a failure after the handler has returned, and tells of
it with the ``message_retried`` and ``dead_lettered`` signals, which carry
the message or its dead letter but not the exception. So the error goes on
with what they do carry: ``attach()`` puts the exception's error on the
run's ``Message`` (the worker sends ``message_retried`` with that very
instance); a dead letter holds the exception's reason and traceback, which
``from_dead_letter()`` reads back.
"""

from __future__ import annotations

import builtins
import traceback
from typing import Any

from django.tasks.base import TaskError

from django_pgqueue import exceptions
from django_pgqueue.exceptions import Permanent, Retry
from django_pgqueue.models import Message

# The runner's own failures after the task's backoff decided, each raised
# from the task's exception (their reasons start so).
RETRY_AFTER = "retry after "
STOPPED_AFTER = "not retried (backoff returned None) after "

# How the traceback module joins an exception to the one it was raised from.
_DIRECT_CAUSE = "\nThe above exception was the direct cause of the following exception:\n\n"

# The run's Message attribute that carries its task's error (see attach()).
_ATTACHED = "_pgqueue_task_error"


def from_exception(exc: BaseException) -> TaskError:
    """The error of an attempt whose function (or its start) raised ``exc``."""
    cls = type(exc)
    return TaskError(
        exception_class_path=f"{cls.__module__}.{cls.__qualname__}",
        traceback="".join(traceback.format_exception(exc)),
    )


def attach(message: Message, error: TaskError) -> None:
    """Give ``error`` to the receiver of ``message_retried`` for this run."""
    message.__dict__[_ATTACHED] = error


def attached(message: Message) -> TaskError | None:
    """The error attach() gave ``message``, once; None if there is none (a
    failure the handler never saw, or a message loaded elsewhere)."""
    error: TaskError | None = message.__dict__.pop(_ATTACHED, None)
    return error


def from_dead_letter(reason: str, trace: str) -> TaskError:
    """The error of the attempt a dead letter records: the task's own
    exception, read from the reason and traceback the worker stored (when
    the task's backoff stopped the retries, the exception the runner's
    Permanent was raised from), else as from_text()."""
    for own in (f"{Retry.__name__}: {RETRY_AFTER}", f"{Permanent.__name__}: {STOPPED_AFTER}"):
        if reason.startswith(own) and _DIRECT_CAUSE in trace:
            reason, trace = reason[len(own) :], trace.rsplit(_DIRECT_CAUSE, 1)[0]
            break
    path = _class_path(reason, trace)
    if path is None:
        return from_text(reason, trace)
    return TaskError(exception_class_path=path, traceback=trace)


def from_text(reason: str, trace: str) -> TaskError:
    """A TaskError for a failure the handler did not see (a timeout, a lost
    worker, a move to the dead letters from the admin): its class from the
    reason ("ClassName: text") when that names one of our exceptions or a
    builtin one, else ``PgQueueError`` (there was no exception)."""
    name = (reason or "").split(":", 1)[0].strip()
    if isinstance(getattr(exceptions, name, None), type):
        path = f"django_pgqueue.exceptions.{name}"
    elif isinstance(getattr(builtins, name, None), type) and issubclass(
        getattr(builtins, name), BaseException
    ):
        path = f"builtins.{name}"
    else:
        path = "django_pgqueue.exceptions.PgQueueError"
    return TaskError(exception_class_path=path, traceback=trace or reason or "")


def lost_run(reason: str, worker: str) -> TaskError:
    """The error of a run that ended with no outcome (its worker was killed,
    or lost its lease): there is no exception and no traceback."""
    return TaskError(
        exception_class_path="django_pgqueue.exceptions.WorkerLost",
        traceback=(
            f"The run was lost with its worker {worker or '(unknown)'}: {reason}\n"
            "No traceback exists: the task's function never returned or raised in a "
            "process that could report it."
        ),
    )


def to_json(error: TaskError) -> dict[str, str]:
    """``error`` as TaskRecord.errors stores it."""
    return {"exception_class_path": error.exception_class_path, "traceback": error.traceback}


def from_json(items: list[dict[str, Any]]) -> list[TaskError]:
    """TaskRecord.errors as TaskErrors."""
    return [
        TaskError(exception_class_path=e["exception_class_path"], traceback=e["traceback"])
        for e in items
    ]


def _class_path(reason: str, trace: str) -> str | None:
    """The ``module.qualname`` of the exception described by ``reason``
    (exceptions.describe(): "Name: text") in ``trace``, its formatted
    traceback: the traceback module ends it with the line "module.qualname:
    first line of text" ("Name: ..." for a builtin, which from_text() maps;
    "| " before it in an exception group). None if no line says it."""
    name, colon, text = reason.partition(": ")
    if not name.isidentifier():
        return None
    ending = f": {text.splitlines()[0] if text else ''}" if colon else ""
    for line in reversed(trace.splitlines()):
        line = line.lstrip(" |")
        if not line.endswith(ending):
            continue
        path = line[: len(line) - len(ending)]
        if path.endswith(f".{name}") and all(part.isidentifier() for part in path.split(".")):
            return path
    return None
