"""The admin of the periodic schedules: each one's expression in words, time
zone, next and last tick, the state of its last tick's message, paused or
not; actions pause, resume, reset (the setting decides again) and run now.

The schedules themselves are declared in the settings and on handlers; a
row here (``Schedule``) is their run-time state, made for every
configured schedule when the list is shown. The actions call the operations
(``schedules.state.set_enabled``, ``schedules.runs.run_now``); each needs
its own permission (``pause_schedule``, ``resume_schedule``, reset both,
``run_schedule``) and writes one admin ``LogEntry`` per schedule.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from django.contrib import admin, messages
from django.contrib.admin.views.main import ChangeList
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse
from django.urls import NoReverseMatch, reverse
from django.utils.html import format_html, format_html_join

from django_pgqueue import conf
from django_pgqueue.admin.common import (
    PgQueueModelAdmin,
    change_url_on,
    chosen_database,
    log_rows,
)
from django_pgqueue.models import Message, Schedule
from django_pgqueue.schedules import configured, overview, runs, state

Schedules = QuerySet[Schedule]
RECENT_TICKS = 20  # the change page's list of ticks


@admin.register(Schedule)
class ScheduleAdmin(PgQueueModelAdmin):
    list_display = [
        "name",
        "schedule",
        "timezone",
        "target",
        "next_tick",
        "last_tick",
        "last_message",
        "state_display",
        "skipped",
    ]
    search_fields = ["name"]
    ordering = ["name"]
    actions = ["pause", "resume", "reset", "run_now"]
    readonly_fields = [
        "name",
        "schedule",
        "expression",
        "timezone",
        "target",
        "state_display",
        "override",
        "next_tick",
        "last_tick",
        "last_message",
        "skipped",
        "skipped_through",
        "changed_at",
        "changed_by",
        "recent_ticks",
    ]
    fields = list(readonly_fields)

    # --- the rows: what overview.rows says of each schedule ----------------------------

    def changelist_view(self, request: HttpRequest, extra_context: Any = None) -> HttpResponse:
        # Every configured schedule gets its row (on its database), so that it
        # is listed (and can be paused) before any worker ran it.
        with conf.on_database(chosen_database(request)):
            state.ensure(spec.name for spec in overview.specs_here())
            return super().changelist_view(request, extra_context)

    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type[ChangeList]:
        return ScheduleChangeList

    def get_object(self, request: HttpRequest, object_id: str, from_field: Any = None) -> Any:
        obj = super().get_object(request, object_id, from_field)
        if obj is not None:
            attach_overview([obj])
        return obj

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        return list(self.readonly_fields)

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False  # schedules are declared in the settings and on handlers

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False  # read only: the actions change schedules

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        # Only the row of a schedule no longer configured (a configured one
        # would come back at once, its pause forgotten), one at a time.
        if obj is None or obj.name in {spec.name for spec in configured.load()[0]}:
            return False
        return super().has_delete_permission(request, obj)

    def has_pause_permission(self, request: HttpRequest) -> bool:
        return self.user_may(request, "pause")

    def has_resume_permission(self, request: HttpRequest) -> bool:
        return self.user_may(request, "resume")

    def has_reset_permission(self, request: HttpRequest) -> bool:
        # Reset pauses or resumes, as the setting says: it needs both.
        return self.user_may(request, "pause") and self.user_may(request, "resume")

    def has_run_permission(self, request: HttpRequest) -> bool:
        return self.user_may(request, "run")

    # --- the columns --------------------------------------------------------------------

    @admin.display(description="schedule")
    def schedule(self, obj: Schedule) -> str:
        spec = _row(obj).spec
        if spec is None:
            return "(no longer configured)"
        if spec.cron is None:
            return spec.describe()
        return format_html("{}<br><code>{}</code>", spec.describe(), spec.cron)

    @admin.display(description="expression")
    def expression(self, obj: Schedule) -> str:
        spec = _row(obj).spec
        return spec.expression if spec else "-"

    @admin.display(description="time zone")
    def timezone(self, obj: Schedule) -> str:
        spec = _row(obj).spec
        return spec.timezone if spec else "-"

    @admin.display(description="enqueues")
    def target(self, obj: Schedule) -> str:
        spec = _row(obj).spec
        return spec.target if spec else "-"

    @admin.display(description="next tick")
    def next_tick(self, obj: Schedule) -> str:
        return self._time(obj, _row(obj).next_tick)

    @admin.display(description="last tick")
    def last_tick(self, obj: Schedule) -> str:
        return self._time(obj, _row(obj).last_tick)

    @admin.display(description="last message")
    def last_message(self, obj: Schedule) -> str:
        row = _row(obj)
        if row.last_message_id is None:
            return "-"
        return _message_link(row.last_message_id, row.last_message_state or "")

    @admin.display(description="state")
    def state_display(self, obj: Schedule) -> str:
        """Active or paused, and what decided it: the run-time pause or
        resume (which wins until reset), or the setting's ``enabled``."""
        row = _row(obj)
        if row.spec is None:
            return "not configured"
        if row.override is None:
            why = "" if row.enabled else " (by the setting)"
        else:
            why = " (at run time)" if row.override == row.enabled else ""
        color, text = ("#2e7d32", "active") if row.enabled else ("#546e7a", "paused")
        return format_html('<strong style="color: {}">{}</strong>{}', color, text, why)

    @admin.display(description="paused/resumed at run time")
    def override(self, obj: Schedule) -> str:
        return {None: "no (the setting decides)", False: "paused", True: "resumed"}[obj.enabled]

    @admin.display(description="recent ticks")
    def recent_ticks(self, obj: Schedule) -> str:
        rows = state.recent_ticks(obj.name, RECENT_TICKS)
        if not rows:
            return "-"
        states = state.message_states(row.message_id for row in rows if row.message_id)
        return format_html(
            "<table><tr><th>tick</th><th>message</th><th>enqueued at</th></tr>{}</table>",
            format_html_join(
                "",
                "<tr><td>{}</td><td>{}</td><td>{}</td></tr>",
                (
                    (
                        self._time(obj, row.tick),
                        _message_link(row.message_id, states.get(row.message_id, ""))
                        if row.message_id
                        else "-",
                        row.enqueued_at.isoformat(" ", timespec="seconds"),
                    )
                    for row in rows
                ),
            ),
        )

    def _time(self, obj: Schedule, value: Any) -> str:
        if value is None:
            return "-"
        spec = _row(obj).spec
        return (value.astimezone(spec.zone) if spec else value).isoformat(" ")

    # --- the actions --------------------------------------------------------------------

    def _set(
        self, request: HttpRequest, queryset: Schedules, enabled: bool | None, done: str
    ) -> None:
        names = set(queryset.values_list("name", flat=True))
        known = {spec.name for spec in configured.load()[0]}
        by = request.user.get_username()
        changed = [state.set_enabled(name, enabled, by=by) for name in sorted(names & known)]
        log_rows(request, changed, f"{done} (admin action)")
        if names - known:
            self.message_user(
                request,
                f"Not configured (left alone): {', '.join(sorted(names - known))}.",
                messages.WARNING,
            )
        self.message_user(request, f"{done}: {len(changed)} schedule(s).", messages.SUCCESS)

    @admin.action(description="Pause (no ticks until resumed)", permissions=["pause"])
    def pause(self, request: HttpRequest, queryset: Schedules) -> None:
        self._set(request, queryset, False, "Paused")

    @admin.action(description="Resume (from the next tick on)", permissions=["resume"])
    def resume(self, request: HttpRequest, queryset: Schedules) -> None:
        self._set(request, queryset, True, "Resumed")

    @admin.action(
        description="Reset (the setting's 'enabled' decides again)",
        permissions=["reset"],
    )
    def reset(self, request: HttpRequest, queryset: Schedules) -> None:
        self._set(request, queryset, None, "Reset")

    @admin.action(description="Run now (one message, outside the ticks)", permissions=["run"])
    def run_now(self, request: HttpRequest, queryset: Schedules) -> None:
        specs = {spec.name: spec for spec in configured.load()[0]}
        by = request.user.get_username()
        done = []
        for row in queryset.order_by("name"):
            spec = specs.get(row.name)
            if spec is None:
                self.message_user(request, f"{row.name}: not configured.", messages.WARNING)
                continue
            message = runs.run_now(spec, by=by)
            done.append(f"{row.name} (message {message.pk})")
            log_rows(request, [row], f"Run now: message {message.pk} (admin action)")
        if done:
            self.message_user(request, f"Enqueued: {', '.join(done)}.", messages.SUCCESS)


