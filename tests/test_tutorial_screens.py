"""The tutorial (docs/tutorial/index.rst), played through in a real browser:
its screenshots are taken here, so they show what the code does today.

The handler is the tutorial's own code block, read from the page and run;
the messages are the tutorial's (Ada's welcome, then Grace's with a comma in
the address); a real worker (``pgqueue_worker --burst``, as the tutorial's
last step runs it) handles them. The admin steps are the tutorial's, in its
order, each checked on the page before its screenshot is taken. The images
go to a temporary folder, or, in a run with --docs-images (the command is in
docs/howto/contributing.rst), to docs/images/tutorial/ (committed), at a
viewport of 1200x800 so that they stay small.

Chromium is the system's, as in tests/test_browser.py (whose helpers this
module uses); a missing Chromium fails the test. As there, the database is
touched only while no browser runs: Playwright's sync API runs an event loop
in this thread, and Django refuses ORM calls from such a thread.
"""

import contextlib
import importlib
import re
import sys
from pathlib import Path

import pytest
from django.core.management import call_command

from django_pgqueue import enqueue, registry
from django_pgqueue.models import Category, DeadLetter, DeadLetterState, Message

from .test_browser import CHROMIUM_ARGS, TIMEOUT_MS, chromium_path, sync_playwright

# Marked like tests/test_browser.py (which conftest.py marks slow as a
# process-level module): one env of the tox matrix runs the browser tests.
pytestmark = [pytest.mark.browser, pytest.mark.slow]

ROOT = Path(__file__).resolve().parent.parent
TUTORIAL = ROOT / "docs" / "tutorial" / "index.rst"
VIEWPORT = {"width": 1200, "height": 800}

TOPIC = "shop.welcome"
ADA = {"name": "Ada", "email": "ada@example.com"}
GRACE = {"name": "Grace", "email": "grace@example,com"}
GRACE_FIXED = {"name": "Grace", "email": "grace@example.com"}
NOTE = "typo in the address, the sign-up form does not check it"
PASSWORD = "s3cret-pass"


def python_blocks(text):
    """The bodies of the page's ``.. code-block:: python`` directives, dedented."""
    blocks = []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.strip() != ".. code-block:: python":
            continue
        body = []
        for following in lines[i + 1 :]:
            if following.strip() and not following.startswith("   "):
                break
            body.append(following)
        code = [b for b in body if not re.match(r"^\s+:\w+:", b)]
        blocks.append("\n".join(b[4:] for b in code).strip("\n") + "\n")
    return blocks


def tutorial_handler_source():
    """The tutorial's shop/handlers.py block, after checking that the page
    still tells the story this test plays."""
    text = TUTORIAL.read_text()
    words = " ".join(text.split())  # a value may wrap across lines of the page
    for value in [*ADA.values(), *GRACE.values(), GRACE_FIXED["email"], NOTE]:
        assert value in words, f"the tutorial no longer mentions {value!r}: update this test"
    [block] = [b for b in python_blocks(text) if b.startswith("# shop/handlers.py")]
    assert f'@handler("{TOPIC}")' in block
    return block


@pytest.fixture
def shop_welcome(tmp_path, monkeypatch):
    """The tutorial's handler, imported from a real shop/handlers.py (so that
    the traceback in the screenshots shows its lines), for this test only."""
    app = tmp_path / "mysite" / "shop"
    app.mkdir(parents=True)
    (app / "__init__.py").write_text("")
    (app / "handlers.py").write_text(tutorial_handler_source())
    monkeypatch.syspath_prepend(str(app.parent))
    for name in ("shop", "shop.handlers"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    registry.unregister(TOPIC)
    importlib.import_module("shop.handlers")
    yield
    registry.unregister(TOPIC)
    for name in ("shop.handlers", "shop"):
        sys.modules.pop(name, None)


@contextlib.contextmanager
def admin_page():
    """A Chromium page at the screenshots' size. The admin's navigation
    sidebar starts collapsed (the admin keeps that choice in localStorage, as
    its « button does): at 1200 pixels it would take a quarter of each image."""
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium_path(), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport=VIEWPORT)
            page.set_default_timeout(TIMEOUT_MS)
            page.add_init_script("localStorage.setItem('django.admin.navSidebarIsOpen', 'false')")
            yield page
        finally:
            browser.close()


