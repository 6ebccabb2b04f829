"""Security: who may do what in the admin (forged requests included), CSRF on
every state-changing POST, escaping of every stored text on every page, who
may read the metrics and health URLs, hostile queue and topic names on every
way in, and the secrecy of the webhook's credentials.

The ordinary cases live with their modules (test_admin, test_summary,
test_metrics, test_health, test_alerts, test_checks); this module adds the
hostile ones. Everything runs against the real PostgreSQL; the webhook is a
real local HTTP server; "nothing changed" is asserted by re-reading every
row an admin request could touch (``snapshot``).
"""

import datetime
import hmac
import json
import logging
import os
import re
import socket
import subprocess
import sys
import traceback
from io import StringIO
from types import SimpleNamespace
from urllib.parse import parse_qs, urlsplit

import pytest
from demo.models import Handled
from django.contrib.admin import helpers
from django.contrib.admin.models import LogEntry
from django.contrib.auth.models import Permission, User
from django.core.management import CommandError, call_command
from django.core.management.base import SystemCheckError
from django.test import Client, override_settings
from django.urls import path, reverse
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from django_pgqueue import InvalidMessage, conf, deadletters, enqueue, enqueue_many
from django_pgqueue import checks as pgqueue_checks
from django_pgqueue import handlers as pgqueue_handlers
from django_pgqueue.exceptions import DeadLetterError
from django_pgqueue.models import (
    AlertState,
    Category,
    DeadLetter,
    DeadLetterState,
    Message,
    WorkerHeartbeat,
)
from django_pgqueue.notify import CHANNEL
from django_pgqueue.observability import alerts
from django_pgqueue.registry import handler

from .conftest import MANAGE, wait_until
from .test_alerts import Webhook

NEW, REVIVED, RESOLVED = DeadLetterState.NEW, DeadLetterState.REVIVED, DeadLetterState.RESOLVED
XSS = "<script>alert(1)</script>"
ESCAPED = "&lt;script&gt;alert(1)&lt;/script&gt;"
TOKEN = "endpoint-token-5c1f0e9d8b7a"

MESSAGES = reverse("admin:django_pgqueue_message_changelist")
DEAD_LETTERS = reverse("admin:django_pgqueue_deadletter_changelist")
WORKERS = reverse("admin:django_pgqueue_workerheartbeat_changelist")
SUMMARY = reverse("admin:django_pgqueue_deadletter_summary")

ALL_PERMISSIONS = (
    "view_message",
    "change_message",
    "view_deadletter",
    "change_deadletter",
    "revive_deadletter",
    "resolve_deadletter",
    "categorize_deadletter",
    "view_workerheartbeat",
)

# Every admin action: (changelist, name, the permission it needs, the data of
# its intermediate page's form).
ACTIONS = [
    (MESSAGES, "run_now", "change_message", {}),
    (MESSAGES, "move_to_dead_letters", "change_message", {"category": "business"}),
    (DEAD_LETTERS, "revive", "revive_deadletter", {}),
    (DEAD_LETTERS, "revive_again", "revive_deadletter", {"note": "again"}),
    (DEAD_LETTERS, "revive_to", "revive_deadletter", {"queue": "elsewhere", "topic": ""}),
    (DEAD_LETTERS, "set_category", "categorize_deadletter", {"category": "business"}),
    (DEAD_LETTERS, "resolve", "resolve_deadletter", {"note": "not needed"}),
]
ACTION_IDS = [name for _, name, _, _ in ACTIONS]


def change_url(obj):
    return reverse(f"admin:django_pgqueue_{obj._meta.model_name}_change", args=[obj.pk])


def reread(obj):
    return type(obj).objects.get(pk=obj.pk)


def post_action(client, url, name, objs=(), **data):
    """POST an action to a changelist as its action bar does (more ``data``
    forges the rest: ``apply``, ``select_across``, a form's fields)."""
    post = {"action": name, "index": 0, helpers.ACTION_CHECKBOX_NAME: [o.pk for o in objs]}
    return client.post(url, {**post, **data})


def snapshot():
    """Every row an admin request could change, to compare before and after."""
    return {
        "messages": list(Message.objects.order_by("pk").values()),
        "dead_letters": list(DeadLetter.objects.order_by("pk").values()),
        "workers": list(WorkerHeartbeat.objects.order_by("pk").values()),
        "log_entries": LogEntry.objects.count(),
        "alert_windows": AlertState.objects.count(),
    }


def listed(response):
    assert response.status_code == 200, response.content[:300]
    return {obj.pk for obj in response.context["cl"].result_list}


def run_checks():
    return pgqueue_checks.check_settings() + pgqueue_checks.check_database()


@pytest.fixture
def make_user(db):
    def make(username, *codenames, is_staff=True, is_active=True):
        user = User.objects.create_user(
            username, password="x", is_staff=is_staff, is_active=is_active
        )
        user.user_permissions.set(
            Permission.objects.filter(
                content_type__app_label="django_pgqueue", codename__in=codenames
            )
        )
        return user

    return make


@pytest.fixture
def rows(make_message, make_dead_letter):
    """Rows every action could change: two waiting messages (one delayed) and
    two dead letters (one new, one revived)."""
    delayed = make_message(run_at=timezone.now() + datetime.timedelta(hours=1))
    waiting = make_message()
    new = make_dead_letter()
    revived = make_dead_letter(state=REVIVED)
    return SimpleNamespace(
        delayed=delayed,
        waiting=waiting,
        new=new,
        revived=revived,
        of={MESSAGES: [delayed, waiting], DEAD_LETTERS: [new, revived]},
    )


# --- 1. permissions --------------------------------------------------------------------


@pytest.mark.django_db
@pytest.mark.parametrize(("changelist", "name", "permission", "data"), ACTIONS, ids=ACTION_IDS)
def test_an_action_without_its_permission_is_never_run_however_it_is_forged(
    client, make_user, rows, changelist, name, permission, data
):
    """The user holds every other permission of the app; the action is not
    offered, and no forged POST runs it: not the first step, not the
    intermediate page's form, not with select_across. With the permission,
    the same POST works (so the refusal was the permission's doing)."""
    user = make_user("operator", *(p for p in ALL_PERMISSIONS if p != permission))
    client.force_login(user)
    action_form = client.get(changelist).context["action_form"]
    offered = [value for value, _ in action_form.fields["action"].choices] if action_form else []
    assert name not in offered, f"{name} is offered without {permission}"

    targets = rows.of[changelist]
    before = snapshot()
    for forged in (
        {},
        {"apply": "yes", **data},
        {"apply": "yes", "select_across": "1", **data},
        {"apply": "yes", "select_across": "1", "index": "0", "post": "yes", **data},
    ):
        response = post_action(client, changelist, name, targets, **forged)
        assert response.status_code in (200, 302), (name, forged, response.status_code)
        templates = [t.name for t in response.templates]
        assert "admin/django_pgqueue/action_form.html" not in templates, (
            f"{name}'s intermediate page was shown without {permission}"
        )
        assert snapshot() == before, f"a forged {name} changed rows without {permission}"

    user.user_permissions.add(Permission.objects.get(codename=permission))
    post_action(client, changelist, name, targets, apply="yes", **data)
    assert snapshot() != before, f"{name} did nothing even with {permission}: the test is void"


