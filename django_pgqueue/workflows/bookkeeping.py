"""The steps moved with their messages, in the transaction that moves the
message: acknowledged (``finished``), dead-lettered (``dead_lettered``),
revived (``revived``), cancelled or resolved (``given_up``). The work is
done by the database functions of migration 0018, one call each; a
message that runs no step never comes here (its callers check
``workflow_step_id`` first)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from django.db import connections

from django_pgqueue.lifecycle.acks import ack_leased, ack_then
from django_pgqueue.sql import workflows as workflows_sql

if TYPE_CHECKING:
    from django_pgqueue.models import Message


@dataclass
class Moved:
    """What finishing steps did: steps released, and the status of each
    workflow it finished (done, failed, cancelled)."""

    released: int = 0
    finished: list[str] = field(default_factory=list)


def finished(messages: Sequence[tuple[Message, str]], using: str) -> Moved:
    """The steps of ``messages`` (each with its handler's result as JSON
    text, ``result_json``) are done: write the steps their handlers added,
    then move them (their followers released). Inside the transaction of
    their acknowledgement."""
    from django_pgqueue.workflows.storing import insert_steps

    moved = Moved()
    if not messages:
        return moved
    with connections[using].cursor() as cursor:
        for message, _ in messages:
            run = message.__dict__.get("workflow")  # the handle, if the handler used it
            if run is not None and run.added:
                moved.released += insert_steps(
                    cursor, run.pk, run.added, run.added_graph(), ending=run.step_name
                )
        cursor.execute(workflows_sql.DONE_SQL, done_params(messages))
        released, workflows = cursor.fetchone()
    moved.released += released
    moved.finished += workflows
    return moved


def acknowledge(
    messages: Sequence[Message],
    steps: Sequence[tuple[Message, str]],
    using: str,
    *,
    async_commit: bool = False,
    skip_locked: bool = False,
) -> tuple[set[int], Moved]:
    """Acknowledge ``messages`` (as lifecycle.ack_leased, same options) and
    move the steps of those acknowledged among ``steps`` (each message of
    ``messages`` that runs a step, with its handler's result as JSON text).
    Returns the ids acknowledged and what the steps' ends did.

    Both go in one round trip (lifecycle.ack_then): in autocommit they are
    one implicit transaction, and the workflows' rows stay locked only for
    that statement, not until the worker's thread comes back to commit.
    When a handler added steps (``adds_steps``) they are written first, by
    those acknowledged only, in the caller's transaction (one it must have
    opened)."""
    if adds_steps(message for message, _ in steps):
        acked = ack_leased(messages, async_commit, skip_locked)
        return acked, finished([(m, value) for m, value in steps if m.id in acked], using)
    then = (workflows_sql.ACKED_DONE_SQL, done_params(steps))
    acked, row = ack_then(messages, then, async_commit, skip_locked)
    assert row is not None
    released, workflows = row
    return acked, Moved(released, list(workflows))


def done_params(steps: Sequence[tuple[Message, str]]) -> list[str]:
    """DONE_SQL's parameters for ``steps`` (each message with its handler's
    result as JSON text): the steps' ids as an array literal, and their
    results as one JSON object by step id, written from the texts as they
    are (the driver would quote a list element by element)."""
    ids = ",".join(str(int(m.workflow_step_id)) for m, _ in steps)  # type: ignore[arg-type]
    results = ",".join(f'"{int(m.workflow_step_id)}":{value}' for m, value in steps)  # type: ignore[arg-type]
    return ["{" + ids + "}", "{" + results + "}"]


def adds_steps(messages: Iterable[Message]) -> bool:
    """Whether the handler of any of ``messages`` added steps to its workflow
    (``message.workflow.add``): they are written with its acknowledgement,
    in a transaction."""
    for message in messages:
        run = message.__dict__.get("workflow")  # the handle, if the handler used it
        if run is not None and run.added:
            return True
    return False


def dead_lettered(message_ids: Sequence[int], using: str) -> None:
    with connections[using].cursor() as cursor:
        cursor.execute(workflows_sql.DEAD_SQL, [list(message_ids)])


def revived(old_ids: Sequence[int], new_ids: Sequence[int], using: str) -> None:
    """Dead letters of steps revived: their messages ``old_ids`` run again as ``new_ids``."""
    with connections[using].cursor() as cursor:
        cursor.execute(workflows_sql.REVIVED_SQL, [list(old_ids), list(new_ids)])


def given_up(step_ids: Sequence[int], using: str) -> list[int]:
    """The steps ``step_ids`` end cancelled, and so do the steps after them
    (but those that allow a failed step). Returns the ids of the messages of
    those that were in the queue (the caller cancels them, or is cancelling
    them)."""
    with connections[using].cursor() as cursor:
        cursor.execute(workflows_sql.GIVEN_UP_SQL, [list(step_ids)])
        return list(cursor.fetchone()[0] or [])


def given_up_messages(message_ids: Sequence[int], using: str) -> None:
    """The messages ``message_ids`` were cancelled, or their dead letters
    resolved: their steps are given up."""
    from django_pgqueue.models.workflows import WorkflowStep

    step_ids = list(
        WorkflowStep.objects.using(using)
        .filter(message_id__in=list(message_ids))
        .values_list("pk", flat=True)
    )
    if step_ids:
        given_up(step_ids, using)


def given_up_dead_letters(dead_letter_ids: Sequence[int], using: str) -> None:
    """The dead letters ``dead_letter_ids`` were resolved: the steps waiting
    in them are given up."""
    with connections[using].cursor() as cursor:
        cursor.execute(workflows_sql.GIVEN_UP_DEAD_LETTERS_SQL, [list(dead_letter_ids)])
