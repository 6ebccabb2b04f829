"""The admin of ordered streams: subscriptions (checkpoint, lag, state, and
the operators' actions) and, read only, the stored stream events.

Imported by ``admin.py`` (the module Django's admin autodiscovers). The
admin writes no subscription row itself: every action calls
``subscriptions`` (pause, resume, reset, dead_letter_blocked), which waits
for the subscription's lock, so an action lands between two deliveries.
Each action needs its permission (``pause_subscription`` for pause and
resume, ``reset_subscription`` for reset and for moving a blocked event to
the dead letters) and writes one admin ``LogEntry`` per changed row.
"""

from django import forms
from django.contrib import admin, messages
from django.contrib.admin.models import CHANGE, LogEntry
from django.utils.html import format_html

from django_pgqueue import conf
from django_pgqueue.admin import (
    NulFreeLookupsMixin,
    _applied_form,
    _intermediate_page,
    _pretty_json,
    _short,
)
from django_pgqueue.admin.forms import DeadLetterMoveForm
from django_pgqueue.exceptions import SubscriptionError
from django_pgqueue.models import StreamEvent, Subscription, SubscriptionState
from django_pgqueue.models.streams import LAG_COUNT_CAP
from django_pgqueue.streams import subscribers, subscriptions

POSITION_MAX = 2**63 - 1

AFTER, BEGINNING, END = "position", "beginning", "end"


class ResetCheckpointForm(forms.Form):
    """Where the selected subscriptions go on from; the position is checked
    against the stored events of each one's stream."""

    target = forms.ChoiceField(
        choices=[
            (AFTER, "After the event at a position (events after it are delivered)"),
            (BEGINNING, "The beginning: deliver every stored event again"),
            (END, "The end: pass over every event published so far"),
        ],
        initial=AFTER,
        widget=forms.RadioSelect,
    )
    position = forms.IntegerField(
        required=False,
        min_value=0,
        max_value=POSITION_MAX,
        error_messages={
            "invalid": "Give the position as a whole number, such as 1042.",
            "min_value": "A position is 0 (the beginning) or more.",
            "max_value": "No event has a position that large.",
        },
        help_text="The position of a stored event of the subscription's stream (see the "
        "stream events); 0 is the beginning.",
    )

    def __init__(self, *args, streams=(), **kwargs):
        super().__init__(*args, **kwargs)
        self.streams = sorted(set(streams))

    def clean(self):
        data = super().clean()
        if data.get("target") != AFTER:
            data["position"] = data.get("target")
            return data
        position = data.get("position")
        if position is None:
            if "position" not in self.errors:
                self.add_error("position", "Give the position to go on after.")
            return data
        for stream in self.streams:
            try:
                subscriptions.checkpoint_for(stream, position)
            except SubscriptionError as exc:
                self.add_error("position", str(exc).capitalize() + ".")
        return data


def _log(request, rows, message):
    LogEntry.objects.log_actions(request.user.pk, list(rows), CHANGE, message)


