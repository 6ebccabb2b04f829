"""The workflow admin against the real database, through Django's test
client: the list (filter, search by name and id), a workflow's page with the
graph of its steps (boxes, arrows, links, escaping, a big workflow capped),
the two actions (cancel, revive the dead-lettered steps) with their
confirmation pages, permissions and LogEntry rows. Workflows are enqueued
and run by a worker in this process (burst: until the queue is empty)."""

import time

import pytest
from django.contrib.admin import helpers
from django.contrib.admin.models import CHANGE, LogEntry
from django.contrib.auth.models import Permission, User
from django.contrib.contenttypes.models import ContentType
from django.urls import reverse

from django_pgqueue import Workflow
from django_pgqueue.admin.workflow_graph import (
    MAX_LAYERS,
    MAX_PER_LAYER,
    Node,
    draw,
    lay_out,
    layers_of,
)
from django_pgqueue.models import (
    DeadLetter,
    DeadLetterState,
    FinishedMessage,
    Message,
    StepState,
    WorkflowStatus,
    WorkflowStep,
)
from django_pgqueue.models import Workflow as StoredWorkflow
from django_pgqueue.worker import Worker

pytestmark = pytest.mark.django_db(transaction=True)

XSS = "<script>alert(1)</script>"
ESCAPED = "&lt;script&gt;alert(1)&lt;/script&gt;"
WORKFLOWS = reverse("admin:django_pgqueue_workflow_changelist")


def page_url(pk):
    return reverse("admin:django_pgqueue_workflow_change", args=[pk])


def change_url(name, pk):
    return reverse(f"admin:django_pgqueue_{name}_change", args=[pk])


def listed(response):
    assert response.status_code == 200, response.content[:500]
    return {obj.pk for obj in response.context["cl"].result_list}


def action(client, name, pks, url=WORKFLOWS, **data):
    """POST an action to the list, as its action bar (or a workflow's button) does."""
    post = {"action": name, "index": 0, helpers.ACTION_CHECKBOX_NAME: pks}
    return client.post(url, {**post, **data})


def apply(client, name, pks, url=WORKFLOWS, **data):
    """POST the confirmation page's form back, as action_form.html does."""
    post = {"action": name, "apply": "yes", helpers.ACTION_CHECKBOX_NAME: pks}
    return client.post(url, {**post, **data}, follow=True)


def texts(response):
    return [str(m) for m in response.context["messages"]]


def logged(model, pk):
    return [
        entry.change_message
        for entry in LogEntry.objects.filter(
            content_type=ContentType.objects.get_for_model(model), object_id=str(pk)
        )
        if entry.action_flag == CHANGE
    ]


def blocked(name="import 42"):
    """fetch (done) -> bad (dead-lettered) -> report (held): blocked."""
    wf = Workflow(name=name)
    fetch = wf.add("wf.value", {"value": 1}, name="fetch")
    bad = wf.add("wf.value", {"fail_times": -1}, name="bad", after=[fetch])
    wf.add("wf.sum", {}, name="report", after=[bad])
    run = wf.enqueue()
    Worker(concurrency=1, burst=True).run()
    assert run.status() == "blocked"
    return run


def running(name="running one", parts=2):
    """first (in the queue) -> parts (held) -> join (held)."""
    wf = Workflow(name=name)
    first = wf.add("wf.value", {"value": 1}, name="first")
    middle = [
        wf.add("wf.value", {"value": i}, name=f"part-{i}", after=[first]) for i in range(parts)
    ]
    wf.add("wf.sum", {}, name="join", after=middle)
    return wf.enqueue()


@pytest.fixture
def staff_client(client):
    """A client logged in as a staff user with the given permissions (codenames)."""

    def make(*codenames):
        user = User.objects.create_user("operator", password="x", is_staff=True)
        user.user_permissions.set(
            Permission.objects.filter(
                content_type__app_label="django_pgqueue", codename__in=codenames
            )
        )
        client.force_login(user)
        return client

    return make


# --- the list -----------------------------------------------------------------------------


