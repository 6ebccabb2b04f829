"""How a stored text (an error, a reason, a note) is cut down for a line:
a log line, a list column, an alert, a table cell."""

from __future__ import annotations


def first_line(text: str | None) -> str:
    """The first line of ``text`` after any blank ones, or "" (a traceback's
    or a reason's first line says what failed; the rest is detail)."""
    lines = (text or "").strip().splitlines()
    return lines[0] if lines else ""
