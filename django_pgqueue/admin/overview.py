"""The queue overview page: per queue and in total, the messages done,
retried, dead-lettered and cancelled per minute over the last hour and per
hour over the last day (SVG charts drawn here, ``charts``, with the numbers
as tables), the depth (ready, delayed, blocked, processing), the oldest
ready message's age, the live workers and the new dead letters by
category.

The outcomes come from the per-minute counts (``observability.outcomes``:
at most a day of small rows), never from the history itself, so the page
costs the same with a million finished messages as with none. Read only.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

from django.contrib import admin
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest
from django.template.response import TemplateResponse
from django.utils import timezone
from django.utils.safestring import mark_safe

from django_pgqueue import conf
from django_pgqueue.admin.charts import LABELS, bar_chart, numbers_table
from django_pgqueue.admin.summary import duration
from django_pgqueue.models import Category, DeadLetterState
from django_pgqueue.observability import outcomes, stats

# Seconds between two refreshes of the page while it is open (with JavaScript).
REFRESH_SECONDS = 30


@dataclass
class Part:
    """What the page reads of one database."""

    minutes: outcomes.Series
    hours: outcomes.Series
    workers: list[Any]
    depth: dict[str, dict[str, Any]]
    dead: list[tuple[str, str, int]]


def _read(now: datetime.datetime) -> Part:
    """The figures of the database the code works on."""
    workers = stats.workers()
    return Part(
        minutes=outcomes.per_minute(now),
        hours=outcomes.per_hour(now),
        workers=workers,
        depth=_depth(now, workers),
        dead=stats.dead_letters_by_topic_and_category(state=DeadLetterState.NEW),
    )


def overview_view(modeladmin: admin.ModelAdmin, request: HttpRequest) -> TemplateResponse:
    """The page, for users who may view the history: every database of the
    queues, each queue's row saying its database when there are several."""
    if not modeladmin.has_view_permission(request):
        raise PermissionDenied
    now = timezone.now()
    parts = {}
    for alias in conf.databases():
        with conf.on_database(alias):
            parts[alias] = _read(now)
    first = next(iter(parts.values()))
    minutes_total = _summed([part.minutes.total for part in parts.values()])
    hours_total = _summed([part.hours.total for part in parts.values()])
    # Each worker once (a worker serving two databases beats in both).
    live = len({row.worker_id for part in parts.values() for row in part.workers if row.alive})
    queues: list[dict[str, Any]] = []
    for alias, part in parts.items():
        queues += _queue_rows(alias, part, len(queues))
    dead_rows = []
    for alias, part in parts.items():
        by_category = dict.fromkeys(Category.values, 0)
        for _, category, count in part.dead:
            by_category[category] = by_category.get(category, 0) + count
        dead_rows += [(alias, category, count) for category, count in by_category.items()]
    context = {
        **modeladmin.admin_site.each_context(request),
        "opts": modeladmin.opts,
        "title": "Queue overview",
        "now": now,
        "keeping": bool(conf.get("KEEP_FINISHED")),
        "refresh_seconds": REFRESH_SECONDS,
        "several_databases": len(parts) > 1,
        "total": {
            "sums": _sums(first.minutes.sums(minutes_total), first.hours.sums(hours_total)),
            "charts": [
                _chart("total-minutes", "All queues: per minute, last hour",
                       first.minutes.slots, minutes_total, "%H:%M"),
                _chart("total-hours", "All queues: per hour, last day",
                       first.hours.slots, hours_total, "%d %H:00"),
            ],
            "depth": {**_total_depth(q["depth"] for q in queues), "workers": live},
        },
        "queues": queues,
        "dead_by_category": dead_rows,
        "dead_total": sum(count for _, _, count in dead_rows),
    }  # fmt: skip
    request.current_app = modeladmin.admin_site.name
    return TemplateResponse(request, "admin/django_pgqueue/overview.html", context)


