"""Writing a workflow: its row, all its steps and their edges, and the
release of the steps that follow none, in the caller's transaction (four
statements, whatever the number of steps); and the steps a handler adds
to its own workflow, written with its acknowledgement."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from django.db import connections, transaction

from django_pgqueue import conf
from django_pgqueue.exceptions import WorkflowError
from django_pgqueue.sql import workflows as workflows_sql
from django_pgqueue.validation import check_using

if TYPE_CHECKING:
    from django_pgqueue.workflows.steps import Step


def write(
    name: str,
    steps: Sequence[Step],
    graph: dict[str, list[str]],
    using: str | None,
    written: Callable[[int], None],
) -> None:
    """Write a workflow named ``name``: its ``steps`` with the edges of
    ``graph``; ``written`` is called with its id (at the caller's commit
    when the queue is on another database than ``using``)."""
    caller, alias = check_using(using), database_of(steps)

    def insert() -> None:
        with transaction.atomic(using=alias), connections[alias].cursor() as cursor:
            cursor.execute(workflows_sql.INSERT_WORKFLOW_SQL, [name])
            pk = cursor.fetchone()[0]
            insert_steps(cursor, pk, steps, graph)
            for step in steps:
                if step.write_record is not None:
                    step.write_record(alias)  # a task step's record
        written(pk)

    if caller == alias:
        insert()
    else:
        # The queue is on another database: the workflow waits for the
        # caller's commit, as enqueue()'s messages do.
        transaction.on_commit(insert, using=caller)


def database_of(steps: Sequence[Step]) -> str:
    """The database alias of the queues of ``steps``: WorkflowError if they
    are on several (a workflow is written, and its steps released, in one
    transaction)."""
    homes: dict[str, str] = {}
    for step in steps:
        queue = step.row.options.queue
        homes.setdefault(conf.queue_database(queue), queue)
    if len(homes) > 1:
        named = ", ".join(f"queue {queue!r} on {alias!r}" for alias, queue in homes.items())
        raise WorkflowError(
            f"a workflow's steps are all on queues of one database; these are on several: {named}"
        )
    return next(iter(homes), conf.get("DATABASE"))


def insert_steps(
    cursor: object,
    workflow_id: int,
    steps: Sequence[Step],
    graph: dict[str, list[str]],
    ending: str | None = None,
) -> int:
    """Insert ``steps`` into workflow ``workflow_id`` with the edges of
    ``graph`` (names: of the new steps, of existing steps that have ended,
    or ``ending``, the step whose handler adds them, which ends in this
    transaction), count them, and release those that wait for nothing.
    Returns how many were released."""
    new: set[str | None] = {s.name for s in steps}
    if ending is not None:
        new.add(ending)  # its end, later in the transaction, releases them
    document = "[" + ",".join(step_document(s, graph, new) for s in steps) + "]"
    edges = json.dumps([[name, after] for name, follows in graph.items() for after in follows])
    cursor.execute(  # type: ignore[attr-defined]
        workflows_sql.INSERT_STEPS_SQL,
        {"steps": document, "edges": edges, "workflow": workflow_id},
    )
    ready, inserted, linked = cursor.fetchone()  # type: ignore[attr-defined]
    expected = sum(len(follows) for follows in graph.values())
    if inserted != len(steps) or linked != expected:
        raise RuntimeError(
            f"workflow {workflow_id}: {inserted} of {len(steps)} steps and {linked} of "
            f"{expected} edges written"
        )
    cursor.execute(workflows_sql.COUNT_SQL, [workflow_id, len(steps), len(steps)])  # type: ignore[attr-defined]
    cursor.execute(workflows_sql.RELEASE_SQL, [ready])  # type: ignore[attr-defined]
    return int(cursor.fetchone()[0])  # type: ignore[attr-defined]


def step_document(step: Step, graph: dict[str, list[str]], new: set[str | None]) -> str:
    """The step as INSERT_STEPS_SQL reads it: [name, waiting_for,
    allow_failed, queue, topic, payload, headers, priority, run_at, delay,
    max_attempts, group_key, partition_key]; the payload and headers as the JSON text
    they were validated as. It waits for the steps of ``new`` it follows
    (the others have ended)."""
    o, row = step.row.options, step.row
    waiting_for = sum(1 for name in graph.get(str(step.name), []) if name in new)
    run_at = None if o.run_at is None else o.run_at.isoformat()
    return (
        f"[{json.dumps(step.name)},{waiting_for},{'true' if step.allow_failed else 'false'},"
        f"{json.dumps(o.queue)},{json.dumps(o.topic)},{row.payload_json},{o.headers_json},"
        f"{o.priority},{json.dumps(run_at)},{o.delay_seconds!r},{json.dumps(o.max_attempts)},"
        f"{json.dumps(o.group_key)},{json.dumps(o.partition_key)}]"
    )


def delete(workflow_ids: list[int], using: str) -> int:
    """Delete workflows ``workflow_ids`` with their steps and their steps'
    dependencies, in one statement; returns how many workflows it deleted."""
    if not workflow_ids:
        return 0
    with connections[using].cursor() as cursor:
        cursor.execute(workflows_sql.DELETE_SQL, [workflow_ids])
        return int(cursor.fetchone()[0])
