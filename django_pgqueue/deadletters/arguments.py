"""Checks of what a caller passes to the triage functions: each returns the
value as it is stored, or raises ``DeadLetterError`` before anything is
written."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from django.db import models

from django_pgqueue import conf
from django_pgqueue.exceptions import DeadLetterError
from django_pgqueue.models import DeadLetter


class User(Protocol):
    """A user object (``request.user``): its username is stored."""

    def get_username(self) -> str: ...


# Who did it: a name, or a user.
Actor = str | User | None

_ACTOR_MAX_LENGTH: int = DeadLetter._meta.get_field("resolved_by").max_length or 0


def actor(by: Actor) -> str:
    """Who did it, as the name stored in the audit fields."""
    if by is None:
        return ""
    if not isinstance(by, str) and hasattr(by, "get_username"):
        by = by.get_username()
    if not isinstance(by, str):
        raise DeadLetterError(f"by must be a name or a user, not {type(by).__name__}")
    by = text("by", by).strip()
    if len(by) > _ACTOR_MAX_LENGTH:
        raise DeadLetterError(f"by is {len(by)} characters long; the limit is {_ACTOR_MAX_LENGTH}")
    return by


def note(value: str | None) -> str:
    """The note on one line: ``notes`` holds one line per change."""
    if value is None:
        return ""
    if not isinstance(value, str):
        raise DeadLetterError(f"note must be a string, not {type(value).__name__}")
    return " ".join(text("note", value).split())


def text(name: str, value: object) -> str:
    """``value`` if PostgreSQL can store it as text, else DeadLetterError."""
    if not isinstance(value, str):
        raise DeadLetterError(f"{name} must be strings, not {type(value).__name__}")
    problem = conf.text_problem(value)
    if problem:
        raise DeadLetterError(f"{name}: {problem}")
    return value


def name_or_none(kind: str, value: str | None, max_length: int) -> str | None:
    """A queue or topic name to send revived messages to, or None."""
    if value is None:
        return None
    problem = conf.name_problem(kind, value, max_length)
    if problem:
        raise DeadLetterError(problem)
    return value


def chunk_size(size: object) -> int:
    if not conf.is_int(size) or size < 1:
        raise DeadLetterError(f"chunk_size must be a whole number of at least 1, not {size!r}")
    return size


def choices(what: str, values: str | Iterable[str], allowed: type[models.Choices]) -> list[str]:
    """``values`` (one or many), every one a value of ``allowed``."""
    values = [values] if isinstance(values, str) else list(values)
    unknown = [v for v in values if v not in allowed.values]
    if unknown:
        raise DeadLetterError(
            f"unknown {what} {', '.join(map(repr, unknown))}; one of {', '.join(allowed.values)}"
        )
    return values


def is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