def log_in(page, base, next_url):
    page.goto(f"{base}/admin/login/?next={next_url}")
    page.fill("#id_username", "admin")
    page.fill("#id_password", PASSWORD)
    page.click("input[type=submit]")
    page.wait_for_url(f"**{next_url}")


def shot(page, path, locator=None, height=None, down_to=None):
    """The viewport; or its top ``height`` pixels; or only ``locator``'s box;
    or the page from its top down to the bottom of ``down_to`` (a field that
    Django 6.1's taller form rows push below the viewport), at most 1,400
    pixels."""
    path = str(path)
    if down_to is not None:
        box = down_to.bounding_box()
        height = min(int(box["y"] + box["height"]) + 16, 1400)
    if locator is not None:
        locator.screenshot(path=path)
    elif height is not None:
        clip = {"x": 0, "y": 0, "width": VIEWPORT["width"], "height": height}
        page.screenshot(path=path, clip=clip, full_page=True)
    else:
        page.screenshot(path=path)


def row_of(page, dead):
    return page.locator("#result_list tbody tr", has=page.locator(f"input[value='{dead.pk}']"))


def run_action(page, dead, action):
    page.check(f"input.action-select[value='{dead.pk}']")
    page.select_option("select[name=action]", action)
    page.click("button[name=index]")