def test_the_list_shows_filters_and_searches(admin_client):
    stuck = blocked("import 42")
    going = running("export 7")
    gone = running("cleanup")
    gone.cancel(by="test")

    page = admin_client.get(WORKFLOWS)
    assert listed(page) == {stuck.pk, going.pk, gone.pk}
    html = page.content.decode()
    assert "1 / 3 (1 dead-lettered)" in html, "steps done of all, and the dead-lettered"
    assert "0 / 4" in html
    assert 'class="pgqueue-workflow-blocked"' in html

    assert listed(admin_client.get(WORKFLOWS, {"status__exact": "blocked"})) == {stuck.pk}
    assert listed(admin_client.get(WORKFLOWS, {"status__exact": "cancelled"})) == {gone.pk}
    assert listed(admin_client.get(WORKFLOWS, {"q": "EXPORT"})) == {going.pk}
    assert listed(admin_client.get(WORKFLOWS, {"q": str(stuck.pk)})) == {stuck.pk}
    assert listed(admin_client.get(WORKFLOWS, {"q": "nothing like it"})) == set()
    # A number past bigint, or a NUL, is a search for nothing or refused, never a 500.
    assert admin_client.get(WORKFLOWS, {"q": "9" * 30}).status_code == 200
    assert admin_client.get(WORKFLOWS, {"q": "a\x00b"}).status_code == 302
    assert admin_client.get(WORKFLOWS, {"id__exact": "x"}).status_code == 302
    for missing in (str(stuck.pk + 100), "x", "9" * 30):
        assert admin_client.get(page_url(missing)).status_code == 302  # "no such workflow"


def test_workflows_are_never_added_changed_or_deleted_by_hand(admin_client):
    run = blocked()
    assert admin_client.get(reverse("admin:django_pgqueue_workflow_add")).status_code == 403
    delete = reverse("admin:django_pgqueue_workflow_delete", args=[run.pk])
    assert admin_client.post(delete, {"post": "yes"}).status_code == 403
    assert admin_client.post(page_url(run.pk), {"name": "renamed"}).status_code == 403
    assert StoredWorkflow.objects.get(pk=run.pk).name == "import 42"
    choices = dict(admin_client.get(WORKFLOWS).context["action_form"].fields["action"].choices)
    assert "delete_selected" not in choices


# --- a workflow's page: the graph ---------------------------------------------------------


def test_the_graph_draws_each_step_linked_to_where_its_message_is(admin_client):
    run = blocked()
    steps = {s.name: s for s in WorkflowStep.objects.filter(workflow_id=run.pk)}
    page = admin_client.get(page_url(run.pk))
    assert page.status_code == 200
    html = page.content.decode()
    assert html.count('<svg xmlns="http://www.w3.org/2000/svg" class="pgqueue-workflow-graph"') == 1
    assert html.count('class="edge"') == 2  # fetch -> bad -> report
    assert "3 step(s) in 3 layer(s): held 1, in the queue 0, done 1, dead-lettered 1" in html
    # Done: its history entry; dead-lettered: its dead letter; held: no link.
    history = FinishedMessage.objects.get(message_id=steps["fetch"].message_id)
    dead = DeadLetter.objects.get(message_id=steps["bad"].message_id)
    assert (
        f'<a href="{change_url("finishedmessage", history.pk)}" class="step step-done" '
        f'data-step="{steps["fetch"].pk}"'
    ) in html
    assert (
        f'<a href="{change_url("deadletter", dead.pk)}" class="step step-dead_lettered" '
        f'data-step="{steps["bad"].pk}"'
    ) in html
    assert f'<g class="step step-held" data-step="{steps["report"].pk}"' in html
    assert "legend-dead_lettered" in html and "dead-lettered (1)" in html


def test_a_released_step_links_to_its_message_and_names_are_escaped(admin_client):
    wf = Workflow(name=f"wf {XSS}")
    first = wf.add("wf.value", {"value": 1}, name=f"first {XSS}")
    wf.add("wf.value", {"value": 2}, name=f'then "{XSS}', after=[first])
    run = wf.enqueue()
    message = Message.objects.get()
    html = admin_client.get(page_url(run.pk)).content.decode()
    assert XSS not in html, "a step's or the workflow's name drawn unescaped"
    assert ESCAPED in html
    assert f'<a href="{change_url("message", message.pk)}" class="step step-released"' in html
    assert "then &quot;&lt;script&gt;" in html  # in the box's tooltip, whole


