"""Running tasks: the handler of ``TASK_TOPIC`` messages, which the worker
runs like any other, and the mark it commits when a task's function begins."""

from __future__ import annotations

import dataclasses
import datetime
import os
import threading
import uuid
from typing import Any

import psycopg
from django.db import connections, transaction
from django.tasks.base import Task, TaskContext, TaskError, TaskResult, TaskResultStatus
from django.tasks.signals import task_finished, task_started
from django.utils import timezone
from django.utils.json import normalize_json

from django_pgqueue import conf, policy, registry
from django_pgqueue.exceptions import Permanent, Retry, describe
from django_pgqueue.fields import finite_sql
from django_pgqueue.models import Category, Message, TaskRecord, TaskStatus
from django_pgqueue.sql import table
from django_pgqueue.tasks import errors, options
from django_pgqueue.tasks.options import TASK_TOPIC
from django_pgqueue.tasks.results import load_task, task_result


# (django-stubs declares TaskContext without its frozen=True.)
@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class WorkflowTaskContext(TaskContext):  # type: ignore[misc]
    """A task step's context (``takes_context=True``): Django's, with the
    step's workflow (``message.workflow`` of a handler): ``results()``,
    ``result(name)``, ``add(...)``."""

    workflow: Any


@registry.handler(TASK_TOPIC, atomic=True)
def run_task(message: Message) -> Any:
    """Run the task of ``message``; its result is written in the handler's
    transaction, with the acknowledgement. A failure is raised to the
    worker (the failure policy decides), after the task's own ``backoff``,
    if it has one, has chosen the delay; its error goes with the message
    to the receiver of ``message_retried`` (errors.attach)."""
    using = conf.database_alias()
    payload = message.payload if isinstance(message.payload, dict) else {}
    try:
        record = TaskRecord.objects.using(using).get(pk=payload["result_id"])
    except (KeyError, ValueError, TaskRecord.DoesNotExist):
        raise Permanent(
            f"task message without a task record (result_id={payload.get('result_id')!r})"
        ) from None
    try:
        # Committed at once, outside the handler's transaction: from here on
        # readers see RUNNING, and a run lost with this worker still counts.
        record.worker_ids, record.started_at, record.last_attempted_at = mark_started(
            record.pk, message, using
        )
        task = load_task(payload.get("task", record.task_path), record)
    except BaseException as exc:
        errors.attach(message, errors.from_exception(exc))
        raise
    # The arguments it runs with: its message's (perhaps edited before a revive).
    args = record.args = payload.get("args", record.args)
    kwargs = record.kwargs = payload.get("kwargs", record.kwargs)
    attempt = task_result(record, task, TaskResultStatus.RUNNING, finished_at=None)
    backend_class = type(task.get_backend())
    task_started.send(sender=backend_class, task_result=attempt)
    try:
        if task.takes_context:
            context = (
                TaskContext(task_result=attempt)
                if message.workflow is None
                else WorkflowTaskContext(task_result=attempt, workflow=message.workflow)
            )
            value = task.call(context, *args, **kwargs)
        else:
            value = task.call(*args, **kwargs)
        value = normalize_json(value)
    except BaseException as exc:  # noqa: BLE001  (SystemExit & co. are failures too)
        error = errors.from_exception(exc)
        errors.attach(message, error)
        _raise_with_backoff(exc, error, task, attempt, message)
        raise
    finished = timezone.now()
    TaskRecord.objects.using(using).filter(pk=record.pk).update(
        status=TaskStatus.SUCCESSFUL,
        return_value=value,
        finished_at=finished,
        args=attempt.args,
        kwargs=attempt.kwargs,
        message_id=message.pk,
    )
    # TaskResult is frozen: changed as Django's own backends change it.
    object.__setattr__(attempt, "status", TaskResultStatus.SUCCESSFUL)
    object.__setattr__(attempt, "finished_at", finished)
    object.__setattr__(attempt, "_return_value", value)
    transaction.on_commit(
        lambda: task_finished.send(sender=backend_class, task_result=attempt), using=using
    )
    return value  # a workflow step's result


def _raise_with_backoff(
    exc: BaseException, error: TaskError, task: Task, attempt: TaskResult, message: Message
) -> None:
    """Raise Retry(after=<the task's backoff>) or Permanent (backoff said no)
    from ``exc``; return (the worker then applies the policy to ``exc`` as
    it is) when there is no backoff, the policy would not retry, or the
    attempts are used up."""
    chosen = options.backoff(task)
    if chosen is None or (isinstance(exc, Retry) and exc.after is not None):
        return  # no backoff, or the task chose its own delay
    backoff = options.loaded(chosen)
    category = policy.classify(exc, message)
    if category in (Category.PERMANENT, Category.BUSINESS):
        return
    if message.attempts >= policy.max_attempts_for(message, registry.lookup(TASK_TOPIC)):
        return
    failed = dataclasses.replace(
        attempt, status=TaskResultStatus.FAILED, errors=[*attempt.errors, error]
    )
    delay = backoff(exc, failed)
    if delay is None:
        raise Permanent(f"{errors.STOPPED_AFTER}{describe(exc)}") from exc
    raise Retry(f"{errors.RETRY_AFTER}{describe(exc)}", after=delay) from exc


