"""The admin: list pages, detail pages (escaped), the actions and their
intermediate pages, permissions, and "select all" over many rows. Rows are
fabricated, the admin is driven through Django's test client, and the rows
are read back."""

import datetime

import pytest
from django.contrib.admin import helpers
from django.contrib.admin.models import CHANGE, LogEntry
from django.contrib.auth.models import Permission, User
from django.contrib.contenttypes.models import ContentType
from django.urls import reverse
from django.utils import timezone

from django_pgqueue.models import Category, DeadLetter, DeadLetterState, Message, Status

pytestmark = pytest.mark.django_db

NEW, REVIVED, RESOLVED = DeadLetterState.NEW, DeadLetterState.REVIVED, DeadLetterState.RESOLVED
XSS = "<script>alert(1)</script>"
ESCAPED = "&lt;script&gt;alert(1)&lt;/script&gt;"

MESSAGES = reverse("admin:django_pgqueue_message_changelist")
DEAD_LETTERS = reverse("admin:django_pgqueue_deadletter_changelist")


def change_url(obj):
    return reverse(f"admin:django_pgqueue_{obj._meta.model_name}_change", args=[obj.pk])


def reread(obj):
    return type(obj).objects.get(pk=obj.pk)


def listed(response):
    """The ids on a changelist page."""
    assert response.status_code == 200, response.content[:500]
    return {obj.pk for obj in response.context["cl"].result_list}


def action(client, url, name, objs=(), follow=False, **data):
    """POST an action to a changelist, as its action bar does."""
    post = {"action": name, "index": 0, helpers.ACTION_CHECKBOX_NAME: [o.pk for o in objs]}
    return client.post(url, {**post, **data}, follow=follow)


def apply(client, url, name, objs=(), follow=False, **data):
    """POST an intermediate page's form back, as action_form.html does."""
    post = {"action": name, "apply": "yes", helpers.ACTION_CHECKBOX_NAME: [o.pk for o in objs]}
    return client.post(url, {**post, **data}, follow=follow)


def texts(response):
    return [str(m) for m in response.context["messages"]] if response.context else []


def logged(obj, contains=""):
    entries = LogEntry.objects.filter(
        content_type=ContentType.objects.get_for_model(obj), object_id=str(obj.pk)
    )
    return [e for e in entries if e.action_flag == CHANGE and contains in e.change_message]


@pytest.fixture
def staff_user():
    """A staff user with the given DeadLetter/Message permissions (codenames)."""

    def make(*codenames):
        user = User.objects.create_user("viewer", password="x", is_staff=True)
        user.user_permissions.set(
            Permission.objects.filter(
                content_type__app_label="django_pgqueue", codename__in=codenames
            )
        )
        return user

    return make


# --- messages ---------------------------------------------------------------------------


def test_message_list_filters_and_searches_the_payload_text(admin_client, make_message):
    waiting = make_message(topic="orders.created", payload={"customer": "ACME-7781"})
    failed = make_message(topic="orders.paid", last_error="boom\nTraceback", attempts=2)
    leased = make_message(topic="orders.paid", status=Status.PROCESSING, dedup_key="k-1")

    assert listed(admin_client.get(MESSAGES)) == {waiting.pk, failed.pk, leased.pk}
    assert listed(admin_client.get(MESSAGES, {"status__exact": "processing"})) == {leased.pk}
    assert listed(admin_client.get(MESSAGES, {"topic": "orders.paid"})) == {failed.pk, leased.pk}
    assert listed(admin_client.get(MESSAGES, {"failed": "yes"})) == {failed.pk}
    assert listed(admin_client.get(MESSAGES, {"failed": "no"})) == {waiting.pk, leased.pk}
    assert listed(admin_client.get(MESSAGES, {"q": "acme-7781"})) == {waiting.pk}, (
        "a value inside the jsonb payload was not found by the search"
    )
    assert listed(admin_client.get(MESSAGES, {"q": "k-1"})) == {leased.pk}
    assert listed(admin_client.get(MESSAGES, {"q": str(failed.pk)})) >= {failed.pk}
    page = admin_client.get(MESSAGES).content.decode()
    assert "boom" in page and "Traceback" not in page, "the list shows the first line only"


