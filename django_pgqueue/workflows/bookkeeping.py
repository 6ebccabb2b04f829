"""The steps moved with their messages, in the transaction that moves the
message: acknowledged (``finished``), dead-lettered (``dead_lettered``),
revived (``revived``), cancelled or resolved (``given_up``). The work is
done by the database functions of migration 0018, one call each; a
message that runs no step never comes here (its callers check
``workflow_step_id`` first)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from django.db import connections

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

    ids, results = [], []
    moved = Moved()
    if not messages:
        return moved
    with connections[using].cursor() as cursor:
        for message, value in messages:
            run = message.__dict__.get("workflow")  # the handle, if the handler used it
            if run is not None and run.added:
                moved.released += insert_steps(
                    cursor, run.pk, run.added, run.added_graph(), ending=run.step_name
                )
            ids.append(message.workflow_step_id)
            results.append(value)
        cursor.execute(workflows_sql.DONE_SQL, [ids, results])
        released, workflows = cursor.fetchone()
    moved.released += released
    moved.finished += workflows
    return moved


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