def test_a_big_workflow_is_capped_per_layer_and_quick(admin_client):
    wf = Workflow(name="fan")
    first = wf.add("wf.value", {"value": 1}, name="first")
    parts = [wf.add("wf.value", {"value": i}, name=f"part-{i}", after=[first]) for i in range(400)]
    wf.add("wf.sum", {}, name="join", after=parts)
    run = wf.enqueue()
    started = time.monotonic()
    html = admin_client.get(page_url(run.pk)).content.decode()
    assert time.monotonic() - started < 5  # a loaded machine's bound; milliseconds when idle
    assert html.count('class="step ') == 2 + MAX_PER_LAYER - 1
    more = 400 - (MAX_PER_LAYER - 1)
    assert f"+{more} more" in html and f"{more} more step(s) in this layer: {more} held" in html
    # Each drawn part's two arrows, and the hidden parts' one each way (deduplicated).
    assert html.count('class="edge"') == 2 * MAX_PER_LAYER


# --- the graph's layout, pure ------------------------------------------------------------


def test_layers_are_the_longest_path_from_the_entry_steps():
    nodes = [Node(i, f"s{i}", StepState.HELD) for i in range(1, 6)]
    # 1 -> 2 -> 3, 1 -> 3 (a shortcut), 4 alone, 5 after 3 and 4.
    edges = [(2, 1), (3, 2), (3, 1), (5, 3), (5, 4)]
    assert layers_of(nodes, edges) == {1: 0, 2: 1, 3: 2, 4: 0, 5: 3}
    # A cycle (refused by enqueue; rows by hand) goes last rather than nowhere.
    assert layers_of(nodes[:2], [(1, 2), (2, 1)]) == {1: 0, 2: 0}


def test_a_capped_layer_draws_the_steps_that_need_attention_first():
    nodes = [Node(1, "root", StepState.DONE)]
    nodes += [Node(i, f"p{i}", StepState.DONE) for i in range(2, 1002)]
    nodes[-1] = Node(1001, "broken", StepState.DEAD_LETTERED)
    layout = lay_out(nodes, [(i, 1) for i in range(2, 1002)])
    drawn = {n.name for n in layout.drawn_steps()}
    assert "broken" in drawn and len(drawn) == MAX_PER_LAYER
    assert layout.boxes[-1].node is None and len(layout.boxes[-1].hidden) == 1000 - 11


def test_a_long_chain_draws_the_layers_where_it_is_now():
    states = [StepState.DONE] * 300 + [StepState.RELEASED] + [StepState.HELD] * 699
    nodes = [Node(i, f"s{i}", state) for i, state in enumerate(states, 1)]
    layout = lay_out(nodes, [(i + 1, i) for i in range(1, 1000)])
    assert layout.drawn_layers == MAX_LAYERS and layout.first == 299
    assert [n.name for n in layout.drawn_steps()][:2] == ["s300", "s301"]
    assert (layout.before, layout.after) == (299, 1000 - 299 - MAX_LAYERS)
    assert layout.note == (
        "Layers 300–329 of 1,000 are drawn, not the 299 step(s) before and the 671 step(s) "
        "after them."
    )
    assert len(layout.edges) == MAX_LAYERS - 1


def test_ten_thousand_steps_lay_out_and_draw_quickly():
    nodes = [Node(1, "start", StepState.DONE)]
    nodes += [Node(i, f"part-{i}", StepState.RELEASED) for i in range(2, 10_002)]
    nodes.append(Node(10_002, "join", StepState.HELD))
    edges = [(i, 1) for i in range(2, 10_002)] + [(10_002, i) for i in range(2, 10_002)]
    started = time.monotonic()
    svg = draw(lay_out(nodes, edges), {}, "g", "big")
    assert time.monotonic() - started < 3  # a loaded machine's bound; ~0.2 s when idle
    assert svg.count('class="step ') == MAX_PER_LAYER + 1
    assert len(svg) < 60_000


# --- the actions --------------------------------------------------------------------------