def test_message_detail_shows_payload_and_headers_escaped(admin_client, make_message):
    message = make_message(
        payload={"html": XSS, "n": 1}, headers={"trace": XSS}, last_error=f"bad {XSS}"
    )
    response = admin_client.get(change_url(message))
    page = response.content.decode()
    assert response.status_code == 200
    assert XSS not in page, "payload, headers or error rendered unescaped"
    assert page.count(ESCAPED) >= 3
    assert '<pre class="pgqueue-json">{\n  &quot;html&quot;' in page, "payload not indented JSON"


def test_messages_are_never_added_or_deleted_from_the_admin(admin_client, make_message):
    assert admin_client.get(reverse("admin:django_pgqueue_message_add")).status_code == 403
    message = make_message()
    url = reverse("admin:django_pgqueue_message_delete", args=[message.pk])
    assert admin_client.post(url, {"post": "yes"}).status_code == 403
    assert Message.objects.filter(pk=message.pk).exists()


def test_a_leased_message_is_read_only(admin_client, make_message):
    leased = make_message(status=Status.PROCESSING)
    response = admin_client.get(change_url(leased))
    assert response.status_code == 200
    assert not response.context["has_change_permission"], "a leased message looks editable"
    assert 'name="_save"' not in response.content.decode()
    assert admin_client.post(change_url(leased), {}).status_code == 403
    assert reread(leased).status == Status.PROCESSING


def test_run_now_clears_the_delay_of_waiting_messages_only(admin_client, make_message):
    later = timezone.now() + datetime.timedelta(hours=2)
    delayed = make_message(run_at=later)
    leased = make_message(status=Status.PROCESSING, run_at=later)

    response = action(admin_client, MESSAGES, "run_now", [delayed, leased], follow=True)
    assert reread(delayed).run_at <= timezone.now(), "the delayed message is still delayed"
    assert reread(leased).run_at == later, "a leased message was touched"
    assert any("1 delayed waiting message" in t for t in texts(response)), texts(response)
    assert logged(delayed, "Run now") and not logged(leased)


def test_move_to_dead_letters_asks_the_category_then_moves_the_waiting_ones(
    admin_client, make_message
):
    waiting = make_message(payload={"n": 3})
    leased = make_message(status=Status.PROCESSING)

    page = action(admin_client, MESSAGES, "move_to_dead_letters", [waiting, leased])
    assert page.status_code == 200
    assert "admin/django_pgqueue/action_form.html" in [t.name for t in page.templates]
    assert "1 being processed (leased) will be skipped" in page.content.decode()
    assert Message.objects.count() == 2, "the intermediate page changed something"

    response = apply(
        admin_client,
        MESSAGES,
        "move_to_dead_letters",
        [waiting, leased],
        category="business",
        follow=True,
    )
    assert not Message.objects.filter(pk=waiting.pk).exists()
    dead = DeadLetter.objects.get(message_id=waiting.pk)
    assert (dead.category, dead.reason, dead.payload) == ("business", "moved by admin", {"n": 3})
    assert reread(leased).status == Status.PROCESSING, "a leased message was dead-lettered"
    assert any("Moved 1" in t and "Skipped 1" in t for t in texts(response)), texts(response)
    assert logged(waiting, "Moved to dead letters")


# --- dead letters -----------------------------------------------------------------------


