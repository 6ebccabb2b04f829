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


def overview_view(modeladmin: admin.ModelAdmin, request: HttpRequest) -> TemplateResponse:
    """The page, for users who may view the history."""
    if not modeladmin.has_view_permission(request):
        raise PermissionDenied
    now = timezone.now()
    minutes = outcomes.per_minute(now)
    hours = outcomes.per_hour(now)
    workers = stats.workers()
    live = sum(1 for row in workers if row.alive)  # each worker once
    depth = _depth(now, workers)
    names = sorted(set(conf.queues()) | set(depth) | set(minutes.by_queue) | set(hours.by_queue))
    empty_minutes = {o: [0] * len(minutes.slots) for o in minutes.total}
    empty_hours = {o: [0] * len(hours.slots) for o in hours.total}
    queues = []
    for i, name in enumerate(names):
        per_minute = minutes.by_queue.get(name, empty_minutes)
        per_hour = hours.by_queue.get(name, empty_hours)
        queues.append(
            {
                "name": name,
                "depth": depth.get(name, _no_depth()),
                "sums": _sums(minutes.sums(per_minute), hours.sums(per_hour)),
                "charts": [
                    _chart(f"queue-{i}-minutes", f"Queue {name}: per minute, last hour",
                           minutes.slots, per_minute, "%H:%M"),
                    _chart(f"queue-{i}-hours", f"Queue {name}: per hour, last day",
                           hours.slots, per_hour, "%d %H:00"),
                ],
            }
        )  # fmt: skip
    dead = stats.dead_letters_by_topic_and_category(state=DeadLetterState.NEW)
    by_category = dict.fromkeys(Category.values, 0)
    for _, category, count in dead:
        by_category[category] = by_category.get(category, 0) + count
    context = {
        **modeladmin.admin_site.each_context(request),
        "opts": modeladmin.opts,
        "title": "Queue overview",
        "now": now,
        "keeping": bool(conf.get("KEEP_FINISHED")),
        "refresh_seconds": REFRESH_SECONDS,
        "total": {
            "sums": _sums(minutes.sums(), hours.sums()),
            "charts": [
                _chart("total-minutes", "All queues: per minute, last hour",
                       minutes.slots, minutes.total, "%H:%M"),
                _chart("total-hours", "All queues: per hour, last day",
                       hours.slots, hours.total, "%d %H:00"),
            ],
            "depth": {**_total_depth(depth.values()), "workers": live},
        },
        "queues": queues,
        "dead_by_category": list(by_category.items()),
        "dead_total": sum(by_category.values()),
    }  # fmt: skip
    request.current_app = modeladmin.admin_site.name
    return TemplateResponse(request, "admin/django_pgqueue/overview.html", context)


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
