"""Cancellation: waiting, delayed or blocked -> cancelled at once
(``cancel``); processing -> cancellation asked (its worker is told), then
cancelled when the run ends without finishing (``cancel_running``: the
handler stopped early or failed, its worker handed it back or was lost).

A cancelled message keeps its row, in the status "cancelled", until
CANCELLED_RETENTION has passed (maintenance deletes it then): it never
runs (again), it no longer holds its dedup key, and its group goes on with
its next message as if it had finished (a trigger of migration 0015
releases the group). ``message_cancelled`` is sent once per cancelled
message, after the commit.
"""

from __future__ import annotations

import datetime
import functools
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

from asgiref.sync import sync_to_async
from django.db import transaction
from django.db.models import QuerySet
from django.db.models.functions import Coalesce

from django_pgqueue import conf, controls, groups, signals
from django_pgqueue.exceptions import QueueControlError
from django_pgqueue.lifecycle.guards import (
    NO_LEASE,
    leased,
    log_extra,
    log_lease_lost,
    logger,
    now_or_db,
)
from django_pgqueue.models import Message, Outcome, Status
from django_pgqueue.paging import ids_in_chunks, slices
from django_pgqueue.sql import history as history_sql
from django_pgqueue.sql import timeouts as timeouts_sql
from django_pgqueue.workflows import bookkeeping

CHUNK_SIZE = 500  # messages locked and changed per transaction
# The control channel's payload that asks the workers to stop running
# messages: this prefix, then their ids, comma-separated. A NOTIFY payload
# must stay under 8000 bytes: the ids go in as many as it takes.
CANCEL_PREFIX = "cancel:"
PAYLOAD_MAX = 7900

# What cancel() is given: a queryset, or ids, or Message instances.
Messages = QuerySet[Message] | Message | int | Iterable[int | Message]


@dataclass
class CancelResult:
    """What one cancel() call did, by outcome."""

    cancelled: int = 0  # waiting, delayed or blocked: cancelled at once
    requested: int = 0  # processing: its worker was told (its handler may still finish)
    already: int = 0  # cancelled before, or its cancellation already asked
    finished: int = 0  # no unfinished message has that id (done, dead-lettered, no such id)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    def __str__(self) -> str:
        return (
            f"cancelled {self.cancelled}, asked {self.requested} running to stop, "
            f"{self.already} already cancelled, {self.finished} finished or unknown"
        )


def cancel(
    messages: Messages,
    *,
    by: str = "",
    now: datetime.datetime | None = None,
    database: str | None = None,
) -> CancelResult:
    """Cancel ``messages`` (a queryset, ids or messages): those waiting,
    delayed or blocked at once (they never run); for those processing, the
    cancellation is recorded and their worker told (their handler's
    ``cancel_requested()`` turns True within a second). Each chunk of
    CHUNK_SIZE messages is one transaction that locks their rows, so a
    claim and a cancel of one message never both win. Returns the counts by
    outcome (CancelResult).

    ``database`` is the alias the messages are on, when queues live on
    several databases (their ids are numbered per database): by default a
    queryset's ``.using()`` alias or the messages' own, else
    ``PGQUEUE["DATABASE"]``."""
    if not isinstance(messages, QuerySet | Message | int):
        messages = list(messages)  # read once: for their database, then their ids
    using = _database_of(messages, database)
    result = CancelResult()
    for ids in _id_chunks(messages, using):
        _cancel_chunk(ids, using, by, now, result)
    logger.info(
        "Messages cancel by %s: %s",
        by or "?",
        result,
        extra={"state": "cancel", **result.as_dict()},
    )
    return result


async def acancel(
    messages: Messages,
    *,
    by: str = "",
    now: datetime.datetime | None = None,
    database: str | None = None,
) -> CancelResult:
    """``cancel()`` for async code: the same arguments, result and errors
    (``QueueControlError``). It runs ``cancel()`` through
    ``sync_to_async(thread_sensitive=True)``, on the connection of your sync
    ORM code, as Django's async ORM methods do: a queryset is evaluated
    there, and each chunk's transaction is a savepoint of the transaction
    open there on the queue's database, if any, else commits at once (docs:
    *Async code*)."""
    return await sync_to_async(cancel, thread_sensitive=True)(
        messages, by=by, now=now, database=database
    )


def cancel_running(
    message: Message,
    error: str = "",
    worker: str = "",
    now: datetime.datetime | None = None,
) -> bool:
    """End the run of ``message``, whose cancellation was asked, as
    cancelled, if this lease still holds it: its handler stopped early or
    failed (``error``), or it never started. False: the lease was lost."""
    using = conf.database_alias()
    clock = now_or_db(now)
    changes: dict[str, Any] = {
        "status": Status.CANCELLED,
        **NO_LEASE,
        "cancel_requested_at": Coalesce("cancel_requested_at", clock),
        "updated_at": clock,
    }
    if error:
        changes["last_error"] = error
    with timeouts_sql.worker_transaction(using):
        if not leased(message, using).update(**changes):
            log_lease_lost(message, "not cancelled")
            return False
        # Its run started at the claim (the row's updated_at is now the
        # cancellation's); the worker's copy of the row still has it.
        history_sql.record(
            [message.pk],
            Outcome.CANCELLED,
            now=now,
            started_at=message.updated_at,
            worker=worker or message.locked_by,
            using=using,
        )
        if message.workflow_step_id is not None:
            bookkeeping.given_up_messages([message.pk], using)
        transaction.on_commit(functools.partial(_cancelled, message, worker), using=using)
    logger.info(
        "Message id=%s topic=%s attempt=%s cancelled while running",
        message.pk,
        message.topic,
        message.attempts,
        extra=log_extra(message, state="cancelled", worker=worker),
    )
    return True


