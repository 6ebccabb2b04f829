"""The queue overview and the history's admin: the SVG charts (a pure
function), the per-minute and per-hour series from the counts, the pages
through Django's test client, the estimated count, the links."""

import datetime
import re
import xml.etree.ElementTree as ET

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone

from django_pgqueue import enqueue
from django_pgqueue.admin import charts, history
from django_pgqueue.models import DeadLetter, FinishedMessage, OutcomeCount
from django_pgqueue.observability import outcomes
from django_pgqueue.worker import Worker

SVG = "{http://www.w3.org/2000/svg}"
NOW = datetime.datetime(2026, 3, 1, 12, 30, 20, tzinfo=datetime.UTC)


# --- the charts: data in, SVG out ------------------------------------------------------


def test_a_bar_chart_is_valid_svg_with_a_title_a_description_and_a_bar_per_count():
    slots = [NOW.replace(second=0) - datetime.timedelta(minutes=2 - i) for i in range(3)]
    series = {"done": [3, 0, 5], "retried": [1, 0, 0], "dead_lettered": [0, 0, 2]}
    svg = charts.bar_chart("c1", "Done <per> minute", slots, series)
    root = ET.fromstring(svg)
    assert root.get("role") == "img" and root.get("aria-labelledby") == "c1-title c1-desc"
    assert root.find(f"{SVG}title").text == "Done <per> minute"  # escaped in the markup
    assert "&lt;per&gt;" in svg
    desc = root.find(f"{SVG}desc").text
    assert "3 bars from 12:28 to 12:30" in desc and "done 8, retried 1, dead-lettered 2" in desc
    bars = [r for r in root.iter(f"{SVG}rect") if "bar" in (r.get("class") or "")]
    assert len(bars) == 4  # one per non-zero count
    titles = sorted(bar.find(f"{SVG}title").text for bar in bars)
    assert titles == [
        "12:28 done: 3",
        "12:28 retried: 1",
        "12:30 dead-lettered: 2",
        "12:30 done: 5",
    ]
    # The tallest stack (7) fills the plot to the axis top, 10.
    frame = charts.Frame()
    heights = {b.find(f"{SVG}title").text: float(b.get("height")) for b in bars}
    assert heights["12:30 done: 5"] == pytest.approx(frame.plot_height * 5 / 10, abs=0.1)


def test_an_empty_chart_still_draws_its_axes():
    slots = [NOW.replace(second=0)]
    svg = charts.bar_chart("empty", "Nothing", slots, {"done": [0]})
    root = ET.fromstring(svg)
    assert not [r for r in root.iter(f"{SVG}rect") if "bar" in (r.get("class") or "")]
    assert root.find(f"{SVG}line") is not None and "done 0" in root.find(f"{SVG}desc").text


@pytest.mark.parametrize(
    ("value", "top"), [(0, 1), (1, 1), (2, 2), (3, 5), (7, 10), (11, 20), (450, 500)]
)
def test_the_axis_top_is_round(value, top):
    assert charts.nice_ceiling(value) == top


# --- the series from the counts ---------------------------------------------------------


@pytest.mark.django_db
def test_per_minute_and_per_hour_sum_the_counts_by_slot_and_queue():
    rows = [
        (NOW - datetime.timedelta(minutes=0), "default", "done", 4),
        (NOW - datetime.timedelta(minutes=1), "default", "done", 2),
        (NOW - datetime.timedelta(minutes=1), "mail", "retried", 1),
        (NOW - datetime.timedelta(minutes=90), "default", "done", 10),  # last day only
        (NOW - datetime.timedelta(hours=30), "default", "done", 99),  # neither
    ]
    for minute, queue, outcome, count in rows:
        OutcomeCount.objects.create(
            minute=minute.replace(second=0), queue=queue, outcome=outcome, count=count
        )
    minutes = outcomes.per_minute(NOW)
    assert len(minutes.slots) == 60 and minutes.slots[-1] == NOW.replace(second=0)
    assert minutes.total["done"][-2:] == [2, 4]
    assert minutes.sums() == {"done": 6, "retried": 1, "dead_lettered": 0, "cancelled": 0}
    assert minutes.by_queue["mail"]["retried"][-2] == 1
    hours = outcomes.per_hour(NOW)
    assert len(hours.slots) == 24 and hours.slots[-1] == NOW.replace(minute=0, second=0)
    assert hours.sums()["done"] == 16
    assert hours.total["done"][-1] == 6 and hours.total["done"][-2] == 10


