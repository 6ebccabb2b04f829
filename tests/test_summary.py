"""stats.py's aggregates on fabricated rows, and the admin summary page that
shows them (counts, permission, escaping)."""

import datetime

import pytest
from django.contrib.auth.models import Permission, User
from django.urls import reverse
from django.utils import timezone

from django_pgqueue.models import Category, DeadLetter, DeadLetterState, Status
from django_pgqueue.observability import stats

pytestmark = pytest.mark.django_db

SUMMARY = reverse("admin:django_pgqueue_deadletter_summary")
XSS = "<script>alert(1)</script>"
NOW = datetime.datetime(2026, 1, 1, 12, 0, tzinfo=datetime.UTC)


def dead(topic, category, state=DeadLetterState.NEW, **fields):
    fields.setdefault("message_id", DeadLetter.objects.count() + 1)
    return DeadLetter.objects.create(
        topic=topic,
        queue="default",
        payload={},
        category=category,
        reason="boom",
        state=state,
        **fields,
    )


def many(count, topic, category, **fields):
    return [dead(topic, category, **fields) for _ in range(count)]


def seconds_ago(seconds):
    return NOW - datetime.timedelta(seconds=seconds)


# --- stats ------------------------------------------------------------------------------


def test_dead_letters_by_topic_and_category_counts_each_pair():
    many(3, "orders.created", Category.TRANSIENT)
    many(1, "orders.created", Category.PERMANENT)
    many(2, "mail.send", Category.DEPENDENCY)
    many(2, "mail.send", Category.DEPENDENCY, state=DeadLetterState.RESOLVED)
    many(1, "mail.send", Category.BUSINESS, state=DeadLetterState.REVIVED)

    assert stats.dead_letters_by_topic_and_category() == [
        ("mail.send", "business", 1),
        ("mail.send", "dependency", 4),
        ("orders.created", "permanent", 1),
        ("orders.created", "transient", 3),
    ]
    assert stats.dead_letters_by_topic_and_category(state=DeadLetterState.NEW) == [
        ("mail.send", "dependency", 2),
        ("orders.created", "permanent", 1),
        ("orders.created", "transient", 3),
    ], "resolved and revived dead letters were counted as new"
    assert stats.dead_letters_by_topic_and_category(state=DeadLetterState.RESOLVED) == [
        ("mail.send", "dependency", 2),
    ]


def test_the_aggregates_of_empty_tables_are_empty():
    assert stats.dead_letters_by_topic_and_category() == []
    assert stats.queue_depth_by_status() == []
    assert stats.oldest_ready_age(now=NOW) == {}


def test_queue_depth_by_status_counts_each_queue_and_status(make_message):
    for _ in range(3):
        make_message(queue="default")
    make_message(queue="default", run_at=NOW + datetime.timedelta(days=1))  # delayed: waiting
    make_message(queue="default", status=Status.PROCESSING)
    make_message(queue="mail", status=Status.PROCESSING)

    assert stats.queue_depth_by_status() == [
        ("default", "processing", 1),
        ("default", "waiting", 4),
        ("mail", "processing", 1),
    ]


def test_oldest_ready_age_is_the_longest_wait_of_a_ready_message_per_queue(make_message):
    make_message(queue="default", run_at=seconds_ago(90))
    make_message(queue="default", run_at=seconds_ago(30))
    make_message(queue="default", run_at=NOW)  # ready exactly now: counts, age 0
    make_message(queue="mail", run_at=seconds_ago(5))
    # Not ready, whatever their age: delayed by a second, leased, in a queue of its own.
    make_message(queue="mail", run_at=NOW + datetime.timedelta(seconds=1))
    make_message(queue="mail", status=Status.PROCESSING, run_at=seconds_ago(3600))
    make_message(queue="later", run_at=NOW + datetime.timedelta(seconds=1))

    assert stats.oldest_ready_age(now=NOW) == {"default": 90.0, "mail": 5.0}, (
        "the age must come from the oldest waiting message with run_at <= now only"
    )
    assert stats.oldest_ready_age(now=seconds_ago(60)) == {"default": 30.0}


def test_oldest_ready_age_defaults_to_the_current_time(make_message):
    make_message(queue="default", run_at=timezone.now() - datetime.timedelta(seconds=60))
    age = stats.oldest_ready_age()["default"]
    assert 60 <= age < 120, age


