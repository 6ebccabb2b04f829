"""The one place where the benchmarks reach into django_pgqueue beyond its
public API: what the worker does in-process (claim, acknowledge), the
statements it sends (captured as they run, not rebuilt here), and the
enqueue_many chunk size. Everything else goes through ``enqueue``,
``enqueue_many`` and the ``pgqueue_worker`` command. When the package's
internals move, this module follows them; the scenarios do not change.

Its functions import Django and the package when called: call them once
Django is set up (``harness.db.setup_django``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from benchmarks.harness.db import MESSAGE_TABLE

if TYPE_CHECKING:
    from django_pgqueue.models import Message

# Statements that are transaction control, not the claim itself, alone or
# leading a string of several statements ("SET LOCAL ...; UPDATE ...").
CONTROL = re.compile(r"^\s*(SAVEPOINT|RELEASE|ROLLBACK|BEGIN|COMMIT|SET)\b", re.IGNORECASE)
LEADING_CONTROL = re.compile(
    r"^\s*(?:(?:SAVEPOINT|RELEASE|ROLLBACK|BEGIN|COMMIT|SET)\b[^;%]*;\s*)+", re.IGNORECASE
)

Statement = tuple[str, Sequence[Any]]


def queue_connection() -> Any:
    """The connection of the queue's database alias (PGQUEUE['DATABASE'])."""
    from django.db import connections

    from django_pgqueue import conf

    return connections[conf.database_alias()]


def claim(
    queues: Sequence[str],
    limit: int,
    worker_id: str,
    lease_seconds: float,
    *,
    few_ready: bool = False,
) -> list[Message]:
    """Lease up to ``limit`` ready messages of ``queues`` to ``worker_id``, as
    the worker's main loop does (one statement per queue), and build them as
    its handler threads do. ``few_ready``: as the worker claims after a claim
    that came back short."""
    from django_pgqueue import lifecycle

    result = lifecycle.ack_and_claim_rows(
        (), queues, limit, worker_id, lease_seconds, few_ready=few_ready
    )
    return [lifecycle.message_from_row(row) for row in result.rows]


def claim_statement(
    queue: str, limit: int, worker_id: str, lease_seconds: float, plain: bool = False
) -> tuple[str, list[Any], dict[str, int]]:
    """The worker's claim of ``queue`` as it sends it outside a transaction
    (sql.claim.claim_statement, asynchronous commit, the fair order unless
    the queue is configured "fair": False; ``plain``: the claim of a queue
    without partitions, PLAIN_CLAIM_SQL, whose last column split_plain_claim
    takes off), its parameters (a fresh lease token), and
    the position of each column in the rows it returns."""
    from django_pgqueue import conf
    from django_pgqueue.sql.claim import CLAIM_ATTNAMES
    from django_pgqueue.sql.claim import claim_statement as statement

    sql, params = statement(
        conf.database_alias(),
        queue,
        limit,
        worker_id,
        lease_seconds=lease_seconds,
        async_commit=True,
        fair=queue not in conf.unfair_queues(),
        plain=plain,
    )
    return sql, params, {name: i for i, name in enumerate(CLAIM_ATTNAMES)}


def ack_many(messages: Sequence[Message]) -> set[int]:
    """Acknowledge finished messages of atomic=False handlers in one
    statement, as the worker does; returns the ids finished."""
    from django_pgqueue import lifecycle

    finished, _busy = lifecycle.ack_unlocked(messages)
    return set(finished)


class _Undo(Exception):
    pass


def capture(run: Callable[[], Any], table: str = MESSAGE_TABLE) -> tuple[list[Statement], Any]:
    """The statements ``run()`` sends to ``table`` through the queue's
    connection, captured with Django's execute_wrapper inside a transaction
    that is rolled back (nothing changes; transaction control and a leading
    ``SET LOCAL ...;`` are left out: EXPLAIN takes one statement). Returns
    (the statements, what ``run`` returned)."""
    from django.db import transaction

    conn = queue_connection()
    captured: list[tuple[str, Any, bool]] = []
    result: list[Any] = []

    def wrapper(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        captured.append((sql, params, many))
        return execute(sql, params, many, context)

    with conn.execute_wrapper(wrapper):
        try:
            with transaction.atomic(using=conn.alias):
                result.append(run())
                raise _Undo
        except _Undo:
            pass
    statements = []
    for sql, params, many in captured:
        sql = LEADING_CONTROL.sub("", sql)
        if not many and sql.strip() and not CONTROL.match(sql) and table in sql:
            statements.append((sql, params))
    if not statements:
        raise RuntimeError(f"no statement on {table} was captured")
    return statements, result[0]


def claim_statements(
    queue: str, limit: int, worker_id: str, lease_seconds: float, few_ready: bool = False
) -> tuple[list[Statement], int]:
    """The statements one claim of ``queue`` sends now (inside a transaction,
    so with a durable commit), and how many messages it would have leased."""
    statements, claimed = capture(
        lambda: claim([queue], limit, worker_id, lease_seconds, few_ready=few_ready)
    )
    return statements, len(claimed)


def enqueue_statement(topic: str) -> Statement:
    """The INSERT that ``enqueue(topic, {"n": 0})`` sends, and its parameters."""
    from django_pgqueue import enqueue

    statements, _ = capture(lambda: enqueue(topic, {"n": 0}))
    inserts = [s for s in statements if s[0].lstrip().upper().startswith("INSERT")]
    return inserts[0]