# --- the pages ---------------------------------------------------------------------------


@pytest.fixture
def admin_client_db(admin_client):
    return admin_client


@pytest.mark.django_db(transaction=True)
def test_the_overview_page_shows_charts_tables_and_depth(admin_client):
    enqueue("test.record", {"n": 1})
    enqueue("test.fail", {"raise": "ConnectionError"}, max_attempts=1)
    Worker(concurrency=1, burst=True).run()
    enqueue("test.record", {"n": 2})  # ready, not run
    response = admin_client.get(reverse("admin:django_pgqueue_finishedmessage_overview"))
    assert response.status_code == 200
    html = response.content.decode()
    # All queues and "default": per minute and per hour.
    assert html.count('class="pgqueue-chart"') == 4
    assert '<title id="total-minutes-title">All queues: per minute, last hour</title>' in html
    totals = re.search(r'<table id="pgqueue-overview-totals">.*?</table>', html, re.S).group(0)
    assert re.search(r"done</td>\s*<td class=\"num\">1</td>\s*<td class=\"num\">1</td>", totals)
    assert re.search(r"dead-lettered</td>\s*<td class=\"num\">1</td>", totals)
    depth = re.search(r'<table id="pgqueue-overview-depth">.*?</table>', html, re.S).group(0)
    assert re.search(r"default</a></td>\s*<td class=\"num\">1</td>", depth)
    assert "pgqueue-chart-numbers" in html and "<script>" in html


@pytest.mark.django_db
def test_the_overview_is_for_users_who_may_view_the_history(client, django_user_model):
    user = django_user_model.objects.create_user("staff", password="pw", is_staff=True)
    client.force_login(user)
    url = reverse("admin:django_pgqueue_finishedmessage_overview")
    assert client.get(url).status_code == 403


@pytest.mark.django_db
def test_the_app_index_and_the_dead_letters_link_the_overview(admin_client):
    url = reverse("admin:django_pgqueue_finishedmessage_overview")
    for page in (
        reverse("admin:app_list", args=["django_pgqueue"]),
        reverse("admin:django_pgqueue_deadletter_changelist"),
        reverse("admin:django_pgqueue_finishedmessage_changelist"),
    ):
        assert f'href="{url}"' in admin_client.get(page).content.decode(), page


def finished(message_id, **fields):
    now = timezone.now()
    values = dict(
        message_id=message_id, queue="default", topic="test.record", payload={"sku": "A-1"},
        outcome="done", attempts=1, enqueued_at=now, started_at=now, finished_at=now,
        worker="w1",
    )  # fmt: skip
    values.update(fields)
    return FinishedMessage.objects.create(**values)


@pytest.mark.django_db
def test_the_history_list_searches_by_id_dedup_key_and_payload(admin_client):
    finished(41, dedup_key="welcome-41")
    finished(42, payload={"email": "ada@example.com"})
    url = reverse("admin:django_pgqueue_finishedmessage_changelist")
    for term, expected in [("42", [42]), ("welcome-41", [41]), ("ada@example", [42])]:
        response = admin_client.get(url, {"q": term})
        shown = [row.message_id for row in response.context["cl"].result_list]
        assert shown == expected, term
    response = admin_client.get(url, {"outcome__exact": "dead_lettered"})
    assert list(response.context["cl"].result_list) == []
    assert admin_client.get(url, {"topic": "test.record"}).status_code == 200


