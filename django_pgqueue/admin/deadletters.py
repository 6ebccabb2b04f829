"""The admin of the dead letters: triage them (revive, revive again or
elsewhere, set the category, resolve), fix a new one's payload first, and
the summary page.

The actions call ``deadletters``, which works through any selection in
locked chunks by id, so "select all 50,000" never loads them. The one write
of its own is the payload of a new dead letter, edited in its form before
a revive; that UPDATE is guarded by the state. Each action needs its own
permission (``revive_deadletter``, ``resolve_deadletter``,
``categorize_deadletter``) and writes one admin ``LogEntry`` per changed
row, in chunks.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any

from django.contrib import admin, messages
from django.contrib.admin.options import IncorrectLookupParameters
from django.contrib.admin.views.main import ChangeList
from django.db.models import QuerySet
from django.http import HttpRequest
from django.template.response import TemplateResponse
from django.urls import URLPattern, path
from django.utils import timezone

from django_pgqueue import conf, deadletters
from django_pgqueue.admin.common import (
    Data,
    QueueModelAdmin,
    asks_first,
    log_changes,
    on_chosen_database,
    pre,
    preformatted,
    report,
    short,
    shown,
)
from django_pgqueue.admin.forms import (
    CategoryForm,
    DeadLetterPayloadForm,
    ResolveForm,
    ReviveAgainForm,
    ReviveToForm,
)
from django_pgqueue.admin.history import history_link
from django_pgqueue.admin.summary import summary_view
from django_pgqueue.deadletters import TriageResult
from django_pgqueue.exceptions import DeadLetterError
from django_pgqueue.models import DeadLetter, DeadLetterState

DeadLetters = QuerySet[DeadLetter]


@admin.register(DeadLetter)
class DeadLetterAdmin(QueueModelAdmin):
    form = DeadLetterPayloadForm
    list_display = [
        "id",
        "topic",
        "category",
        "state",
        "attempts",
        "reason_short",
        "dead_lettered_at",
        "revive_count",
    ]
    list_filter = ["category", "topic", "state", "dead_lettered_at"]
    date_hierarchy = "dead_lettered_at"
    search_fields = ["reason", "=message_id", "=partition_key"]
    ordering = ["-dead_lettered_at", "-id"]
    actions = ["revive", "revive_again", "set_category", "resolve", "revive_to"]
    _fields = [
        "message_id",
        "message_history",
        "queue",
        "topic",
        "priority",
        "category",
        "state",
        "reason_full",
        "traceback_full",
        "headers_json",
        "attempts",
        "max_attempts",
        "dedup_key",
        "group_key",
        "partition_key",
        "first_failed_at",
        "last_failed_at",
        "dead_lettered_at",
        "worker",
        "revived_at",
        "revived_by",
        "revive_count",
        "revived_message_id",
        "resolved_at",
        "resolved_by",
        "category_set_at",
        "category_set_by",
        "notes_full",
    ]

    def get_changelist_instance(self, request: HttpRequest) -> ChangeList:
        try:
            return super().get_changelist_instance(request)
        except (ValueError, OverflowError) as exc:
            # The date hierarchy's ?dead_lettered_at__year=9999 (a hand-made
            # URL, or a row at 'infinity', see fields.py): Django computes the
            # end of the year, month or day in Python, and there is none
            # after 9999-12-31. Refused as any unusable filter (?e=1).
            raise IncorrectLookupParameters(exc) from exc

    @admin.display(description="history")
    def message_history(self, obj: DeadLetter) -> str:
        """A link to the finished messages with its message's id (KEEP_FINISHED)."""
        return history_link(obj.message_id, self.admin_site.name)

    def _payload_editable(self, request: HttpRequest, obj: DeadLetter | None) -> bool:
        return (
            obj is not None
            and obj.state == DeadLetterState.NEW
            and self.has_change_permission(request, obj)
        )

    def get_fields(self, request: HttpRequest, obj: Any = None) -> list[Any]:
        payload = "payload" if self._payload_editable(request, obj) else "payload_json"
        fields = list(self._fields)
        fields.insert(fields.index("headers_json"), payload)
        return fields

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        return [name for name in self.get_fields(request, obj) if name != "payload"]

    def save_model(self, request: HttpRequest, obj: DeadLetter, form: Any, change: bool) -> None:
        # Only the payload, and only while the dead letter is new: a revive
        # or resolve that committed meanwhile is not overwritten.
        updated = (
            DeadLetter.objects.using(conf.database_alias())
            .filter(pk=obj.pk, state=DeadLetterState.NEW)
            .update(payload=obj.payload)
        )
        if not updated:
            self.message_user(
                request, "Not saved: the dead letter is no longer new.", messages.ERROR
            )

    def get_urls(self) -> list[URLPattern]:
        # Before the model's own URLs: "<path:object_id>/" would take "summary/".
        view = self.admin_site.admin_view(on_chosen_database(self.summary_view))
        name = f"{self.opts.app_label}_{self.opts.model_name}_summary"
        return [path("summary/", view, name=name), *super().get_urls()]

    def summary_view(self, request: HttpRequest) -> TemplateResponse:
        """Dead letters by topic and category, queue depth and oldest ready age."""
        return summary_view(self, request)

    def has_revive_permission(self, request: HttpRequest) -> bool:
        return self.user_may(request, "revive")

    def has_resolve_permission(self, request: HttpRequest) -> bool:
        return self.user_may(request, "resolve")

    def has_categorize_permission(self, request: HttpRequest) -> bool:
        return self.user_may(request, "categorize")

    reason_short = shown("reason", short, "reason")
    reason_full = shown("reason", pre, "reason")
    traceback_full = shown("traceback", preformatted, "traceback")
    notes_full = shown("notes", preformatted, "notes")

    # --- the actions ----------------------------------------------------------------

    def _triage(
        self,
        request: HttpRequest,
        operation: Callable[[datetime], TriageResult],
        marked: str,
        message: str,
        **state: str,
    ) -> None:
        """Run ``operation(now)`` (a function of ``deadletters``), report its
        result, and write one LogEntry per dead letter it changed: those whose
        ``<marked>_at`` is its ``now`` and ``<marked>_by`` this user (and in
        ``state``, when given)."""
        now = timezone.now()
        try:
            result = operation(now)
        except DeadLetterError as exc:
            self.message_user(request, str(exc), messages.ERROR)
            return
        report(self, request, result)
        marks = {f"{marked}_at": now, f"{marked}_by": request.user.get_username(), **state}
        log_changes(request, self.get_queryset(request).filter(**marks), message)

    def _revive(
        self,
        request: HttpRequest,
        queryset: DeadLetters,
        note: str = "",
        queue: str | None = None,
        topic: str | None = None,
        force: bool = False,
    ) -> None:
        """Revive, and log what this call revived."""
        by = request.user
        where = ", ".join(f"{k} {v}" for k, v in [("queue", queue), ("topic", topic)] if v)
        self._triage(
            request,
            lambda now: deadletters.revive(
                queryset, queue=queue, topic=topic, by=by, note=note, now=now, force=force
            ),
            "revived",
            f"Revived{' to ' + where if where else ''} (admin action)",
            state=DeadLetterState.REVIVED,
        )

    @admin.action(description="Revive (back into the queue)", permissions=["revive"])
    def revive(self, request: HttpRequest, queryset: DeadLetters) -> None:
        self._revive(request, queryset)

    @admin.action(description="Revive again, even if revived or resolved…", permissions=["revive"])
    @asks_first(ReviveAgainForm)
    def revive_again(self, request: HttpRequest, queryset: DeadLetters, data: Data) -> None:
        self._revive(request, queryset, data["note"], force=True)

    @admin.action(description="Revive to another queue or topic…", permissions=["revive"])
    @asks_first(ReviveToForm)
    def revive_to(self, request: HttpRequest, queryset: DeadLetters, data: Data) -> None:
        self._revive(request, queryset, data["note"], queue=data["queue"], topic=data["topic"])

    @admin.action(description="Set category…", permissions=["categorize"])
    @asks_first(CategoryForm)
    def set_category(self, request: HttpRequest, queryset: DeadLetters, data: Data) -> None:
        category, note = data["category"], data["note"]
        self._triage(
            request,
            lambda now: deadletters.categorize(
                queryset, category, note=note, by=request.user, now=now
            ),
            "category_set",
            f"Category set to {category}",
        )

    @admin.action(description="Resolve (close without redelivery)…", permissions=["resolve"])
    @asks_first(ResolveForm)
    def resolve(self, request: HttpRequest, queryset: DeadLetters, data: Data) -> None:
        self._triage(
            request,
            lambda now: deadletters.resolve(queryset, note=data["note"], by=request.user, now=now),
            "resolved",
            "Resolved (admin action)",
            state=DeadLetterState.RESOLVED,
        )
