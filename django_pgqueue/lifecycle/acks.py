"""Acknowledgement: processing -> (deleted), if the lease still holds the row.

The worker acknowledges an atomic handler's message inside the handler's
transaction (``ack``, or ``ack_leased`` for a batch sharing one), and the
messages of atomic=False handlers in batches that never wait long for a
row another transaction has locked (``ack_unlocked``, or with its next
claim: claim.ack_and_claim_rows; sql.acks says how).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from django.db import OperationalError, connections
from django.db.models import Q

from django_pgqueue import conf
from django_pgqueue.db import lock_timed_out
from django_pgqueue.lifecycle.guards import log_lease_lost
from django_pgqueue.models import Message, Status
from django_pgqueue.sql import acks as acks_sql
from django_pgqueue.sql import history as history_sql
from django_pgqueue.sql import timeouts as timeouts_sql


def ack(message: Message) -> bool:
    """Finish ``message``: delete its row if this lease still holds it.

    Called inside the handler's transaction for atomic handlers, so the
    handler's writes and the removal commit together. False: the lease was
    lost, and the caller must roll back.
    """
    if ack_leased([message]):
        return True
    log_lease_lost(message, "not acknowledged")
    return False


def ack_unlocked(
    messages: Sequence[Message], wait_briefly: bool = True
) -> tuple[set[int], set[int]]:
    """Finish many messages (non-atomic handlers) in one DELETE, leaving the
    rows another transaction holds locked. Returns (the ids finished, the
    ids still leased but locked: acknowledge them again later); the others
    lost their lease (logged). Outside a transaction its commit, like the
    claim's, does not wait for the WAL to reach the disk: a lost
    acknowledgement only means the message runs again, which atomic=False
    handlers accept.

    ``wait_briefly`` (outside a transaction only: a failed statement would
    break the caller's): the DELETE first waits for a locked row at most
    sql.acks.BRIEF_LOCK_WAIT, the cheaper statement; past it, the rows
    locked are skipped (the caller's retries of those pass False)."""
    if not messages:
        return set(), set()
    async_commit = not connections[conf.database_alias()].in_atomic_block
    if wait_briefly and async_commit:
        try:
            finished = ack_then(messages, None, async_commit, brief_lock_wait=True)[0]
        except OperationalError as exc:
            if not lock_timed_out(exc):
                raise
            finished = ack_leased(messages, async_commit, skip_locked=True)
    else:
        finished = ack_leased(messages, async_commit, skip_locked=True)
    return finished, unacknowledged(messages, finished)


def unacknowledged(messages: Sequence[Message], finished: set[int]) -> set[int]:
    """The ids of ``messages`` not in ``finished`` that their lease still
    holds (their row was locked); the others lost their lease (logged)."""
    missing = [m for m in messages if m.id not in finished]
    busy = still_leased(missing) if missing else set()
    for message in missing:
        if message.id not in busy:
            log_lease_lost(message, "not acknowledged")
    return busy


def still_leased(messages: Sequence[Message]) -> set[int]:
    """The ids of ``messages`` that their own lease still holds: one plain
    SELECT, which never waits for a row lock."""
    held = Q()
    for token, ids in acks_sql.ids_by_token(messages).items():
        held |= Q(pk__in=ids, lease_token=token)
    return set(
        Message.objects.using(conf.database_alias())
        .filter(held, status=Status.PROCESSING)
        .values_list("pk", flat=True)
    )


def ack_leased(
    messages: Sequence[Message], async_commit: bool = False, skip_locked: bool = False
) -> set[int]:
    """Delete each of ``messages`` whose lease (its own token) still holds it,
    in one statement; returns the ids deleted. Inside the caller's
    transaction: the atomic batch compares the ids with what it expected and
    rolls back when a lease was lost. ``async_commit`` (autocommit only):
    the statement's commit does not wait for the WAL flush. ``skip_locked``:
    leave the rows another transaction has locked (else wait for them, up to
    LOCK_TIMEOUT: an atomic handler's transaction would rather commit a
    moment later than roll back its work)."""
    if not messages:
        return set()  # (no statement: an empty condition is not SQL)
    return ack_then(messages, None, async_commit, skip_locked)[0]


def ack_then(
    messages: Sequence[Message],
    then: tuple[str, Sequence[Any]] | None,
    async_commit: bool = False,
    skip_locked: bool = False,
    brief_lock_wait: bool = False,
) -> tuple[set[int], tuple[Any, ...] | None]:
    """``ack_leased``, and the statement ``then`` (SQL, parameters) right
    after it, sent together: one round trip, and in autocommit one implicit
    transaction (both commit or neither). Returns the ids deleted and the
    first row of ``then`` (None without it). ``then`` sees the deletions:
    a workflow step's bookkeeping moves the steps whose message is gone.
    ``brief_lock_wait`` (without ``then`` and ``skip_locked``): wait for a
    locked row at most sql.acks.BRIEF_LOCK_WAIT (else lock_not_available),
    not LOCK_TIMEOUT."""
    connection = connections[conf.database_alias()]
    statement, params = history_sql.ack_statement(
        connection, acks_sql.ids_by_token(messages), skip_locked
    )
    if async_commit:
        statement = acks_sql.ASYNC_COMMIT_SQL + statement
    skip = 0
    if brief_lock_wait:
        statement, skip = f"{acks_sql.BRIEF_LOCK_WAIT_SQL};{statement}", 1
    elif not skip_locked:  # only a statement that may wait for a lock needs the limits
        statement, params, skip = timeouts_sql.with_limits(statement, params)
    if then is not None:
        statement = f"{statement};{then[0]}"
        params = [*params, *then[1]]
    with connection.cursor() as cursor:
        cursor.execute(statement, params)
        for _ in range(skip + async_commit):
            cursor.nextset()  # past the limits and the SET LOCAL
        acked = {row[0] for row in cursor.fetchall()}
        if then is None:
            return acked, None
        cursor.nextset()
        return acked, cursor.fetchone()
