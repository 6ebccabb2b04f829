"""The queue overview in a real browser: Chromium (Debian's, on PATH) driven
by Playwright against pytest-django's ``live_server``. The charts are
drawn, named for assistive technology, their numbers are in tables; the
page reads without JavaScript and refreshes in place with it. Its
screenshot is the documentation's (docs/images/overview.png, written there
only by a run with --docs-images: docs/howto/contributing.rst).

As in test_browser.py, the database is touched only before the browser
starts and after it closed (Playwright's sync API runs an event loop in
this thread, where Django refuses ORM calls).
"""

import datetime

import pytest
from django.utils import timezone

from django_pgqueue import enqueue, lifecycle
from django_pgqueue.models import OutcomeCount
from django_pgqueue.worker import Worker

from .test_browser import CHROMIUM_ARGS, TIMEOUT_MS, chromium_path, sync_playwright

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def fabricate_counts(now):
    """A day of plausible traffic on two queues, as the ack batches count it."""
    rows = []
    for minutes_ago in range(3, 24 * 60):  # the last two minutes: the real outcomes
        minute = (now - datetime.timedelta(minutes=minutes_ago)).replace(second=0, microsecond=0)
        wave = 20 + (minutes_ago * 37) % 40 + (15 if (minutes_ago // 60) % 5 == 0 else 0)
        rows.append(OutcomeCount(minute=minute, queue="default", outcome="done", count=wave))
        rows.append(OutcomeCount(minute=minute, queue="mail", outcome="done", count=wave // 3))
        if minutes_ago % 9 == 0:
            rows.append(OutcomeCount(minute=minute, queue="mail", outcome="retried", count=3))
        if minutes_ago % 11 == 0:
            rows.append(
                OutcomeCount(minute=minute, queue="default", outcome="dead_lettered", count=1)
            )
        if minutes_ago % 13 == 0:
            rows.append(OutcomeCount(minute=minute, queue="mail", outcome="cancelled", count=2))
    OutcomeCount.objects.bulk_create(rows)


def test_the_queue_overview_in_the_browser(live_server, django_user_model, screenshots):
    django_user_model.objects.create_superuser("admin", "admin@example.com", "s3cret-pass")
    now = timezone.now()
    fabricate_counts(now)
    # Real outcomes this minute, through a worker: 3 done, 1 dead-lettered, 1 cancelled.
    for n in range(3):
        enqueue("test.record", {"n": n})
    enqueue("test.fail", {"raise": "ValueError"})
    lifecycle.cancel(enqueue("test.record", {"n": "cancel me"}))
    Worker(concurrency=1, burst=True).run()
    for n in range(4):
        enqueue("test.record", {"n": n}, queue="mail")  # ready, waiting for a worker
    enqueue("test.record", {"later": True}, delay=3600)
    image = screenshots(docs_folder="") / "overview.png"
    base = live_server.url
    url = f"{base}/admin/django_pgqueue/finishedmessage/overview/"

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium_path(), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.set_default_timeout(TIMEOUT_MS)
            page.clock.install()  # the refresh's timer, fast-forwarded below
            page.goto(f"{base}/admin/login/?next=/admin/django_pgqueue/")
            page.fill("#id_username", "admin")
            page.fill("#id_password", "s3cret-pass")
            page.click("input[type=submit]")
            page.wait_for_url("**/admin/django_pgqueue/")
            # From the app's index, through its link.
            page.click("a.pgqueue-overview-link")
            page.wait_for_url(url)

            charts = page.locator("svg.pgqueue-chart")
            assert charts.count() == 6  # all queues, default, mail: per minute and per hour
            total = page.locator("svg#total-hours")
            assert total.get_attribute("role") == "img"
            assert total.locator("title#total-hours-title").text_content() == (
                "All queues: per hour, last day"
            )
            assert "Totals: done" in total.locator("desc").text_content()
            assert total.locator("rect.bar-done").count() >= 20  # nearly every hour
            assert total.bounding_box()["height"] > 100, "the chart is not drawn"
            minute_bars = page.locator("svg#total-minutes rect.bar-dead_lettered")
            assert minute_bars.count() >= 1
            page.screenshot(path=str(image), full_page=False)
            # The numbers, as a table behind each chart.
            details = page.locator("details", has_text="All queues: per minute").first
            details.locator("summary").click()
            numbers = details.locator("table.pgqueue-chart-numbers")
            assert numbers.is_visible() and numbers.locator("tbody tr").count() == 60
            # The worker's outcomes, in this minute or the one before (the page
            # may have been drawn after the minute turned): done, retried,
            # dead-lettered, cancelled.
            rows = numbers.locator("tbody tr")
            recent = [rows.nth(i).inner_text().split("\t")[1:] for i in (58, 59)]
            sums = [sum(int(row[k]) for row in recent) for k in range(4)]
            assert sums == [3, 0, 1, 1], recent
            depth = page.locator("#pgqueue-overview-depth").inner_text()
            assert "mail\t4\t0\t0\t0" in depth, depth
            assert "default\t0\t1\t0\t0" in depth, depth
            dead = page.locator("#pgqueue-overview-dead-letters").inner_text()
            assert "permanent\t1" in dead, dead

            # With JavaScript the content refreshes in place.
            assert page.evaluate("document.body.dataset.pgqueueRefreshed") is None
            page.clock.fast_forward(31_000)
            page.wait_for_function("document.body.dataset.pgqueueRefreshed !== undefined")
            assert page.locator("svg.pgqueue-chart").count() == 6

            # Without JavaScript it reads the same.
            bare = browser.new_context(java_script_enabled=False)
            bare.add_cookies(page.context.cookies())
            plain = bare.new_page()
            plain.goto(url)
            assert plain.locator("svg.pgqueue-chart").count() == 6
            assert "mail\t4" in plain.locator("#pgqueue-overview-depth").inner_text()
            bare.close()
        finally:
            browser.close()
    assert image.stat().st_size > 20_000, "the screenshot looks empty"
