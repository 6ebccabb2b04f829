"""The Queues page of the admin: every queue with what it holds (ready,
delayed, blocked, processing, the oldest ready message's age, new dead
letters) and its run-time state (paused, the limits that hold), with
pause and resume buttons and a form for the limits, and a page of the
limits of its partitions (the settings' for each, the named ones' own) with
a form to set or clear one partition's.

The page is the changelist of ``QueueState`` (a queue without a row is
running with the settings' limits). Nothing here writes a row itself: the
buttons and the form call ``controls``, which also tells the workers.
Pausing and resuming need their own permission
(``django_pgqueue.pause_queuestate``), changing the limits the change
permission (the partitions' limits too); each change writes an admin
LogEntry.
"""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import admin, messages
from django.contrib.admin.models import CHANGE, DELETION, LogEntry
from django.core.exceptions import PermissionDenied
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.views.decorators.http import require_POST

from django_pgqueue import conf, controls
from django_pgqueue.admin.common import PgQueueModelAdmin, run_on, several_databases
from django_pgqueue.admin.summary import duration
from django_pgqueue.exceptions import QueueControlError
from django_pgqueue.models import PartitionLimit, QueueState
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


class PartitionLimitsForm(QueueLimitsForm):
    """One partition's limits: its own, or those the queue's "partition"
    settings give every partition."""

    partition_key = forms.CharField(
        required=False,
        strip=False,  # the key as the messages carry it, exactly
        max_length=conf.KEY_MAX_LENGTH,
        label="Partition",
        help_text="The messages' partition_key; empty: the default partition (the messages "
        "without one).",
    )
    source = forms.ChoiceField(
        choices=[
            (FROM_SETTINGS, "The limits of the queue's 'partition' settings (PGQUEUE['QUEUES'])"),
            (SET_HERE, "These limits (empty: none), in place of the settings'"),
        ],
        widget=forms.RadioSelect,
    )
    concurrency = forms.IntegerField(
        required=False,
        min_value=1,
        max_value=conf.limits.CONCURRENCY_MAX,
        help_text="At most this many of the partition's messages processing at once, all "
        "workers together.",
    )

    field_order = ["partition_key", "source", "concurrency", "rate"]

    def clean_partition_key(self) -> str:
        key = self.cleaned_data["partition_key"]
        problem = conf.text_problem(key)
        if problem:
            raise forms.ValidationError(f"The partition {problem}.")
        return key


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
        prefix = f"{self.opts.app_label}_{self.opts.model_name}"

        def view(function: Any) -> Any:
            return self.admin_site.admin_view(_on_queue_database(function))

        return [
            path("<path:name>/pause/", view(self.pause_view), name=f"{prefix}_pause"),
            path("<path:name>/resume/", view(self.resume_view), name=f"{prefix}_resume"),
            path("<path:name>/limits/", view(self.limits_view), name=f"{prefix}_limits"),
            path(
                "<path:name>/partition-limits/",
                view(self.partition_limits_view),
                name=f"{prefix}_partition_limits",
            ),
            *super().get_urls(),
        ]

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> TemplateResponse:
        if not self.has_view_or_change_permission(request):
            raise PermissionDenied
        rows = overview.every_database()
        context = {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "title": "Queues",
            "rows": [(row, duration(row.oldest_ready_age)) for row in rows],
            "may_pause": self.has_pause_permission(request),
            "may_limit": self.has_change_permission(request),
            "several_databases": several_databases(),
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

    def partition_limits_view(self, request: HttpRequest, name: str) -> HttpResponse:
        if not self.has_change_permission(request):
            raise PermissionDenied
        if conf.name_problem("queue name", name, conf.QUEUE_MAX_LENGTH):
            raise Http404("No such queue.")
        own = controls.partition_limits(name)
        if request.method == "POST":
            form = PartitionLimitsForm(request.POST)
            if form.is_valid() and self._set_partition_limits(request, name, form.cleaned_data):
                return HttpResponseRedirect(request.path)
        else:
            # ?partition=KEY: that partition's own limits, to change them.
            key = request.GET.get("partition", "")
            row = _own(own, key)
            form = PartitionLimitsForm(
                initial={
                    "partition_key": key,
                    "source": FROM_SETTINGS if row is None else SET_HERE,
                    "concurrency": None if row is None else row.concurrency,
                    "rate": "" if row is None else row.rate,
                }
            )
        context = {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "title": f"Partition limits of queue {name}",
            "queue": name,
            "form": form,
            "settings_limits": conf.queue_limits().get(name, conf.NO_LIMITS).partition,
            "own": [(row, controls.partition_limits_of(row)) for row in own],
        }
        request.current_app = self.admin_site.name
        return TemplateResponse(
            request, "admin/django_pgqueue/queue_partition_limits.html", context
        )

    def _set_partition_limits(self, request: HttpRequest, name: str, data: dict[str, Any]) -> bool:
        by, key = request.user.get_username(), data["partition_key"]
        partition = controls.partition_name(key)
        before = _own(controls.partition_limits(name), key)  # a clear's LogEntry names it
        try:
            if data["source"] == FROM_SETTINGS:
                changed = controls.clear_partition_limits(name, key, by=by)
            else:
                controls.set_partition_limits(
                    name, key, concurrency=data["concurrency"], rate=data["rate"], by=by
                )
                changed = True
        except QueueControlError as exc:
            self.message_user(request, str(exc), messages.ERROR)
            return False
        after = _own(controls.partition_limits(name), key)
        if data["source"] == FROM_SETTINGS:
            if not changed or before is None:
                text = f"Queue {name}: {partition} had no limits of its own."
                self.message_user(request, text, messages.WARNING)
                return True
            logged, flag = before, DELETION
            text = f"Limits of {partition} from the settings (admin)"
        else:
            assert after is not None, "set_partition_limits wrote it"
            logged, flag = after, CHANGE
            text = (
                f"Limits of {partition} set: concurrency {data['concurrency']}, "
                f"rate {data['rate']} (admin)"
            )
        LogEntry.objects.log_actions(request.user.pk, [logged], flag, text)  # type: ignore[arg-type]
        limits = controls.partition_limits_for(name, after)
        source = "settings" if after is None else "run time"
        self.message_user(
            request, f"Queue {name}, {partition}: limits {limits} ({source}).", messages.SUCCESS
        )
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


# A view of one queue (its name in the URL) runs on the queue's own
# database: where its run-time state and partition limits are kept.
_on_queue_database = run_on(lambda request, name: conf.queue_database(name))


def _own(rows: list[PartitionLimit], key: str) -> PartitionLimit | None:
    """The row of the partition ``key`` among a queue's ``rows``, if any."""
    return next((row for row in rows if row.partition_key == key), None)