@pytest.mark.django_db
@pytest.mark.parametrize("who", ["anonymous", "not staff", "inactive staff"])
def test_outside_the_admin_no_request_changes_anything(client, make_user, rows, who):
    """Every permission of the app does not help a user who may not enter the
    admin: every action, change form and custom view redirects to the login."""
    if who != "anonymous":
        client.force_login(
            make_user(
                "outsider",
                *ALL_PERMISSIONS,
                is_staff=who == "inactive staff",
                is_active=who != "inactive staff",
            )
        )
    before = snapshot()
    requests = [
        *(
            ("post", changelist, {"action": name, "index": 0, "apply": "yes", **data})
            for changelist, name, _, data in ACTIONS
        ),
        ("post", change_url(rows.new), {"payload": '{"changed": true}'}),
        ("post", change_url(rows.waiting), {"topic": "changed"}),
        ("get", SUMMARY, {}),
        ("get", DEAD_LETTERS, {}),
    ]
    for method, url, data in requests:
        if method == "post":
            data = {**data, helpers.ACTION_CHECKBOX_NAME: [o.pk for o in rows.of[MESSAGES]]}
            data[helpers.ACTION_CHECKBOX_NAME] += [o.pk for o in rows.of[DEAD_LETTERS]]
        response = getattr(client, method)(url, data)
        assert response.status_code == 302, (who, url, response.status_code)
        assert "/login/" in response["Location"], (who, url, response["Location"])
    assert snapshot() == before, f"an {who} user changed something"


@pytest.mark.django_db
def test_an_action_permission_without_view_or_change_opens_nothing(client, make_user, rows):
    client.force_login(make_user("reviver", "revive_deadletter", "resolve_deadletter"))
    before = snapshot()
    assert client.get(DEAD_LETTERS).status_code == 403
    assert client.get(SUMMARY).status_code == 403
    assert client.get(change_url(rows.new)).status_code == 403
    for _, name, _, data in ACTIONS[2:]:
        response = post_action(client, DEAD_LETTERS, name, [rows.new], apply="yes", **data)
        assert response.status_code == 403, name
    response = post_action(client, MESSAGES, "run_now", [rows.delayed])
    assert response.status_code == 403
    assert snapshot() == before


@pytest.mark.django_db
def test_a_get_never_runs_an_action(admin_client, rows):
    """An action named in a query string (a link, an <img src>) is a filter
    Django refuses, never an action, even for a superuser."""
    before = snapshot()
    for changelist, name, _, data in ACTIONS:
        query = {"action": name, "index": 0, "apply": "yes", "select_across": "1", **data}
        query[helpers.ACTION_CHECKBOX_NAME] = [o.pk for o in rows.of[changelist]]
        response = admin_client.get(changelist, query)
        assert response.status_code in (200, 302), (name, response.status_code)
        response = admin_client.get(SUMMARY, query)
        assert response.status_code == 200
    assert snapshot() == before, "a GET ran an action"


@pytest.mark.django_db
@pytest.mark.parametrize(
    "name", ["delete_selected", "summary_view", "_revive", "save_model", "get_queryset", "revive "]
)
def test_only_registered_actions_run_even_for_a_superuser(admin_client, rows, name):
    before = snapshot()
    for changelist, targets in rows.of.items():
        response = post_action(
            admin_client, changelist, name, targets, apply="yes", post="yes", select_across="1"
        )
        assert response.status_code == 302, (changelist, response.status_code)
    assert snapshot() == before, f"{name!r} ran as an action"


@pytest.mark.django_db
def test_dead_letters_are_never_added_or_deleted_from_the_admin(admin_client, rows):
    before = snapshot()
    delete = reverse("admin:django_pgqueue_deadletter_delete", args=[rows.new.pk])
    assert admin_client.post(delete, {"post": "yes"}).status_code == 403
    add = reverse("admin:django_pgqueue_deadletter_add")
    assert admin_client.post(add, {"payload": "{}"}).status_code == 403
    worker_delete = reverse("admin:django_pgqueue_workerheartbeat_delete", args=["w"])
    assert admin_client.post(worker_delete, {"post": "yes"}).status_code == 403
    assert snapshot() == before


@pytest.mark.django_db
def test_a_forged_selection_reaches_only_the_rows_the_changelist_shows(
    client, make_user, make_dead_letter
):
    """select_across set on the intermediate page's POST, and the ids of rows
    outside the changelist's filter, reach the filtered rows and no others."""
    client.force_login(make_user("resolver", "view_deadletter", "resolve_deadletter"))
    mine = [make_dead_letter(topic="a.topic") for _ in range(3)]
    outside = make_dead_letter(topic="b.topic")
    filtered = f"{DEAD_LETTERS}?topic=a.topic"

    page = post_action(client, filtered, "resolve", mine[:1])
    assert page.context["count"] == 1
    post_action(client, filtered, "resolve", [outside], apply="yes", note="outside")
    assert reread(outside).state == NEW, "a row outside the filter was resolved by its id"
    post_action(client, filtered, "resolve", [outside, *mine[:1]], apply="yes", note="forged")
    assert [reread(d).state for d in mine] == [RESOLVED, NEW, NEW]
    assert reread(outside).state == NEW

    post_action(client, filtered, "resolve", mine[1:2], apply="yes", select_across="1", note="all")
    assert [reread(d).state for d in mine] == [RESOLVED] * 3
    assert reread(outside).state == NEW, "select_across reached past the changelist's filter"


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("value", "across"), [("1", True), ("yes", True), ("0", False), ("", False)]
)
def test_the_intermediate_page_posts_back_the_selection_it_counted(
    admin_client, make_dead_letter, value, across
):
    """Django reads select_across as a BooleanField ("yes" is True): the
    page must count, and post back, the same selection."""
    dead = [make_dead_letter() for _ in range(3)]
    page = post_action(admin_client, DEAD_LETTERS, "resolve", dead[:1], select_across=value)
    assert page.context["count"] == (3 if across else 1)
    assert f'name="select_across" value="{int(across)}"' in page.content.decode(), (
        "the page counted one selection and posts back another"
    )


@pytest.mark.django_db
def test_the_change_forms_take_nothing_but_a_new_dead_letters_payload(admin_client, rows):
    forged = {
        "payload": '{"fixed": true}',
        "state": "resolved",
        "category": "business",
        "reason": "forged",
        "notes": "forged",
        "topic": "forged",
        "queue": "forged",
        "revive_count": "9",
        "status": "processing",
        "attempts": "9",
        "run_at_0": "2000-01-01",
    }
    new_before = DeadLetter.objects.filter(pk=rows.new.pk).values().get()
    assert admin_client.post(change_url(rows.new), forged).status_code == 302
    new_after = DeadLetter.objects.filter(pk=rows.new.pk).values().get()
    assert new_after["payload"] == {"fixed": True}
    assert {**new_after, "payload": None} == {**new_before, "payload": None}, (
        "a field other than the payload was changed by a forged POST"
    )

    before = snapshot()
    response = admin_client.post(change_url(rows.revived), forged)
    assert response.status_code == 200 and response.context["adminform"].form.errors
    admin_client.post(change_url(rows.waiting), forged)
    assert snapshot()["messages"] == before["messages"]
    assert snapshot()["dead_letters"] == before["dead_letters"]


# --- 2. CSRF ----------------------------------------------------------------------------


CSRF_INPUT = re.compile(r'name="csrfmiddlewaretoken" value="([^"]+)"')


@pytest.fixture
def csrf_client(django_user_model):
    user = django_user_model.objects.create_superuser("csrf-admin", "a@example.com", "pw")
    client = Client(enforce_csrf_checks=True)
    client.force_login(user)
    return client


@pytest.fixture
def csrf_rows(make_message, make_dead_letter):
    return SimpleNamespace(
        delayed=make_message(run_at=timezone.now() + datetime.timedelta(hours=1)),
        waiting=make_message(),
        **{name: make_dead_letter() for name in ("revive", "again", "to", "category", "resolve")},
        payload=make_dead_letter(payload={"broken": True}),
    )