def test_tutorial_screens(live_server, django_user_model, mailoutbox, shop_welcome, screenshots):
    django_user_model.objects.create_superuser("admin", "admin@example.com", PASSWORD)
    images = screenshots(docs_folder="tutorial")
    base = live_server.url

    # "Enqueue a message", "Run the worker", "A first failure".
    enqueue(TOPIC, ADA)
    enqueue(TOPIC, GRACE)
    call_command("pgqueue_worker", "--burst", "--concurrency", "1", "--log-level", "ERROR")
    assert [(m.to, m.subject) for m in mailoutbox] == [(["ada@example.com"], "Welcome to the shop")]
    assert "Hello Ada, thank you for signing up." in mailoutbox[0].body
    dead = DeadLetter.objects.get()
    assert (dead.topic, dead.category, dead.state, dead.payload) == (
        TOPIC,
        Category.BUSINESS,
        DeadLetterState.NEW,
        GRACE,
    )
    assert dead.reason.startswith("ValidationError: ['Enter a valid email address.']"), dead.reason
    assert 'shop/handlers.py", line' in dead.traceback, dead.traceback
    assert "validate_email(address)" in dead.traceback, dead.traceback
    assert not Message.objects.exists()

    # "Triage in the admin", up to the revive.
    with admin_page() as page:
        log_in(page, base, "/admin/")
        section = page.locator(".app-django_pgqueue")
        assert section.locator("caption").text_content().strip() == "Message queue"
        for model in ("Dead letters", "Messages", "Workers"):
            assert section.get_by_role("link", name=model, exact=True).count() == 1, model
        shot(page, images / "admin-index.png", down_to=section)

        # The list: one new business dead letter.
        section.get_by_role("link", name="Dead letters", exact=True).click()
        page.wait_for_url("**/admin/django_pgqueue/deadletter/")
        assert page.locator("#result_list tbody tr").count() == 1
        row = row_of(page, dead).inner_text().lower()
        for word in (TOPIC, "business", "new", "enter a valid email address"):
            assert word in row, (word, row)
        shot(page, images / "deadletters.png")

        # One dead letter: reason, traceback, payload.
        row_of(page, dead).get_by_role("link", name=str(dead.pk), exact=True).click()
        page.wait_for_url(f"**/admin/django_pgqueue/deadletter/{dead.pk}/change/")
        assert "Enter a valid email address" in page.locator(".field-reason_full").inner_text()
        traceback = page.locator(".field-traceback_full").inner_text()
        assert "validate_email(address)" in traceback, traceback
        assert "grace@example,com" in page.input_value("textarea[name=payload]")
        shot(page, images / "deadletter.png", down_to=page.locator(".field-traceback_full"))

        # The category: Set category… with a note.
        page.goto(f"{base}/admin/django_pgqueue/deadletter/")
        run_action(page, dead, "set_category")
        page.wait_for_selector("form select[name=category]")
        assert "1 dead letter(s) selected." in page.content()
        page.select_option("select[name=category]", "permanent")
        page.fill("input[name=note]", NOTE)
        page.press("input[name=note]", "Home")  # the note's start, in the image
        shot(page, images / "set-category.png", height=400)
        page.click("input[type=submit][value='Set category']")
        page.wait_for_selector("ul.messagelist")
        assert "Categorized 1, skipped 0." in page.locator("ul.messagelist").inner_text()
        assert "permanent" in row_of(page, dead).inner_text().lower()

        # The payload: corrected and saved.
        page.goto(f"{base}/admin/django_pgqueue/deadletter/{dead.pk}/change/")
        payload = page.locator("textarea[name=payload]")
        payload.fill(payload.input_value().replace("grace@example,com", "grace@example.com"))
        shot(page, images / "fix-payload.png", page.locator(".field-payload"))
        page.click("input[name=_save]")
        page.wait_for_selector("ul.messagelist")
        assert "was changed successfully" in page.locator("ul.messagelist").inner_text()

        # Revive.
        run_action(page, dead, "revive")
        page.wait_for_selector("ul.messagelist")
        assert "Revived 1, skipped 0." in page.locator("ul.messagelist").inner_text()
        row = row_of(page, dead).inner_text().lower()
        assert "revived" in row and "permanent" in row, row
        shot(page, images / "revived.png")

    # The revived message is back in the queue with the corrected payload,
    # and the worker handles it.
    dead.refresh_from_db()
    assert (dead.state, dead.category, dead.payload) == (
        DeadLetterState.REVIVED,
        Category.PERMANENT,
        GRACE_FIXED,
    )
    assert (dead.revived_by, dead.category_set_by) == ("admin", "admin")
    assert NOTE in dead.notes
    revived = Message.objects.get()
    assert (revived.pk, revived.topic, revived.payload, revived.attempts) == (
        dead.revived_message_id,
        TOPIC,
        GRACE_FIXED,
        0,
    )
    call_command("pgqueue_worker", "--burst", "--concurrency", "1", "--log-level", "ERROR")
    assert [m.to for m in mailoutbox] == [["ada@example.com"], ["grace@example.com"]]
    assert "Hello Grace, thank you for signing up." in mailoutbox[1].body
    assert not Message.objects.exists(), "the revived message was not handled"

    # "The summary": what failed, by topic and category; the queue is empty.
    with admin_page() as page:
        log_in(page, base, "/admin/django_pgqueue/deadletter/")
        page.click("a.pgqueue-summary-link")
        page.wait_for_url("**/admin/django_pgqueue/deadletter/summary/")
        dead_table = page.locator("#pgqueue-dead-letters").inner_text()
        assert f"{TOPIC}\tpermanent\t1" in dead_table, dead_table
        content = page.locator("#content-main").inner_text()
        assert "Dead letters: 1" in content, content
        assert "The queue is empty." in content, content
        shot(page, images / "summary.png", height=580)

    for name in (
        "admin-index.png",
        "deadletters.png",
        "deadletter.png",
        "set-category.png",
        "fix-payload.png",
        "revived.png",
        "summary.png",
    ):
        assert (images / name).stat().st_size > 5_000, f"{name} looks empty"