def cancel_payloads(ids: Iterable[int]) -> list[str]:
    """The control channel's payloads that name ``ids`` (CANCEL_PREFIX, then
    as many ids as fit)."""
    payloads, current = [], CANCEL_PREFIX
    for pk in ids:
        item = str(pk)
        if len(current) + len(item) + 1 > PAYLOAD_MAX:
            payloads.append(current.rstrip(","))
            current = CANCEL_PREFIX
        current += item + ","
    if current != CANCEL_PREFIX:
        payloads.append(current.rstrip(","))
    return payloads


def _cancel_chunk(
    ids: list[int],
    using: str,
    by: str,
    now: datetime.datetime | None,
    result: CancelResult,
) -> None:
    clock = now_or_db(now)
    waiting = [Status.WAITING, Status.BLOCKED]
    with timeouts_sql.worker_transaction(using):
        # The rows locked, in id order (two cancels never deadlock); their
        # payload is not needed, and may be JSON Python cannot load.
        rows = list(
            Message.objects.using(using)
            .select_for_update()
            .filter(pk__in=ids)
            .defer("payload", "headers")
            .order_by("pk")
        )
        at_once = [row for row in rows if row.status in waiting]
        running = [
            row
            for row in rows
            if row.status == Status.PROCESSING and row.cancel_requested_at is None
        ]
        already = sum(
            row.status == Status.CANCELLED
            or (row.status == Status.PROCESSING and row.cancel_requested_at is not None)
            for row in rows
        )
        result.already += already
        result.finished += len(ids) - len(at_once) - len(running) - already
        if at_once:
            Message.objects.using(using).filter(
                pk__in=[row.pk for row in at_once], status__in=waiting
            ).update(status=Status.CANCELLED, cancel_requested_at=clock, updated_at=clock)
            history_sql.record([row.pk for row in at_once], Outcome.CANCELLED, now=now, using=using)
            steps = [row.pk for row in at_once if row.workflow_step_id is not None]
            if steps:  # workflow steps: given up, and those after them
                bookkeeping.given_up_messages(steps, using)
            if any(row.group_key is not None for row in at_once):
                # Its group goes on now, as after an acknowledgement (the
                # trigger recorded the release; workers are woken).
                groups.promote_groups()
            for row in at_once:
                row.status = Status.CANCELLED
                transaction.on_commit(functools.partial(_cancelled, row, ""), using=using)
        if running:
            Message.objects.using(using).filter(
                pk__in=[row.pk for row in running], status=Status.PROCESSING
            ).update(cancel_requested_at=clock)
            controls.notify_workers(cancel_payloads(row.pk for row in running), using)
    result.cancelled += len(at_once)
    result.requested += len(running)


def _cancelled(message: Message, worker: str) -> None:
    signals.send(signals.message_cancelled, sender=Message, message=message, worker=worker)


def _database_of(messages: Messages, database: str | None) -> str:
    """The alias ``messages`` are on (``cancel``'s ``database``); a bad
    alias, or messages of several databases, is a QueueControlError."""
    if database is not None:
        problem = conf.alias_problem(database)
        if problem:
            raise QueueControlError(f"database {problem}")
        return database
    if isinstance(messages, QuerySet):
        # _db: the alias its .using() named, if any (QuerySet.db would
        # answer the router's default instead of the database in scope).
        return messages._db or conf.database_alias()  # type: ignore[union-attr]
    items = [messages] if isinstance(messages, Message | int) else messages
    if isinstance(items, list):
        found = {m._state.db for m in items if isinstance(m, Message) and m._state.db}
        if len(found) > 1:
            raise QueueControlError(
                f"the messages are on several databases ({', '.join(sorted(found))}): "
                "cancel those of each database in a call of its own"
            )
        if found:
            return found.pop()
    return conf.database_alias()


def _id_chunks(messages: Messages, using: str) -> Iterator[list[int]]:
    """The ids of ``messages``, ascending, CHUNK_SIZE at a time; a bad
    argument is a QueueControlError before anything changes."""
    if isinstance(messages, QuerySet):
        if messages.model is not Message:
            raise QueueControlError(
                f"expected a Message queryset, not one of {messages.model.__name__}"
            )
        if messages.query.is_sliced:
            picked = sorted(set(messages.using(using).values_list("pk", flat=True)))
            return slices(picked, CHUNK_SIZE)
        return ids_in_chunks(messages.using(using), CHUNK_SIZE)
    items = [messages] if isinstance(messages, Message | int) else list(messages)
    ids: set[int] = set()
    for item in items:
        pk = item.pk if isinstance(item, Message) else item
        if not isinstance(pk, int) or isinstance(pk, bool) or pk < 1:
            raise QueueControlError(f"message ids are whole numbers of at least 1, not {pk!r}")
        ids.add(pk)
    ordered = sorted(ids)
    return slices(ordered, CHUNK_SIZE)