def csrf_posts(r):
    """(what, url, data, needs an intermediate page) of every state-changing POST."""
    ids = helpers.ACTION_CHECKBOX_NAME
    return [
        ("run now", MESSAGES, {"action": "run_now", "index": 0, ids: [r.delayed.pk]}, False),
        (
            "move to dead letters",
            MESSAGES,
            {"action": "move_to_dead_letters", "index": 0, ids: [r.waiting.pk]},
            {"category": "business"},
        ),
        ("revive", DEAD_LETTERS, {"action": "revive", "index": 0, ids: [r.revive.pk]}, False),
        (
            "revive again",
            DEAD_LETTERS,
            {"action": "revive_again", "index": 0, ids: [r.again.pk]},
            {"note": "again"},
        ),
        (
            "revive to",
            DEAD_LETTERS,
            {"action": "revive_to", "index": 0, ids: [r.to.pk]},
            {"queue": "elsewhere", "topic": ""},
        ),
        (
            "set category",
            DEAD_LETTERS,
            {"action": "set_category", "index": 0, ids: [r.category.pk]},
            {"category": "business"},
        ),
        (
            "resolve",
            DEAD_LETTERS,
            {"action": "resolve", "index": 0, ids: [r.resolve.pk]},
            {"note": "not needed"},
        ),
        ("edit payload", change_url(r.payload), {"payload": '{"fixed": true}'}, False),
    ]


def assert_every_csrf_post_took_effect(r):
    assert reread(r.delayed).run_at <= timezone.now(), "run now"
    assert not Message.objects.filter(pk=r.waiting.pk).exists(), "move to dead letters"
    assert DeadLetter.objects.get(message_id=r.waiting.pk).category == Category.BUSINESS
    assert reread(r.revive).state == REVIVED, "revive"
    assert reread(r.again).state == REVIVED, "revive again"
    assert Message.objects.get(pk=reread(r.to).revived_message_id).queue == "elsewhere"
    assert reread(r.category).category == Category.BUSINESS, "set category"
    assert reread(r.resolve).state == RESOLVED, "resolve"
    assert reread(r.payload).payload == {"fixed": True}, "edit payload"


@pytest.mark.django_db
def test_every_state_changing_admin_post_without_a_csrf_token_is_refused(csrf_client, csrf_rows):
    before = snapshot()
    posts = []
    for what, url, data, form in csrf_posts(csrf_rows):
        posts.append((what, url, data))
        if form:
            posts.append((f"{what} (its intermediate page)", url, {**data, "apply": "yes", **form}))
    posts += [
        ("message change form", change_url(csrf_rows.waiting), {}),
        ("summary", SUMMARY, {}),
    ]
    for what, url, data in posts:
        response = csrf_client.post(url, data)
        assert response.status_code == 403, f"{what}: {response.status_code} without a token"
        assert b"CSRF" in response.content, what
    assert snapshot() == before, "a POST without a CSRF token changed something"


@pytest.mark.django_db
def test_every_state_changing_admin_post_with_the_pages_csrf_token_works(csrf_client, csrf_rows):
    """The token comes from the page the POST is sent from: the changelist,
    the intermediate page (which must carry one), the change form."""
    for what, url, data, form in csrf_posts(csrf_rows):
        page = csrf_client.get(url)
        token = CSRF_INPUT.search(page.content.decode()).group(1)
        response = csrf_client.post(url, {**data, "csrfmiddlewaretoken": token})
        if form:
            assert response.status_code == 200, f"{what}: {response.status_code}"
            found = CSRF_INPUT.search(response.content.decode())
            assert found, f"{what}: the intermediate page's form has no CSRF token"
            response = csrf_client.post(
                url, {**data, "apply": "yes", **form, "csrfmiddlewaretoken": found.group(1)}
            )
        assert response.status_code == 302, f"{what}: {response.status_code} with a token"
    assert_every_csrf_post_took_effect(csrf_rows)


@pytest.mark.django_db
@override_settings(PGQUEUE={"METRICS_ACCESS": "open", "HEALTH_ACCESS": "open"})
def test_the_metrics_and_health_urls_take_no_post_with_or_without_a_token(csrf_client):
    token = CSRF_INPUT.search(csrf_client.get(DEAD_LETTERS).content.decode()).group(1)
    for url in ("/pgqueue/metrics", "/pgqueue/health"):
        assert csrf_client.post(url).status_code == 403
        assert csrf_client.post(url, {"csrfmiddlewaretoken": token}).status_code == 405
        assert csrf_client.get(url).status_code in (200, 503)


# --- 3. escaping ------------------------------------------------------------------------


@pytest.fixture
def hostile(make_message, make_dead_letter):
    """A hostile text in every field the admin shows (rows written past
    enqueue()'s validation, as another client's INSERT could)."""
    later = timezone.now() + datetime.timedelta(hours=1)
    texts = {"dedup_key": XSS, "group_key": XSS, "headers": {"h": XSS}}
    message = make_message(
        topic=XSS,
        queue=XSS,
        payload={"html": XSS, XSS: 1},
        last_error=f"ValueError: {XSS}\n{XSS}",
        last_error_category="<b>x</b>",
        locked_by=XSS,
        run_at=later,
        **texts,
    )
    dead = {
        "topic": XSS,
        "queue": XSS,
        "payload": {"html": XSS},
        "reason": f"ValueError: {XSS}",
        "traceback": f"Traceback (most recent call last):\nValueError: {XSS}",
        "worker": XSS,
        "notes": XSS,
        **texts,
    }
    new = make_dead_letter(**dead)
    revived = make_dead_letter(
        state=REVIVED, revived_by=XSS, resolved_by=XSS, category_set_by=XSS, **dead
    )
    worker = WorkerHeartbeat.objects.create(
        worker_id=XSS,
        hostname=XSS,
        pid=1,
        queues=[XSS],
        concurrency=1,
        expires_at=later,
    )
    return SimpleNamespace(message=message, new=new, revived=revived, worker=worker)


def assert_escaped(response, where):
    assert response.status_code == 200, f"{where}: {response.status_code}"
    page = response.content.decode()
    assert XSS not in page, f"{where}: a stored text rendered unescaped"
    assert "<b>x</b>" not in page, f"{where}: a stored text rendered unescaped"
    assert ESCAPED in page, f"{where}: the hostile text is not shown at all (the test is void)"


@pytest.mark.django_db
def test_every_admin_page_shows_stored_texts_escaped(admin_client, hostile):
    pages = {
        "message list": (MESSAGES, {}),
        "message list, filtered and searched": (MESSAGES, {"topic": XSS, "q": XSS}),
        "message detail": (change_url(hostile.message), {}),
        "dead-letter list": (DEAD_LETTERS, {}),
        "dead-letter list, filtered and searched": (
            DEAD_LETTERS,
            {"topic__exact": XSS, "q": "ValueError"},
        ),
        "new dead letter (payload editable)": (change_url(hostile.new), {}),
        "revived dead letter": (change_url(hostile.revived), {}),
        "worker list": (WORKERS, {}),
        "worker detail": (change_url(hostile.worker), {}),
        "summary": (SUMMARY, {}),
    }
    for where, (url, query) in pages.items():
        assert_escaped(admin_client.get(url, query), where)


