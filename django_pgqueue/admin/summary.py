"""The summary page of the dead-letter admin: dead letters by topic and
category, queue depth and the oldest ready message's age, read through
``stats`` (read only), as tables and CSS bars (summary.html)."""

from __future__ import annotations

from django.contrib import admin
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest
from django.template.response import TemplateResponse
from django.utils.http import urlencode

from django_pgqueue import conf
from django_pgqueue.models import Category, DeadLetterState, Status
from django_pgqueue.observability import stats


def duration(seconds: float | None) -> str:
    """``seconds`` as its two largest units from the first non-zero one ("1h 0m",
    "4m 12s", "7s"), or "-" for None."""
    if seconds is None:
        return "-"
    rest, parts = int(seconds), list[str]()
    for size, unit in [(86400, "d"), (3600, "h"), (60, "m"), (1, "s")]:
        n, rest = divmod(rest, size)
        if n or parts or size == 1:
            parts.append(f"{n}{unit}")
    return " ".join(parts[:2])


def summary_view(modeladmin: admin.ModelAdmin, request: HttpRequest) -> TemplateResponse:
    """The page, for users who may view dead letters; ``?state=`` limits the
    dead letters to one state."""
    if not modeladmin.has_view_permission(request):
        raise PermissionDenied
    alias, several = conf.database_alias(), len(conf.databases()) > 1
    state = request.GET.get("state")
    state = state if state in DeadLetterState.values else None
    dead = stats.dead_letters_by_topic_and_category(state=state)
    by_category = dict.fromkeys(Category.values, 0)
    for _, category, count in dead:
        by_category[category] = by_category.get(category, 0) + count
    most = max(by_category.values(), default=0) or 1
    ages = stats.oldest_ready_age()
    queues: dict[str, dict[str, int]] = {}
    for queue, status, count in stats.queue_depth_by_status():
        queues.setdefault(queue, dict.fromkeys(Status.values, 0))[status] = count
    context = {
        **modeladmin.admin_site.each_context(request),
        "opts": modeladmin.opts,
        "title": "Queue and dead-letter summary" + (f" (database {alias})" if several else ""),
        # The database it shows, kept by its links (a query string part).
        "on_database": urlencode({"database": alias}) if several else "",
        "state": state,
        "states": DeadLetterState.choices,
        "dead_letters": dead,
        "dead_total": sum(count for *_, count in dead),
        "category_bars": [
            (category, count, round(100 * count / most, 1))
            for category, count in by_category.items()
        ],
        "statuses": Status.values,
        "depth": [
            (queue, [counts[s] for s in Status.values], duration(ages.get(queue)))
            for queue, counts in sorted(queues.items())
        ],
    }
    request.current_app = modeladmin.admin_site.name
    return TemplateResponse(request, "admin/django_pgqueue/summary.html", context)