# --- the start mark ---------------------------------------------------------------

# Marks a run as begun (see mark_started). The worker's id is appended once
# per lease, however often the handler runs under it (an atomic batch that
# rolls back runs its handlers again, one by one).
MARK_STARTED_SQL = """
UPDATE {table} SET
    worker_ids = CASE WHEN started_lease IS NOT DISTINCT FROM %(lease)s THEN worker_ids
                      ELSE worker_ids || jsonb_build_array(%(worker)s::text) END,
    started_at = COALESCE(started_at, %(now)s),
    last_attempted_at = CASE WHEN started_lease IS NOT DISTINCT FROM %(lease)s
                             THEN last_attempted_at ELSE %(now)s END,
    started_lease = %(lease)s
WHERE id = %(id)s
RETURNING worker_ids, {started_at}, {last_attempted_at}
""".format(
    table="{table}",
    # Read clamped as the ORM reads them (a value written by hand may be 'infinity').
    started_at=finite_sql("started_at"),
    last_attempted_at=finite_sql("last_attempted_at"),
)

# A handler's own transaction is open while its start is marked: the mark
# waits at most this long for the record's row lock (held only by another
# transaction writing the same record), then fails the attempt (retried)
# rather than hang.
MARK_STARTED_LOCK_TIMEOUT_MS = 10_000


def mark_started(
    record_id: uuid.UUID, message: Message, using: str
) -> tuple[list[str], datetime.datetime, datetime.datetime]:
    """Record, committed at once, that the task's function of ``message``
    begins now under its lease, on a connection of the thread's own (the
    handler's transaction would show it only at its end). Returns
    (worker_ids, started_at, last_attempted_at) as they now are."""
    params = {
        "id": record_id,
        "lease": message.lease_token,
        "worker": message.locked_by,
        "now": timezone.now(),
    }
    statement = MARK_STARTED_SQL.format(table=table(connections[using], TaskRecord))
    row = None
    for attempt in (1, 2):
        conn = _side_connection(using)
        try:
            row = conn.execute(statement, params).fetchone()
            break
        except psycopg.OperationalError:
            if not conn.broken or attempt == 2:
                raise  # a lock timeout, or the server is gone: the attempt fails (retried)
            close_side_connection(using)  # dropped (a restart, a terminated backend): again
    if row is None:
        # Another connection cannot see a record that this connection's open
        # transaction created: a test's transaction (django_pgqueue.testing's
        # drain() inside a TestCase), which never commits. Marked there.
        with connections[using].cursor() as cursor:
            cursor.execute(statement, params)
            row = cursor.fetchone()
    if row is None:
        raise Permanent(f"the task record {record_id} was deleted while its task was claimed")
    worker_ids, started_at, last_attempted_at = row
    return worker_ids, started_at, last_attempted_at


_side = threading.local()


class _SideConnection:
    """A thread's own autocommit connection to the queue's database, closed
    when the thread ends (its thread-local slot is freed)."""

    def __init__(self, using: str) -> None:
        params = connections[using].get_connection_params()
        params.pop("cursor_factory", None)
        params.pop("context", None)
        params["application_name"] = f"pgqueue_tasks#{os.getpid()}"
        self.conn = psycopg.connect(**params, autocommit=True)
        self.conn.execute(f"SET lock_timeout = {int(MARK_STARTED_LOCK_TIMEOUT_MS)}")

    def __del__(self) -> None:
        self.conn.close()


def _side_connection(using: str) -> psycopg.Connection[Any]:
    held: dict[str, _SideConnection] | None = getattr(_side, "connections", None)
    if held is None:
        held = _side.connections = {}
    side = held.get(using)
    if side is None or side.conn.closed:
        side = held[using] = _SideConnection(using)
    return side.conn


def close_side_connection(using: str) -> None:
    """Close this thread's side connection to ``using``, if it has one (a
    worker's handler threads end, which frees theirs; a thread that lives
    on, such as a test's with django_pgqueue.testing's drain(), closes it:
    an open connection keeps the test database from being dropped)."""
    side = getattr(_side, "connections", {}).pop(using, None)
    if side is not None:
        side.conn.close()
