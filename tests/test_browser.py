"""The dead-letter admin in a real browser: Chromium driven by Playwright
against pytest-django's ``live_server``. Log in, filter by category, "Set
category…" through its intermediate page, "Revive", then the summary page.
Screenshots go to a temporary folder (the ``screenshots`` fixture):
``deadletters.png``, ``summary.png`` and ``subscriptions.png``.

Chromium is the system's (``chromium`` on PATH, e.g. Debian's package);
Playwright never downloads a browser here. A missing Chromium fails the test
instead of skipping it: CI installs it, and a skipped UI test proves nothing.

The database is touched only before the browser starts and after it closed:
Playwright's sync API runs an asyncio event loop in this thread, and Django
refuses ORM calls from a thread with a running loop (SynchronousOnlyOperation).
The live server answers the browser from its own thread, so it is unaffected.
"""

import datetime
import re
import shutil

import pytest
from django.utils import timezone

from django_pgqueue.models import Category, DeadLetter, DeadLetterState, Message

pytestmark = pytest.mark.browser

CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
TIMEOUT_MS = 60_000  # a bound for a broken page, far above a loaded machine's slowest step


def chromium_path():
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if not path:
        pytest.fail(
            "Chromium is not on PATH: install it (Debian/Ubuntu: apt-get install chromium) "
            "to run the browser tests; Playwright's own browser download is not used."
        )
    return path


def sync_playwright():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("the browser tests need Playwright: pip install -e '.[dev]'")
    return sync_playwright()


def dead_letter(message_id, topic, category, **fields):
    return DeadLetter.objects.create(
        message_id=message_id,
        queue="default",
        topic=topic,
        payload={"message_id": message_id},
        category=category,
        reason=f"{category} failure of message {message_id}\nTraceback (most recent call last)",
        attempts=5,
        **fields,
    )


def test_triage_a_dead_letter_in_the_browser(
    live_server, django_user_model, make_message, screenshots
):
    django_user_model.objects.create_superuser("admin", "admin@example.com", "s3cret-pass")
    for n in range(3):
        dead_letter(100 + n, "orders.created", Category.TRANSIENT)
    target = dead_letter(200, "mail.send", Category.PERMANENT)
    dead_letter(201, "mail.send", Category.PERMANENT)
    dead_letter(300, "imports.row", Category.BUSINESS, state=DeadLetterState.RESOLVED)
    ago = timezone.now() - datetime.timedelta(minutes=4)
    for _ in range(2):
        make_message(topic="orders.created", run_at=ago)
    make_message(topic="mail.send", queue="mail", run_at=ago + datetime.timedelta(minutes=2))
    results = screenshots()
    base = live_server.url

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium_path(), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1440, "height": 900})
            page.set_default_timeout(TIMEOUT_MS)

            # Log in through the form; "next" lands on the dead letters.
            page.goto(f"{base}/admin/login/?next=/admin/django_pgqueue/deadletter/")
            page.fill("#id_username", "admin")
            page.fill("#id_password", "s3cret-pass")
            page.click("input[type=submit]")
            page.wait_for_url("**/admin/django_pgqueue/deadletter/")
            assert page.locator("#result_list tbody tr").count() == 6

            # Filter by category with the sidebar's link.
            filters = page.locator("#changelist-filter")
            filters.get_by_role("link", name="Permanent", exact=True).click()
            page.wait_for_url("**category__exact=permanent**")
            assert page.locator("#result_list tbody tr").count() == 2, "the filter did not apply"

            # "Set category…": select the row, run the action, fill its page.
            page.check(f"input.action-select[value='{target.pk}']")
            page.select_option("select[name=action]", "set_category")
            page.click("button[name=index]")
            page.wait_for_selector("form select[name=category]")
            assert "1 dead letter(s) selected." in page.content()
            page.select_option("select[name=category]", "business")
            page.fill("input[name=note]", "a price rule, not a bug")
            page.click("input[type=submit][value='Set category']")
            page.wait_for_selector("ul.messagelist")
            assert "Categorized 1, skipped 0." in page.locator("ul.messagelist").inner_text()
            assert page.locator("#result_list tbody tr").count() == 1, "still listed as permanent"

            # Now it is a business dead letter: find it there and revive it.
            page.locator("#changelist-filter").get_by_role(
                "link", name="Business", exact=True
            ).click()
            page.wait_for_url("**category__exact=business**")
            page.check(f"input.action-select[value='{target.pk}']")
            page.select_option("select[name=action]", "revive")
            page.click("button[name=index]")
            page.wait_for_selector("ul.messagelist")
            assert "Revived 1, skipped 0." in page.locator("ul.messagelist").inner_text()

            page.goto(f"{base}/admin/django_pgqueue/deadletter/")
            page.screenshot(path=str(results / "deadletters.png"), full_page=True)

            # The summary, through the changelist's link.
            page.click("a.pgqueue-summary-link")
            page.wait_for_url("**/admin/django_pgqueue/deadletter/summary/")
            dead_table = page.locator("#pgqueue-dead-letters").inner_text()
            assert "orders.created\ttransient\t3" in dead_table, dead_table
            assert "mail.send\tbusiness\t1" in dead_table, dead_table
            assert "mail.send\tpermanent\t1" in dead_table, dead_table
            depth = page.locator("#pgqueue-depth").inner_text()
            # 2 fabricated + 1 revived; the oldest ready for 4 minutes, or
            # longer on a machine slow enough that the test took minutes.
            oldest = re.search(r"^default\t3\t0\t0\t0\t0\t(?:(\d+)h )?(\d+)m", depth, re.M)
            assert oldest and (oldest[1] or int(oldest[2]) >= 4), depth
            assert page.locator(".pgqueue-bars .bar").count() == len(Category.values)
            page.screenshot(path=str(results / "summary.png"), full_page=True)
        finally:
            browser.close()

    # The browser is closed: the ORM may run in this thread again.
    target.refresh_from_db()
    assert (target.category, target.category_set_by) == (Category.BUSINESS, "admin")
    assert "a price rule, not a bug" in target.notes
    assert target.state == DeadLetterState.REVIVED and target.revived_by == "admin"
    message = Message.objects.get(pk=target.revived_message_id)
    assert (message.status, message.topic, message.payload) == (
        "waiting",
        "mail.send",
        {"message_id": 200},
    ), "the revived dead letter is not back in the queue"
    assert DeadLetter.objects.filter(state=DeadLetterState.NEW).count() == 4
    for name in ("deadletters.png", "summary.png"):
        assert (results / name).stat().st_size > 10_000, f"{name} looks empty"


