"""The admin: look at the queue, triage the dead letters.

The admin never writes queue rows itself: "Run now" and "Move to dead
letters" call ``lifecycle``, the dead-letter actions call ``deadletters``
(which work through any selection in locked chunks by id, so "select all
50,000" never loads them). The one exception is the payload of a new dead
letter, edited in its form before a revive; that UPDATE is guarded by the
state. Each action needs its own permission (``revive_deadletter``,
``resolve_deadletter``, ``categorize_deadletter``) and writes one admin
``LogEntry`` per changed row, in chunks.
"""

import json

from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.contrib.admin.models import CHANGE, LogEntry
from django.contrib.admin.options import IncorrectLookupParameters
from django.core.exceptions import PermissionDenied
from django.core.serializers.json import DjangoJSONEncoder
from django.db.models import BooleanField, ExpressionWrapper, Q, TextField
from django.db.models.functions import Cast, Now
from django.template.response import TemplateResponse
from django.urls import path
from django.utils import timezone
from django.utils.html import format_html
from django.utils.text import Truncator
from django.utils.timesince import timesince

from django_pgqueue import conf, deadletters, lifecycle
from django_pgqueue.admin.forms import (
    CategoryForm,
    DeadLetterMoveForm,
    DeadLetterPayloadForm,
    ResolveForm,
    ReviveAgainForm,
    ReviveToForm,
)
from django_pgqueue.exceptions import DeadLetterError
from django_pgqueue.models import (
    Category,
    DeadLetter,
    DeadLetterState,
    Message,
    Status,
    WorkerHeartbeat,
)
from django_pgqueue.observability import stats

LOG_CHUNK = 1000  # LogEntry rows written per INSERT
EXAMPLES = 10  # rows named on an intermediate page


def _pretty_json(value):
    """``value`` as indented JSON in a <pre>, escaped."""
    text = json.dumps(value, indent=2, ensure_ascii=False, sort_keys=True, cls=DjangoJSONEncoder)
    return format_html('<pre class="pgqueue-json">{}</pre>', text)


def _duration(seconds):
    """``seconds`` as its two largest units from the first non-zero one ("1h 0m",
    "4m 12s", "7s"), or "-" for None."""
    if seconds is None:
        return "-"
    rest, parts = int(seconds), []
    for size, unit in [(86400, "d"), (3600, "h"), (60, "m"), (1, "s")]:
        n, rest = divmod(rest, size)
        if n or parts or size == 1:
            parts.append(f"{n}{unit}")
    return " ".join(parts[:2])


def _short(text, length=80):
    first = (text or "").strip().splitlines()
    return Truncator(first[0]).chars(length) if first else ""


def _ids_in_chunks(queryset, size=LOG_CHUNK):
    """The ids of ``queryset``, ascending, ``size`` at a time (keyset paging)."""
    after = 0
    while True:
        ids = list(queryset.filter(pk__gt=after).order_by("pk").values_list("pk", flat=True)[:size])
        if not ids:
            return
        yield ids
        after = ids[-1]


def _log_changes(request, queryset, message):
    """One CHANGE LogEntry per row of ``queryset``, a chunk of rows at a time."""
    logged = 0
    for ids in _ids_in_chunks(queryset):
        rows = list(
            queryset.model.objects.using(queryset.db).filter(pk__in=ids).only("id", "topic")
        )
        LogEntry.objects.log_actions(request.user.pk, rows, CHANGE, message)
        logged += len(rows)
    return logged


def _report(modeladmin, request, result):
    """A TriageResult as the admin's message: success, or a warning when rows were skipped."""
    text = str(result)
    level = messages.WARNING if result.skipped else messages.SUCCESS
    modeladmin.message_user(request, text[:1].upper() + text[1:] + ".", level)


