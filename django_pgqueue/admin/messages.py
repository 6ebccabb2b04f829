"""The admin of the queue table: look at messages, run a delayed one now,
move messages to the dead letters by hand, cancel them.

Every field is read only: a message changes only through ``lifecycle``
(``run_now``, ``dead_letter``, ``cancel``), each change one transaction
guarded by the state it expects, so a worker that claimed the message
meanwhile wins.
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.db.models import Q, QuerySet
from django.http import HttpRequest, HttpResponse
from django.utils import timezone
from django.utils.timesince import timesince

from django_pgqueue import lifecycle
from django_pgqueue.admin.common import (
    ChoiceFilter,
    Data,
    QueueModelAdmin,
    asks_first,
    log_changes,
    log_rows,
    preformatted,
    short,
    shown,
)
from django_pgqueue.admin.forms import CancelForm, MessagesMoveForm
from django_pgqueue.models import Message, Status
from django_pgqueue.paging import ids_in_chunks

Messages = QuerySet[Message]

MOVE_CHUNK = 500  # messages read per query by "Move to dead letters"


class FailedFilter(ChoiceFilter):
    title = "has failed"
    parameter_name = "failed"
    options = {"yes": ("Yes", ~Q(last_error="")), "no": ("No", Q(last_error=""))}


@admin.register(Message)
class MessageAdmin(QueueModelAdmin):
    list_display = [
        "id",
        "queue",
        "topic",
        "status",
        "attempts",
        "run_at",
        "age",
        "last_error_short",
    ]
    list_filter = ["queue", "topic", "status", FailedFilter]
    search_fields = ["=id", "topic", "=dedup_key", "=partition_key"]
    ordering = ["-id"]
    show_full_result_count = False
    actions = ["run_now", "move_to_dead_letters", "cancel"]
    fieldsets = [
        (None, {"fields": ["queue", "topic", "status", "priority", "run_at", "attempts"]}),
        ("Content", {"fields": ["payload_json", "headers_json"]}),
        ("Keys", {"fields": ["dedup_key", "group_key", "partition_key", "max_attempts"]}),
        (
            "Lease",
            {"fields": ["locked_by", "lease_expires_at", "lease_token", "cancel_requested_at"]},
        ),
        (
            "Last failure",
            {"fields": ["last_error_category", "first_failed_at", "last_error_full"]},
        ),
        ("Times", {"fields": ["created_at", "updated_at"]}),
    ]

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> list[Any]:
        # Every field: a message changes only through the lifecycle (the actions).
        return [name for _, options in self.fieldsets for name in options["fields"]]

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        if obj is not None and obj.status == Status.PROCESSING:
            return False  # a worker holds it: look, do not touch
        return super().has_change_permission(request, obj)

    def save_model(self, request: HttpRequest, obj: Any, form: Any, change: bool) -> None:
        """Nothing to save: every field is read-only (the lifecycle owns the row)."""

    def change_view(
        self,
        request: HttpRequest,
        object_id: str,
        form_url: str = "",
        extra_context: dict[str, Any] | None = None,
    ) -> HttpResponse:
        extra_context = {**(extra_context or {}), "show_save": False}
        extra_context |= {"show_save_and_continue": False, "show_save_and_add_another": False}
        return super().change_view(request, object_id, form_url, extra_context)

    @admin.display(description="age")
    def age(self, obj: Message) -> str:
        return timesince(obj.created_at, timezone.now())

    last_error_short = shown("last_error", short, "last error")
    last_error_full = shown("last_error", preformatted, "last error")

    @admin.action(description="Run now (clear the delay)", permissions=["change"])
    def run_now(self, request: HttpRequest, queryset: Messages) -> None:
        now = timezone.now()
        changed = lifecycle.run_now(queryset, now=now)
        log_changes(
            request,
            self.get_queryset(request).filter(run_at=now, updated_at=now, status=Status.WAITING),
            "Run now (admin action)",
        )
        level = messages.SUCCESS if changed else messages.WARNING
        self.message_user(
            request,
            f"{changed} delayed waiting message(s) will run now; "
            "leased and already due ones were left alone.",
            level,
        )

    @admin.action(description="Move to dead letters…", permissions=["change"])
    @asks_first(MessagesMoveForm)
    def move_to_dead_letters(self, request: HttpRequest, queryset: Messages, data: Data) -> None:
        category = data["category"]
        reason = f"moved by {request.user.get_username()}"
        moved = lost = 0
        movable = queryset.filter(status__in=[Status.WAITING, Status.BLOCKED])
        for ids in ids_in_chunks(movable, MOVE_CHUNK):
            batch = []
            for message in (
                Message.objects.using(queryset.db)
                .filter(pk__in=ids)
                .only("id", "topic", "attempts", "status")
            ):
                # One guarded transaction each; None: a worker took it meanwhile.
                if lifecycle.dead_letter(message, category, reason, expect=message.status):
                    batch.append(message)
                else:
                    lost += 1
            log_rows(request, batch, f"Moved to dead letters as {category}")
            moved += len(batch)
        leased = queryset.filter(status=Status.PROCESSING).count() + lost
        text = f"Moved {moved} message(s) to the dead letters as {category}."
        if leased:
            text += f" Skipped {leased} being processed (leased)."
        self.message_user(request, text, messages.WARNING if leased else messages.SUCCESS)

    def has_cancel_permission(self, request: HttpRequest) -> bool:
        return self.user_may(request, "cancel")

    @admin.action(description="Cancel…", permissions=["cancel"])
    @asks_first(CancelForm)
    def cancel(self, request: HttpRequest, queryset: Messages, data: Data) -> None:
        now = timezone.now()
        result = lifecycle.cancel(queryset, by=request.user.get_username(), now=now)
        # The rows this call cancelled, or asked to stop: cancel() marked them with its now.
        log_changes(
            request,
            self.get_queryset(request).filter(cancel_requested_at=now),
            "Cancelled (admin action)",
        )
        level = messages.SUCCESS if result.cancelled or result.requested else messages.WARNING
        self.message_user(request, str(result)[:1].upper() + str(result)[1:] + ".", level)
