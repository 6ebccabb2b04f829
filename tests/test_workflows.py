"""Workflows against the real database and a real worker (in this process,
threads and all): the graph checked before anything is written, steps held
until what they follow has finished, results passed along, dead letters
that block and resume a workflow, cancels, and steps added by a handler."""

import pytest
from demo.models import Handled
from django.db import connection, transaction

from django_pgqueue import (
    InvalidMessage,
    Workflow,
    WorkflowError,
    chain,
    chord,
    enqueue,
    group,
    resolve,
    revive,
    step,
    workflow,
)
from django_pgqueue.models import (
    DeadLetter,
    Message,
    StepState,
    WorkflowDependency,
    WorkflowStatus,
    WorkflowStep,
)
from django_pgqueue.models import Workflow as StoredWorkflow
from django_pgqueue.workflows import WorkflowRun

from .conftest import running_worker, wait_until

pytestmark = pytest.mark.django_db(transaction=True)

WORKER = {"concurrency": 4, "batch_size": 10, "poll_interval": 0.2}


def nothing_written():
    return (
        not StoredWorkflow.objects.exists()
        and not WorkflowStep.objects.exists()
        and not Message.objects.exists()
    )


def fan(parts=3, topic="wf.value"):
    wf = Workflow(name="fan")
    fetch = wf.add(topic, {"value": 1}, name="fetch")
    middle = [wf.add(topic, {"value": i}, name=f"part-{i}", after=[fetch]) for i in range(parts)]
    wf.add("wf.sum", {"add": 100}, name="report", after=middle)
    return wf


def finished(run):
    return run.status() in ("done", "failed", "cancelled")


def handled(topic):
    return Handled.objects.filter(topic=topic).count()


# --- built and checked before anything is written --------------------------------


@pytest.mark.parametrize(
    "build, error",
    [
        (lambda wf: [wf.add("wf.value", name="a"), wf.add("wf.value", name="a")], "named 'a'"),
        (lambda wf: wf.add("wf.value", name="a", after=["nope"]), "follows 'nope'"),
        (
            lambda wf: [
                wf.add("wf.value", name="a", after=["c"]),
                wf.add("wf.value", name="b", after=["a"]),
                wf.add("wf.value", name="c", after=["b"]),
            ],
            "cycle: ",
        ),
        (lambda wf: wf.add("wf.value", name="a", after=["a"]), "cycle: a -> a"),
        (lambda wf: wf.add("wf.value", name="", after=[]), "non-empty string"),
        (lambda wf: wf.add("wf.value", after=[42]), "steps or step names"),
        (lambda wf: wf.add("wf.value", allow_failed="yes"), "True or False"),
        (lambda wf: Workflow().add("wf.value", after=[wf.add("wf.value")]), "not a step of"),
        (lambda wf: None, "at least one step"),
    ],
)
def test_a_bad_graph_is_refused_before_anything_is_written(build, error):
    wf = Workflow(name="bad")
    with pytest.raises(WorkflowError, match=error):
        build(wf)
        wf.enqueue()
    assert nothing_written()


@pytest.mark.parametrize(
    "options, error",
    [
        ({"priority": 10**6}, "priority"),
        ({"queue": "no spaces allowed"}, "queue"),
        ({"dedup_key": "k"}, "no dedup_key"),
        ({"colour": "red"}, "unknown step option"),
        ({"delay": -1}, "delay"),
    ],
)
def test_a_bad_option_is_refused_when_the_step_is_added(options, error):
    wf = Workflow()
    with pytest.raises(InvalidMessage, match=error):
        wf.add("wf.value", {"value": 1}, **options)
    assert nothing_written()


def test_enqueue_follows_the_callers_transaction():
    with pytest.raises(RuntimeError), transaction.atomic():
        fan().enqueue()
        raise RuntimeError("roll back")
    assert nothing_written()
    with transaction.atomic():
        run = fan().enqueue()
    assert run.status() == "running"
    assert StoredWorkflow.objects.get().steps_total == 5


def test_only_the_steps_that_follow_none_are_in_the_queue():
    run = fan().enqueue()
    assert run.steps() == {
        "fetch": "waiting",
        "part-0": "held",
        "part-1": "held",
        "part-2": "held",
        "report": "held",
    }
    [message] = Message.objects.all()
    assert (message.topic, message.payload) == ("wf.value", {"value": 1})
    assert WorkflowStep.objects.get(message_id=message.pk).workflow_id == run.pk
    assert WorkflowRun.of_step(message.workflow_step_id) == run
    assert workflow(run.pk) == run and workflow(run.pk).name == "fan"
    assert WorkflowDependency.objects.count() == 6
    with pytest.raises(WorkflowError, match="no workflow with id"):
        workflow(run.pk + 1)
    with pytest.raises(WorkflowError, match="whole number"):
        workflow("1")