def test_reset_a_blocked_subscription_in_the_browser(live_server, django_user_model, screenshots):
    """Subscriptions in the browser: the list shows the blocked one with its
    lag; "Reset the checkpoint…" asks for a position on its confirmation
    page, refuses one that names no stored event with the reason, then
    resets; the list shows it active and caught up."""
    from django_pgqueue import publish
    from django_pgqueue.models import Subscription, SubscriptionState

    django_user_model.objects.create_superuser("admin", "admin@example.com", "s3cret-pass")
    events = [publish("test.events", {"n": n}, key=f"k{n}") for n in range(4)]
    blocked = Subscription.objects.create(
        name="search.orders",
        stream="test.events",
        checkpoint_xid=events[0].xid,
        checkpoint_position=events[0].position,
        state=SubscriptionState.BLOCKED,
        attempts=3,
        failing_position=events[1].position,
        last_error="KeyError: 'status'",
    )
    results = screenshots()
    base = live_server.url
    missing = events[-1].position + 1000

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium_path(), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1440, "height": 900})
            page.set_default_timeout(TIMEOUT_MS)
            page.goto(f"{base}/admin/login/?next=/admin/django_pgqueue/subscription/")
            page.fill("#id_username", "admin")
            page.fill("#id_password", "s3cret-pass")
            page.click("input[type=submit]")
            page.wait_for_url("**/admin/django_pgqueue/subscription/")
            row = page.locator("#result_list tbody tr", has_text="search.orders")
            assert "blocked" in row.inner_text().lower(), row.inner_text()
            assert "KeyError" in row.inner_text()
            page.screenshot(path=str(results / "subscriptions.png"), full_page=True)

            page.check(f"input.action-select[value='{blocked.pk}']")
            page.select_option("select[name=action]", "reset_checkpoint")
            page.click("button[name=index]")
            page.wait_for_selector("input[name=position]")
            # The blocked event's position is offered: resetting to it skips it.
            assert page.input_value("input[name=position]") == str(events[1].position)
            page.fill("input[name=position]", str(missing))
            page.click("input[type=submit][value='Reset the checkpoint']")
            page.wait_for_selector(".errorlist")
            assert "no event at position" in page.locator(".errorlist").inner_text()

            page.fill("input[name=position]", str(events[-1].position))
            page.click("input[type=submit][value='Reset the checkpoint']")
            page.wait_for_selector("ul.messagelist")
            row = page.locator("#result_list tbody tr", has_text="search.orders")
            assert "active" in row.inner_text().lower(), row.inner_text()
        finally:
            browser.close()
    blocked.refresh_from_db()
    assert (blocked.state, blocked.checkpoint_position) == (
        SubscriptionState.ACTIVE,
        events[-1].position,
    )
