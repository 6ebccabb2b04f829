"""``resolve()``: close dead letters without redelivering them."""

from __future__ import annotations

import datetime

from django.db import transaction
from django.utils import timezone

from django_pgqueue.deadletters import arguments, audit, selection
from django_pgqueue.deadletters.arguments import Actor
from django_pgqueue.deadletters.audit import logger
from django_pgqueue.deadletters.result import ALREADY_RESOLVED, IS_REVIVED, TriageResult
from django_pgqueue.deadletters.selection import CHUNK_SIZE, DeadLetters, id_batches, locked
from django_pgqueue.exceptions import DeadLetterError
from django_pgqueue.models import DeadLetter, DeadLetterState
from django_pgqueue.workflows import bookkeeping


def resolve(
    dead_letters: DeadLetters,
    *,
    note: str | None,
    by: Actor = "",
    dry_run: bool = False,
    now: datetime.datetime | None = None,
    chunk_size: int = CHUNK_SIZE,
) -> TriageResult:
    """Close dead letters without redelivering them; they are kept for audit.

    Each ``new`` dead letter becomes ``resolved`` with ``resolved_at``,
    ``resolved_by`` (``by``: a name or a user) and ``note`` appended to
    ``notes``; ``note`` is required. Already resolved and revived ones are
    skipped.
    """
    dead_letters, using = selection.database_of(dead_letters)
    actor, line_note = arguments.actor(by), arguments.note(note)
    if not line_note:
        raise DeadLetterError("resolve() needs a note saying why (note='...')")
    batches = id_batches(dead_letters, using, arguments.chunk_size(chunk_size))
    result = TriageResult("resolve", dry_run=dry_run)
    for ids in batches:
        with transaction.atomic(using=using):
            rows = locked(ids, using, result, only=audit.LOG_FIELDS, lock=not dry_run)
            fresh = []
            for row in rows:
                if row.state == DeadLetterState.NEW:
                    fresh.append(row)
                elif row.state == DeadLetterState.RESOLVED:
                    result.skipped[ALREADY_RESOLVED] += 1
                else:
                    result.skipped[IS_REVIVED] += 1
            if dry_run or not fresh:
                result.done += len(fresh)
                continue
            now_value = now or timezone.now()
            line = audit.note_line(now_value, "resolved", actor, line_note)
            fresh_rows = DeadLetter.objects.using(using).filter(
                pk__in=[row.pk for row in fresh], state=DeadLetterState.NEW
            )
            ids = [row.pk for row in fresh]
            result.done += audit.noted_update(
                fresh_rows,
                line,
                state=DeadLetterState.RESOLVED,
                holds_group=False,  # a trigger releases the group (migration 0009)
                resolved_at=now_value,
                resolved_by=actor,
            )
            # A workflow step's dead letter given up: so is the step, and those after it.
            bookkeeping.given_up_dead_letters(ids, using)
        for row in fresh:
            logger.info(
                "Dead letter id=%s topic=%s resolved by %s",
                row.pk,
                row.topic,
                actor or "-",
                extra=audit.log_extra(row, state=DeadLetterState.RESOLVED, actor=actor),
            )
    return result