def _queue_rows(alias: str, part: Part, start: int) -> list[dict[str, Any]]:
    """The rows of the queues of database ``alias``: those configured on it
    and those with messages or outcomes there; charts numbered from ``start``."""
    minutes, hours = part.minutes, part.hours
    configured = [name for name in conf.queues() if conf.queue_database(name) == alias]
    names = sorted(set(configured) | set(part.depth) | set(minutes.by_queue) | set(hours.by_queue))
    empty_minutes = {o: [0] * len(minutes.slots) for o in minutes.total}
    empty_hours = {o: [0] * len(hours.slots) for o in hours.total}
    rows = []
    for i, name in enumerate(names, start):
        per_minute = minutes.by_queue.get(name, empty_minutes)
        per_hour = hours.by_queue.get(name, empty_hours)
        rows.append(
            {
                "name": name,
                "database": alias,
                "depth": part.depth.get(name, _no_depth()),
                "sums": _sums(minutes.sums(per_minute), hours.sums(per_hour)),
                "charts": [
                    _chart(f"queue-{i}-minutes", f"Queue {name}: per minute, last hour",
                           minutes.slots, per_minute, "%H:%M"),
                    _chart(f"queue-{i}-hours", f"Queue {name}: per hour, last day",
                           hours.slots, per_hour, "%d %H:00"),
                ],
            }
        )  # fmt: skip
    return rows


def _summed(series: list[dict[str, list[int]]]) -> dict[str, list[int]]:
    """Each outcome's counts per slot, summed over ``series`` (same slots)."""
    return {
        outcome: [sum(values) for values in zip(*(s[outcome] for s in series), strict=True)]
        for outcome in series[0]
    }


def _chart(
    chart_id: str,
    title: str,
    slots: list[datetime.datetime],
    series: dict[str, list[int]],
    slot_format: str,
) -> dict[str, Any]:
    """A chart's SVG and its numbers as a table (both escaped by charts)."""
    return {
        "id": chart_id,
        "title": title,
        "svg": mark_safe(bar_chart(chart_id, title, slots, series, slot_format)),  # noqa: S308
        "table": mark_safe(numbers_table(title, slots, series, slot_format)),  # noqa: S308
    }


def _sums(hour: dict[str, int], day: dict[str, int]) -> list[tuple[str, str, int, int]]:
    """(outcome, its label, last hour, last day) per outcome, in the charts' order."""
    return [(outcome, LABELS[outcome], hour[outcome], day[outcome]) for outcome in hour]


def _no_depth() -> dict[str, Any]:
    return {
        stats.READY: 0,
        stats.DELAYED: 0,
        stats.BLOCKED: 0,
        stats.PROCESSING: 0,
        "oldest": "-",
        "oldest_seconds": 0.0,
        "workers": 0,
    }


def _depth(now: datetime.datetime, workers: list[Any]) -> dict[str, dict[str, Any]]:
    """{queue: its depth by state, oldest ready age, live workers (of ``workers``)}."""
    depth: dict[str, dict[str, Any]] = {}
    for queue, _topic, state, count in stats.messages_by_queue_topic_state(now=now):
        depth.setdefault(queue, _no_depth())[state] += count
    for queue, seconds in stats.oldest_ready_age(now=now).items():
        row = depth.setdefault(queue, _no_depth())
        row["oldest"], row["oldest_seconds"] = duration(seconds), seconds
    for queue, alive in stats.live_by_queue(workers).items():
        depth.setdefault(queue, _no_depth())["workers"] = alive
    return depth


def _total_depth(rows: Any) -> dict[str, Any]:
    total = _no_depth()
    for row in rows:
        for state in (stats.READY, stats.DELAYED, stats.BLOCKED, stats.PROCESSING):
            total[state] += row[state]
        total["oldest_seconds"] = max(total["oldest_seconds"], row["oldest_seconds"])
    total["oldest"] = duration(total["oldest_seconds"]) if total["oldest_seconds"] else "-"
    return total
