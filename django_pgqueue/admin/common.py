"""What the admin's pages share: the base ModelAdmins, the intermediate page
of an action that asks for something first, the audit trail, and how texts
and JSON are shown.

Every row shown here lives on a database of the queues: the one the page
works on (``chosen_database``: the "Database" filter, shown when the queues
span several databases, ``?database=`` in the URL, kept by the links and
forms of the page; else ``PGQUEUE["DATABASE"]``), and is changed through
the operations (``lifecycle``, ``deadletters``, ``streams.subscriptions``),
not by a ModelAdmin's own save or delete; the one exception is a new dead
letter's payload, fixed in its form before a revive (``deadletters.DeadLetterAdmin.save_model``).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.contrib.admin.models import CHANGE, LogEntry
from django.contrib.admin.options import IncorrectLookupParameters
from django.core.serializers.json import DjangoJSONEncoder
from django.db.models import Model, Q, QuerySet, TextField
from django.db.models.functions import Cast
from django.http import HttpRequest, HttpResponse, QueryDict
from django.template.response import TemplateResponse
from django.utils.html import format_html
from django.utils.safestring import SafeString
from django.utils.text import Truncator

from django_pgqueue import conf
from django_pgqueue.admin.forms import ActionPageForm
from django_pgqueue.paging import ids_in_chunks
from django_pgqueue.text import first_line

if TYPE_CHECKING:
    from django.contrib.admin.views.main import ChangeList

    from django_pgqueue.deadletters import TriageResult

LOG_CHUNK = 1000  # LogEntry rows written per INSERT
EXAMPLES = 10  # rows named on an intermediate page


# --- how values are shown ---------------------------------------------------------------


def pretty_json(value: object) -> SafeString:
    """``value`` as indented JSON in a <pre>, escaped."""
    text = json.dumps(value, indent=2, ensure_ascii=False, sort_keys=True, cls=DjangoJSONEncoder)
    return format_html('<pre class="pgqueue-json">{}</pre>', text)


def pre(text: str) -> SafeString:
    """A long text (a reason, an error, a traceback) as written, escaped."""
    return format_html("<pre>{}</pre>", text)


def preformatted(text: str) -> str:
    """``pre(text)``, or "-" when it is empty."""
    return pre(text) if text else "-"


def short(text: str | None, length: int = 80) -> str:
    """The first line of ``text``, cut to ``length`` characters (a list column)."""
    first = first_line(text)
    return Truncator(first).chars(length) if first else ""


def shown(field: str, render: Callable[[Any], str], description: str) -> Callable[..., str]:
    """A ModelAdmin column (or read-only field): the row's ``field`` through
    ``render``, titled ``description``."""

    @admin.display(description=description)
    def column(modeladmin: admin.ModelAdmin, obj: Model) -> str:
        return render(getattr(obj, field))

    return column


View = Callable[..., HttpResponse]

# --- which database ---------------------------------------------------------------------

# The query parameter that names the database a page works on.
DATABASE = "database"


def several_databases() -> bool:
    """Whether the queues span several databases (the filter and column are shown)."""
    return len(conf.databases()) > 1


def chosen_database(request: HttpRequest) -> str:
    """The database alias a page works on: ``?database=`` of the URL, or of
    the changelist filters it preserves (a change page, ``_changelist_filters``);
    else, or when it names no database of the queues, the first
    (``PGQUEUE["DATABASE"]``)."""
    aliases = conf.databases()
    value = request.GET.get(DATABASE)
    if value is None and "_changelist_filters" in request.GET:
        value = QueryDict(request.GET["_changelist_filters"]).get(DATABASE)
    return value if value in aliases else aliases[0]


def on_database_of(url: str, alias: str) -> str:
    """``url`` (of a changelist) limited to the database ``alias`` when
    there are several: with ``database=alias`` in its query string."""
    if not several_databases():
        return url
    return f"{url}{'&' if '?' in url else '?'}{DATABASE}={alias}"


def change_url_on(url: str, alias: str) -> str:
    """``url`` (of a change page) on the database ``alias`` when there are
    several: ``?_changelist_filters=database%3Dalias``, as Django's own
    links from a filtered changelist."""
    if not several_databases():
        return url
    query = QueryDict(mutable=True)
    query["_changelist_filters"] = f"{DATABASE}={alias}"
    return f"{url}{'&' if '?' in url else '?'}{query.urlencode()}"


class DatabaseFilter(admin.SimpleListFilter):
    """The database of the rows shown (a changelist reads one at a time:
    querysets of two databases cannot be joined); the first is the default,
    so there is no "All". ``get_queryset`` reads the chosen one; this
    filter only shows the choice and keeps it in the URL."""

    title = "database"
    parameter_name = DATABASE

    def __init__(self, request: HttpRequest, *args: Any, **kwargs: Any) -> None:
        self.chosen = chosen_database(request)
        super().__init__(request, *args, **kwargs)

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [(alias, alias) for alias in conf.databases()]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        return queryset  # the queryset is already on the chosen database

    def choices(self, changelist: Any) -> Any:
        for value, label in self.lookup_choices:
            yield {
                "selected": value == self.chosen,
                "query_string": changelist.get_query_string({self.parameter_name: value}),
                "display": label,
            }


@admin.display(description="database")
def database_column(obj: Model) -> str:
    """The database a row was read from."""
    return obj._state.db or ""


# --- the base ModelAdmins ---------------------------------------------------------------


class PgQueueModelAdmin(admin.ModelAdmin):
    """Rows read from the database the page works on (``chosen_database``,
    a "Database" filter and column when there are several); every view runs
    inside ``conf.on_database`` of it, so the actions and the operations
    they call work there. A filter or search value with a NUL is refused as
    Django refuses any unusable filter value (a redirect to ``?e=1``):
    PostgreSQL text cannot hold one, and the query would fail in the
    database (a server error)."""

    def get_queryset(self, request: HttpRequest) -> QuerySet[Any]:
        return super().get_queryset(request).using(conf.database_alias())

    def get_list_filter(self, request: HttpRequest) -> Any:
        found = list(super().get_list_filter(request))
        return [DatabaseFilter, *found] if several_databases() else found

    def get_list_display(self, request: HttpRequest) -> Any:
        found = list(super().get_list_display(request))
        return [*found, database_column] if several_databases() else found

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        with conf.on_database(chosen_database(request)):
            return _rendered(super().changelist_view(request, extra_context))

    def changeform_view(self, request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        with conf.on_database(chosen_database(request)):
            return _rendered(super().changeform_view(request, *args, **kwargs))

    def history_view(self, request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        with conf.on_database(chosen_database(request)):
            return _rendered(super().history_view(request, *args, **kwargs))

    def delete_view(self, request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        with conf.on_database(chosen_database(request)):
            return _rendered(super().delete_view(request, *args, **kwargs))

    def get_changelist_instance(self, request: HttpRequest) -> ChangeList:
        if any("\x00" in value for _, values in request.GET.lists() for value in values):
            raise IncorrectLookupParameters("a NUL character in the query string")
        return super().get_changelist_instance(request)

    def user_may(self, request: HttpRequest, action: str) -> bool:
        """Whether the user has this model's custom permission ``action``
        (``revive`` is ``django_pgqueue.revive_deadletter``)."""
        opts = self.opts
        return request.user.has_perm(f"{opts.app_label}.{action}_{opts.model_name}")


def _rendered(response: HttpResponse) -> HttpResponse:
    """``response`` rendered now (a TemplateResponse is rendered lazily,
    after the view returns: outside the database the view works on)."""
    render = getattr(response, "render", None)
    if render is not None and not getattr(response, "is_rendered", True):
        render()
    return response


def run_on(alias_of: Callable[..., str]) -> Callable[[View], View]:
    """Run a custom admin view inside ``conf.on_database`` of the alias that
    ``alias_of(request, *args, **kwargs)`` names, its response rendered there."""

    def decorate(view: View) -> View:
        @functools.wraps(view)
        def wrapped(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
            with conf.on_database(alias_of(request, *args, **kwargs)):
                return _rendered(view(request, *args, **kwargs))

        return wrapped

    return decorate


# A custom view of the page's database (``chosen_database``).
on_chosen_database = run_on(lambda request, *args, **kwargs: chosen_database(request))


class ReadOnlyModelAdmin(PgQueueModelAdmin):
    """Looked at, never changed here: the workers and the code write these rows."""

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Model | None = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Model | None = None) -> bool:
        return False


class ShowsJSON:
    """The ``payload`` and ``headers`` columns as indented JSON."""

    payload_json = shown("payload", pretty_json, "payload")
    headers_json = shown("headers", pretty_json, "headers")


class ChoiceFilter(admin.SimpleListFilter):
    """A list filter over fixed options: ``{value: (label, condition)}``."""

    options: dict[str, tuple[str, Q]] = {}

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [(value, label) for value, (label, _) in self.options.items()]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        choice = self.options.get(self.value() or "")
        return queryset if choice is None else queryset.filter(choice[1])


class QueueModelAdmin(ShowsJSON, PgQueueModelAdmin):
    """Messages and dead letters: the payload is searched as text too;
    nothing is added or deleted here (rows come from enqueue and go through
    the lifecycle and maintenance)."""

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Model | None = None) -> bool:
        return False

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet[Any], search_term: str
    ) -> tuple[QuerySet[Any], bool]:
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


# --- actions: the intermediate page, the report, the audit trail ------------------------


Data = dict[str, Any]  # a submitted form's cleaned_data
Page = TemplateResponse | None  # what an action returns: a page, or None (the changelist)
AnsweredAction = Callable[[Any, HttpRequest, QuerySet[Any], Data], None]
Action = Callable[[Any, HttpRequest, QuerySet[Any]], Page]


def asks_first(form_class: type[ActionPageForm]) -> Callable[[AnsweredAction], Action]:
    """Make an admin action ask first: the action shows its intermediate page
    (``form_class`` and what it says about the selection) and runs, with the
    form's cleaned data, once the page was submitted valid."""

    def decorate(action: AnsweredAction) -> Action:
        @functools.wraps(action)
        def ask(
            modeladmin: admin.ModelAdmin, request: HttpRequest, queryset: QuerySet[Any]
        ) -> Page:
            form = form_class.for_request(request, queryset)
            if not form.is_valid():
                return intermediate_page(modeladmin, request, queryset, action.__name__, form)
            action(modeladmin, request, queryset, form.cleaned_data)
            return None

        return ask

    return decorate


