"""The admin of workflows: the list (status, steps done of all), a page per
workflow with the graph of its steps (drawn by ``workflow_graph``), and two
actions: cancel workflows, revive their dead-lettered steps.

Read only: a workflow's rows change with its steps' messages, in the
transaction that moves each message (``workflows.bookkeeping``), never by
hand. The actions call the operations, ``WorkflowRun.cancel`` and
``deadletters.revive`` (which resumes the steps); each needs its own
permission (``cancel_workflow``, ``revive_workflow``), asks on a
confirmation page first, and writes one admin ``LogEntry`` per workflow it
changed (and per dead letter it revived, as the dead letters' Revive
does). A workflow's page has a button for each, posting the action to the
list for that one workflow.
"""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import admin, messages
from django.db.models import Q, QuerySet
from django.http import HttpRequest, HttpResponse
from django.urls import reverse
from django.utils import timezone
from django.utils.html import format_html
from django.utils.safestring import SafeString, mark_safe

from django_pgqueue import conf, deadletters
from django_pgqueue.admin.common import (
    LOG_CHUNK,
    Data,
    ReadOnlyModelAdmin,
    asks_first,
    change_url_on,
    log_changes,
    log_rows,
    on_database_of,
    report,
)
from django_pgqueue.admin.forms import NOTE_MAX_LENGTH, ActionPageForm
from django_pgqueue.admin.workflow_graph import Node, draw, lay_out
from django_pgqueue.exceptions import DeadLetterError, WorkflowError
from django_pgqueue.lifecycle.cancel import CancelResult
from django_pgqueue.models import (
    DeadLetter,
    DeadLetterState,
    FinishedMessage,
    Message,
    StepState,
    Workflow,
    WorkflowDependency,
    WorkflowStatus,
    WorkflowStep,
)
from django_pgqueue.models.workflows import FINISHED_STATUSES
from django_pgqueue.paging import ids_in_chunks
from django_pgqueue.workflows import WorkflowRun

Workflows = QuerySet[Workflow]

CANCEL_CHUNK = 100  # workflows read per query by "Cancel" (each is cancelled on its own)
STEPS_NAMED = 10  # dead-lettered steps named on the revive's confirmation page

# A workflow's page, every field read only.
FIELDS = (
    "name",
    "status_display",
    "progress",
    "steps_active",
    "steps_dead",
    "steps_failed",
    "created_at",
    "finished_at",
)
STATUS_COLOURS: dict[str, str] = {
    WorkflowStatus.RUNNING: "#0072B2",
    WorkflowStatus.BLOCKED: "#c62828",
    WorkflowStatus.DONE: "#2e7d32",
    WorkflowStatus.FAILED: "#b26a00",
    WorkflowStatus.CANCELLED: "#546e7a",
}
# Where a drawn step's link goes, by its state: the first of these admin
# pages that has a row for its message id. A cancelled step's message may
# be kept cancelled (CANCELLED_RETENTION), its dead letter resolved, or
# its end in the history.
PAGES: dict[str, list[str]] = {
    StepState.RELEASED: ["message"],
    StepState.DONE: ["finishedmessage"],
    StepState.DEAD_LETTERED: ["deadletter"],
    StepState.CANCELLED: ["message", "deadletter", "finishedmessage"],
}


# --- the confirmation pages ---------------------------------------------------------------
# (ActionPageForm, as the other actions' pages in forms.py; these two serve
# only this admin.)


class CancelWorkflowsForm(ActionPageForm):
    """The confirmation of a cancel: nothing to fill in."""

    title, submit_label = "Cancel workflows", "Yes, cancel them"
    text = (
        "{selected} workflow(s) selected, {counted} of them not finished: every step of "
        "theirs that has not ended is cancelled, held and dead-lettered ones at once, those "
        "in the queue as a message's Cancel does (a running one is asked to stop). Finished "
        "workflows are skipped."
    )
    counted = Q(status__in=[WorkflowStatus.RUNNING, WorkflowStatus.BLOCKED])


