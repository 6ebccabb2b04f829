"""The Queues page of the admin: every queue with what it holds (ready,
delayed, blocked, processing, the oldest ready message's age, new dead
letters) and its run-time state (paused, the limits that hold), with
pause and resume buttons and a form for the limits.

The page is the changelist of ``QueueState`` (a queue without a row is
running with the settings' limits). Nothing here writes a row itself: the
buttons and the form call ``controls``, which also tells the workers.
Pausing and resuming need their own permission
(``django_pgqueue.pause_queuestate``), changing the limits the change
permission; each change writes an admin LogEntry.
"""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import admin, messages
from django.contrib.admin.models import CHANGE, LogEntry
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.views.decorators.http import require_POST

from django_pgqueue import conf, controls
from django_pgqueue.admin.common import PgQueueModelAdmin
from django_pgqueue.admin.summary import duration
from django_pgqueue.exceptions import QueueControlError
from django_pgqueue.models import QueueState
from django_pgqueue.observability import queues as overview

# The limits form's choices: where the queue's limits come from.
FROM_SETTINGS, SET_HERE = "settings", "set"


class QueueLimitsForm(forms.Form):
    source = forms.ChoiceField(
        choices=[
            (FROM_SETTINGS, "The settings' limits (PGQUEUE['QUEUES'])"),
            (SET_HERE, "These limits (empty: none), over the settings'"),
        ],
        widget=forms.RadioSelect,
    )
    concurrency = forms.IntegerField(
        required=False,
        min_value=1,
        max_value=conf.limits.CONCURRENCY_MAX,
        help_text="At most this many of its messages processing at once, all workers together.",
    )
    rate = forms.CharField(
        required=False,
        max_length=16,
        help_text="At most this many started per second, minute or hour: 20/s, 100/m, 500/h.",
    )

    def clean_rate(self) -> str | None:
        rate = self.cleaned_data["rate"].strip()
        if not rate:
            return None
        problem = conf.rate_problem(rate)
        if problem:
            raise forms.ValidationError(f"The rate {problem}.")
        return rate


@admin.register(QueueState)
class QueueStateAdmin(PgQueueModelAdmin):
    """The Queues page (its changelist), the pause and resume buttons and
    the limits form."""

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_pause_permission(self, request: HttpRequest) -> bool:
        return self.user_may(request, "pause")

    def get_urls(self) -> list[URLPattern]:
        # Before the model's own URLs, whose "<path:object_id>/" would take these.
        # A queue name may hold "/": the path converter, anchored by the suffix.
        view, prefix = self.admin_site.admin_view, f"{self.opts.app_label}_{self.opts.model_name}"
        return [
            path("<path:name>/pause/", view(self.pause_view), name=f"{prefix}_pause"),
            path("<path:name>/resume/", view(self.resume_view), name=f"{prefix}_resume"),
            path("<path:name>/limits/", view(self.limits_view), name=f"{prefix}_limits"),
            *super().get_urls(),
        ]

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> TemplateResponse:
        if not self.has_view_or_change_permission(request):
            raise PermissionDenied
        rows = overview.overview()
        context = {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "title": "Queues",
            "rows": [(row, duration(row.oldest_ready_age)) for row in rows],
            "may_pause": self.has_pause_permission(request),
            "may_limit": self.has_change_permission(request),
            **(extra_context or {}),
        }
        request.current_app = self.admin_site.name
        return TemplateResponse(request, "admin/django_pgqueue/queues.html", context)

    def pause_view(self, request: HttpRequest, name: str) -> HttpResponse:
        return self._pause_or_resume(request, name, pause=True)

    def resume_view(self, request: HttpRequest, name: str) -> HttpResponse:
        return self._pause_or_resume(request, name, pause=False)

    def _pause_or_resume(self, request: HttpRequest, name: str, pause: bool) -> HttpResponse:
        @require_POST
        def act(request: HttpRequest) -> HttpResponse:
            if not self.has_pause_permission(request):
                raise PermissionDenied
            by = request.user.get_username()
            try:
                operation = controls.pause_queue if pause else controls.resume_queue
                changed = operation(name, by=by)
            except QueueControlError as exc:
                self.message_user(request, str(exc), messages.ERROR)
                return self._back()
            what = "paused" if pause else "resumed"
            if changed:
                self._log(request, name, f"{what.capitalize()} (admin)")
                self.message_user(request, f"Queue {name} {what}.", messages.SUCCESS)
            else:
                self.message_user(request, f"Queue {name} was {what} already.", messages.WARNING)
            return self._back()

        return act(request)

    def limits_view(self, request: HttpRequest, name: str) -> HttpResponse:
        if not self.has_change_permission(request):
            raise PermissionDenied
        state = controls.states([name]).get(name)
        limits = controls.limits_for(name, state)
        if request.method == "POST":
            form = QueueLimitsForm(request.POST)
            if form.is_valid() and self._set_limits(request, name, form.cleaned_data):
                return self._back()
        else:
            form = QueueLimitsForm(
                initial={
                    "source": SET_HERE if state is not None and state.limits_set else FROM_SETTINGS,
                    "concurrency": limits.concurrency,
                    "rate": "" if limits.rate is None else str(limits.rate),
                }
            )
        context = {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "title": f"Limits of queue {name}",
            "queue": name,
            "form": form,
            "settings_limits": conf.queue_limits().get(name, conf.NO_LIMITS),
        }
        request.current_app = self.admin_site.name
        return TemplateResponse(request, "admin/django_pgqueue/queue_limits.html", context)

    def _set_limits(self, request: HttpRequest, name: str, data: dict[str, Any]) -> bool:
        by = request.user.get_username()
        try:
            if data["source"] == FROM_SETTINGS:
                controls.clear_limits(name, by=by)
                text = "Limits from the settings (admin)"
            else:
                controls.set_limits(name, concurrency=data["concurrency"], rate=data["rate"], by=by)
                text = f"Limits set: concurrency {data['concurrency']}, rate {data['rate']} (admin)"
        except QueueControlError as exc:
            self.message_user(request, str(exc), messages.ERROR)
            return False
        self._log(request, name, text)
        limits = controls.limits_for(name, controls.states([name]).get(name))
        self.message_user(request, f"Queue {name}: limits {limits}.", messages.SUCCESS)
        return True

    def _log(self, request: HttpRequest, name: str, message: str) -> None:
        row = QueueState.objects.using(conf.database_alias()).get(name=name)
        LogEntry.objects.log_actions(request.user.pk, [row], CHANGE, message)  # type: ignore[arg-type]

    def _back(self) -> HttpResponseRedirect:
        opts = self.opts
        return HttpResponseRedirect(
            reverse(
                f"admin:{opts.app_label}_{opts.model_name}_changelist",
                current_app=self.admin_site.name,
            )
        )
