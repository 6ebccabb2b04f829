"""``revive()``: dead letters back into the queue, as new messages."""

from __future__ import annotations

import datetime
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from django.db import connections, transaction
from django.utils import timezone

from django_pgqueue import conf, groups
from django_pgqueue.deadletters import arguments, audit, selection
from django_pgqueue.deadletters.arguments import Actor
from django_pgqueue.deadletters.audit import logger
from django_pgqueue.deadletters.result import (
    ALREADY_REVIVED,
    DUPLICATE,
    INVALID,
    IS_RESOLVED,
    TriageResult,
)
from django_pgqueue.deadletters.selection import CHUNK_SIZE, DeadLetters, id_batches, locked
from django_pgqueue.enqueuing import enqueue_many
from django_pgqueue.exceptions import DeadLetterError, InvalidMessage
from django_pgqueue.models import UNFINISHED, DeadLetter, DeadLetterState, Message
from django_pgqueue.validation import check_message
from django_pgqueue.workflows import bookkeeping

# The enqueue() keywords of a revived dead letter's new message.
Fields = dict[str, Any]


def revive(
    dead_letters: DeadLetters,
    *,
    queue: str | None = None,
    topic: str | None = None,
    force: bool = False,
    by: Actor = "",
    note: str | None = "",
    rate: float | None = None,
    dry_run: bool = False,
    now: datetime.datetime | None = None,
    chunk_size: int = CHUNK_SIZE,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], object] = time.sleep,
) -> TriageResult:
    """Put dead letters back into the queue as new messages.

    Each becomes a waiting ``Message`` with the same topic, payload, headers,
    priority, queue, group_key, dedup_key, max_attempts and partition_key,
    and 0 attempts, inserted through enqueue's INSERT (so its NOTIFY wakes
    the workers); ``queue=`` or ``topic=`` sends it elsewhere instead. In
    the same transaction the dead letter becomes ``revived`` with ``revived_at``,
    ``revive_count + 1``, ``revived_message_id``, ``revived_by`` (``by``: a
    name or a user) and a line in ``notes`` saying who and ``note``.

    Skipped: dead letters already revived or resolved, unless ``force``;
    those whose dedup_key an unfinished message of the topic holds
    (``DUPLICATE``: that message already carries the work; resolve the dead
    letter, or revive it when the other has finished); those enqueue()
    rejects (``INVALID``; revive them with another ``topic=``/``queue=``).

    ``rate``: revive at most this many messages per second, sleeping between
    chunks (outside any transaction, so call it in autocommit mode), so that
    a large redrive trickles in instead of flooding the workers. ``clock``
    and ``sleep`` are for tests.
    """
    dead_letters, using = selection.database_of(dead_letters)
    queue = arguments.name_or_none("queue", queue, conf.QUEUE_MAX_LENGTH)
    if queue is not None and conf.queue_database(queue) != using:
        raise DeadLetterError(
            f"queue {queue!r} is on the database {conf.queue_database(queue)!r} and these dead "
            f"letters on {using!r}: a revival writes its message and marks its dead letter in "
            "one transaction, so on one database"
        )
    topic = arguments.name_or_none("topic", topic, conf.TOPIC_MAX_LENGTH)
    actor, line_note = arguments.actor(by), arguments.note(note)
    size = arguments.chunk_size(chunk_size)
    if rate is not None:
        if not arguments.is_number(rate) or not 0 < rate < math.inf:
            raise DeadLetterError(f"rate must be a number of messages per second > 0, not {rate!r}")
        if not dry_run and connections[using].in_atomic_block:
            raise DeadLetterError(
                "revive(rate=...) sleeps between chunks and must not hold a transaction open: "
                "call it outside transaction.atomic()"
            )
        size = max(1, min(size, int(rate)))
    batches = id_batches(dead_letters, using, size)

    reviver = _Reviver(
        using, queue, topic, force, actor, line_note, now, TriageResult("revive", dry_run)
    )
    started = clock()
    for ids in batches:
        if rate is not None and not dry_run and reviver.result.done:
            wait = started + reviver.result.done / rate - clock()
            if wait > 0:
                sleep(wait)
        reviver.revive_chunk(ids)
    return reviver.result