@pytest.mark.django_db
def test_every_intermediate_page_and_action_message_shows_stored_texts_escaped(
    admin_client, hostile
):
    pages = [
        (MESSAGES, "move_to_dead_letters", [hostile.message], {}),
        (DEAD_LETTERS, "revive_again", [hostile.new, hostile.revived], {}),
        (DEAD_LETTERS, "revive_to", [hostile.new], {}),
        (DEAD_LETTERS, "set_category", [hostile.new], {}),
        (DEAD_LETTERS, "resolve", [hostile.new], {}),
        # A form error that names the value given.
        (DEAD_LETTERS, "revive_to", [hostile.new], {"apply": "yes", "queue": XSS, "topic": ""}),
    ]
    for changelist, name, objs, data in pages:
        response = post_action(admin_client, changelist, name, objs, **data)
        assert "admin/django_pgqueue/action_form.html" in [t.name for t in response.templates]
        assert_escaped(response, f"{name}'s intermediate page")
    assert not Message.objects.exclude(pk=hostile.message.pk).exists(), "revived anyway"

    # The messages shown after an action (a revive into the hostile queue fails).
    response = post_action(admin_client, DEAD_LETTERS, "revive", [hostile.new])
    page = admin_client.get(response["Location"]).content.decode()
    assert XSS not in page, "an action's message rendered a stored text unescaped"


METRIC_NAME = 'a"b\\c\nd<script>'
# The same in the Prometheus text format: \ " and newline escaped, nothing else.
METRIC_LABEL = 'a\\"b\\\\c\\nd<script>'


@pytest.mark.django_db
@override_settings(PGQUEUE={"METRICS_ACCESS": "open"})
def test_metric_label_values_are_escaped_per_the_prometheus_text_format(
    client, make_message, make_dead_letter
):
    make_message(topic=METRIC_NAME, queue=METRIC_NAME)
    make_dead_letter(topic=METRIC_NAME)
    response = client.get("/pgqueue/metrics")
    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/plain; version=")
    assert response["X-Content-Type-Options"] == "nosniff", "a browser must not sniff it as HTML"
    text = response.content.decode()
    assert METRIC_NAME not in text, "a label value went out with a raw quote or newline"
    assert f'queue="{METRIC_LABEL}"' in text and f'topic="{METRIC_LABEL}"' in text
    assert f'topic="{METRIC_LABEL}"' in text.split("pgqueue_dead_letters{", 1)[1]
    for line in text.splitlines():
        assert line.startswith(("#", "pgqueue_")), f"a label broke a line: {line!r}"
    parsed = {
        (sample.name, tuple(sorted(sample.labels.items())))
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
    ready = ("database", "default"), ("queue", METRIC_NAME), ("state", "ready")
    ready += (("topic", METRIC_NAME),)
    assert ("pgqueue_messages", ready) in parsed, "the value does not parse back as written"


@pytest.mark.django_db
def test_the_alerts_admin_link_encodes_the_topic(admin_client, make_dead_letter):
    """A topic written past enqueue()'s validation could add a filter of its
    own to the link ("&state__exact=…") or markup: it is percent-encoded, and
    the page the link opens shows it escaped."""
    topic = '<b>x</b>&state__exact=resolved"'
    ours = [make_dead_letter(topic=topic, category=Category.BUSINESS) for _ in range(2)]
    make_dead_letter(topic="<b>x</b>", category=Category.BUSINESS, state=RESOLVED)
    site = {"ALERT_WEBHOOK_URL": "http://127.0.0.1:9/hook", "ALERT_SITE_URL": "https://ops.test"}
    with override_settings(PGQUEUE=site):
        payload = alerts.build_payload(ours[0], suppressed=1)
    url = urlsplit(payload["admin_url"])
    assert not set('<>"') & set(payload["admin_url"]), payload["admin_url"]
    assert parse_qs(url.query) == {"topic__exact": [topic], "category__exact": ["business"]}
    # In the chat text, "&" is "&amp;" as Slack asks (it shows and links "&").
    assert payload["text"].endswith(" " + payload["admin_url"].replace("&", "&amp;"))
    response = admin_client.get(f"{url.path}?{url.query}")
    assert listed(response) == {d.pk for d in ours}, "the link's filter was changed by the topic"
    page = response.content.decode()
    assert "<b>x</b>" not in page and "&lt;b&gt;x&lt;/b&gt;" in page


@pytest.mark.django_db
def test_the_alerts_chat_text_pings_and_links_nobody(make_dead_letter, webhook):
    """A topic and queue written past enqueue()'s validation, and an
    exception's text, carry every way a chat message pings or links (Slack's
    <!channel>, <@U123>, <#C123>, <url|label>; @here and the like; markdown
    links): the alert that reaches a real webhook shows them inert in
    "text", and as written in the other fields."""
    z = "\u200b"  # zero-width space
    topic = "orders.<!channel>\n[x]: http://evil.example"
    queue = "<@U999>@all"
    reason = (
        "ValueError: <!everyone> <!here|here> @channel @everyone <@U123> <#C123|general> "
        "<!subteam^S1> [click](http://evil.example/x) ![i](http://evil.example/i.png) "
        "<http://evil.example|your bank> a&b"
    )
    dead = make_dead_letter(topic=topic, queue=queue, reason=reason + "\nsecond line")
    site = {"ALERT_WEBHOOK_URL": webhook.url, "ALERT_SITE_URL": "https://ops.test"}
    with override_settings(PGQUEUE=site):
        assert pgqueue_handlers.deliver(alerts.build_payload(dead, suppressed=0)) == 200
    [request] = webhook.requests
    link = f"https://ops.test/admin/django_pgqueue/deadletter/{dead.pk}/change/"
    assert request.body == {
        "event": "dead_lettered",
        "topic": topic,
        "category": "transient",
        "queue": queue,
        "reason": reason,
        "dead_letter_id": dead.pk,
        "message_id": dead.message_id,
        "attempts": 5,
        "worker": "",
        "dead_lettered_at": dead.dead_lettered_at.isoformat(),
        "count": 1,
        "suppressed": 0,
        "window_seconds": conf.DEFAULTS["ALERT_WINDOW"],
        "admin_url": link,
        "text": f"Dead letter in orders.&lt;!channel&gt; [x]: http://evil.example (transient) "
        f"on queue &lt;@{z}U999&gt;@{z}all: ValueError: &lt;!everyone&gt; &lt;!here|here&gt; "
        f"@{z}channel @{z}everyone &lt;@{z}U123&gt; &lt;#C123|general&gt; &lt;!subteam^S1&gt; "
        f"[click]{z}(http://evil.example/x) ![i]{z}(http://evil.example/i.png) "
        f"&lt;http://evil.example|your bank&gt; a&amp;b {link}",
    }
    text = request.body["text"]
    assert not re.search(r"<|>|@\w|\]\(|\n", text), "a ping, link or line break got through"


# --- 4. the metrics and health URLs -----------------------------------------------------


def answer(client, endpoint, user=None, **headers):
    client.logout()
    if user is not None:
        client.force_login(user)
    return client.get(f"/pgqueue/{endpoint}", headers=headers)


SERVED = (200, 503)  # health is 503 with no live worker: served all the same


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("endpoint", "setting"), [("metrics", "METRICS_ACCESS"), ("health", "HEALTH_ACCESS")]
)
def test_each_access_setting_lets_in_exactly_whom_it_names(client, make_user, endpoint, setting):
    staff = make_user("staff")
    requesters = {
        "anonymous": (None, {}),
        "anonymous with the token": (None, {"Authorization": f"Bearer {TOKEN}"}),
        "anonymous with a wrong token": (None, {"Authorization": f"Bearer {TOKEN[:-1]}"}),
        "anonymous with the token in another scheme": (None, {"Authorization": f"Token {TOKEN}"}),
        "not staff": (make_user("plain", is_staff=False), {}),
        "inactive staff": (make_user("gone", is_active=False), {}),
        "staff": (staff, {}),
        "staff with a wrong token": (staff, {"Authorization": "Bearer nope"}),
    }
    expected = {
        "open": set(requesters),
        "staff": {"staff", "staff with a wrong token"},
        "token": {"anonymous with the token"},
    }
    for access, allowed in expected.items():
        with override_settings(PGQUEUE={setting: access, "ENDPOINT_TOKEN": TOKEN}):
            for who, (user, headers) in requesters.items():
                response = answer(client, endpoint, user, **headers)
                served = response.status_code in SERVED
                assert served == (who in allowed), f"{endpoint} {access}: {who} got {response}"
                if not served:
                    assert response.status_code in (401, 403)
                    assert TOKEN.encode() not in response.content
                    assert TOKEN not in str(response.headers)
            client.logout()
            query = client.get(f"/pgqueue/{endpoint}", {"token": TOKEN, "access_token": TOKEN})
            assert (query.status_code in SERVED) == (access == "open"), "a token in the URL"