def test_cancel_asks_first_then_cancels_and_logs(admin_client):
    stuck = blocked("import 42")  # first: its worker would run the others
    going = running("export 7")
    done_already = running("old")
    done_already.cancel(by="earlier")

    pks = [going.pk, stuck.pk, done_already.pk]
    page = action(admin_client, "cancel", pks)
    assert page.status_code == 200
    assert "3 workflow(s) selected, 2 of them not finished" in page.content.decode()
    assert going.status() == "running", "nothing changes before the confirmation"

    response = apply(admin_client, "cancel", pks)
    assert texts(response) == [
        "Cancelled 2 of 3 selected workflow(s): 6 step(s) cancelled, 0 running asked to "
        "stop; the others had finished."
    ]
    assert going.status() == stuck.status() == "cancelled"
    assert set(going.steps().values()) == {"cancelled"}
    assert logged(StoredWorkflow, going.pk) == ["Cancelled (admin action)"]
    assert logged(StoredWorkflow, stuck.pk) == ["Cancelled (admin action)"]
    assert logged(StoredWorkflow, done_already.pk) == []


def test_revive_from_the_workflows_page_resumes_it_and_logs(admin_client):
    run = blocked("import 42")
    other = running("untouched")
    dead = DeadLetter.objects.get()
    page = admin_client.get(page_url(run.pk)).content.decode()
    assert 'value="revive"' in page and 'value="cancel"' in page
    assert f'action="{WORKFLOWS}?id__exact={run.pk}"' in page

    # The page's button posts the action to the list, limited to this workflow.
    url = f"{WORKFLOWS}?id__exact={run.pk}"
    confirm = action(admin_client, "revive", [run.pk], url=url).content.decode()
    assert "1 workflow(s) selected, 1 of them with dead-lettered steps" in confirm
    assert f"The steps: bad (workflow #{run.pk})." in confirm
    response = apply(admin_client, "revive", [run.pk], url=url, note="fixed upstream")
    assert response.redirect_chain[-1][0] == url
    assert texts(response) == ["Revived 1, skipped 0."]
    assert listed(response) == {run.pk}

    assert run.status() == "running" and run.steps()["bad"] == "waiting"
    dead.refresh_from_db()
    assert dead.state == DeadLetterState.REVIVED and "fixed upstream" in dead.notes
    assert WorkflowStep.objects.get(name="bad").message_id == dead.revived_message_id
    assert logged(DeadLetter, dead.pk) == ["Revived (workflow admin action)"]
    assert logged(StoredWorkflow, run.pk) == ["Dead-lettered steps revived (admin action)"]
    assert logged(StoredWorkflow, other.pk) == []
    # Nothing left to revive: the button is gone, the action revives nothing.
    assert 'value="revive"' not in admin_client.get(page_url(run.pk)).content.decode()
    assert texts(apply(admin_client, "revive", [run.pk])) == ["Revived 0, skipped 0."]


def test_without_the_permissions_a_staff_user_sees_no_action(staff_client):
    run = blocked()
    client = staff_client("view_workflow")
    page = client.get(WORKFLOWS)
    assert listed(page) == {run.pk}
    assert page.context["action_form"] is None, "no action offered"
    assert 'name="action"' not in client.get(page_url(run.pk)).content.decode()
    # Posted anyway: refused, nothing changes.
    for name in ("cancel", "revive"):
        response = apply(client, name, [run.pk])
        assert response.status_code == 200
    assert run.status() == "blocked" and DeadLetter.objects.get().state == DeadLetterState.NEW
    assert not LogEntry.objects.exists()


@pytest.mark.parametrize(
    "codename, offered, absent",
    [("cancel_workflow", "cancel", "revive"), ("revive_workflow", "revive", "cancel")],
)
def test_each_action_needs_its_own_permission(staff_client, codename, offered, absent):
    run = blocked()
    client = staff_client("view_workflow", codename)
    choices = dict(client.get(WORKFLOWS).context["action_form"].fields["action"].choices)
    assert offered in choices and absent not in choices
    page = client.get(page_url(run.pk)).content.decode()
    assert f'value="{offered}"' in page and f'value="{absent}"' not in page
    apply(client, absent, [run.pk])
    assert run.status() == "blocked"
    apply(client, offered, [run.pk])
    assert run.status() == ("cancelled" if offered == "cancel" else "running")
    assert StoredWorkflow.objects.get(pk=run.pk).status != WorkflowStatus.BLOCKED