def test_dead_letter_list_filters_and_searches(admin_client, make_dead_letter):
    old = make_dead_letter(
        topic="orders.created",
        category=Category.PERMANENT,
        payload={"sku": "ZX-99"},
        dead_lettered_at=timezone.now() - datetime.timedelta(days=30),
    )
    recent = make_dead_letter(topic="orders.paid", reason="KeyError: 'amount'")
    resolved = make_dead_letter(topic="orders.paid", state=RESOLVED)

    assert listed(admin_client.get(DEAD_LETTERS)) == {old.pk, recent.pk, resolved.pk}
    assert listed(admin_client.get(DEAD_LETTERS, {"category__exact": "permanent"})) == {old.pk}
    assert listed(admin_client.get(DEAD_LETTERS, {"state__exact": "resolved"})) == {resolved.pk}
    assert listed(admin_client.get(DEAD_LETTERS, {"topic": "orders.paid"})) == {
        recent.pk,
        resolved.pk,
    }
    since = (timezone.now() - datetime.timedelta(days=7)).isoformat()
    assert listed(admin_client.get(DEAD_LETTERS, {"dead_lettered_at__gte": since})) == {
        recent.pk,
        resolved.pk,
    }
    assert listed(admin_client.get(DEAD_LETTERS, {"q": "zx-99"})) == {old.pk}, "payload text"
    assert listed(admin_client.get(DEAD_LETTERS, {"q": "amount"})) == {recent.pk}, "reason"
    assert listed(admin_client.get(DEAD_LETTERS, {"q": str(old.message_id)})) == {old.pk}


def test_dead_letter_detail_shows_reason_traceback_and_payload_escaped(
    admin_client, make_dead_letter
):
    dead = make_dead_letter(
        payload={"html": XSS},
        headers={"h": XSS},
        reason=f"ValueError: {XSS}",
        traceback=f'Traceback (most recent call last):\n  File "x.py"\nValueError: {XSS}',
    )
    response = admin_client.get(change_url(dead))
    page = response.content.decode()
    assert response.status_code == 200
    assert XSS not in page, "something rendered unescaped"
    assert page.count(ESCAPED) >= 4
    assert "<pre>Traceback (most recent call last):\n  File &quot;x.py&quot;" in page
    assert '<textarea name="payload"' in page, "a new dead letter's payload is not editable"


def test_only_a_new_dead_letters_payload_is_editable(admin_client, make_dead_letter):
    revived = make_dead_letter(state=REVIVED)
    page = admin_client.get(change_url(revived)).content.decode()
    assert '<textarea name="payload"' not in page
    assert '<pre class="pgqueue-json">' in page


def test_payload_edit_with_invalid_json_is_a_form_error_and_saves_nothing(
    admin_client, make_dead_letter
):
    dead = make_dead_letter(payload={"amount": "12,50"}, notes="keep")
    response = admin_client.post(change_url(dead), {"payload": '{"amount": 12.5'})
    assert response.status_code == 200
    assert response.context["adminform"].form.errors["payload"] == ["Enter a valid JSON."]
    assert reread(dead).payload == {"amount": "12,50"}

    response = admin_client.post(change_url(dead), {"payload": '{"amount": 12.5}'})
    assert response.status_code == 302, response.content[:500]
    row = reread(dead)
    assert row.payload == {"amount": 12.5}
    assert (row.state, row.notes, row.reason) == (NEW, "keep", dead.reason), "other fields changed"
    assert LogEntry.objects.filter(object_id=str(dead.pk)).exists()


def test_revive_puts_a_waiting_message_and_records_who_and_a_log_entry(
    admin_client, make_dead_letter
):
    dead = make_dead_letter(payload={"order": 7}, queue="mail")
    other = make_dead_letter()

    response = action(admin_client, DEAD_LETTERS, "revive", [dead], follow=True)
    message = Message.objects.get()
    assert (message.status, message.queue, message.payload) == ("waiting", "mail", {"order": 7})
    row = reread(dead)
    assert (row.state, row.revived_by, row.revived_message_id) == (REVIVED, "admin", message.pk)
    assert reread(other).state == NEW
    assert texts(response) == ["Revived 1, skipped 0."]
    assert logged(dead, "Revived") and not logged(other)

    again = action(admin_client, DEAD_LETTERS, "revive", [dead], follow=True)
    assert texts(again) == ["Revived 0, skipped 1 (already revived: 1)."]
    assert Message.objects.count() == 1


