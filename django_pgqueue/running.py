"""What a handler can ask about the run it is in: ``cancel_requested()``.

The worker sets the run (``current``) around each handler call, in the
handler's thread; a context variable, so an ``async def`` handler (run by
``async_to_sync``, which copies the context) sees it too. Outside a
worker's handler there is no run, and nothing was asked.
"""

from __future__ import annotations

import contextvars
from typing import Protocol


class Run(Protocol):
    """A handler's run as the worker carries it (``worker.job.Job``)."""

    cancel_requested: bool


current: contextvars.ContextVar[Run | None] = contextvars.ContextVar(
    "django_pgqueue_run", default=None
)


def cancel_requested() -> bool:
    """True once cancellation was asked for the message this handler runs
    (``django_pgqueue.cancel``; its worker is told within a second). The
    handler may then stop early by raising (any exception): the message
    ends cancelled, never retried, and an ``atomic=True`` handler's
    transaction rolls back. A handler that returns has finished: its
    outcome stands. False outside a handler."""
    run = current.get()
    return run is not None and run.cancel_requested
