"""The admin of the history: "Finished messages", read only, and the queue
overview page (``overview``) linked from it.

Built for a big table (a day of traffic by default): no full count (an
estimate from the planner once the filtered rows pass ESTIMATE_ABOVE), list
filters whose choices come from the settings and the handler registry
rather than a DISTINCT over the table, and a date drill-down by day whose
days come from the first and last entries of the finished_at index (Django's
own date hierarchy asks the table for its distinct years, months and days).
"""

from __future__ import annotations

import datetime
import json
from typing import Any

from django.contrib import admin
from django.contrib.admin.options import IncorrectLookupParameters
from django.core.paginator import Paginator
from django.db.models import Q, QuerySet, TextField
from django.db.models.functions import Cast
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils import timezone
from django.utils.functional import cached_property
from django.utils.html import format_html

from django_pgqueue import conf, registry
from django_pgqueue.admin.common import (
    ReadOnlyModelAdmin,
    ShowsJSON,
    change_url_on,
    chosen_database,
    on_database_of,
)
from django_pgqueue.admin.overview import overview_view
from django_pgqueue.admin.summary import duration
from django_pgqueue.models import FinishedMessage, OutcomeCount

# Counted exactly up to this many rows; past it, the planner's estimate.
ESTIMATE_ABOVE = 10_000
# The date drill-down shows at most this many days, the latest.
DAYS_SHOWN = 31
# A history entry's page, every field read only.
FIELDS = (
    "message_id",
    "topic",
    "queue",
    "outcome",
    "attempts",
    "dedup_key",
    "dead_letter_link",
    "enqueued_at",
    "started_at",
    "finished_at",
    "duration_text",
    "worker",
    "payload_json",
    "headers_json",
    "same_message_link",
)


class EstimatedCountPaginator(Paginator):
    """A paginator that never counts a big table: it counts at most
    ESTIMATE_ABOVE + 1 rows of the (filtered) list, and past that takes
    PostgreSQL's estimate of the list's size (EXPLAIN, no rows read)."""

    @cached_property
    def count(self) -> int:
        rows = self.object_list
        assert isinstance(rows, QuerySet)
        capped = rows.order_by()[: ESTIMATE_ABOVE + 1].count()
        if capped <= ESTIMATE_ABOVE:
            return capped
        plan = json.loads(rows.order_by().explain(format="json"))
        return max(int(plan[0]["Plan"]["Plan Rows"]), capped)


class TopicFilter(admin.SimpleListFilter):
    """The topics of the registered handlers (not a DISTINCT over the history)."""

    title = "topic"
    parameter_name = "topic"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [(name, name) for name in sorted(spec.topic for spec in registry.all_handlers())]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        return queryset if value is None else queryset.filter(topic=value)


class QueueFilter(admin.SimpleListFilter):
    """The configured queues and those counted in the last two days."""

    title = "queue"
    parameter_name = "queue"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        counted = (
            OutcomeCount.objects.using(conf.database_alias())
            .values_list("queue", flat=True)
            .distinct()
        )
        names = sorted(set(conf.queues()) | set(counted))
        return [(name, name) for name in names]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        return queryset if value is None else queryset.filter(queue=value)