class ScheduleChangeList(ChangeList):
    """The list's page of schedules, each with its overview (one set of
    queries for the page, not one per row and column)."""

    def get_results(self, request: HttpRequest) -> None:
        super().get_results(request)
        attach_overview(self.result_list)


def attach_overview(objs: Iterable[Schedule]) -> None:
    """Give each state row ``overview``: what overview.rows says of it."""
    rows = {row.name: row for row in overview.rows()}
    for obj in objs:
        obj.overview = rows.get(obj.name) or overview.Row(  # type: ignore[attr-defined]
            obj.name, None, False, obj.enabled, None, None, None, None, obj.skipped, None, ""
        )


def _row(obj: Schedule) -> overview.Row:
    row: overview.Row = obj.overview  # type: ignore[attr-defined]
    return row


def _message_link(message_id: int, what: str) -> str:
    """``#id state``, linked to the message while it is in the queue table."""
    if what in {choice for choice, _ in Message._meta.get_field("status").choices or ()}:
        try:
            url = change_url_on(
                reverse("admin:django_pgqueue_message_change", args=[message_id]),
                conf.database_alias(),
            )
        except NoReverseMatch:
            url = ""
        if url:
            return format_html('<a href="{}">#{}</a> {}', url, message_id, what)
    return format_html("#{} {}", message_id, what)