@pytest.mark.django_db
@override_settings(PGQUEUE={"METRICS_ACCESS": "token", "ENDPOINT_TOKEN": TOKEN})
def test_the_token_is_compared_with_hmac_compare_digest(client, monkeypatch):
    compared, real = [], hmac.compare_digest

    def spy(given, expected):
        compared.append((given, expected))
        return real(given, expected)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    assert answer(client, "metrics", Authorization=f"Bearer {TOKEN}x").status_code == 401
    assert answer(client, "metrics", Authorization=f"Bearer {TOKEN}").status_code == 200
    assert compared == [(f"{TOKEN}x".encode(), TOKEN.encode()), (TOKEN.encode(), TOKEN.encode())]

    monkeypatch.setattr(hmac, "compare_digest", lambda given, expected: False)
    assert answer(client, "metrics", Authorization=f"Bearer {TOKEN}").status_code == 401, (
        "the decision does not rest on hmac.compare_digest"
    )


@pytest.mark.django_db
@pytest.mark.parametrize("token", [None, ""], ids=["missing", "empty"])
@pytest.mark.parametrize(
    ("endpoint", "setting"), [("metrics", "METRICS_ACCESS"), ("health", "HEALTH_ACCESS")]
)
def test_token_access_without_a_token_is_a_check_error_and_lets_nobody_in(
    client, make_user, endpoint, setting, token
):
    with override_settings(PGQUEUE={setting: "token", "ENDPOINT_TOKEN": token}):
        errors = run_checks()
        assert any(
            f"PGQUEUE['{setting}'] is 'token' but PGQUEUE['ENDPOINT_TOKEN'] is not set" in e.msg
            for e in errors
        ), [e.msg for e in errors]
        for header in (None, "Bearer", "Bearer ", "Bearer  ", "Bearer None", 'Bearer ""'):
            headers = {} if header is None else {"Authorization": header}
            response = answer(client, endpoint, **headers)
            assert response.status_code == 401, f"{header!r} got in with no token configured"
        assert answer(client, endpoint, make_user("staff")).status_code == 401


@pytest.mark.django_db
@pytest.mark.parametrize("value", ["public", "OPEN", "", None])
def test_an_unknown_access_value_is_a_check_error_and_lets_only_staff_in(client, make_user, value):
    for setting, endpoint in (("METRICS_ACCESS", "metrics"), ("HEALTH_ACCESS", "health")):
        with override_settings(PGQUEUE={setting: value}):
            [error] = run_checks()
            assert "must be one of 'open', 'staff', 'token'" in error.msg
            assert answer(client, endpoint).status_code == 403, f"{setting}={value!r} is open"
            assert answer(client, endpoint, make_user(f"s-{setting}")).status_code in SERVED


# A worker's own ports (--metrics-port, --health-port): where they listen, and
# the token.


def listening_on(port):
    """The local addresses at which a socket of this host listens on TCP
    ``port``, as the kernel reports them (/proc/net/tcp and tcp6)."""
    found = set()
    for name, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        with open(f"/proc/net/{name}") as table:
            for line in table.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                address, hex_port = local.split(":")
                if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                    raw = bytes.fromhex(address)  # 32-bit words in host (little-endian) order
                    raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
                    found.add(socket.inet_ntop(family, raw))
    return found


def other_addresses_of_this_host():
    """This host's own IPv4 addresses other than loopback (/proc/net/fib_trie)."""
    with open("/proc/net/fib_trie") as trie:
        lines = trie.read().splitlines()
    return {
        previous.split()[-1]
        for previous, line in zip(lines, lines[1:], strict=False)
        if line.strip() == "/32 host LOCAL" and not previous.split()[-1].startswith("127.")
    }


def logged_url(worker, kind):
    """(host, port) of the URL a worker logged for its ``kind`` port."""
    pattern = re.compile(rf"{kind} on http://\[?([^\]/]+?)\]?:(\d+)/")
    found = wait_until(lambda: pattern.search(worker.log()), timeout=60, message=f"{kind} port")
    return found.group(1), int(found.group(2))


def port_get(url, authorization=None):
    """(status, headers, body) of a GET, proxies of the environment ignored."""
    import urllib.error
    import urllib.request

    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    headers = {"Authorization": authorization} if authorization else {}
    try:
        with opener.open(urllib.request.Request(url, headers=headers), timeout=10) as response:
            return response.status, response.headers, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.headers, error.read().decode()


@pytest.mark.slow
def test_a_workers_ports_listen_on_loopback_only_by_default(start_worker):
    worker = start_worker("--metrics-port", "0", "--health-port", "0", "--poll-interval", "0.2")
    (metrics_host, metrics), (health_host, health) = (
        logged_url(worker, "metrics"),
        logged_url(worker, "health"),
    )
    assert (metrics_host, health_host) == ("127.0.0.1", "127.0.0.1")
    assert listening_on(metrics) == {"127.0.0.1"}
    assert listening_on(health) == {"127.0.0.1"}
    others = other_addresses_of_this_host()
    assert others, "this host has no other address: the test cannot try one"
    for address in others:
        for port in (metrics, health):
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection((address, port), timeout=10).close()
    # Loopback answers; the default METRICS_ACCESS ("staff") and HEALTH_ACCESS
    # ("open") ask for no token on a worker's port, which has no users.
    assert port_get(f"http://127.0.0.1:{metrics}/")[0] == 200
    assert wait_until(lambda: port_get(f"http://127.0.0.1:{health}/")[0] == 200)
    assert "answers anyone" not in worker.log()


@pytest.mark.slow
def test_the_setting_and_the_option_choose_where_a_workers_ports_listen(start_worker):
    """PGQUEUE["WORKER_HTTP_HOST"] moves both ports; --http-host overrides it;
    an IPv6 address works too. (127.0.0.2 and .3 are loopback addresses
    other than the default.)"""
    setting = {"WORKER_HTTP_HOST": "127.0.0.2"}
    by_setting = start_worker("--metrics-port", "0", "--health-port", "0", pgqueue=setting)
    by_option = start_worker("--health-port", "0", "--http-host", "127.0.0.3", pgqueue=setting)
    ipv6 = start_worker("--metrics-port", "0", "--http-host", "::1", pgqueue=setting)
    for worker, kind, host in [
        (by_setting, "metrics", "127.0.0.2"),
        (by_setting, "health", "127.0.0.2"),
        (by_option, "health", "127.0.0.3"),
        (ipv6, "metrics", "::1"),
    ]:
        logged, port = logged_url(worker, kind)
        assert (logged, listening_on(port)) == (host, {host}), f"{kind} of {worker.log()}"
        url = f"http://[{host}]:{port}/" if ":" in host else f"http://{host}:{port}/"
        assert port_get(url)[0] in (200, 503)