def test_each_aggregate_is_one_query(django_assert_num_queries, make_message):
    make_message()
    dead("t", Category.TRANSIENT)
    for aggregate in [
        stats.dead_letters_by_topic_and_category,
        stats.queue_depth_by_status,
        stats.oldest_ready_age,
    ]:
        with django_assert_num_queries(1):
            aggregate()


# --- the admin page ---------------------------------------------------------------------


def test_the_summary_page_shows_the_counts(admin_client, make_message):
    many(3, "orders.created", Category.TRANSIENT)
    many(2, "mail.send", Category.DEPENDENCY)
    many(4, "mail.send", Category.DEPENDENCY, state=DeadLetterState.RESOLVED)
    make_message(queue="default", run_at=timezone.now() - datetime.timedelta(minutes=5))
    make_message(queue="default", status=Status.PROCESSING)

    response = admin_client.get(SUMMARY)
    assert response.status_code == 200
    assert "admin/django_pgqueue/summary.html" in [t.name for t in response.templates]
    page = response.content.decode()
    assert response.context["dead_letters"] == [
        ("mail.send", "dependency", 6),
        ("orders.created", "transient", 3),
    ]
    assert "<td>orders.created</td>" in page and "<td>mail.send</td>" in page
    assert "Dead letters: 9" in page
    assert 'class="pgqueue-bar-dependency"' in page and "width: 100.0%" in page, (
        "the largest category's bar should be full width"
    )
    assert "width: 50.0%" in page, "transient (3 of the largest 6) should be a half bar"
    [(queue, counts, age)] = response.context["depth"]
    assert (queue, counts) == ("default", [1, 0, 1, 0, 0]), (
        "by status: waiting, blocked, processing, done, cancelled"
    )
    assert age.startswith("5m "), f"oldest ready age {age!r}, expected about 5 minutes"

    new_only = admin_client.get(SUMMARY, {"state": "new"})
    assert new_only.context["dead_letters"] == [
        ("mail.send", "dependency", 2),
        ("orders.created", "transient", 3),
    ]
    assert admin_client.get(SUMMARY, {"state": "bogus"}).context["state"] is None


def test_the_summary_page_of_empty_tables(admin_client):
    page = admin_client.get(SUMMARY).content.decode()
    assert "No dead letters." in page and "The queue is empty." in page


def test_the_summary_is_linked_from_the_app_index_and_the_changelist(admin_client):
    app_index = admin_client.get(reverse("admin:app_list", args=["django_pgqueue"]))
    changelist = admin_client.get(reverse("admin:django_pgqueue_deadletter_changelist"))
    for response in (app_index, changelist):
        assert response.status_code == 200
        assert f'href="{SUMMARY}"' in response.content.decode(), response.request["PATH_INFO"]


def test_the_summary_needs_the_view_permission_on_dead_letters(client):
    staff = User.objects.create_user("staff", password="x", is_staff=True)
    staff.user_permissions.set(Permission.objects.filter(codename="view_message"))
    client.force_login(staff)
    assert client.get(SUMMARY).status_code == 403, "a staff user without view_deadletter got in"
    app_index = client.get(reverse("admin:app_list", args=["django_pgqueue"]))
    assert SUMMARY not in app_index.content.decode(), "the link is shown without the permission"

    staff.user_permissions.add(Permission.objects.get(codename="view_deadletter"))
    client.force_login(User.objects.get(pk=staff.pk))
    assert client.get(SUMMARY).status_code == 200

    client.logout()
    anonymous = client.get(SUMMARY)
    assert anonymous.status_code == 302 and "/login/" in anonymous["Location"]


def test_topic_names_are_escaped(admin_client, make_message):
    dead(XSS, Category.TRANSIENT)
    make_message(queue="q<b>", topic=XSS)
    page = admin_client.get(SUMMARY).content.decode()
    assert XSS not in page and "<b>" not in page, "a topic or queue name rendered unescaped"
    assert "<td>&lt;script&gt;alert(1)&lt;/script&gt;</td>" in page
    assert "<td>q&lt;b&gt;</td>" in page
    assert "topic=%3Cscript%3Ealert%281%29%3C/script%3E" in page, "the filter link is not encoded"
