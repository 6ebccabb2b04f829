"""The admin of ordered streams: subscriptions (checkpoint, lag, state, and
the operators' actions) and, read only, the stored stream events.

Imported by ``django_pgqueue.admin`` (the package Django's admin
autodiscovers). The admin writes no subscription row itself: every action calls
``subscriptions`` (pause, resume, reset, dead_letter_blocked), which waits
for the subscription's lock, so an action lands between two deliveries.
Each action needs its permission (``pause_subscription`` for pause and
resume, ``reset_subscription`` for reset and for moving a blocked event to
the dead letters) and writes one admin ``LogEntry`` per changed row.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest
from django.utils.html import format_html

from django_pgqueue.admin.common import (
    Data,
    PgQueueModelAdmin,
    ReadOnlyModelAdmin,
    ShowsJSON,
    asks_first,
    log_rows,
    preformatted,
    short,
    shown,
)
from django_pgqueue.admin.forms import BlockedEventsMoveForm, ResetCheckpointForm
from django_pgqueue.exceptions import SubscriptionError
from django_pgqueue.models import StreamEvent, Subscription, SubscriptionState
from django_pgqueue.models.streams import LAG_COUNT_CAP, SubscriptionQuerySet
from django_pgqueue.streams import subscribers, subscriptions

Subscriptions = QuerySet[Subscription]


@admin.register(Subscription)
class SubscriptionAdmin(PgQueueModelAdmin):
    list_display = [
        "name",
        "stream",
        "state_display",
        "checkpoint_position",
        "head_position_display",
        "lag_display",
        "behind",
        "attempts",
        "last_error_short",
        "retry_at",
        "delivered_at",
    ]
    list_filter = ["state", "stream"]
    search_fields = ["name", "stream"]
    ordering = ["name"]
    actions = ["pause", "resume", "reset_checkpoint", "dead_letter_blocked"]
    readonly_fields = [
        "name",
        "stream",
        "state_display",
        "registered",
        "checkpoint_position",
        "checkpoint_xid",
        "head_position_display",
        "lag_display",
        "behind",
        "attempts",
        "failing_position",
        "last_error_full",
        "retry_at",
        "delivered",
        "delivered_at",
        "created_at",
        "updated_at",
    ]
    fields = list(readonly_fields)

    def get_queryset(self, request: HttpRequest) -> QuerySet[Any]:
        return cast(SubscriptionQuerySet, super().get_queryset(request)).with_lag()

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False  # read only: the actions change subscriptions

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        # Only a subscription no subscriber serves any more (it would hold
        # back the retention of its stream's events), one at a time (no
        # "delete selected"): a registered one would be created again and
        # start over.
        if obj is None or subscribers.lookup(obj.name) is not None:
            return False
        return super().has_delete_permission(request, obj)

    def has_pause_permission(self, request: HttpRequest) -> bool:
        return self.user_may(request, "pause")

    def has_reset_permission(self, request: HttpRequest) -> bool:
        return self.user_may(request, "reset")

    @admin.display(description="state", ordering="state")
    def state_display(self, obj: Subscription) -> str:
        colors: dict[str, str] = {
            SubscriptionState.ACTIVE: "#2e7d32",
            SubscriptionState.RETRYING: "#b26a00",
            SubscriptionState.BLOCKED: "#c62828",
            SubscriptionState.PAUSED: "#546e7a",
        }
        return format_html(
            '<strong style="color: {}">{}</strong>', colors[obj.state], obj.get_state_display()
        )

    @admin.display(description="registered", boolean=True)
    def registered(self, obj: Subscription) -> bool:
        return subscribers.lookup(obj.name) is not None

    @admin.display(description="head", ordering="head_position")
    def head_position_display(self, obj: Any) -> Any:
        return obj.head_position or "-"

    @admin.display(description="lag (events)", ordering="lag")
    def lag_display(self, obj: Any) -> str:
        return f"{obj.lag:,}+" if obj.lag >= LAG_COUNT_CAP else f"{obj.lag:,}"

    @admin.display(description="behind since", ordering="oldest_pending_at")
    def behind(self, obj: Any) -> Any:
        return obj.oldest_pending_at or "-"

    last_error_short = shown("last_error", short, "last error")
    last_error_full = shown("last_error", preformatted, "last error")

    # --- the actions ----------------------------------------------------------------

    def _run(
        self,
        request: HttpRequest,
        queryset: Subscriptions,
        change: Callable[[list[str]], object],
        done: str,
        what: str,
    ) -> None:
        """Run ``change`` (a function of subscriptions.py) over the selection
        and report; a SubscriptionError is shown, not raised."""
        names = list(queryset.order_by("name").values_list("name", flat=True))
        rows = Subscription.objects.using(queryset.db).filter(name__in=names)
        before = dict(rows.values_list("name", "updated_at"))
        try:
            change(names)
        except SubscriptionError as exc:  # the ones before it are changed
            self.message_user(request, f"{str(exc).capitalize()}.", messages.ERROR)
        changed = [row for row in rows if row.updated_at != before.get(row.name)]
        log_rows(request, changed, what)
        level = messages.SUCCESS if changed else messages.WARNING
        self.message_user(
            request, f"{done} {len(changed)} of {len(names)} selected subscription(s).", level
        )

    @admin.action(description="Pause", permissions=["pause"])
    def pause(self, request: HttpRequest, queryset: Subscriptions) -> None:
        self._run(request, queryset, subscriptions.pause, "Paused", "Paused (admin action)")

    @admin.action(description="Resume (deliver again, fresh attempts)", permissions=["pause"])
    def resume(self, request: HttpRequest, queryset: Subscriptions) -> None:
        self._run(request, queryset, subscriptions.resume, "Resumed", "Resumed (admin action)")

    @admin.action(description="Reset the checkpoint…", permissions=["reset"])
    @asks_first(ResetCheckpointForm)
    def reset_checkpoint(self, request: HttpRequest, queryset: Subscriptions, data: Data) -> None:
        position = data["position"]
        self._run(
            request,
            queryset,
            lambda names: subscriptions.reset(names, position),
            "Reset",
            f"Checkpoint reset to {position} (admin action)",
        )

    @admin.action(description="Move the blocked event to the dead letters…", permissions=["reset"])
    @asks_first(BlockedEventsMoveForm)
    def dead_letter_blocked(
        self, request: HttpRequest, queryset: Subscriptions, data: Data
    ) -> None:
        category, by = data["category"], request.user.get_username()
        self._run(
            request,
            queryset,
            lambda names: subscriptions.dead_letter_blocked(names, category, by=by),
            "Moved the blocked event of",
            f"Blocked event moved to the dead letters as {category} (admin action)",
        )


@admin.register(StreamEvent)
class StreamEventAdmin(ShowsJSON, ReadOnlyModelAdmin):
    """Read only: events are published by code and deleted by retention."""

    list_display = ["position", "stream", "key", "created_at", "xid"]
    search_fields = ["=stream", "=key", "=position"]
    ordering = ["-position"]
    show_full_result_count = False
    readonly_fields = [
        "position",
        "stream",
        "key",
        "xid",
        "created_at",
        "payload_json",
        "headers_json",
    ]
    fields = list(readonly_fields)