def _intermediate_page(modeladmin, request, queryset, action_name, form, **context):
    """Render an action's intermediate page (see action_form.html)."""
    # Read as the changelist read it (the ActionForm's BooleanField), so the
    # page posts back the selection it counted.
    select_across = helpers.ActionForm.base_fields["select_across"].to_python(
        request.POST.get("select_across")
    )
    count = queryset.count()
    examples = list(queryset.order_by("pk")[:EXAMPLES])
    opts = modeladmin.model._meta
    context = {
        **modeladmin.admin_site.each_context(request),
        "opts": opts,
        "action_name": action_name,
        "action_checkbox_name": helpers.ACTION_CHECKBOX_NAME,
        "selected": request.POST.getlist(helpers.ACTION_CHECKBOX_NAME),
        "select_across": select_across,
        "form": form,
        "count": count,
        "examples": examples,
        "more": max(count - len(examples), 0),
        "media": modeladmin.media + form.media,
        **context,
    }
    request.current_app = modeladmin.admin_site.name
    return TemplateResponse(request, "admin/django_pgqueue/action_form.html", context)


def _applied_form(request, form_class, **initial):
    """The intermediate page's form: bound when it was submitted."""
    if request.POST.get("apply"):
        return form_class(request.POST)
    return form_class(initial=initial)


class NulFreeLookupsMixin:
    """PostgreSQL text cannot hold NUL: a filter or search value with one
    would fail in the database (a server error). It is refused as Django
    refuses any unusable filter value (a redirect to ``?e=1``)."""

    def get_changelist_instance(self, request):
        if any("\x00" in value for _, values in request.GET.lists() for value in values):
            raise IncorrectLookupParameters("a NUL character in the query string")
        return super().get_changelist_instance(request)


class QueueAdminMixin(NulFreeLookupsMixin):
    """Rows live on the queue's database (``PGQUEUE["DATABASE"]``); the payload
    is searched as text and shown as indented JSON; nothing
    is added or deleted here (rows come from enqueue and go through the
    lifecycle and maintenance)."""

    def get_queryset(self, request):
        return super().get_queryset(request).using(conf.database_alias())

    def has_add_permission(self, request):
        return False

    def has_delete_permission(self, request, obj=None):
        return False

    def _has_perm(self, request, action):
        opts = self.opts
        return request.user.has_perm(f"{opts.app_label}.{action}_{opts.model_name}")

    def get_search_results(self, request, queryset, search_term):
        matches, may_have_duplicates = super().get_search_results(request, queryset, search_term)
        term = search_term.strip()
        if term:
            # jsonb has no icontains of its own: search its text form.
            in_payload = queryset.alias(payload_text=Cast("payload", TextField())).filter(
                payload_text__icontains=term
            )
            matches = queryset.filter(
                Q(pk__in=matches.values("pk")) | Q(pk__in=in_payload.values("pk"))
            )
        return matches, may_have_duplicates

    @admin.display(description="payload")
    def payload_json(self, obj):
        return _pretty_json(obj.payload)

    @admin.display(description="headers")
    def headers_json(self, obj):
        return _pretty_json(obj.headers)


# --- messages ---------------------------------------------------------------------------


class FailedFilter(admin.SimpleListFilter):
    title = "has failed"
    parameter_name = "failed"

    def lookups(self, request, model_admin):
        return [("yes", "Yes"), ("no", "No")]

    def queryset(self, request, queryset):
        if self.value() == "yes":
            return queryset.exclude(last_error="")
        if self.value() == "no":
            return queryset.filter(last_error="")
        return queryset