class ReviveStepsForm(ActionPageForm):
    title, submit_label = "Revive the dead-lettered steps of workflows", "Revive"
    text = (
        "{selected} workflow(s) selected, {counted} of them with dead-lettered steps: their "
        "dead letters go back into the queue as new messages, the steps run again and their "
        "workflows go on."
    )
    counted = Q(steps_dead__gt=0)

    note = forms.CharField(
        required=False,
        max_length=NOTE_MAX_LENGTH,
        help_text="Why (optional): kept in the dead letters' notes.",
    )

    def summary(self, queryset: QuerySet[Any]) -> str:
        """The summary, and the names of the steps to revive."""
        steps = dead_lettered_steps(queryset)
        named = steps.order_by("workflow_id", "id").values_list("name", "workflow_id")
        names = [f"{name} (workflow #{pk})" for name, pk in named[:STEPS_NAMED]]
        text = super().summary(queryset)
        if not names:
            return f"{text} None of their steps is dead-lettered."
        more = steps.count() - len(names)
        return f"{text} The steps: {', '.join(names)}" + (f" and {more} more." if more else ".")


def dead_lettered_steps(workflows: QuerySet[Any]) -> QuerySet[WorkflowStep]:
    return WorkflowStep.objects.using(workflows.db).filter(
        workflow_id__in=workflows.values("pk"), state=StepState.DEAD_LETTERED
    )


# --- the list and the page ----------------------------------------------------------------