@admin.register(FinishedMessage)
class FinishedMessageAdmin(ShowsJSON, ReadOnlyModelAdmin):
    """Read only: the rows are written with the acknowledgement (or the
    dead-lettering, the cancellation) and deleted by maintenance."""

    list_display = [
        "message_id",
        "topic",
        "queue",
        "outcome",
        "attempts",
        "finished_at",
        "duration_text",
        "worker",
        "dead_letter_link",
    ]
    list_filter = [TopicFilter, QueueFilter, "outcome", "finished_at"]
    date_hierarchy = "finished_at"  # the URL parameters; the template draws its own days
    search_fields = ["message_id", "dedup_key"]  # (get_search_results: by hand)
    search_help_text = (
        "A message id or dedup key (fast), or text in the payload (slow on a big history)."
    )
    # Newest first: the order of the primary key, the order the rows were
    # written in (a BRIN index cannot give an order).
    ordering = ["-id"]
    paginator = EstimatedCountPaginator
    show_full_result_count = False
    fields = FIELDS
    readonly_fields = FIELDS

    def get_urls(self) -> list[URLPattern]:
        # Before the model's own URLs: "<path:object_id>/" would take "overview/".
        view = self.admin_site.admin_view(self.overview_view)
        name = f"{self.opts.app_label}_{self.opts.model_name}_overview"
        return [path("overview/", view, name=name), *super().get_urls()]

    def overview_view(self, request: HttpRequest) -> TemplateResponse:
        """The queue overview (admin/overview.py)."""
        return overview_view(self, request)

    def get_changelist_instance(self, request: HttpRequest) -> Any:
        try:
            return super().get_changelist_instance(request)
        except (ValueError, OverflowError) as exc:
            # ?finished_at__year=9999: Django computes the end of that year in
            # Python and there is none. Refused as any unusable filter (?e=1).
            raise IncorrectLookupParameters(exc) from exc

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        with conf.on_database(chosen_database(request)):
            context = {**(extra_context or {}), "history_days": self._days(request)}
            return super().changelist_view(request, context)

    def _days(self, request: HttpRequest) -> list[tuple[datetime.date, str, bool]]:
        """The days from the oldest row to the newest (at most DAYS_SHOWN, the
        latest): (day, its query string, whether it is the one shown). The
        first and last rows by primary key (written in finish order): two
        probes, whatever the table holds."""
        rows = FinishedMessage.objects.using(conf.database_alias()).only("finished_at")
        oldest, newest = rows.order_by("id").first(), rows.order_by("-id").first()
        if oldest is None or newest is None:
            return []
        zone = timezone.get_current_timezone()
        first = oldest.finished_at.astimezone(zone).date()
        last = max(newest.finished_at, oldest.finished_at).astimezone(zone).date()
        first = max(first, last - datetime.timedelta(days=DAYS_SHOWN - 1))
        chosen = (
            request.GET.get("finished_at__year"),
            request.GET.get("finished_at__month"),
            request.GET.get("finished_at__day"),
        )
        days = []
        day = first
        while day <= last:
            values = (str(day.year), str(day.month), str(day.day))
            query = "finished_at__year={}&finished_at__month={}&finished_at__day={}".format(*values)
            days.append((day, query, chosen == values))
            day += datetime.timedelta(days=1)
        return days

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet[Any], search_term: str
    ) -> tuple[QuerySet[Any], bool]:
        term = search_term.strip()
        if not term:
            return queryset, False
        # A number is a message id or a dedup key (both indexed: fast); any
        # other term a dedup key or text of the payload (read row by row:
        # seconds on millions of rows, so never for a number, the usual
        # "what became of message 42?").
        matches = Q(dedup_key=term)
        if term.isdigit():
            if int(term) < 2**63:
                matches |= Q(message_id=int(term))
            return queryset.filter(matches), False
        in_payload = queryset.alias(payload_text=Cast("payload", TextField())).filter(
            payload_text__icontains=term
        )
        return queryset.filter(matches | Q(pk__in=in_payload.values("pk"))), False

    @admin.display(description="duration", ordering=None)
    def duration_text(self, obj: FinishedMessage) -> str:
        seconds = obj.duration
        if seconds is None:
            return "-"
        return f"{seconds * 1000:.0f} ms" if seconds < 10 else duration(seconds)

    @admin.display(description="dead letter")
    def dead_letter_link(self, obj: FinishedMessage) -> str:
        if obj.dead_letter_id is None:
            return "-"
        url = reverse(
            "admin:django_pgqueue_deadletter_change",
            args=[obj.dead_letter_id],
            current_app=self.admin_site.name,
        )
        url = change_url_on(url, obj._state.db or conf.database_alias())
        return format_html('<a href="{}">#{}</a>', url, obj.dead_letter_id)

    @admin.display(description="history of this message")
    def same_message_link(self, obj: FinishedMessage) -> str:
        return history_link(obj.message_id, self.admin_site.name)


def history_link(message_id: int, site: str = "admin") -> str:
    """A link to the history entries of message ``message_id`` (on the
    database the page works on)."""
    url = reverse("admin:django_pgqueue_finishedmessage_changelist", current_app=site)
    url = on_database_of(f"{url}?q={message_id}", conf.database_alias())
    return format_html(
        '<a href="{}" class="pgqueue-history-link">Finished messages with id {}</a>',
        url,
        message_id,
    )