def test_revive_again_is_an_explicit_confirmed_action(admin_client, make_dead_letter):
    dead = make_dead_letter()
    action(admin_client, DEAD_LETTERS, "revive", [dead])
    resolved = make_dead_letter(state=RESOLVED)

    page = action(admin_client, DEAD_LETTERS, "revive_again", [dead, resolved])
    assert "2 dead letter(s) will be put back into the queue, 2 of them again" in (
        page.content.decode()
    )
    assert Message.objects.count() == 1, "revived again before the confirmation"

    response = apply(
        admin_client, DEAD_LETTERS, "revive_again", [dead, resolved], note="retry", follow=True
    )
    assert texts(response) == ["Revived 2, skipped 0."]
    assert Message.objects.count() == 3
    assert reread(dead).revive_count == 2 and reread(resolved).state == REVIVED
    assert logged(resolved, "Revived")


def test_set_category_shows_a_form_then_sets_it(admin_client, make_dead_letter):
    a, b = make_dead_letter(), make_dead_letter(category=Category.BUSINESS)

    page = action(admin_client, DEAD_LETTERS, "set_category", [a, b])
    assert page.status_code == 200 and 'name="category"' in page.content.decode()
    assert reread(a).category == Category.TRANSIENT

    response = apply(
        admin_client,
        DEAD_LETTERS,
        "set_category",
        [a, b],
        category="business",
        note="price rule",
        follow=True,
    )
    row = reread(a)
    assert (row.category, row.category_set_by) == (Category.BUSINESS, "admin")
    assert row.category_set_at is not None
    assert "by admin: price rule" in row.notes
    assert texts(response) == ["Categorized 1, skipped 1 (category unchanged: 1)."]
    assert logged(a, "Category set to business") and not logged(b)


def test_resolve_confirms_the_count_and_needs_a_note(admin_client, make_dead_letter):
    a, b = make_dead_letter(), make_dead_letter()
    done = make_dead_letter(state=REVIVED)

    page = action(admin_client, DEAD_LETTERS, "resolve", [a, b, done])
    assert "2 of the 3 selected dead letter(s) will be resolved" in page.content.decode()

    no_note = apply(admin_client, DEAD_LETTERS, "resolve", [a, b, done], note="  ")
    assert no_note.status_code == 200 and no_note.context["form"].errors["note"]
    assert reread(a).state == NEW, "resolved without a note"

    response = apply(
        admin_client, DEAD_LETTERS, "resolve", [a, b, done], note="test orders", follow=True
    )
    for dead in (a, b):
        row = reread(dead)
        assert (row.state, row.resolved_by) == (RESOLVED, "admin")
        assert row.notes.endswith("resolved by admin: test orders")
        assert logged(dead, "Resolved")
    assert reread(done).state == REVIVED
    assert texts(response) == ["Resolved 2, skipped 1 (revived: 1)."]


def test_revive_to_another_queue(admin_client, make_dead_letter):
    dead = make_dead_letter(queue="default")

    page = action(admin_client, DEAD_LETTERS, "revive_to", [dead])
    assert 'name="queue"' in page.content.decode()
    empty = apply(admin_client, DEAD_LETTERS, "revive_to", [dead], queue="", topic="")
    assert empty.status_code == 200 and empty.context["form"].non_field_errors()
    assert not Message.objects.exists()

    apply(admin_client, DEAD_LETTERS, "revive_to", [dead], queue="urgent", topic="")
    message = Message.objects.get()
    assert (message.queue, message.topic) == ("urgent", "test.record")
    assert "queue default -> urgent" in reread(dead).notes
    assert logged(dead, "Revived to queue urgent")


def test_select_across_revives_every_matching_dead_letter(admin_client, make_dead_letter):
    rows = DeadLetter.objects.bulk_create(
        DeadLetter(
            message_id=i,
            queue="default",
            topic="test.record",
            payload={"i": i},
            category=Category.TRANSIENT,
            reason="boom",
        )
        for i in range(1, 1201)
    )
    elsewhere = make_dead_letter(topic="test.other")
    page_ids = rows[:100]

    response = action(
        admin_client,
        f"{DEAD_LETTERS}?topic=test.record",
        "revive",
        page_ids,
        select_across="1",
        follow=True,
    )
    assert texts(response) == ["Revived 1200, skipped 0."]
    assert DeadLetter.objects.filter(topic="test.record", state=REVIVED).count() == 1200
    assert Message.objects.count() == 1200
    assert reread(elsewhere).state == NEW, "a dead letter outside the filter was revived"
    entries = LogEntry.objects.filter(content_type=ContentType.objects.get_for_model(DeadLetter))
    assert entries.count() == 1200


