"""Workflows under kill -9 (issue 37's "done when"): 200 workflows of a
fan-out of 50 steps and a fan-in of 1, drained by real worker processes
that are SIGKILLed at random moments (seeded) and started again. At the
end every workflow is done, every join ran exactly once (and saw all 50
results), no step is held whose predecessors all ended, nothing is left in
the queue. Half the workflows' parts are atomic (each ran exactly once:
the ledger row commits with the acknowledgement and the step's
bookkeeping), half atomic=False (each ran at least once: their
acknowledgement, with the bookkeeping, is a transaction of its own)."""

import collections
import random
import signal
import time

import pytest
from demo.models import Handled
from django.db import connection, transaction

from django_pgqueue import Workflow
from django_pgqueue.models import (
    DeadLetter,
    Message,
    Status,
    StepState,
    WorkflowStatus,
    WorkflowStep,
)
from django_pgqueue.models import Workflow as StoredWorkflow

from .conftest import wait_until

pytestmark = pytest.mark.slow

WORKFLOWS = 200
PARTS = 50
WORKERS = 3
SEED = 37
# Short leases: a killed worker's messages come back within seconds (the
# probe of a polling worker sees the expired lease and rescues them).
WORKER_ARGS = (
    *("--concurrency", "4", "--batch-size", "20", "--lease", "3", "--poll-interval", "0.5"),
    *("--subscriptions", "none", "--no-schedules", "--log-level", "WARNING"),
)
# Kill a worker this many times, one every KILL_EVERY seconds (drawn), while work is left.
KILLS = 12
KILL_EVERY = (0.5, 2.5)
# A step may be taken by a worker that is then killed many times over:
# never dead-lettered for that.
MAX_ATTEMPTS = 1000

# A held step whose predecessors have all ended: it should have been released.
STRANDED_SQL = """
    SELECT s.id FROM django_pgqueue_workflowstep AS s
    WHERE s.state = 'held' AND NOT EXISTS (
        SELECT 1 FROM django_pgqueue_workflowdependency AS d
        JOIN django_pgqueue_workflowstep AS a ON a.id = d.after_id
        WHERE d.step_id = s.id AND a.state NOT IN ('done', 'cancelled'))
"""
# A step whose waiting_for is not the number of its predecessors not ended.
MISCOUNTED_SQL = """
    SELECT s.id FROM django_pgqueue_workflowstep AS s
    WHERE s.waiting_for <> (
        SELECT count(*) FROM django_pgqueue_workflowdependency AS d
        JOIN django_pgqueue_workflowstep AS a ON a.id = d.after_id
        WHERE d.step_id = s.id AND a.state NOT IN ('done', 'cancelled'))
"""


def fan(n):
    wf = Workflow(name=f"chaos {n}")
    topic = "wf.chaos_part" if n % 2 == 0 else "wf.chaos_part_nonatomic"
    parts = [
        wf.add(
            topic,
            {"value": i, "sleep": 0.002},
            name=f"part-{i}",
            max_attempts=MAX_ATTEMPTS,
        )
        for i in range(PARTS)
    ]
    wf.add("wf.chaos_join", {}, name="join", after=parts, max_attempts=MAX_ATTEMPTS)
    return wf


def rows(sql):
    with connection.cursor() as cursor:
        cursor.execute(sql)
        return [row[0] for row in cursor.fetchall()]


def unfinished():
    return StoredWorkflow.objects.exclude(status=WorkflowStatus.DONE).count()