def intermediate_page(
    modeladmin: admin.ModelAdmin,
    request: HttpRequest,
    queryset: QuerySet[Any],
    action_name: str,
    form: ActionPageForm,
) -> TemplateResponse:
    """The page an action shows before it acts (see action_form.html): what
    the selection holds and ``form``, posted back with the selection it
    counted."""
    # Read as the changelist read it (the ActionForm's BooleanField), so the
    # page posts back the selection it counted.
    select_across = helpers.ActionForm.base_fields["select_across"].to_python(
        request.POST.get("select_across")
    )
    count = queryset.count()
    examples = list(queryset.order_by("pk")[:EXAMPLES])
    context = {
        **modeladmin.admin_site.each_context(request),
        "opts": modeladmin.model._meta,
        "action_name": action_name,
        "action_checkbox_name": helpers.ACTION_CHECKBOX_NAME,
        "selected": request.POST.getlist(helpers.ACTION_CHECKBOX_NAME),
        "select_across": select_across,
        "form": form,
        "count": count,
        "examples": examples,
        "more": max(count - len(examples), 0),
        "media": modeladmin.media + form.media,
        "title": form.title,
        "summary": form.summary(queryset),
        "submit_label": form.submit_label,
    }
    request.current_app = modeladmin.admin_site.name
    return TemplateResponse(request, "admin/django_pgqueue/action_form.html", context)


def report(modeladmin: admin.ModelAdmin, request: HttpRequest, result: TriageResult) -> None:
    """A TriageResult as the admin's message: success, or a warning when rows were skipped."""
    text = str(result)
    level = messages.WARNING if result.skipped else messages.SUCCESS
    modeladmin.message_user(request, text[:1].upper() + text[1:] + ".", level)


def log_rows(request: HttpRequest, rows: list[Any], message: str) -> None:
    """One CHANGE LogEntry for each of ``rows``, in one INSERT."""
    LogEntry.objects.log_actions(cast(int, request.user.pk), rows, CHANGE, message)


def log_changes(request: HttpRequest, queryset: QuerySet[Any], message: str) -> int:
    """One CHANGE LogEntry per row of ``queryset``, a chunk of rows at a time;
    returns how many were written."""
    logged = 0
    for ids in ids_in_chunks(queryset, LOG_CHUNK):
        rows = list(
            queryset.model.objects.using(queryset.db).filter(pk__in=ids).only("id", "topic")
        )
        log_rows(request, rows, message)
        logged += len(rows)
    return logged