@pytest.mark.django_db
def test_a_dead_letter_and_its_history_entry_link_each_other(admin_client):
    dead = DeadLetter.objects.create(
        message_id=77, queue="default", topic="test.fail", payload={}, category="transient",
        reason="ConnectionError", attempts=3,
    )  # fmt: skip
    row = finished(77, outcome="dead_lettered", dead_letter_id=dead.pk, attempts=3)
    page = admin_client.get(
        reverse("admin:django_pgqueue_finishedmessage_change", args=[row.pk])
    ).content.decode()
    assert reverse("admin:django_pgqueue_deadletter_change", args=[dead.pk]) in page
    page = admin_client.get(
        reverse("admin:django_pgqueue_deadletter_change", args=[dead.pk])
    ).content.decode()
    history_url = reverse("admin:django_pgqueue_finishedmessage_changelist") + "?q=77"
    assert history_url in page


@pytest.mark.django_db
def test_the_history_is_read_only(admin_client):
    row = finished(5)
    url = reverse("admin:django_pgqueue_finishedmessage_change", args=[row.pk])
    assert admin_client.post(url, {"topic": "x"}).status_code == 403
    add = reverse("admin:django_pgqueue_finishedmessage_add")
    assert admin_client.get(add).status_code == 403


@pytest.mark.django_db
def test_a_big_history_is_never_counted_in_full(admin_client):
    with connection.cursor() as cursor:
        cursor.execute(
            """
            INSERT INTO django_pgqueue_finishedmessage (message_id, queue, topic, payload,
                headers, outcome, attempts, enqueued_at, started_at, finished_at, worker)
            SELECT n, 'default', 'test.record', '{}', '{}', 'done', 1, now(), now(),
                now() - make_interval(secs => n), 'w'
            FROM generate_series(1, %s) AS n
            """,
            [history.ESTIMATE_ABOVE + 2000],
        )
        cursor.execute("ANALYZE django_pgqueue_finishedmessage")
    url = reverse("admin:django_pgqueue_finishedmessage_changelist")
    with CaptureQueriesContext(connection) as queries:
        response = admin_client.get(url)
    assert response.status_code == 200
    counts = [q["sql"] for q in queries if "COUNT(" in q["sql"].upper()]
    assert counts and all("LIMIT" in q for q in counts), counts
    distinct = [q["sql"] for q in queries if "DISTINCT" in q["sql"].upper()]
    assert not [q for q in distinct if "finishedmessage" in q], distinct
    count = response.context["cl"].result_count
    assert count > history.ESTIMATE_ABOVE
    # The day drill-down comes from the index's two ends.
    assert response.context["history_days"]


def test_the_numbers_table_has_a_row_per_slot_and_escapes():
    slots = [NOW.replace(second=0) - datetime.timedelta(minutes=1 - i) for i in range(2)]
    html = charts.numbers_table("<b>x</b>", slots, {"done": [1, 2], "cancelled": [0, 3]})
    table = ET.fromstring(html)
    assert table.get("aria-label") == "<b>x</b>" and "&lt;b&gt;" in html
    rows = [[cell.text for cell in row] for row in table.iter("tr")]
    assert rows == [
        ["Time (UTC)", "done", "cancelled"],
        ["12:29", "1", "0"],
        ["12:30", "2", "3"],
    ]


@pytest.mark.django_db
def test_the_day_drill_down_filters_the_history(admin_client):
    today = timezone.now()
    yesterday = today - datetime.timedelta(days=1)
    finished(1, finished_at=yesterday)
    finished(2, finished_at=today)
    url = reverse("admin:django_pgqueue_finishedmessage_changelist")
    response = admin_client.get(url)
    days = response.context["history_days"]
    assert [day for day, _, _ in days] == [yesterday.date(), today.date()]
    response = admin_client.get(f"{url}?{days[0][1]}")
    assert [row.message_id for row in response.context["cl"].result_list] == [1]
    assert response.context["history_days"][0][2] is True  # shown as the chosen day
    assert admin_client.get(f"{url}?finished_at__year=9999").status_code in (200, 302)