@admin.register(Message)
class MessageAdmin(QueueAdminMixin, admin.ModelAdmin):
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
    search_fields = ["=id", "topic", "=dedup_key"]
    ordering = ["-id"]
    show_full_result_count = False
    actions = ["run_now", "move_to_dead_letters"]
    fieldsets = [
        (None, {"fields": ["queue", "topic", "status", "priority", "run_at", "attempts"]}),
        ("Content", {"fields": ["payload_json", "headers_json"]}),
        ("Keys", {"fields": ["dedup_key", "group_key", "max_attempts"]}),
        ("Lease", {"fields": ["locked_by", "lease_expires_at", "lease_token"]}),
        (
            "Last failure",
            {"fields": ["last_error_category", "first_failed_at", "last_error_full"]},
        ),
        ("Times", {"fields": ["created_at", "updated_at"]}),
    ]

    def get_readonly_fields(self, request, obj=None):
        # Every field: a message changes only through the lifecycle (the actions).
        return [name for _, options in self.fieldsets for name in options["fields"]]

    def has_change_permission(self, request, obj=None):
        if obj is not None and obj.status == Status.PROCESSING:
            return False  # a worker holds it: look, do not touch
        return super().has_change_permission(request, obj)

    def save_model(self, request, obj, form, change):
        """Nothing to save: every field is read-only (the lifecycle owns the row)."""

    def change_view(self, request, object_id, form_url="", extra_context=None):
        extra_context = {**(extra_context or {}), "show_save": False}
        extra_context |= {"show_save_and_continue": False, "show_save_and_add_another": False}
        return super().change_view(request, object_id, form_url, extra_context)

    @admin.display(description="age")
    def age(self, obj):
        return timesince(obj.created_at, timezone.now())

    @admin.display(description="last error")
    def last_error_short(self, obj):
        return _short(obj.last_error)

    @admin.display(description="last error")
    def last_error_full(self, obj):
        return format_html("<pre>{}</pre>", obj.last_error) if obj.last_error else "-"

    @admin.action(description="Run now (clear the delay)", permissions=["change"])
    def run_now(self, request, queryset):
        now = timezone.now()
        changed = lifecycle.run_now(queryset, now=now)
        _log_changes(
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
    def move_to_dead_letters(self, request, queryset):
        form = _applied_form(request, DeadLetterMoveForm)
        if not form.is_bound or not form.is_valid():
            leased = queryset.filter(status=Status.PROCESSING).count()
            return _intermediate_page(
                self,
                request,
                queryset,
                "move_to_dead_letters",
                form,
                title="Move messages to the dead letters",
                summary=(
                    f"{queryset.count()} message(s) selected. Waiting (and blocked) ones move "
                    f"to the dead letters with the category chosen here; {leased} being processed "
                    "(leased) will be skipped."
                ),
                submit_label="Move to dead letters",
            )
        category = form.cleaned_data["category"]
        reason = f"moved by {request.user.get_username()}"
        moved = lost = 0
        movable = queryset.filter(status__in=[Status.WAITING, Status.BLOCKED])
        for ids in _ids_in_chunks(movable, size=500):
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
            LogEntry.objects.log_actions(
                request.user.pk, batch, CHANGE, f"Moved to dead letters as {category}"
            )
            moved += len(batch)
        leased = queryset.filter(status=Status.PROCESSING).count() + lost
        text = f"Moved {moved} message(s) to the dead letters as {category}."
        if leased:
            text += f" Skipped {leased} being processed (leased)."
        self.message_user(request, text, messages.WARNING if leased else messages.SUCCESS)


# --- dead letters -----------------------------------------------------------------------


@admin.register(DeadLetter)
class DeadLetterAdmin(QueueAdminMixin, admin.ModelAdmin):
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
    search_fields = ["reason", "=message_id"]
    ordering = ["-dead_lettered_at", "-id"]
    actions = ["revive", "revive_again", "set_category", "resolve", "revive_to"]
    _fields = [
        "message_id",
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

    def get_changelist_instance(self, request):
        try:
            return super().get_changelist_instance(request)
        except (ValueError, OverflowError) as exc:
            # The date hierarchy's ?dead_lettered_at__year=9999 (a hand-made
            # URL, or a row at 'infinity', see fields.py): Django computes the
            # end of the year, month or day in Python, and there is none
            # after 9999-12-31. Refused as any unusable filter (?e=1).
            raise IncorrectLookupParameters(exc) from exc

    def _payload_editable(self, request, obj):
        return (
            obj is not None
            and obj.state == DeadLetterState.NEW
            and self.has_change_permission(request, obj)
        )

    def get_fields(self, request, obj=None):
        payload = "payload" if self._payload_editable(request, obj) else "payload_json"
        fields = list(self._fields)
        fields.insert(fields.index("headers_json"), payload)
        return fields

    def get_readonly_fields(self, request, obj=None):
        return [name for name in self.get_fields(request, obj) if name != "payload"]

    def save_model(self, request, obj, form, change):
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

    def get_urls(self):
        # Before the model's own URLs: "<path:object_id>/" would take "summary/".
        view = self.admin_site.admin_view(self.summary_view)
        name = f"{self.opts.app_label}_{self.opts.model_name}_summary"
        return [path("summary/", view, name=name), *super().get_urls()]

    def summary_view(self, request):
        """Dead letters by topic and category, queue depth and oldest ready age
        (``stats``, read-only), as tables and CSS bars."""
        if not self.has_view_permission(request):
            raise PermissionDenied
        state = request.GET.get("state")
        state = state if state in DeadLetterState.values else None
        dead = stats.dead_letters_by_topic_and_category(state=state)
        by_category = dict.fromkeys(Category.values, 0)
        for _, category, count in dead:
            by_category[category] = by_category.get(category, 0) + count
        most = max(by_category.values(), default=0) or 1
        ages = stats.oldest_ready_age()
        queues = {}
        for queue, status, count in stats.queue_depth_by_status():
            queues.setdefault(queue, dict.fromkeys(Status.values, 0))[status] = count
        context = {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "title": "Queue and dead-letter summary",
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
                (queue, [counts[s] for s in Status.values], _duration(ages.get(queue)))
                for queue, counts in sorted(queues.items())
            ],
        }
        request.current_app = self.admin_site.name
        return TemplateResponse(request, "admin/django_pgqueue/summary.html", context)

    def has_revive_permission(self, request):
        return self._has_perm(request, "revive")

    def has_resolve_permission(self, request):
        return self._has_perm(request, "resolve")

    def has_categorize_permission(self, request):
        return self._has_perm(request, "categorize")

    @admin.display(description="reason")
    def reason_short(self, obj):
        return _short(obj.reason)

    @admin.display(description="reason")
    def reason_full(self, obj):
        return format_html("<pre>{}</pre>", obj.reason)

    @admin.display(description="traceback")
    def traceback_full(self, obj):
        return format_html("<pre>{}</pre>", obj.traceback) if obj.traceback else "-"

    @admin.display(description="notes")
    def notes_full(self, obj):
        return format_html("<pre>{}</pre>", obj.notes) if obj.notes else "-"

    def _revive(self, request, queryset, queue=None, topic=None, note="", force=False):
        """Revive, report, and write one LogEntry per dead letter this call revived."""
        now = timezone.now()
        try:
            result = deadletters.revive(
                queryset,
                queue=queue,
                topic=topic,
                by=request.user,
                note=note,
                now=now,
                force=force,
            )
        except DeadLetterError as exc:
            self.message_user(request, str(exc), messages.ERROR)
            return
        _report(self, request, result)
        # This call's rows: revived at exactly its ``now`` by this user.
        revived = self.get_queryset(request).filter(
            state=DeadLetterState.REVIVED, revived_at=now, revived_by=request.user.get_username()
        )
        where = ", ".join(f"{k} {v}" for k, v in [("queue", queue), ("topic", topic)] if v)
        _log_changes(request, revived, f"Revived{' to ' + where if where else ''} (admin action)")

    @admin.action(description="Revive (back into the queue)", permissions=["revive"])
    def revive(self, request, queryset):
        self._revive(request, queryset)

    @admin.action(description="Revive again, even if revived or resolved…", permissions=["revive"])
    def revive_again(self, request, queryset):
        form = _applied_form(request, ReviveAgainForm)
        if not form.is_bound or not form.is_valid():
            again = queryset.exclude(state=DeadLetterState.NEW).count()
            return _intermediate_page(
                self,
                request,
                queryset,
                "revive_again",
                form,
                title="Revive again",
                summary=f"{queryset.count()} dead letter(s) will be put back into the queue, "
                f"{again} of them again although they were revived or resolved before.",
                submit_label="Revive again",
            )
        self._revive(request, queryset, note=form.cleaned_data["note"], force=True)
        return None

    @admin.action(description="Revive to another queue or topic…", permissions=["revive"])
    def revive_to(self, request, queryset):
        form = _applied_form(request, ReviveToForm)
        if not form.is_bound or not form.is_valid():
            return _intermediate_page(
                self,
                request,
                queryset,
                "revive_to",
                form,
                title="Revive to another queue or topic",
                summary=f"{queryset.count()} dead letter(s) will be revived into the queue "
                "and/or topic given here (new ones only; revived and resolved ones are skipped).",
                submit_label="Revive",
            )
        data = form.cleaned_data
        self._revive(request, queryset, data["queue"], data["topic"], data["note"])
        return None

    @admin.action(description="Set category…", permissions=["categorize"])
    def set_category(self, request, queryset):
        form = _applied_form(request, CategoryForm)
        if not form.is_bound or not form.is_valid():
            return _intermediate_page(
                self,
                request,
                queryset,
                "set_category",
                form,
                title="Set the category of dead letters",
                summary=f"{queryset.count()} dead letter(s) selected.",
                submit_label="Set category",
            )
        category, note = form.cleaned_data["category"], form.cleaned_data["note"]
        now = timezone.now()
        result = deadletters.categorize(queryset, category, note=note, by=request.user, now=now)
        _report(self, request, result)
        changed = self.get_queryset(request).filter(
            category_set_at=now, category_set_by=request.user.get_username()
        )
        _log_changes(request, changed, f"Category set to {category}")
        return None

    @admin.action(description="Resolve (close without redelivery)…", permissions=["resolve"])
    def resolve(self, request, queryset):
        form = _applied_form(request, ResolveForm)
        if not form.is_bound or not form.is_valid():
            count = queryset.count()
            fresh = queryset.filter(state=DeadLetterState.NEW).count()
            return _intermediate_page(
                self,
                request,
                queryset,
                "resolve",
                form,
                title="Resolve dead letters",
                summary=f"{fresh} of the {count} selected dead letter(s) will be resolved "
                "(the others are already revived or resolved). They are kept, with your note.",
                submit_label="Resolve",
            )
        now = timezone.now()
        result = deadletters.resolve(
            queryset, note=form.cleaned_data["note"], by=request.user, now=now
        )
        _report(self, request, result)
        resolved = self.get_queryset(request).filter(
            state=DeadLetterState.RESOLVED, resolved_at=now, resolved_by=request.user.get_username()
        )
        _log_changes(request, resolved, "Resolved (admin action)")
        return None


# --- workers ----------------------------------------------------------------------------


class AliveFilter(admin.SimpleListFilter):
    title = "alive"
    parameter_name = "alive"

    def lookups(self, request, model_admin):
        return [("yes", "Alive"), ("no", "Dead (heartbeat stale)")]

    def queryset(self, request, queryset):
        if self.value() == "yes":
            return queryset.filter(expires_at__gt=Now())
        if self.value() == "no":
            return queryset.filter(expires_at__lte=Now())
        return queryset


@admin.register(WorkerHeartbeat)
class WorkerHeartbeatAdmin(NulFreeLookupsMixin, admin.ModelAdmin):
    """Read only: rows are written by the workers' heartbeats. A worker that
    stopped cleanly has no row; a dead one shows as not alive for a day."""

    list_display = [
        "worker_id",
        "alive",
        "queues_text",
        "concurrency",
        "inflight",
        "processed",
        "heartbeat_at",
        "started_at",
    ]
    list_filter = [AliveFilter]
    search_fields = ["worker_id", "hostname"]
    ordering = ["-heartbeat_at"]

    def get_queryset(self, request):
        return (
            super()
            .get_queryset(request)
            .using(conf.database_alias())
            .annotate(is_alive=ExpressionWrapper(Q(expires_at__gt=Now()), BooleanField()))
        )

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False

    @admin.display(boolean=True, ordering="is_alive")
    def alive(self, obj):
        return obj.is_alive

    @admin.display(description="queues")
    def queues_text(self, obj):
        return ", ".join(obj.queues)


# --- streams: subscriptions and stream events (streams_admin.py) -----------------------

from django_pgqueue.admin import streams  # noqa: E402, F401