@admin.register(Workflow)
class WorkflowAdmin(ReadOnlyModelAdmin):
    """Read only: workflows are written by ``Workflow.enqueue()`` and moved
    by their steps' messages; maintenance deletes the finished ones."""

    list_display = ["id", "name", "status_display", "progress", "created_at", "finished_at"]
    list_filter = ["status"]
    search_fields = ["name", "=id"]
    search_help_text = "A workflow's name (or a part of it), or its id."
    ordering = ["-id"]
    show_full_result_count = False
    actions = ["cancel", "revive"]
    fields = FIELDS
    readonly_fields = FIELDS

    def has_cancel_permission(self, request: HttpRequest) -> bool:
        return self.user_may(request, "cancel")

    def has_revive_permission(self, request: HttpRequest) -> bool:
        return self.user_may(request, "revive")

    @admin.display(description="status", ordering="status")
    def status_display(self, obj: Workflow) -> str:
        return format_html(
            '<strong class="pgqueue-workflow-{}" style="color: {}">{}</strong>',
            obj.status,
            STATUS_COLOURS.get(obj.status, "inherit"),
            obj.get_status_display(),
        )

    @admin.display(description="steps done")
    def progress(self, obj: Workflow) -> str:
        text = f"{obj.steps_done} / {obj.steps_total}"
        return f"{text} ({obj.steps_dead} dead-lettered)" if obj.steps_dead else text

    def render_change_form(
        self,
        request: HttpRequest,
        context: dict[str, Any],
        add: bool = False,
        change: bool = False,
        form_url: str = "",
        obj: Workflow | None = None,
    ) -> HttpResponse:
        if obj is not None:
            changelist = reverse(
                "admin:django_pgqueue_workflow_changelist", current_app=self.admin_site.name
            )
            context |= {
                "workflow_graph": self.graph(obj),
                # The buttons post to the list, limited to this workflow:
                # after the action, the list shows it with the outcome.
                "actions_url": on_database_of(
                    f"{changelist}?id__exact={obj.pk}", conf.database_alias()
                ),
                "may_cancel": obj.status not in FINISHED_STATUSES
                and self.has_cancel_permission(request),
                "may_revive": obj.steps_dead > 0 and self.has_revive_permission(request),
            }
        return super().render_change_form(request, context, add, change, form_url, obj)

    def graph(self, workflow: Workflow) -> SafeString:
        """The SVG of ``workflow``'s steps (see workflow_graph)."""
        using = conf.database_alias()
        rows = list(
            WorkflowStep.objects.using(using)
            .filter(workflow_id=workflow.pk)
            .order_by("id")
            .values_list("id", "name", "state", "topic", "message_id")
        )
        edges = (
            WorkflowDependency.objects.using(using)
            .filter(step__workflow_id=workflow.pk)
            .values_list("step_id", "after_id")
        )
        layout = lay_out(
            [Node(pk, name, state, topic) for pk, name, state, topic, _ in rows], edges
        )
        message_ids = {row[0]: row[4] for row in rows}
        links = self.step_links(layout.drawn_steps(), message_ids)
        svg = draw(layout, links, f"workflow-{workflow.pk}-graph", f"The steps of {workflow}")
        return mark_safe(svg)  # noqa: S308 (workflow_graph escapes every text)

    def step_links(self, steps: list[Node], message_ids: dict[int, int | None]) -> dict[int, str]:
        """{step id: URL} of ``steps``: the page of its message, its dead
        letter or its history entry (PAGES), where one exists."""
        using = conf.database_alias()
        ids = [pk for s in steps if (pk := message_ids.get(s.id)) is not None]
        wanted = {page for s in steps for page in PAGES.get(s.state, [])}
        rows: dict[str, dict[int, int]] = {}  # page -> {message id: row id}
        if ids and "message" in wanted:
            found = Message.objects.using(using).filter(pk__in=ids).values_list("pk", flat=True)
            rows["message"] = {pk: pk for pk in found}
        for page, model in (("deadletter", DeadLetter), ("finishedmessage", FinishedMessage)):
            if ids and page in wanted:
                # By id: the newest row of a message id is the one kept.
                rows[page] = dict(
                    model.objects.using(using)
                    .filter(message_id__in=ids)
                    .order_by("id")
                    .values_list("message_id", "id")
                )
        links = {}
        for s in steps:
            message_id = message_ids.get(s.id)
            for page in PAGES.get(s.state, []):
                pk = rows.get(page, {}).get(message_id or 0)
                if pk is not None:
                    links[s.id] = change_url_on(
                        reverse(
                            f"admin:django_pgqueue_{page}_change",
                            args=[pk],
                            current_app=self.admin_site.name,
                        ),
                        conf.database_alias(),
                    )
                    break
        return links

    # --- the actions ----------------------------------------------------------------

    @admin.action(description="Cancel…", permissions=["cancel"])
    @asks_first(CancelWorkflowsForm)
    def cancel(self, request: HttpRequest, queryset: Workflows, data: Data) -> None:
        by = request.user.get_username()
        selected = queryset.count()
        total, cancelled = CancelResult(), 0
        unfinished = queryset.exclude(status__in=FINISHED_STATUSES)
        for ids in ids_in_chunks(unfinished, CANCEL_CHUNK):
            for pk in ids:
                try:
                    result = WorkflowRun(pk, queryset.db).cancel(by=by)
                except WorkflowError:  # deleted meanwhile (retention)
                    continue
                total.cancelled += result.cancelled
                total.requested += result.requested
            # Unfinished when the chunk was read, cancelled now.
            rows = Workflow.objects.using(queryset.db).filter(
                pk__in=ids, status=WorkflowStatus.CANCELLED
            )
            changed = list(rows.only("id", "name"))
            log_rows(request, changed, "Cancelled (admin action)")
            cancelled += len(changed)
        self.message_user(
            request,
            f"Cancelled {cancelled} of {selected} selected workflow(s): {total.cancelled} "
            f"step(s) cancelled, {total.requested} running asked to stop; the others had "
            "finished.",
            messages.SUCCESS if cancelled else messages.WARNING,
        )

    @admin.action(description="Revive the dead-lettered steps…", permissions=["revive"])
    @asks_first(ReviveStepsForm)
    def revive(self, request: HttpRequest, queryset: Workflows, data: Data) -> None:
        using = queryset.db
        steps = dead_lettered_steps(queryset)
        dead = DeadLetter.objects.using(using).filter(message_id__in=steps.values("message_id"))
        now = timezone.now()
        try:
            result = deadletters.revive(dead, by=request.user, note=data["note"], now=now)
        except DeadLetterError as exc:
            self.message_user(request, str(exc), messages.ERROR)
            return
        report(self, request, result)
        # What this call revived: marked with its now and this user.
        revived = DeadLetter.objects.using(using).filter(
            revived_at=now, revived_by=request.user.get_username(), state=DeadLetterState.REVIVED
        )
        log_changes(request, revived, "Revived (workflow admin action)")
        resumed = Workflow.objects.using(using).filter(
            pk__in=WorkflowStep.objects.using(using)
            .filter(message_id__in=revived.values("revived_message_id"))
            .values("workflow_id")
        )
        for ids in ids_in_chunks(resumed, LOG_CHUNK):
            rows = Workflow.objects.using(using).filter(pk__in=ids).only("id", "name")
            log_rows(request, list(rows), "Dead-lettered steps revived (admin action)")
