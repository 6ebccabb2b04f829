"""Charts drawn on the server as inline SVG: ``bar_chart`` turns counts per
time slot into an SVG string (a pure function: data in, markup out).

No script and nothing fetched: the page is readable without JavaScript and
offline. Each chart has a ``<title>`` and a ``<desc>`` (``role="img"`` and
``aria-labelledby`` name them to screen readers), each bar a ``<title>``
(its slot, outcome and count: a tooltip when hovered), and the page shows
the same numbers as a table. Every text is escaped.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from html import escape

# Bar colours by outcome: distinguishable for the common colour-vision
# deficiencies (the Okabe-Ito palette), and each series is named in the
# legend and in every bar's title, never by colour alone.
COLOURS = {
    "done": "#009E73",
    "retried": "#E69F00",
    "dead_lettered": "#D55E00",
    "cancelled": "#56B4E9",
}
LABELS = {
    "done": "done",
    "retried": "retried",
    "dead_lettered": "dead-lettered",
    "cancelled": "cancelled",
}


@dataclass(frozen=True)
class Frame:
    """The chart's size and margins, in SVG user units (pixels at 100%)."""

    width: int = 480
    height: int = 180
    left: int = 40
    right: int = 8
    top: int = 24
    bottom: int = 28

    @property
    def plot_width(self) -> int:
        return self.width - self.left - self.right

    @property
    def plot_height(self) -> int:
        return self.height - self.top - self.bottom


def nice_ceiling(value: int) -> int:
    """The smallest of 1, 2, 5 times a power of ten that is >= ``value``
    (at least 1): the top of the axis."""
    top = 1
    while True:
        for factor in (1, 2, 5):
            if top * factor >= value:
                return top * factor
        top *= 10


def bar_chart(
    chart_id: str,
    title: str,
    slots: Sequence[datetime.datetime],
    series: Mapping[str, Sequence[int]],
    slot_format: str = "%H:%M",
    frame: Frame | None = None,
) -> str:
    """Stacked bars, one per slot (oldest left), one colour per outcome of
    ``series`` ({outcome: a count per slot}); a y axis from 0 to a round
    top, the first, middle and last slot's time under the x axis, and a
    legend with each outcome's total. ``chart_id`` must be unique in the
    page (the ids of the title and description derive from it)."""
    frame = frame or Frame()
    n = len(slots)
    totals = [sum(values[i] for values in series.values()) for i in range(n)]
    top = nice_ceiling(max(totals, default=0))
    scale = frame.plot_height / top
    step = frame.plot_width / max(n, 1)
    bar = max(step - 1, 1.0) if step > 2 else step
    sums = {outcome: sum(values) for outcome, values in series.items()}
    desc = (
        f"{len(slots)} bars from {_when(slots, 0, slot_format)} to "
        f"{_when(slots, n - 1, slot_format)}. Totals: "
        + ", ".join(f"{LABELS.get(o, o)} {sums[o]}" for o in series)
        + "."
    )
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="pgqueue-chart" id="{escape(chart_id)}" '
        f'role="img" aria-labelledby="{escape(chart_id)}-title {escape(chart_id)}-desc" '
        f'viewBox="0 0 {frame.width} {frame.height}" width="100%" '
        f'preserveAspectRatio="xMinYMin meet">',
        f'<title id="{escape(chart_id)}-title">{escape(title)}</title>',
        f'<desc id="{escape(chart_id)}-desc">{escape(desc)}</desc>',
    ]
    out += _axes(frame, top)
    for i, slot in enumerate(slots):
        x = frame.left + i * step
        y: float = frame.top + frame.plot_height
        for outcome, values in series.items():
            count = values[i]
            if not count:
                continue
            h = count * scale
            y -= h
            label = f"{slot.strftime(slot_format)} {LABELS.get(outcome, outcome)}: {count}"
            out.append(
                f'<rect class="bar bar-{escape(outcome)}" x="{x:.1f}" y="{y:.1f}" '
                f'width="{bar:.1f}" height="{h:.1f}" fill="{COLOURS.get(outcome, "#888")}">'
                f"<title>{escape(label)}</title></rect>"
            )
    out += _x_labels(frame, slots, step, slot_format)
    out += _legend(frame, series, sums)
    out.append("</svg>")
    return "\n".join(out)


def _when(slots: Sequence[datetime.datetime], i: int, slot_format: str) -> str:
    return slots[i].strftime(slot_format) if slots else "-"


def _axes(frame: Frame, top: int) -> list[str]:
    base = frame.top + frame.plot_height
    right = frame.left + frame.plot_width
    lines = [
        f'<line class="axis" x1="{frame.left}" y1="{base}" x2="{right}" y2="{base}" '
        'stroke="currentColor" stroke-width="1"/>'
    ]
    for value in (0, top // 2 if top >= 2 else None, top):
        if value is None:
            continue
        y = base - value * frame.plot_height / top
        lines.append(
            f'<line class="grid" x1="{frame.left}" y1="{y:.1f}" x2="{right}" y2="{y:.1f}" '
            'stroke="currentColor" stroke-opacity="0.15"/>'
        )
        lines.append(
            f'<text x="{frame.left - 4}" y="{y + 4:.1f}" text-anchor="end" font-size="11" '
            f'fill="currentColor">{value}</text>'
        )
    return lines


def _x_labels(
    frame: Frame, slots: Sequence[datetime.datetime], step: float, slot_format: str
) -> list[str]:
    if not slots:
        return []
    y = frame.top + frame.plot_height + 16
    picks = sorted({0, len(slots) // 2, len(slots) - 1})
    anchors = {0: "start", len(slots) - 1: "end"}
    lines = []
    for i in picks:
        x = frame.left + (i + (0 if i == 0 else 1 if i == len(slots) - 1 else 0.5)) * step
        lines.append(
            f'<text x="{x:.1f}" y="{y}" text-anchor="{anchors.get(i, "middle")}" '
            f'font-size="11" fill="currentColor">{escape(slots[i].strftime(slot_format))}</text>'
        )
    return lines


def _legend(
    frame: Frame, series: Mapping[str, Sequence[int]], sums: Mapping[str, int]
) -> list[str]:
    lines, x = [], frame.left
    for outcome in series:
        colour = COLOURS.get(outcome, "#888")
        text = f"{LABELS.get(outcome, outcome)} ({sums[outcome]})"
        lines.append(
            f'<rect x="{x}" y="6" width="10" height="10" fill="{colour}"/>'
            f'<text x="{x + 14}" y="15" font-size="10" fill="currentColor">{escape(text)}</text>'
        )
        x += 20 + 6 * len(text)
    return lines


def numbers_table(
    caption: str,
    slots: Sequence[datetime.datetime],
    series: Mapping[str, Sequence[int]],
    slot_format: str = "%H:%M",
) -> str:
    """The numbers of a chart as an HTML table: a row per slot, a column per
    outcome (what a screen reader or a copy into a spreadsheet wants)."""
    head = "".join(f'<th class="num">{escape(LABELS.get(o, o))}</th>' for o in series)
    rows = "".join(
        f"<tr><td>{escape(slot.strftime(slot_format))}</td>"
        + "".join(f'<td class="num">{int(values[i])}</td>' for values in series.values())
        + "</tr>"
        for i, slot in enumerate(slots)
    )
    return (
        f'<table class="pgqueue-chart-numbers" aria-label="{escape(caption)}">'
        f"<thead><tr><th>Time (UTC)</th>{head}</tr></thead><tbody>{rows}</tbody></table>"
    )
