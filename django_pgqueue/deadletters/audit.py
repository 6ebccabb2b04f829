"""Who changed a dead letter, and why: the lines appended to ``notes``, and
the fields of the log records the triage functions write."""

from __future__ import annotations

import datetime
import logging
from typing import Any

from django.db.models import Case, F, QuerySet, TextField, Value, When
from django.db.models.functions import Concat

from django_pgqueue.models import DeadLetter

# One logger for every triage module: the name users configure.
logger = logging.getLogger("django_pgqueue.deadletters")

# What resolve() and categorize() read of a row: the state, and what the log says.
LOG_FIELDS = ("id", "message_id", "topic", "state", "category")


def note_line(now: datetime.datetime, what: str, by: str, note: str) -> str:
    """``[time] what by who: note``, one line of ``notes``."""
    line = f"[{now.isoformat(timespec='seconds')}] {what}"
    if by:
        line += f" by {by}"
    if note:
        line += f": {note}"
    return line


def appended(notes: str, line: str) -> str:
    """``notes`` with ``line`` appended, in Python."""
    return f"{notes}\n{line}" if notes else line


def noted_update(rows: QuerySet[DeadLetter], line: str, **changes: Any) -> int:
    """UPDATE ``rows`` with ``changes`` and ``line`` appended to their notes,
    in the server; returns how many rows changed."""
    notes = Case(
        When(notes="", then=Value(line)),
        default=Concat(F("notes"), Value("\n" + line), output_field=TextField()),
        output_field=TextField(),
    )
    return rows.update(notes=notes, **changes)


def log_extra(row: DeadLetter, **fields: Any) -> dict[str, Any]:
    """The ``extra`` of a log record about ``row``."""
    return {"dead_letter_id": row.pk, "message_id": row.message_id, "topic": row.topic, **fields}
