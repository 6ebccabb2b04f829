"""What the management commands print: table cells and rows, ages, counts
(a command module must not import another, so they share these here).

Names, hosts, topics and reasons come from the database, written by other
programs: a cell shows no control characters to the terminal.
"""

from __future__ import annotations

from collections.abc import Sequence


def cell(value: object, width: int) -> str:
    """``value`` as text of at most ``width`` characters (cut with "…"),
    each unprintable character shown as "?"."""
    text = "".join(c if c.isprintable() else "?" for c in str(value))
    if len(text) > width:
        text = text[: width - 1] + "…"
    return text


class Columns:
    """A table's columns: their titles and layout, each a format spec's
    alignment and width ("<26": left, 26 wide; ">9": right, 9 wide; numbers
    and ages are right-aligned under their titles)."""

    def __init__(self, titles: Sequence[str], layout: str) -> None:
        specs = layout.split()
        if len(specs) != len(titles):
            raise ValueError(f"{len(titles)} titles, {len(specs)} widths")
        self.titles = tuple(titles)
        self.specs = [(spec[0], int(spec[1:])) for spec in specs]

    def led_by(self, title: str, spec: str) -> Columns:
        """These columns after a first one (``title``, laid out as ``spec``)."""
        layout = " ".join(f"{align}{width}" for align, width in self.specs)
        return Columns([title, *self.titles], f"{spec} {layout}")

    def header(self) -> str:
        return self.row(self.titles)

    def row(self, values: Sequence[object]) -> str:
        """The row of ``values``, one per column from the first (fewer than
        the columns: the first columns only)."""
        cells = []
        for (align, width), value in zip(self.specs[: len(values)], values, strict=True):
            text = cell(value, width)
            cells.append(text.rjust(width) if align == ">" else text.ljust(width))
        return " ".join(cells).rstrip()


def age(seconds: float) -> str:
    """12s, 5m 03s, 2h 05m, 3d 04h: short and readable (JSON has the exact seconds)."""
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds}s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m {seconds:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours}h {minutes:02d}m"
    days, hours = divmod(hours, 24)
    return f"{days}d {hours:02d}h"


def seconds(value: float) -> str:
    """312.5, 300: seconds without a trailing .0 (nor an exponent)."""
    return f"{value:.3f}".rstrip("0").rstrip(".")


def plural(number: int, noun: str) -> str:
    """ "1 worker", "2 workers"."""
    return f"{number} {noun}{'' if number == 1 else 's'}"


def one_line(error: BaseException) -> str:
    """An error's text with its line breaks and runs of spaces folded."""
    return " ".join(str(error).split())