def test_workflows_survive_kill_9(start_worker):
    with transaction.atomic():
        runs = [fan(n).enqueue() for n in range(WORKFLOWS)]
    assert StoredWorkflow.objects.count() == WORKFLOWS
    assert Message.objects.count() == WORKFLOWS * PARTS

    chance = random.Random(SEED)
    workers = [start_worker(*WORKER_ARGS) for _ in range(WORKERS)]
    kills = 0
    # Let the workers start and take work before the first kill.
    wait_until(
        lambda: Handled.objects.exists(), timeout=300, message="the workers to handle a part"
    )
    while kills < KILLS and unfinished():
        time.sleep(chance.uniform(*KILL_EVERY))  # the chaos's own timing, not a wait
        # A worker with messages in flight (on a loaded machine a restarted
        # one takes seconds to start: a kill then would find nothing to lose).
        wait_until(
            lambda: holders(workers) or not unfinished(), timeout=120, message="a lease held"
        )
        holding = holders(workers)
        if not holding:
            break  # drained meanwhile
        victim = chance.choice(sorted(holding))
        workers[victim].signal(signal.SIGKILL)
        workers[victim].wait(timeout=30)
        kills += 1
        workers[victim] = start_worker(*WORKER_ARGS)

    try:
        wait_until(lambda: not unfinished(), timeout=600, interval=0.5, message="every workflow")
    except AssertionError as exc:
        raise AssertionError(f"{exc}: {where_the_steps_are()}") from None
    for worker in workers:
        assert worker.popen.poll() is None, f"a worker died on its own:\n{worker.log()}"
        worker.signal(signal.SIGTERM)
    for worker in workers:
        assert worker.wait(timeout=120) == 0, worker.log()

    # Every workflow done, its counts settled.
    stored = StoredWorkflow.objects.all()
    assert {w.status for w in stored} == {WorkflowStatus.DONE}
    assert all(
        (w.steps_total, w.steps_unfinished, w.steps_active, w.steps_dead, w.steps_failed)
        == (PARTS + 1, 0, 0, 0, 0)
        for w in stored
    ), [w for w in stored if w.steps_unfinished or w.steps_active][:3]
    assert set(WorkflowStep.objects.values_list("state", flat=True)) == {StepState.DONE}
    # Nothing stranded, nothing miscounted, nothing left.
    assert rows(STRANDED_SQL) == []
    assert rows(MISCOUNTED_SQL) == []
    assert not Message.objects.exists(), "messages left in the queue"
    assert not DeadLetter.objects.exists(), "steps dead-lettered"

    # Every atomic step's handler committed exactly once: its ledger row
    # commits with its acknowledgement or not at all (an atomic=False
    # part's, at least once).
    ledger = collections.Counter(Handled.objects.values_list("topic", "message_id"))
    steps = dict(WorkflowStep.objects.values_list("message_id", "topic"))
    assert len(steps) == WORKFLOWS * (PARTS + 1)
    assert set(ledger) == {(topic, message_id) for message_id, topic in steps.items()}, (
        "a step never ran, or a message ran that is no step's"
    )
    twice = {key: n for key, n in ledger.items() if n != 1 and key[0] != "wf.chaos_part_nonatomic"}
    assert not twice, f"handled more than once: {list(twice.items())[:5]}"
    joins = [key for key in ledger if key[0] == "wf.chaos_join"]
    assert len(joins) == WORKFLOWS, "every workflow's join once"
    # Each join ran after all of its parts: it saw 50 results.
    assert {run.result("join") for run in runs} == {PARTS}

    # The kills landed on work: some messages ran again after a rescue.
    again = Handled.objects.filter(attempt__gt=1).count()
    print(f"{kills} kills; {again} of {len(ledger)} steps committed on a later attempt")
    assert kills >= 3, f"only {kills} kill(s): the workflows drained before the chaos"
    assert again, "no kill took a message in flight"


def holders(workers):
    """The indexes of ``workers`` that hold a lease (its locked_by is
    "host:pid:suffix")."""
    pids = {
        int(locked_by.rsplit(":", 2)[1])
        for locked_by in Message.objects.filter(status=Status.PROCESSING)
        .exclude(locked_by="")
        .values_list("locked_by", flat=True)
        .distinct()
    }
    return {i for i, worker in enumerate(workers) if worker.pid in pids}


def where_the_steps_are():
    states = collections.Counter(WorkflowStep.objects.values_list("state", flat=True))
    messages = collections.Counter(Message.objects.values_list("status", flat=True))
    return (
        f"steps by state {dict(states)}, messages by status {dict(messages)}, "
        f"{DeadLetter.objects.count()} dead letter(s), stranded steps {rows(STRANDED_SQL)[:5]}"
    )
