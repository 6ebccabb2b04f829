"""``categorize()``: set the category of dead letters, as a person decided."""

from __future__ import annotations

import collections
import datetime

from django.db import transaction
from django.utils import timezone

from django_pgqueue.deadletters import arguments, audit, selection
from django_pgqueue.deadletters.arguments import Actor
from django_pgqueue.deadletters.audit import logger
from django_pgqueue.deadletters.result import UNCHANGED, TriageResult
from django_pgqueue.deadletters.selection import CHUNK_SIZE, DeadLetters, id_batches, locked
from django_pgqueue.exceptions import DeadLetterError
from django_pgqueue.models import Category, DeadLetter


def categorize(
    dead_letters: DeadLetters,
    category: str,
    *,
    note: str | None = "",
    by: Actor = "",
    dry_run: bool = False,
    now: datetime.datetime | None = None,
    chunk_size: int = CHUNK_SIZE,
) -> TriageResult:
    """Set the category of dead letters (in any state), as a person decided.

    ``category`` is one of ``models.Category``. ``category_set_by`` (``by``)
    and ``category_set_at`` record who and when; a line in ``notes`` records
    the previous category, who and ``note``. Dead letters already in
    that category are skipped.
    """
    dead_letters, using = selection.database_of(dead_letters)
    if category not in Category.values:
        raise DeadLetterError(f"unknown category {category!r}; one of {', '.join(Category.values)}")
    category = Category(category).value
    actor, line_note = arguments.actor(by), arguments.note(note)
    batches = id_batches(dead_letters, using, arguments.chunk_size(chunk_size))
    result = TriageResult("categorize", dry_run=dry_run)
    for ids in batches:
        with transaction.atomic(using=using):
            rows = locked(ids, using, result, only=audit.LOG_FIELDS, lock=not dry_run)
            by_old = collections.defaultdict(list)
            for row in rows:
                if row.category == category:
                    result.skipped[UNCHANGED] += 1
                else:
                    by_old[row.category].append(row)
            changed = [row for group in by_old.values() for row in group]
            if dry_run or not changed:
                result.done += len(changed)
                continue
            now_value = now or timezone.now()
            # One UPDATE per previous category (at most five), so the note
            # line can say what the category was.
            for old, group in by_old.items():
                what = f"category set to {category} (was {old})"
                line = audit.note_line(now_value, what, actor, line_note)
                rows_of_old = DeadLetter.objects.using(using).filter(
                    pk__in=[row.pk for row in group], category=old
                )
                result.done += audit.noted_update(
                    rows_of_old,
                    line,
                    category=category,
                    category_set_by=actor,
                    category_set_at=now_value,
                )
        for row in changed:
            logger.info(
                "Dead letter id=%s topic=%s category %s -> %s by %s",
                row.pk,
                row.topic,
                row.category,
                category,
                actor or "-",
                extra=audit.log_extra(
                    row, category=category, previous_category=row.category, actor=actor
                ),
            )
    return result