@admin.register(Subscription)
class SubscriptionAdmin(NulFreeLookupsMixin, admin.ModelAdmin):
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
    fields = readonly_fields

    def get_queryset(self, request):
        return super().get_queryset(request).using(conf.get("DATABASE")).with_lag()

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False  # read only: the actions change subscriptions

    def has_delete_permission(self, request, obj=None):
        # Only a subscription no subscriber serves any more (it would hold
        # back the retention of its stream's events), one at a time (no
        # "delete selected"): a registered one would be created again and
        # start over.
        if obj is None or subscribers.lookup(obj.name) is not None:
            return False
        return super().has_delete_permission(request, obj)

    def has_pause_permission(self, request):
        return request.user.has_perm(f"{self.opts.app_label}.pause_subscription")

    def has_reset_permission(self, request):
        return request.user.has_perm(f"{self.opts.app_label}.reset_subscription")

    @admin.display(description="state", ordering="state")
    def state_display(self, obj):
        colors = {
            SubscriptionState.ACTIVE: "#2e7d32",
            SubscriptionState.RETRYING: "#b26a00",
            SubscriptionState.BLOCKED: "#c62828",
            SubscriptionState.PAUSED: "#546e7a",
        }
        return format_html(
            '<strong style="color: {}">{}</strong>', colors[obj.state], obj.get_state_display()
        )

    @admin.display(description="registered", boolean=True)
    def registered(self, obj):
        return subscribers.lookup(obj.name) is not None

    @admin.display(description="head", ordering="head_position")
    def head_position_display(self, obj):
        return obj.head_position or "-"

    @admin.display(description="lag (events)", ordering="lag")
    def lag_display(self, obj):
        return f"{obj.lag:,}+" if obj.lag >= LAG_COUNT_CAP else f"{obj.lag:,}"

    @admin.display(description="behind since", ordering="oldest_pending_at")
    def behind(self, obj):
        return obj.oldest_pending_at or "-"

    @admin.display(description="last error")
    def last_error_short(self, obj):
        return _short(obj.last_error)

    @admin.display(description="last error")
    def last_error_full(self, obj):
        return format_html("<pre>{}</pre>", obj.last_error) if obj.last_error else "-"

    def _run(self, request, queryset, change, done, what):
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
        _log(request, changed, what)
        level = messages.SUCCESS if changed else messages.WARNING
        self.message_user(
            request, f"{done} {len(changed)} of {len(names)} selected subscription(s).", level
        )

    @admin.action(description="Pause", permissions=["pause"])
    def pause(self, request, queryset):
        self._run(request, queryset, subscriptions.pause, "Paused", "Paused (admin action)")

    @admin.action(description="Resume (deliver again, fresh attempts)", permissions=["pause"])
    def resume(self, request, queryset):
        self._run(request, queryset, subscriptions.resume, "Resumed", "Resumed (admin action)")

    @admin.action(description="Reset the checkpoint…", permissions=["reset"])
    def reset_checkpoint(self, request, queryset):
        streams = queryset.values_list("stream", flat=True)
        if request.POST.get("apply"):
            form = ResetCheckpointForm(request.POST, streams=streams)
        else:
            failing = queryset.values_list("failing_position", flat=True).first()
            form = ResetCheckpointForm(initial={"position": failing}, streams=streams)
        if not form.is_bound or not form.is_valid():
            rows = ", ".join(
                f"{row.name} at position {row.checkpoint_position} (head "
                f"{row.head_position or '-'}, {row.lag} behind)"
                for row in queryset.order_by("name")[:10]
            )
            return _intermediate_page(
                self,
                request,
                queryset,
                "reset_checkpoint",
                form,
                title="Reset the checkpoint of subscriptions",
                summary=f"{queryset.count()} subscription(s): {rows}. Going back delivers "
                "events again (their handlers run again); going forward passes events over "
                "without delivering them. Retrying and blocked subscriptions become active.",
                submit_label="Reset the checkpoint",
            )
        position = form.cleaned_data["position"]
        self._run(
            request,
            queryset,
            lambda names: subscriptions.reset(names, position),
            "Reset",
            f"Checkpoint reset to {position} (admin action)",
        )
        return None

    @admin.action(description="Move the blocked event to the dead letters…", permissions=["reset"])
    def dead_letter_blocked(self, request, queryset):
        form = _applied_form(request, DeadLetterMoveForm)
        if not form.is_bound or not form.is_valid():
            blocked = queryset.filter(state=SubscriptionState.BLOCKED).count()
            return _intermediate_page(
                self,
                request,
                queryset,
                "dead_letter_blocked",
                form,
                title="Move blocked events to the dead letters",
                summary=f"{blocked} of the {queryset.count()} selected subscription(s) are "
                "blocked: the event each stopped at goes to the dead letters with the category "
                "chosen here, and the subscription goes on after it. The others are skipped.",
                submit_label="Move to dead letters",
            )
        category, by = form.cleaned_data["category"], request.user.get_username()
        self._run(
            request,
            queryset,
            lambda names: subscriptions.dead_letter_blocked(names, category, by=by),
            "Moved the blocked event of",
            f"Blocked event moved to the dead letters as {category} (admin action)",
        )
        return None


@admin.register(StreamEvent)
class StreamEventAdmin(NulFreeLookupsMixin, admin.ModelAdmin):
    """Read only: events are published by code and deleted by retention."""

    list_display = ["position", "stream", "key", "created_at", "xid"]
    search_fields = ["=stream", "=key", "=position"]
    ordering = ["-position"]
    show_full_result_count = False
    fields = ["position", "stream", "key", "xid", "created_at", "payload_json", "headers_json"]
    readonly_fields = fields

    def get_queryset(self, request):
        return super().get_queryset(request).using(conf.get("DATABASE"))

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False

    @admin.display(description="payload")
    def payload_json(self, obj):
        return _pretty_json(obj.payload)

    @admin.display(description="headers")
    def headers_json(self, obj):
        return _pretty_json(obj.headers)