def test_a_plain_message_has_no_workflow():
    assert enqueue("test.record").workflow is None


def test_step_options_reach_the_message():
    wf = Workflow()
    wf.add("wf.value", {"value": 1}, queue="other", priority=5, headers={"h": 1}, max_attempts=7)
    wf.enqueue()
    message = Message.objects.get()
    assert (message.queue, message.priority, message.headers, message.max_attempts) == (
        "other",
        5,
        {"h": 1},
        7,
    )


# --- run by a worker ---------------------------------------------------------------


@pytest.mark.parametrize("topic", ["wf.value", "wf.value_nonatomic"])
def test_fan_out_and_fan_in_run_in_order_and_pass_results(topic):
    run = fan(parts=6, topic=topic).enqueue()
    with running_worker(**WORKER):
        wait_until(lambda: finished(run), message="the workflow finished")
    assert run.status() == "done"
    assert set(run.steps().values()) == {"done"}
    # The report ran once, after every part, and saw all their results.
    assert handled("wf.sum") == 1
    assert run.result("report") == {
        "sum": 100 + sum(range(6)),
        "saw": sorted(f"part-{i}" for i in range(6)),
    }
    assert run.result("fetch") == 1
    stored = StoredWorkflow.objects.get()
    assert (stored.steps_unfinished, stored.steps_active, stored.steps_failed) == (0, 0, 0)
    assert stored.finished_at is not None and not Message.objects.exists()
    with pytest.raises(WorkflowError, match="no step named"):
        run.result("nope")


def test_a_step_waits_for_a_retried_step():
    wf = Workflow()
    first = wf.add("wf.value", {"value": 2, "fail_times": 2, "raise": "ConnectionError"})
    wf.add("wf.sum", {}, name="after", after=first)
    run = wf.enqueue()
    with running_worker(**WORKER):
        wait_until(lambda: finished(run), message="the workflow finished")
    assert run.status() == "done" and run.result("after") == {"sum": 2, "saw": [first.name]}
    assert WorkflowStep.objects.count() == 2  # a retried step stays one step


def test_celery_canvas_nests():
    flow = chain(
        step("wf.value", {"value": 1}, name="a"),
        group(step("wf.value", {"value": 2}, name="b"), step("wf.value", {"value": 3}, name="c")),
        step("wf.sum", {}, name="d"),
    )
    assert flow.graph() == {"a": [], "b": ["a"], "c": ["a"], "d": ["b", "c"]}
    callback = chord(
        [step("wf.value", {"value": n}) for n in range(3)], step("wf.sum", {}, name="total")
    )
    assert callback.graph()["total"] == ["wf.value-1", "wf.value-2", "wf.value-3"]
    assert chain(callback, step("wf.sum", {}, name="last")).graph()["last"] == ["total"]
    with pytest.raises(WorkflowError, match="need at least one"):
        group()
    with pytest.raises(WorkflowError, match="take steps"):
        chain("wf.value")
    run = flow.enqueue()
    with running_worker(**WORKER):
        wait_until(lambda: finished(run), message="the workflow finished")
    assert run.result("d") == {"sum": 5, "saw": ["b", "c"]}


def test_an_unserialisable_result_fails_the_step():
    wf = Workflow()
    bad = wf.add("wf.unserialisable", max_attempts=1)
    wf.add("wf.sum", {}, name="after", after=[bad])
    run = wf.enqueue()
    with running_worker(**WORKER):
        wait_until(lambda: run.status() == "blocked", message="blocked")
    dead = DeadLetter.objects.get()
    assert "JSON-serialisable" in dead.reason
    assert run.steps() == {bad.name: "dead_lettered", "after": "held"}


# --- dead letters, revive and resolve ----------------------------------------------


def blocked_workflow():
    wf = Workflow(name="blocked")
    bad = wf.add("wf.value", {"value": 5, "fail_times": -1}, name="bad")
    good = wf.add("wf.value", {"value": 1}, name="good")
    wf.add("wf.sum", {}, name="join", after=[bad, good])
    wf.add("wf.sum", {}, name="tolerant", after=[bad, good], allow_failed=True)
    wf.add("wf.sum", {}, name="later", after=["join"])
    return wf.enqueue()