def test_select_across_through_an_intermediate_page(admin_client, make_dead_letter):
    rows = [make_dead_letter() for _ in range(3)]
    page = action(admin_client, DEAD_LETTERS, "resolve", rows[:1], select_across="1")
    assert "3 of the 3 selected" in page.content.decode()
    assert 'name="select_across" value="1"' in page.content.decode()
    apply(admin_client, DEAD_LETTERS, "resolve", rows[:1], select_across="1", note="all of them")
    assert DeadLetter.objects.filter(state=RESOLVED).count() == 3


# --- permissions ------------------------------------------------------------------------


def test_a_view_only_user_is_offered_no_action_and_a_forged_one_is_refused(
    client, staff_user, make_dead_letter
):
    client.force_login(staff_user("view_deadletter", "view_message"))
    dead = make_dead_letter()
    response = client.get(DEAD_LETTERS)
    assert response.status_code == 200
    assert response.context["action_form"] is None, "actions offered without permission"
    assert 'name="payload"' not in client.get(change_url(dead)).content.decode()

    for name in ["revive", "revive_again", "resolve", "set_category", "revive_to"]:
        forged = action(client, DEAD_LETTERS, name, [dead], note="x", apply="yes")
        assert forged.status_code in (200, 302, 403)
    row = reread(dead)
    assert (row.state, row.category) == (NEW, Category.TRANSIENT), "a forged action changed it"
    assert not Message.objects.exists()
    assert client.post(change_url(dead), {"payload": "{}"}).status_code == 403


def test_each_action_needs_its_own_permission(client, staff_user, make_dead_letter):
    client.force_login(staff_user("view_deadletter", "revive_deadletter"))
    dead = make_dead_letter()
    choices = [
        name
        for name, _ in client.get(DEAD_LETTERS).context["action_form"].fields["action"].choices
        if name
    ]
    assert sorted(choices) == ["revive", "revive_again", "revive_to"]

    action(client, DEAD_LETTERS, "resolve", [dead], note="x", apply="yes")
    assert reread(dead).state == NEW, "resolved without resolve_deadletter"
    action(client, DEAD_LETTERS, "revive", [dead])
    assert reread(dead).state == REVIVED


def test_workers_are_listed_read_only_with_alive_or_dead(admin_client):
    from django_pgqueue.models import WorkerHeartbeat

    now = timezone.now()
    for worker_id, expires in (("alive-one", 60), ("dead-one", -60)):
        WorkerHeartbeat.objects.create(
            worker_id=worker_id,
            hostname="host",
            pid=1,
            queues=["default", "mail"],
            concurrency=4,
            expires_at=now + datetime.timedelta(seconds=expires),
        )
    workers = reverse("admin:django_pgqueue_workerheartbeat_changelist")
    response = admin_client.get(workers)
    assert {w.pk for w in response.context["cl"].result_list} == {"alive-one", "dead-one"}
    assert "default, mail" in response.content.decode()
    assert {w.pk for w in admin_client.get(workers + "?alive=yes").context["cl"].result_list} == {
        "alive-one"
    }
    assert {w.pk for w in admin_client.get(workers + "?alive=no").context["cl"].result_list} == {
        "dead-one"
    }
    detail = reverse("admin:django_pgqueue_workerheartbeat_change", args=["alive-one"])
    page = admin_client.get(detail).content.decode()
    assert 'name="_save"' not in page, "read only"
    assert admin_client.post(detail, {"concurrency": 9}).status_code == 403
    assert WorkerHeartbeat.objects.get(pk="alive-one").concurrency == 4
    assert (
        admin_client.get(workers.replace("workerheartbeat/", "workerheartbeat/add/")).status_code
        == 403
    )