@pytest.mark.slow
def test_a_workers_ports_ask_for_the_token_when_their_access_is_token(start_worker):
    settings = {"METRICS_ACCESS": "token", "HEALTH_ACCESS": "token", "ENDPOINT_TOKEN": TOKEN}
    worker = start_worker(
        "--metrics-port", "0", "--health-port", "0", "--poll-interval", "0.2", pgqueue=settings
    )
    urls = {
        kind: f"http://127.0.0.1:{logged_url(worker, kind)[1]}/" for kind in ("metrics", "health")
    }
    refused = [None, f"Bearer {TOKEN}x", f"Bearer {TOKEN[:-1]}", f"Basic {TOKEN}", TOKEN, "Bearer "]
    for kind, url in urls.items():
        for authorization in refused:
            for page in ("", "nope"):  # a wrong path is refused first: nothing is told
                status, headers, body = port_get(url + page, authorization)
                assert status == 401, f"{kind} {authorization!r}: {status} {body}"
                assert headers["WWW-Authenticate"] == 'Bearer realm="django-pgqueue"'
                assert body == "A valid bearer token is required.\n"
    status, _, body = port_get(urls["metrics"], f"Bearer {TOKEN}")
    assert status == 200 and "pgqueue_worker_inflight " in body
    status, _, body = wait_until(
        lambda: (lambda got: got if got[0] == 200 else None)(
            port_get(urls["health"], f"bearer {TOKEN}")
        ),
        message="a healthy worker",
    )
    assert json.loads(body)["status"] == "ok"
    assert TOKEN not in worker.log()


@pytest.mark.django_db(transaction=True)
def test_a_workers_ports_on_every_network_without_a_token_are_a_warning(caplog):
    """Listening on 0.0.0.0 (for as long as a --burst worker runs) while an
    access setting is not "token" is logged as a warning that says what to do."""
    caplog.set_level(logging.INFO, logger="django_pgqueue")
    settings = {"METRICS_ACCESS": "token", "ENDPOINT_TOKEN": TOKEN}
    with override_settings(PGQUEUE=settings):
        call_command(
            "pgqueue_worker", "--burst", "--metrics-port", "0", "--health-port", "0",
            "--http-host", "0.0.0.0",
        )  # fmt: skip
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1, warnings
    assert re.match(r"Worker \S+: the health port on 0\.0\.0\.0 answers anyone", warnings[0])
    assert "set PGQUEUE['HEALTH_ACCESS'] to 'token'" in warnings[0]


@pytest.mark.parametrize(
    "host", ["127.0.0.1:9100", "[::1]", "", "0.0.0.256", "a host", "x-.example.com"]
)
def test_a_bad_http_host_option_is_refused(host):
    with pytest.raises(CommandError, match="--http-host.*must be an IP address"):
        call_command("pgqueue_worker", "--burst", "--http-host", host)


@pytest.mark.parametrize(
    "host", ["127.0.0.1", "0.0.0.0", "::", "::1", "10.1.2.3", "localhost", "worker-1.internal"]
)
def test_addresses_and_host_names_are_good_listen_addresses(host):
    with override_settings(PGQUEUE={"WORKER_HTTP_HOST": host}):
        assert run_checks() == []


# --- 5. hostile names ---------------------------------------------------------------------


HOSTILE = {
    "quote": "default'",
    "double quote": 'default"',
    "semicolon": "a;b",
    "drop table": '"; DROP TABLE django_pgqueue_message; --',
    "close and drop": "'); DROP TABLE django_pgqueue_message; --",
    "dollar quote": "$$x$$",
    "trailing newline": "default\n",
    "header injection": "default\r\nX-Injected: 1",
    "cyrillic e": "d\u0435fault",
    "fullwidth": "\uff44\uff45\uff46\uff41\uff55\uff4c\uff54",
    "zero-width space": "default\u200b",
    "nul": "default\x00",
    "space": "de fault",
    "leading dash": "-default",
    "leading dot": ".default",
    "percent": "default%",
    "backslash": "a\\b",
    "markup": XSS,
    "or true": "' OR '1'='1",
    "very long": "x" * 100_000,
    "empty": "",
}
# The worker's --queues and the admin's forms strip surrounding whitespace
# first: "default\n" is then the valid "default" (harmless).
NOT_STRIPPED = {k: v for k, v in HOSTILE.items() if conf.name_problem("q", v.strip(), 100)}


def hostile_params(names=HOSTILE):
    return pytest.mark.parametrize("name", list(names.values()), ids=list(names))


def assert_tables_intact():
    """The queue's tables and the insert trigger are all still there."""
    Message.objects.count()
    DeadLetter.objects.count()
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_trigger WHERE tgname = 'pgqueue_notify_insert'")
        assert cursor.fetchone() == (1,), "the NOTIFY trigger is gone"


def test_names_are_plain_ascii_and_the_notify_channel_a_plain_identifier():
    for name in HOSTILE.values():
        assert conf.name_problem("queue", name, conf.QUEUE_MAX_LENGTH), repr(name[:40])
    for name in ("default", "orders.created", "a/b:c-d_e", "_x", "q" * 100):
        assert conf.name_problem("queue", name, conf.QUEUE_MAX_LENGTH) is None, name
    # LISTEN cannot take a bound parameter: the channel is a constant that
    # needs no quoting.
    assert re.fullmatch(r"[a-z_][a-z0-9_]*", CHANNEL), CHANNEL


@pytest.mark.django_db
@hostile_params()
def test_enqueue_refuses_hostile_topic_and_queue_names_before_writing(name):
    for kind, call in (
        ("topic", lambda: enqueue(name, {})),
        ("queue", lambda: enqueue("fine", {}, queue=name)),
        (
            "topic",
            lambda: enqueue_many([{"topic": "ok", "payload": 1}, {"topic": name, "payload": 1}]),
        ),
        ("queue", lambda: enqueue_many([{"payload": 1}, {"payload": 2, "queue": name}], topic="t")),
    ):
        with pytest.raises(InvalidMessage, match=kind):
            call()
    with override_settings(PGQUEUE={"DEFAULT_QUEUE": name}):
        with pytest.raises(InvalidMessage, match="queue"):
            enqueue("fine", {})
    assert not Message.objects.exists()
    assert_tables_intact()


@hostile_params()
def test_hostile_queue_settings_are_check_errors_that_quote_the_name(name):
    for setting in ({"DEFAULT_QUEUE": name}, {"QUEUES": [name]}, {"QUEUES": ["default", name]}):
        with override_settings(PGQUEUE=setting):
            [error] = run_checks()
        assert error.id == "pgqueue.E003", error
        assert not set("\n\r\x00") & set(error.msg), "a raw control character in the message"


@hostile_params()
def test_registering_a_handler_for_a_hostile_topic_fails(name):
    with pytest.raises(ValueError, match="@handler: topic"):
        handler(name)


@hostile_params(NOT_STRIPPED)
def test_the_worker_refuses_hostile_queue_names(name):
    with pytest.raises(CommandError, match="--queues"):
        call_command("pgqueue_worker", "--burst", f"--queues={name}")


@pytest.mark.django_db
@hostile_params()
def test_the_commands_refuse_hostile_names(name):
    for args in (
        ["pgqueue_status", f"--queue={name}"],
        ["pgqueue_deadletters", "revive", "--all", f"--queue={name}"],
        ["pgqueue_deadletters", "revive", "--all", f"--topic-to={name}"],
    ):
        with pytest.raises(CommandError, match="name"):
            call_command(*args)
    with pytest.raises(DeadLetterError):
        deadletters.revive(DeadLetter.objects.all(), queue=name)
    with pytest.raises(DeadLetterError):
        deadletters.revive(DeadLetter.objects.all(), topic=name)


@pytest.mark.django_db
# Left out: "" and a NUL, which argparse refuses (--topic: tests/test_commands.py).
@hostile_params({k: v for k, v in HOSTILE.items() if v and "\x00" not in v})
def test_a_hostile_topic_filter_of_the_deadletters_command_is_only_a_value(make_dead_letter, name):
    dead = make_dead_letter()
    out = StringIO()
    call_command("pgqueue_deadletters", "list", f"--topic={name}", "--json", stdout=out)
    assert out.getvalue().strip() == "[]", "a hostile topic filter matched something"
    call_command("pgqueue_deadletters", "resolve", f"--topic={name}", "--note=x", stdout=out)
    assert reread(dead).state == NEW
    assert_tables_intact()