def test_a_dead_lettered_step_blocks_and_its_revival_resumes_the_workflow():
    run = blocked_workflow()
    with running_worker(**WORKER):
        wait_until(lambda: run.status() == "blocked", message="blocked")
        assert run.steps() == {
            "bad": "dead_lettered",
            "good": "done",
            "join": "held",
            "tolerant": "held",
            "later": "held",
        }
        # The payload fixed, the dead letter revived: the step runs again.
        DeadLetter.objects.update(payload={"value": 5})
        assert revive(DeadLetter.objects.all()).done == 1
        wait_until(lambda: finished(run), message="the workflow finished")
    assert run.status() == "done"
    assert run.result("later") == {"sum": 6, "saw": ["join"]}
    assert run.result("tolerant") == {"sum": 6, "saw": ["bad", "good"]}
    assert handled("wf.sum") == 3


def test_resolving_a_dead_lettered_step_cancels_those_after_it_but_tolerant_ones():
    run = blocked_workflow()
    with running_worker(**WORKER):
        wait_until(lambda: run.status() == "blocked", message="blocked")
        resolve(DeadLetter.objects.all(), note="given up")
        wait_until(lambda: finished(run), message="the workflow finished")
    assert run.status() == "failed"
    assert run.steps() == {
        "bad": "cancelled",
        "good": "done",
        "join": "cancelled",
        "tolerant": "done",
        "later": "cancelled",
    }
    # The tolerant step ran without the failed step's result.
    assert run.result("tolerant") == {"sum": 1, "saw": ["good"]}
    stored = StoredWorkflow.objects.get()
    assert (stored.steps_unfinished, stored.steps_failed, stored.steps_dead) == (0, 3, 0)


def test_cancel_cancels_every_unfinished_step():
    wf = Workflow()
    first = wf.add("wf.value", {"value": 1}, name="first", delay=3600)
    wf.add("wf.sum", {}, name="second", after=[first])
    run = wf.enqueue()
    result = run.cancel(by="test")
    assert (result.cancelled, result.requested) == (2, 0)
    assert run.status() == "cancelled"
    assert run.steps() == {"first": "cancelled", "second": "cancelled"}
    assert Message.objects.get().status == "cancelled"
    again = run.cancel()
    assert again.as_dict() == {"cancelled": 0, "requested": 0, "already": 0, "finished": 0}


def test_cancelling_a_steps_message_counts_as_a_failure():
    from django_pgqueue import cancel

    wf = Workflow()
    first = wf.add("wf.value", {"value": 1}, name="first", delay=3600)
    wf.add("wf.sum", {}, name="needs", after=[first])
    wf.add("wf.sum", {}, name="tolerates", after=[first], allow_failed=True)
    run = wf.enqueue()
    cancel(list(Message.objects.values_list("pk", flat=True)))
    assert run.steps() == {"first": "cancelled", "needs": "cancelled", "tolerates": "waiting"}
    with running_worker(**WORKER):
        wait_until(lambda: finished(run), message="the workflow finished")
    assert run.status() == "failed" and run.result("tolerates") == {"sum": 0, "saw": []}


def test_cancel_tells_a_running_step():
    wf = Workflow()
    wf.add("wf.sleep", {"seconds": 30}, name="slow")
    run = wf.enqueue()
    with running_worker(**WORKER):
        wait_until(lambda: run.steps()["slow"] == "processing", message="started")
        result = run.cancel()
        # As cancel() counts a running message: its worker told.
        assert (result.cancelled, result.requested) == (0, 1)
        assert run.status() == "cancelled"
        wait_until(lambda: not Message.objects.filter(status="processing").exists())
    assert run.steps() == {"slow": "cancelled"}


# --- steps added by a handler ---------------------------------------------------


def test_a_handler_adds_steps_and_a_join_that_runs_once_after_them():
    wf = Workflow(name="dynamic")
    wf.add("wf.split", {"parts": 5, "fail": True}, name="split")
    run = wf.enqueue()
    with running_worker(**WORKER):
        wait_until(lambda: finished(run), message="the workflow finished")
    assert run.status() == "done"
    # The first attempt failed after adding: its additions were rolled
    # back with its other writes (its Handled row).
    assert len(run.steps()) == 7
    assert handled("wf.split") == 1 and handled("wf.sum") == 1
    assert run.result("join") == {"sum": 10, "saw": [f"part-{i}" for i in range(5)]}


