"""Exceptions raised by django-pgqueue, and raised by handlers to steer it.

Each class's docstring is its default message, so ``raise InvalidMessage()``
still says something useful.
"""

from __future__ import annotations

import datetime


def describe(exc: BaseException) -> str:
    """``Type: message`` of an exception (``Type`` alone when its message is
    empty): how a failure's reason is recorded and logged."""
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class PgQueueError(Exception):
    """A django-pgqueue error."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message if message is not None else self.__doc__)


class InvalidMessage(PgQueueError, ValueError):
    """The message cannot be enqueued as given; nothing was written."""


class DeadLetterError(PgQueueError, ValueError):
    """The dead-letter operation cannot run as asked; nothing was changed."""


class QueueControlError(PgQueueError, ValueError):
    """A queue cannot be paused, resumed or limited, or messages cancelled, as asked."""


class WorkflowError(PgQueueError, ValueError):
    """The workflow cannot be built, enqueued or changed as asked; nothing was written."""


class DuplicateHandler(PgQueueError):
    """Two handlers are registered for one topic."""


class Retry(PgQueueError):
    """Raised by a handler: try this message again later; counts as an attempt.

    ``after`` is the delay in seconds (a number or a timedelta); None lets the
    backoff policy choose.
    """

    def __init__(
        self, reason: str = "retry requested", *, after: float | datetime.timedelta | None = None
    ) -> None:
        super().__init__(reason)
        if isinstance(after, datetime.timedelta):
            after = after.total_seconds()
        if after is not None and (
            not isinstance(after, int | float) or isinstance(after, bool) or not 0 <= after < 1e9
        ):
            raise ValueError(f"Retry(after=...) takes seconds >= 0 or a timedelta, not {after!r}")
        self.after = None if after is None else float(after)


class Permanent(PgQueueError):
    """Raised by a handler: this message can never succeed; dead-letter it now."""

    def __init__(self, reason: str = "permanent failure") -> None:
        super().__init__(reason)


class HandlerTimeout(PgQueueError):
    """The handler ran past its timeout; its late result is discarded."""


class WorkerLost(PgQueueError):
    """The run ended with no outcome: its worker died or lost the lease.

    Never raised: it names such a run's error where an exception class is
    expected (a Django task's ``TaskResult.errors``)."""


# --- streams (the transactional outbox) ---------------------------------------------


class DuplicateSubscriber(PgQueueError):
    """Two subscribers are registered under one subscription name."""


class SubscriptionError(PgQueueError, ValueError):
    """The subscription operation cannot run as asked; nothing was changed."""