@pytest.mark.django_db
@hostile_params()
def test_hostile_filter_and_search_values_in_the_admin_are_only_values(
    admin_client, rows, hostile_worker, name
):
    """Filters match nothing (no value acts as SQL: "' OR '1'='1" lists no
    row); searches and the other pages answer; a NUL, which PostgreSQL
    text cannot hold, is refused as Django refuses any unusable filter."""
    before = snapshot()
    filters = [
        (MESSAGES, {"topic": name}),
        (MESSAGES, {"queue__exact": name}),
        (MESSAGES, {"status__exact": name}),
        (DEAD_LETTERS, {"topic__exact": name}),
        (DEAD_LETTERS, {"category__exact": name}),
        (DEAD_LETTERS, {"state__exact": name}),
    ]
    others = [
        (MESSAGES, {"q": name}),
        (DEAD_LETTERS, {"q": name}),
        (WORKERS, {"q": name, "alive": name}),
        (SUMMARY, {"state": name}),
    ]
    for url, query in filters + others:
        response = admin_client.get(url, query)
        where = f"{url} {sorted(query)}"
        if "\x00" in name and url != SUMMARY:  # the summary checks ?state against its choices
            assert response.status_code == 302 and response["Location"].endswith("?e=1"), where
            continue
        assert response.status_code in (200, 302), where
        if response.status_code == 302:  # Django's answer to an unusable filter value
            assert response["Location"].endswith("?e=1"), where
            continue
        assert XSS not in response.content.decode(), where
        if (url, query) in filters and name:
            assert listed(response) == set(), f"{where} matched rows"
    assert snapshot() == before
    assert_tables_intact()


@pytest.fixture
def hostile_worker(db):
    return WorkerHeartbeat.objects.create(
        worker_id="w-1",
        hostname="host",
        pid=1,
        queues=["default"],
        concurrency=1,
        expires_at=timezone.now() + datetime.timedelta(minutes=1),
    )


@pytest.mark.django_db
@hostile_params(NOT_STRIPPED)
def test_revive_to_refuses_hostile_names_in_its_form(admin_client, make_dead_letter, name):
    dead = make_dead_letter()
    for field in ("queue", "topic"):
        data = {"queue": "", "topic": "", field: name}
        response = post_action(admin_client, DEAD_LETTERS, "revive_to", [dead], apply="yes", **data)
        assert response.status_code == 200, response.status_code
        form = response.context["form"]
        assert form.errors, f"{field}={name[:40]!r} was accepted"
    assert reread(dead).state == NEW
    assert not Message.objects.exists()


@pytest.mark.django_db
def test_a_payload_edit_with_a_nul_character_is_a_form_error(admin_client, make_dead_letter):
    dead = make_dead_letter(payload={"n": 1})
    for text in ('{"a": "\\u0000"}', '{"\\u0000": 1}', '[[["x\\u0000"]]]'):
        response = admin_client.post(change_url(dead), {"payload": text})
        assert response.status_code == 200
        assert "NUL character" in str(response.context["adminform"].form.errors["payload"])
    assert reread(dead).payload == {"n": 1}
    response = admin_client.post(change_url(dead), {"payload": '{"a": "\\\\u0000"}'})
    assert response.status_code == 302, "an escaped backslash before u0000 is no NUL"
    assert reread(dead).payload == {"a": "\\u0000"}


@pytest.mark.django_db(transaction=True)
def test_a_hostile_queue_written_by_another_client_travels_as_data_only(listener, other_connection):
    """Another client's INSERT is not validated: its queue name reaches the
    NOTIFY (a bound argument of pg_notify) and the worker's claim (a bound
    parameter) as data. A worker that serves it (configured with the checks
    skipped) handles the message; nothing else happens."""
    name = HOSTILE["close and drop"]
    other_connection.execute(
        "INSERT INTO django_pgqueue_message (topic, queue, payload) VALUES (%s, %s, '{}')",
        ["test.record", name],
    )
    assert listener.wait_for(1) == [(CHANNEL, name)]
    call_command("pgqueue_worker", "--burst", "--queues", "default", "--log-level", "ERROR")
    assert Message.objects.filter(queue=name).count() == 1, "another queue's worker took it"

    with override_settings(PGQUEUE={"QUEUES": [name]}):
        with pytest.raises(SystemCheckError, match="pgqueue.E003"):
            call_command("pgqueue_worker", "--burst", skip_checks=False)
        with pytest.raises(SystemCheckError, match="pgqueue.E003"):
            call_command("pgqueue_status", skip_checks=False)
        call_command("pgqueue_worker", "--burst", "--log-level", "ERROR")  # checks skipped
    assert not Message.objects.exists()
    assert Handled.objects.count() == 1
    assert_tables_intact()


# --- 6. the webhook's secrets ---------------------------------------------------------------


QUERY_TOKEN = "qs-9a8b7c6d5e4f3a2b1c"
HEADER_TOKEN = "hdr-1f2e3d4c5b6a7980"
HEADER_KEY = "key-0a1b2c3d4e5f6789"
PASSWORD = "pa55-w0rd-3e4f5a6b"
HEADERS = {"Authorization": f"Bearer {HEADER_TOKEN}", "X-Alert-Key": HEADER_KEY}
SECRETS = (QUERY_TOKEN, HEADER_TOKEN, HEADER_KEY, PASSWORD)


def assert_no_secret(text, where):
    for secret in SECRETS:
        assert secret not in text, f"{secret!r} leaked into {where}: {text[:3000]}"


@pytest.fixture
def webhook():
    hook = Webhook()
    yield hook
    hook.close()


@pytest.fixture
def debug_logs(caplog):
    """Every log record of every logger, DEBUG and up."""
    pgqueue_logger = logging.getLogger("django_pgqueue")
    level = pgqueue_logger.level
    caplog.set_level(logging.DEBUG)
    yield caplog
    pgqueue_logger.setLevel(level)  # the worker command sets it


def closed_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]  # closed again: nothing listens there