def test_a_handler_may_not_follow_an_unfinished_step():
    wf = Workflow()
    wf.add("wf.value", {"value": 1}, name="held_one", delay=3600)
    wf.add("wf.split", {"parts": 1}, name="split")
    run = wf.enqueue()
    split = Message.objects.get(topic="wf.split")
    handle = WorkflowRun.of_step(split.workflow_step_id)  # the handler's message.workflow
    with pytest.raises(WorkflowError, match="'held_one' is released"):
        handle.add("wf.value", after=["held_one"])
    with pytest.raises(WorkflowError, match="not a step of workflow"):
        handle.add("wf.value", after=["nope"])
    with pytest.raises(WorkflowError, match="named 'split' already"):
        handle.add("wf.value", name="split")
    with pytest.raises(WorkflowError, match="only a step's handler"):
        run.add("wf.value")
    assert run.steps()["split"] == "waiting"


def test_steps_states_are_stored_with_their_messages():
    run = fan(parts=2).enqueue()
    with running_worker(**WORKER):
        wait_until(lambda: finished(run), message="the workflow finished")
    states = set(WorkflowStep.objects.values_list("state", flat=True))
    assert states == {StepState.DONE}
    assert StoredWorkflow.objects.get().status == WorkflowStatus.DONE
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM django_pgqueue_workflowstep WHERE result IS NULL")
        assert cursor.fetchone()[0] == 0


# --- Django tasks as steps (django.tasks: Django 6) -------------------------------


def test_a_task_is_a_step_and_its_return_value_its_result():
    pytest.importorskip("django.tasks")
    from demo.tasks import add, total_of_results

    from django_pgqueue.models import TaskRecord

    wf = Workflow(name="tasks")
    first = wf.add_task(add, 2, 3, name="add")
    second = wf.add("wf.value", {"value": 10}, name="ten")
    wf.add_task(total_of_results, name="total", after=[first, second], extra=1)
    with pytest.raises(WorkflowError, match="Django task"):
        wf.add_task(lambda: None)
    run = wf.enqueue()
    assert TaskRecord.objects.count() == 2  # written with the workflow
    assert first.task_result.id == str(TaskRecord.objects.get(task_path=add.module_path).pk)
    with running_worker(**WORKER):
        wait_until(lambda: finished(run), message="the workflow finished")
    assert run.status() == "done"
    assert (run.result("add"), run.result("total")) == (5, 16)
    assert add.get_result(first.task_result.id).return_value == 5


# --- watched: status, metrics; pruned with the history ------------------------------


def test_status_counts_workflows_by_status():
    import io
    import json

    from django.core.management import call_command

    fan().enqueue()
    other = Workflow()
    other.add("wf.value", delay=3600)
    other.enqueue().cancel()
    out = io.StringIO()
    call_command("pgqueue_status", "--json", stdout=out)
    assert json.loads(out.getvalue())["workflows"] == {
        "running": 1,
        "blocked": 0,
        "done": 0,
        "failed": 0,
        "cancelled": 1,
    }
    out = io.StringIO()
    call_command("pgqueue_status", stdout=out)
    assert "Workflows\nrunning 1, blocked 0, done 0, failed 0, cancelled 1" in out.getvalue()


def test_metrics_count_steps_released_and_workflows_finished():
    from django_pgqueue.observability import metrics
    from django_pgqueue.observability.scrape import render_database_metrics

    reporter = metrics.WorkerMetrics()
    run = fan(parts=4, topic="wf.value_nonatomic").enqueue()
    with running_worker(**WORKER, metrics=reporter):
        wait_until(lambda: finished(run), message="the workflow finished")
    value = reporter.registry.get_sample_value
    assert value("pgqueue_worker_workflow_steps_released_total") == 5  # 4 parts, the report
    assert value("pgqueue_worker_workflows_finished_total", {"outcome": "done"}) == 1
    scraped = render_database_metrics()[0].decode()
    assert 'pgqueue_workflows{database="default",status="done"} 1.0' in scraped
    assert 'pgqueue_workflows{database="default",status="running"} 0.0' in scraped