@dataclass
class _Reviver:
    """One revive() call: its options, its result so far, and (for a dry run)
    the dedup keys its earlier chunks would have taken."""

    using: str
    queue: str | None
    topic: str | None
    force: bool
    by: str
    note: str
    now: datetime.datetime | None
    result: TriageResult
    planned_keys: set[tuple[str, str]] = field(default_factory=set)

    def revive_chunk(self, ids: list[int]) -> None:
        result = self.result
        skips: list[tuple[DeadLetter, str, str]] = []  # row, reason, detail for the log
        revived: list[tuple[DeadLetter, Message]] = []
        with transaction.atomic(using=self.using):
            rows = locked(ids, self.using, result, lock=not result.dry_run)
            now = self.now or timezone.now()
            inserts = self._plan(rows, skips)
            if result.dry_run:
                result.done += len(inserts)
            elif inserts:
                revived = self._insert(inserts, now, skips)
                # A workflow step's dead letter: the step runs again as the new message.
                bookkeeping.revived(
                    [row.message_id for row, _ in revived],
                    [message.pk for _, message in revived],
                    self.using,
                )
            for _, reason, _ in skips:
                result.skipped[reason] += 1
        # Logged once the chunk has committed: a rolled-back chunk changed nothing.
        for row, message in revived:
            logger.info(
                "Dead letter id=%s topic=%s revived as message id=%s queue=%s topic=%s by %s",
                row.pk,
                row.topic,
                message.pk,
                message.queue,
                message.topic,
                self.by or "-",
                extra=audit.log_extra(
                    row,
                    state=DeadLetterState.REVIVED,
                    revived_message_id=message.pk,
                    queue=message.queue,
                    revived_topic=message.topic,
                    actor=self.by,
                ),
            )
        for row, reason, detail in [] if result.dry_run else skips:
            logger.warning(
                "Dead letter id=%s topic=%s not revived (%s): %s",
                row.pk,
                row.topic,
                reason,
                detail,
                extra=audit.log_extra(row, skipped=reason),
            )

    def _plan(
        self, rows: list[DeadLetter], skips: list[tuple[DeadLetter, str, str]]
    ) -> list[tuple[DeadLetter, Fields]]:
        """The rows of the chunk to revive, with their new messages' fields;
        the others go to ``skips`` (or are counted, when their state says so)."""
        result = self.result
        candidates = []
        for row in rows:
            if row.state == DeadLetterState.REVIVED and not self.force:
                result.skipped[ALREADY_REVIVED] += 1
            elif row.state == DeadLetterState.RESOLVED and not self.force:
                result.skipped[IS_RESOLVED] += 1
            else:
                fields = self.message_fields(row)
                try:
                    check_message(**fields)
                except InvalidMessage as exc:
                    skips.append((row, INVALID, str(exc)))
                else:
                    candidates.append((row, fields))

        # Dedup: an unfinished message holding the key already carries the
        # work. The INSERT's ON CONFLICT would find it too (and two rows of
        # this chunk with one key); asking first serves the dry run.
        held = _held_keys([fields for _, fields in candidates], self.using)
        inserts = []
        for row, fields in candidates:
            key = (fields["topic"], fields["dedup_key"])
            holder: object = held.get(key)
            if holder is None and result.dry_run and key in self.planned_keys:
                holder = "(another dead letter of this run)"
            if holder is not None:
                skips.append((row, DUPLICATE, f"message id={holder} holds its dedup_key"))
                continue
            if fields["dedup_key"] is not None:
                self.planned_keys.add(key)
            inserts.append((row, fields))
        return inserts

    def _insert(
        self,
        inserts: list[tuple[DeadLetter, Fields]],
        now: datetime.datetime,
        skips: list[tuple[DeadLetter, str, str]],
    ) -> list[tuple[DeadLetter, Message]]:
        """Enqueue the new messages and mark their dead letters revived, in
        the chunk's transaction; returns the rows revived, with their message."""
        revived = []
        messages = enqueue_many([fields for _, fields in inserts], using=self.using)
        for (row, _), message in zip(inserts, messages, strict=True):
            if message.created:
                self.mark(row, message, now)
                revived.append((row, message))
            else:  # the ON CONFLICT found a holder after all
                skips.append((row, DUPLICATE, f"message id={message.pk} holds its dedup_key"))
        for row, message in revived:
            if row.holds_group:
                # It kept its group blocked: it goes first.
                groups.lead_group(message)
                row.holds_group = False
        _save_revived([row for row, _ in revived], self.using)
        self.result.done += len(revived)
        return revived

    def message_fields(self, row: DeadLetter) -> Fields:
        """The enqueue() keywords of the dead letter's new message."""
        return {
            "topic": self.topic or row.topic,
            "payload": row.payload,
            "headers": row.headers,
            "priority": row.priority,
            "queue": self.queue or row.queue,
            "dedup_key": row.dedup_key,
            "group_key": row.group_key,
            "max_attempts": row.max_attempts,
            "partition_key": row.partition_key,
        }

    def mark(self, row: DeadLetter, message: Message, now: datetime.datetime) -> None:
        """``row`` revived as ``message``, in memory (saved by _save_revived)."""
        row.state = DeadLetterState.REVIVED
        row.revived_at = now
        row.revive_count += 1
        row.revived_message_id = message.pk
        row.revived_by = self.by
        moved = [
            f"{name} {old} -> {new}"
            for name, old, new in [
                ("queue", row.queue, message.queue),
                ("topic", row.topic, message.topic),
            ]
            if old != new
        ]
        what = f"revived as message {message.pk}" + (f" ({', '.join(moved)})" if moved else "")
        row.notes = audit.appended(row.notes, audit.note_line(now, what, self.by, self.note))


def _save_revived(rows: list[DeadLetter], using: str) -> None:
    """The revived dead letters' UPDATE, in the transaction of their INSERT."""
    if rows:
        DeadLetter.objects.using(using).bulk_update(
            rows,
            [
                "state",
                "revived_at",
                "revive_count",
                "revived_message_id",
                "revived_by",
                "notes",
                "holds_group",  # a trigger releases the group (migration 0009)
            ],
        )


def _held_keys(fields_list: list[Fields], using: str) -> dict[tuple[str, str], int]:
    """{(topic, dedup_key): id of the unfinished message holding it}."""
    wanted = {(f["topic"], f["dedup_key"]) for f in fields_list if f["dedup_key"] is not None}
    if not wanted:
        return {}
    rows = (
        Message.objects.using(using)
        .filter(
            status__in=UNFINISHED,
            topic__in={t for t, _ in wanted},
            dedup_key__in={k for _, k in wanted},
        )
        .values_list("topic", "dedup_key", "pk")
    )
    return {(t, k): pk for t, k, pk in rows if k is not None and (t, k) in wanted}
