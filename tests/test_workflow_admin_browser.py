"""The workflow admin in a real browser: Chromium (Debian's, on PATH) driven
by Playwright against pytest-django's ``live_server``, a worker running in
a thread of this process. Log in, find the blocked workflow in the list,
open its page and its graph, revive its dead-lettered step through the
button and the confirmation page, and watch the workflow go on to its end.
The screenshots are the documentation's (docs/images/workflows/, written
there only by a run with --docs-images: docs/howto/contributing.rst).

As in test_browser.py, this thread touches the database only before the
browser starts and after it closed (Playwright's sync API runs an event
loop here, where Django refuses ORM calls); the worker's thread and the
live server's have their own connections.
"""

import time

import pytest

from django_pgqueue import Workflow
from django_pgqueue.models import DeadLetter
from django_pgqueue.worker import Worker

from .conftest import running_worker
from .test_browser import CHROMIUM_ARGS, TIMEOUT_MS, chromium_path, sync_playwright

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def blocked_import():
    """fetch -> parse-0..3 -> report; parse-2 is dead-lettered (its payload
    cannot work), so the report waits: blocked."""
    wf = Workflow(name="import 42")
    fetch = wf.add("wf.value", {"value": 1}, name="fetch")
    parts = [
        wf.add(
            "wf.value",
            {"value": i, "fail_times": -1 if i == 2 else 0},
            name=f"parse-{i}",
            after=[fetch],
        )
        for i in range(4)
    ]
    wf.add("wf.sum", {}, name="report", after=parts)
    return wf.enqueue()


def done_report():
    wf = Workflow(name="nightly report")
    first = wf.add("wf.value", {"value": 5}, name="collect")
    wf.add("wf.sum", {}, name="sum", after=[first])
    return wf.enqueue()


def test_revive_a_blocked_workflow_in_the_browser(live_server, django_user_model, screenshots):
    django_user_model.objects.create_superuser("admin", "admin@example.com", "s3cret-pass")
    done_report()
    run = blocked_import()
    Worker(concurrency=1, burst=True).run()
    assert run.status() == "blocked"
    # The cause fixed in the dead letter's payload, as an operator would first.
    DeadLetter.objects.update(payload={"value": 2})
    folder = screenshots(docs_folder="workflows")
    base = live_server.url
    workflow_url = f"**/admin/django_pgqueue/workflow/{run.pk}/change/**"

    with running_worker(concurrency=2, poll_interval=0.2), sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium_path(), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.set_default_timeout(TIMEOUT_MS)
            page.goto(f"{base}/admin/login/?next=/admin/django_pgqueue/workflow/")
            page.fill("#id_username", "admin")
            page.fill("#id_password", "s3cret-pass")
            page.click("input[type=submit]")
            page.wait_for_url("**/admin/django_pgqueue/workflow/")
            assert page.locator("#result_list tbody tr").count() == 2
            page.screenshot(path=str(folder / "workflows.png"))

            # The list's filter, then the workflow's page.
            page.locator("#changelist-filter").get_by_role("link", name="Blocked").click()
            page.wait_for_url("**status__exact=blocked**")
            assert page.locator("#result_list tbody tr").count() == 1
            assert "4 / 6 (1 dead-lettered)" in page.locator("#result_list").inner_text()
            page.locator("#result_list tbody tr a").first.click()
            page.wait_for_url(workflow_url)

            graph = page.locator("svg.pgqueue-workflow-graph")
            assert graph.bounding_box()["height"] > 150, "the graph is not drawn"
            assert graph.locator(".step").count() == 6
            assert graph.locator("path.edge").count() == 8
            assert graph.locator("a.step-done").count() == 4  # each to its history entry
            dead = graph.locator("a.step-dead_lettered")
            assert dead.count() == 1 and "parse-2" in dead.text_content()
            assert "/admin/django_pgqueue/deadletter/" in dead.get_attribute("href")
            assert graph.locator("g.step-held").count() == 1
            page.screenshot(path=str(folder / "workflow.png"), full_page=True)

            # The button, its confirmation page, and back to the list.
            page.click("button.pgqueue-revive-steps")
            page.wait_for_selector("form input[name=note]")
            assert "The steps: parse-2" in page.locator(".pgqueue-action-summary").inner_text()
            page.fill("input[name=note]", "the parser is fixed")
            page.screenshot(path=str(folder / "revive.png"))
            page.click("input[type=submit][value=Revive]")
            page.wait_for_selector("ul.messagelist")
            assert "Revived 1, skipped 0." in page.locator("ul.messagelist").inner_text()
            assert page.locator("#result_list tbody tr").count() == 1

            # The worker runs the step again, then the report: the workflow is done.
            page.locator("#result_list tbody tr a").first.click()
            page.wait_for_url(workflow_url)
            deadline = time.monotonic() + TIMEOUT_MS / 1000
            while page.locator("svg.pgqueue-workflow-graph .step-done").count() < 6:
                assert time.monotonic() < deadline, "the workflow did not go on"
                page.wait_for_timeout(300)
                page.reload()
            assert "Done" in page.locator(".field-status_display").inner_text()
            assert not page.locator("button.pgqueue-revive-steps").count()
            page.screenshot(path=str(folder / "workflow-done.png"), full_page=True)
        finally:
            browser.close()
    assert run.status() == "done" and run.result("report")["sum"] == 0 + 1 + 2 + 3
    assert (folder / "workflow.png").stat().st_size > 20_000, "the screenshot looks empty"