def test_finished_workflows_are_pruned_with_their_steps_by_the_history_retention():
    import datetime

    from django.utils import timezone

    from django_pgqueue import maintenance

    done = fan(parts=2).enqueue()
    kept = fan(parts=2).enqueue()
    with running_worker(**WORKER):
        wait_until(lambda: finished(done) and finished(kept), message="both finished")
    old = timezone.now() - datetime.timedelta(days=2)
    StoredWorkflow.objects.filter(pk=done.pk).update(finished_at=old)
    running = fan(parts=2).enqueue()  # unfinished: never pruned
    result = maintenance.prune()
    assert result.counts["workflows"] == 1
    assert set(StoredWorkflow.objects.values_list("pk", flat=True)) == {kept.pk, running.pk}
    assert not WorkflowStep.objects.filter(workflow_id=done.pk).exists()
    assert WorkflowDependency.objects.count() == 2 * 4  # the two left, 4 edges each


def test_cancelling_a_blocked_workflow_resolves_its_dead_letters():
    from django_pgqueue.models import DeadLetterState

    run = blocked_workflow()
    with running_worker(**WORKER):
        wait_until(lambda: run.status() == "blocked", message="blocked")
    result = run.cancel(by="ops")
    assert result.cancelled == 4  # the dead-lettered step and the three held
    dead = DeadLetter.objects.get()
    assert dead.state == DeadLetterState.RESOLVED and "workflow" in dead.notes
    assert run.status() == "cancelled"
    assert revive(DeadLetter.objects.all()).done == 0  # nothing left to resume


def test_names_given_in_a_composition_are_kept_or_refused():
    with pytest.raises(WorkflowError, match="two steps are named 'x'"):
        chain(step("wf.value", name="x"), group(step("wf.value", name="x"), step("wf.value")))
    twice = chain(group(step("wf.value"), step("wf.value")), group(step("wf.value")))
    assert len(twice.steps) == 3


def test_a_handler_knows_its_step_name():
    wf = Workflow()
    wf.add("wf.value", {"value": 1}, name="only")
    wf.enqueue()
    message = Message.objects.get()
    assert WorkflowRun.of_step(message.workflow_step_id).step_name == "only"


@pytest.mark.parametrize("unlocked", [False, True], ids=["atomic", "atomic=False"])
def test_an_acknowledgement_that_lost_its_lease_moves_no_step(unlocked):
    """The worker acknowledges steps' messages and moves their steps in one
    round trip (bookkeeping.acknowledge): a message whose lease was lost
    (rescued, and leased again elsewhere) is not acknowledged, and its step
    does not move; the others' do, in the same statement."""
    import uuid

    from django_pgqueue.workflows import bookkeeping

    from .claiming import claim

    wf = Workflow(name="two roots")
    a = wf.add("wf.value", {"value": 1}, name="a")
    b = wf.add("wf.value", {"value": 2}, name="b")
    wf.add("wf.sum", {}, name="c", after=[a, b])
    run = wf.enqueue()
    names = {1: "a", 2: "b"}
    leased = {names[m.payload["value"]]: m for m in claim(["default"], 10, "w1", 60)}
    assert set(leased) == {"a", "b"}
    # b's lease is lost: its message was rescued and leased to another worker.
    Message.objects.filter(pk=leased["b"].pk).update(lease_token=uuid.uuid4())
    options = {"skip_locked": True, "async_commit": True} if unlocked else {}
    messages = [leased["a"], leased["b"]]
    acked, moved = bookkeeping.acknowledge(
        messages, [(m, str(m.payload["value"])) for m in messages], "default", **options
    )
    assert acked == {leased["a"].pk}
    assert (moved.released, moved.finished) == (0, [])
    assert run.steps() == {"a": "done", "b": "processing", "c": "held"}
    assert WorkflowStep.objects.get(name="c").waiting_for == 1
    assert WorkflowStep.objects.get(name="a").result == 1
    # The same acknowledgement again moves nothing twice.
    assert bookkeeping.acknowledge(messages[:1], [(messages[0], "1")], "default")[0] == set()
    assert WorkflowStep.objects.get(name="c").waiting_for == 1
    # b's current lease acknowledges it: c is released, once.
    current = Message.objects.get(pk=leased["b"].pk)
    acked, moved = bookkeeping.acknowledge([current], [(current, "2")], "default", **options)
    assert acked == {current.pk}
    assert moved.released == 1
    assert run.steps() == {"a": "done", "b": "done", "c": "waiting"}
    assert WorkflowStep.objects.get(name="b").result == 2
