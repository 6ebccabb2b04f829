"""aenqueue() and aenqueue_many(): enqueue() and enqueue_many() for async code.

Each awaits its sync form run through ``sync_to_async(...,
thread_sensitive=True)``, as Django's async ORM methods run theirs
(``QuerySet.aget``, ``Model.asave``): on the thread that holds the sync
database connection of the request (or of the ``async_to_sync`` caller).
So the message joins a transaction opened on that thread, by sync code
under ``transaction.atomic`` called through ``sync_to_async``, and is
otherwise committed at once, in autocommit.

One code path: the sync form checks the arguments, and its
``InvalidMessage`` reaches the awaiting caller as it was raised. A separate
module only because ``enqueuing.py`` is at the size limit of a module.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable
from typing import Any, Unpack

from asgiref.sync import sync_to_async

from django_pgqueue.enqueuing import enqueue, enqueue_many
from django_pgqueue.models import Message
from django_pgqueue.validation import MessageFields


async def aenqueue(
    topic: str,
    payload: Any = None,
    *,
    delay: float | datetime.timedelta | None = None,
    run_at: datetime.datetime | None = None,
    priority: int = 0,
    queue: str | None = None,
    dedup_key: str | None = None,
    group_key: str | None = None,
    headers: dict[str, Any] | None = None,
    max_attempts: int | None = None,
    partition_key: str | None = None,
    using: str | None = None,
) -> Message:
    """``enqueue()`` for async code: the same arguments, checks, errors and
    returned ``Message``. It runs ``enqueue()`` through
    ``sync_to_async(thread_sensitive=True)``, on the connection of your
    sync ORM code: in the transaction that sync code opened there
    (``transaction.atomic`` called through ``sync_to_async``), else
    committed at once (docs: *Async code*)."""
    return await sync_to_async(enqueue, thread_sensitive=True)(
        topic, payload, delay=delay, run_at=run_at, priority=priority, queue=queue,
        dedup_key=dedup_key, group_key=group_key, headers=headers,
        max_attempts=max_attempts, partition_key=partition_key, using=using,
    )  # fmt: skip


async def aenqueue_many(
    messages: Iterable[dict[str, Any]],
    *,
    using: str | None = None,
    **defaults: Unpack[MessageFields],
) -> list[Message]:
    """``enqueue_many()`` for async code: the same arguments, checks, errors
    and returned messages, in the same transaction as ``aenqueue()``.
    ``messages`` is a plain iterable (not an async one); it is read on the
    sync thread."""
    return await sync_to_async(enqueue_many, thread_sensitive=True)(
        messages, using=using, **defaults
    )