def run_worker():
    out, err = StringIO(), StringIO()
    call_command(
        "pgqueue_worker", "--burst", "--concurrency", "1", "--log-level", "DEBUG",
        stdout=out, stderr=err,
    )  # fmt: skip
    return out.getvalue() + err.getvalue()


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    "answer",
    [
        200,
        500,
        (503, f"echo {HEADER_TOKEN} {HEADER_KEY}"),
        pytest.param((503, f"echo {QUERY_TOKEN}"), id="503-echoing-the-query-token"),
        401,
        (302, "/x"),
        "down",
    ],
    ids=lambda answer: answer if isinstance(answer, str | int) else f"{answer[0]}-echo",
)
def test_the_webhooks_secrets_appear_in_no_log_row_page_or_output(
    webhook, debug_logs, capfd, make_dead_letter, django_user_model, answer
):
    """An alert goes through a real worker (two tries) to a real webhook whose
    URL carries a token in its query string and whose headers carry two
    more. Everything it leaves behind is searched for them: every log record
    at DEBUG (messages and tracebacks), the process's stdout and stderr, the
    alert message's last_error, the dead letter, and the admin's pages."""
    webhook.default = answer
    url = f"{webhook.url}?token={QUERY_TOKEN}"
    if answer == "down":
        url = f"http://127.0.0.1:{closed_port()}/hook?token={QUERY_TOKEN}"
    settings = {
        "ALERT_WEBHOOK_URL": url,
        "ALERT_WEBHOOK_HEADERS": HEADERS,
        "ALERT_WEBHOOK_RETRIES": 1,
        "ALERT_WEBHOOK_TIMEOUT": 2,
        "BACKOFF_BASE": 3600,  # the retry waits: last_error is read in between
    }
    dead = make_dead_letter(topic="orders.created")
    seen = []
    with override_settings(PGQUEUE=settings):
        alert = alerts.raise_alert(dead)
        seen.append(run_worker())
        retried = Message.objects.filter(pk=alert.pk).first()
        if retried is not None:
            assert retried.last_error, "the failed try recorded no error"
            seen.append(retried.last_error)
            Message.objects.filter(pk=alert.pk).update(run_at=timezone.now())
            seen.append(run_worker())

    if answer == 200:
        assert not DeadLetter.objects.filter(topic=conf.ALERT_TOPIC).exists()
    else:
        failed = DeadLetter.objects.get(topic=conf.ALERT_TOPIC)
        assert failed.reason, "the undeliverable alert's dead letter has no reason"
        seen.append(repr(DeadLetter.objects.filter(pk=failed.pk).values().get()))
    if answer != "down":
        request = webhook.requests[0]
        assert QUERY_TOKEN in request.path and request.headers["x-alert-key"] == HEADER_KEY, (
            "the secrets were not in play: the test is void"
        )
    assert not Message.objects.exists()

    admin = django_user_model.objects.create_superuser("ops", "ops@example.com", "pw")
    client = Client()
    client.force_login(admin)
    for page in (DEAD_LETTERS, MESSAGES, SUMMARY, *map(change_url, DeadLetter.objects.all())):
        response = client.get(page)
        assert response.status_code == 200
        seen.append(response.content.decode())

    captured = capfd.readouterr()
    logged = [debug_logs.text, captured.out, captured.err]
    logged += [r.getMessage() + str(r.__dict__) for r in debug_logs.records]
    assert any("pgqueue.alert" in text for text in logged), "no log of the delivery was captured"
    for where, text in [
        ("the logs and output", "\n".join(logged)),
        ("the rows and pages", "\n".join(seen)),
    ]:
        assert_no_secret(text, where)


@pytest.mark.parametrize(
    "url",
    [
        f"http://alerts:{PASSWORD}@hooks.example.com/hook",
        f"https://{PASSWORD}@hooks.example.com/hook",
        f"ftp://hooks.example.com/hook?token={PASSWORD}",
        f"hooks.example.com/{PASSWORD}",
    ],
)
def test_a_bad_webhook_url_is_a_check_error_that_never_echoes_it(url):
    with override_settings(PGQUEUE={"ALERT_WEBHOOK_URL": url}):
        [error] = run_checks()
    assert error.id == "pgqueue.E003"
    assert "(got a hidden value)" in error.msg
    assert_no_secret(error.msg + error.hint, "a system-check message")


def test_credentials_in_the_webhook_url_are_refused_by_the_checks():
    with override_settings(PGQUEUE={"ALERT_WEBHOOK_URL": f"http://a:{PASSWORD}@example.com/"}):
        [error] = run_checks()
    assert "must not carry a user name or password" in error.msg
    assert "ALERT_WEBHOOK_HEADERS" in error.msg
    with override_settings(
        PGQUEUE={
            "ALERT_WEBHOOK_URL": f"https://hooks.example.com/services/T0/B0/{QUERY_TOKEN}"
            f"?token={QUERY_TOKEN}",
            "ALERT_WEBHOOK_HEADERS": HEADERS,
        }
    ):
        assert run_checks() == [], "a token in the path or query string is a valid webhook URL"


def test_a_password_in_the_webhook_url_never_reaches_an_exception_message():
    settings = {"ALERT_WEBHOOK_URL": f"http://alerts:{PASSWORD}@127.0.0.1/hook"}
    with override_settings(PGQUEUE=settings):
        with pytest.raises(pgqueue_handlers.WebhookUnavailable) as caught:
            pgqueue_handlers.deliver({"topic": "t", "category": "unknown"})
    assert_no_secret("".join(traceback.format_exception(caught.value)), "the exception")


# This module doubles as a URLconf for the debug page test. (The page shows
# the source lines around each frame: keep secrets out of this one's.)
def crash(request):
    raise RuntimeError("the view failed")


urlpatterns = [path("crash/", crash)]


# Django's debug page (DEBUG = True, and the error e-mail to ADMINS) masks a
# setting by its name: API, AUTH, TOKEN, KEY, SECRET, PASS, SIGNATURE, in
# nested dicts too. Neither "ALERT_WEBHOOK_URL" (a Slack hook URL is its
# token) nor a header name like "X-Hook-Credential" is such a name.
CREDENTIAL = "cred-7e6d5c4b3a291807"
SLACK_HOOK = f"https://hooks.slack.com/services/T0/B0/{QUERY_TOKEN}"


def secret_settings():
    return {
        "ENDPOINT_TOKEN": TOKEN,
        "ALERT_WEBHOOK_URL": SLACK_HOOK,
        "ALERT_WEBHOOK_HEADERS": {**HEADERS, "X-Hook-Credential": CREDENTIAL},
    }


def assert_settings_shown_but_no_secret(page, where):
    assert "the view failed" in page, f"not Django's debug page: {page[:2000]}"
    for name in ("PGQUEUE", "ENDPOINT_TOKEN", "ALERT_WEBHOOK_URL", "X-Hook-Credential"):
        assert name in page, f"{name} is missing from {where}"
    assert "********************" in page
    for secret in (TOKEN, QUERY_TOKEN, HEADER_TOKEN, HEADER_KEY, CREDENTIAL, "hooks.slack.com"):
        assert secret not in page, f"{secret!r} is on {where}"


@pytest.mark.django_db
def test_djangos_debug_page_shows_the_secret_settings_names_but_not_their_values():
    settings = secret_settings()
    with override_settings(DEBUG=True, ROOT_URLCONF=__name__, PGQUEUE=settings):
        client = Client(raise_request_exception=False)
        html = client.get("/crash/", headers={"Accept": "text/html"})
        text = client.get("/crash/", headers={"Accept": "text/plain"})
        # Still the very values to every other use.
        assert conf.get("ALERT_WEBHOOK_URL") == SLACK_HOOK
        assert conf.get("ALERT_WEBHOOK_HEADERS") == secret_settings()["ALERT_WEBHOOK_HEADERS"]
        assert conf.get("ENDPOINT_TOKEN") == TOKEN
    assert (html.status_code, text.status_code) == (500, 500)
    assert html["Content-Type"].startswith("text/html")
    assert text["Content-Type"].startswith("text/plain")
    assert_settings_shown_but_no_secret(html.content.decode(), "the HTML debug page")
    assert_settings_shown_but_no_secret(text.content.decode(), "the text debug page")


def test_the_settings_files_secrets_are_hidden_from_the_debug_page_too():
    """PGQUEUE as the settings module defines it (not override_settings): the
    report Django renders in a fresh process, as for the debug page and the
    error e-mail."""
    code = (
        "import sys\n"
        "from django.views.debug import ExceptionReporter\n"
        "try:\n"
        "    raise RuntimeError('the view failed')\n"
        "except RuntimeError:\n"
        "    reporter = ExceptionReporter(None, *sys.exc_info())\n"
        "    print(reporter.get_traceback_text())\n"
        "    print('=' * 40)\n"
        "    print(reporter.get_traceback_html())\n"
    )
    env = {**os.environ, "PGQUEUE_JSON": json.dumps(secret_settings())}
    done = subprocess.run(
        [sys.executable, str(MANAGE), "shell", "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    text, html = done.stdout.split("=" * 40)
    assert_settings_shown_but_no_secret(text, "the text report")
    assert_settings_shown_but_no_secret(html, "the HTML report")
