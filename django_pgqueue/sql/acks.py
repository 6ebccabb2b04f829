"""The acknowledgement: the DELETE of the messages a lease still holds,
by lease token (``history`` wraps it to keep the history)."""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from django.db.backends.base.base import BaseDatabaseWrapper

from django_pgqueue.models import Message
from django_pgqueue.sql import table

# Acknowledgement: the ORM cannot return the ids a DELETE removed, and
# QuerySet.delete() adds a transaction of its own (three round trips instead
# of one). The guard is the lease: only rows this lease still holds go.
#
# Messages of one or more claims are acknowledged in one statement: each
# claim's messages share its lease token, so the rows go by token, each group
# an "id = ANY(...)" that the primary key (or a hashed filter) answers. (A
# join of (id, token) pairs against unnest() was planned as a nested loop
# over every leased row: quadratic once several workers hold hundreds.)
ACK_SQL = """
DELETE FROM {table}
WHERE status = 'processing' AND ({groups})
RETURNING id
"""
ACK_GROUP_SQL = "(lease_token = %s::uuid AND id = ANY(%s::bigint[]))"
# The worker's batches of acknowledgements (atomic=False handlers) never
# wait long for a row another transaction has locked (an admin action, a
# script's SELECT ... FOR UPDATE): one locked row must not hold up the
# others, nor the claim sent with them, for LOCK_TIMEOUT each cycle.
#
# A batch first goes as the plain DELETE (ACK_SQL) under BRIEF_LOCK_WAIT_SQL:
# it waits for a locked row at most BRIEF_LOCK_WAIT (the heartbeat's lease
# extension or a cancellation holds one for milliseconds). Locking the rows
# first instead (ACK_UNLOCKED_SQL's FOR UPDATE SKIP LOCKED) costs the server
# 3 us of CPU and 54 bytes of WAL more per message (a lock record per row;
# benchmarks/RESULTS.md, issue 41). A row held longer fails the statement
# (lock_not_available), and the batch goes again as ACK_UNLOCKED_SQL, which
# skips the rows another transaction has locked: they are still leased and
# are acknowledged on a later try, as ACK_UNLOCKED_SQL again.
BRIEF_LOCK_WAIT = "50ms"
BRIEF_LOCK_WAIT_SQL = (
    "SELECT set_config('pgqueue.lock_timeout', current_setting('lock_timeout'), true), "
    f"set_config('lock_timeout', '{BRIEF_LOCK_WAIT}', true)"
)
# Right after the acknowledgement, in its transaction: the session's
# lock_timeout back for the statements sent with it (the claim, the
# groups' promotion).
LOCK_WAIT_BACK_SQL = (
    "SELECT set_config('lock_timeout', current_setting('pgqueue.lock_timeout'), true)"
)
ACK_UNLOCKED_SQL = """
DELETE FROM {table}
WHERE id IN (
    SELECT id FROM {table} WHERE status = 'processing' AND ({groups}) FOR UPDATE SKIP LOCKED)
RETURNING id
"""
# Before acknowledgements sent on their own, outside a caller's transaction:
# their commit, like the claim's, need not wait for the WAL flush (a lost
# acknowledgement only means the message runs again, which atomic=False
# handlers accept).
ASYNC_COMMIT_SQL = "SET LOCAL synchronous_commit = off;"


def ids_by_token(messages: Iterable[Message]) -> dict[uuid.UUID | None, list[int]]:
    """The ids of ``messages`` by lease token: the statements that a lease
    guards take them this way (one claim's messages share its token)."""
    # Grouped by the token's integer: each row of a claim carries its own
    # UUID object, whose __hash__ and __eq__ are Python methods (two calls
    # per message as a dict key), where an int hashes and compares in C.
    groups: dict[int | None, tuple[uuid.UUID | None, list[int]]] = {}
    for message in messages:
        token = message.lease_token
        key = None if token is None else token.int
        group = groups.get(key)
        if group is None:
            group = groups[key] = (token, [])
        group[1].append(message.id)
    return dict(groups.values())


def ack_statement(
    connection: BaseDatabaseWrapper,
    ids: Mapping[uuid.UUID | None, Sequence[int]],
    skip_locked: bool = False,
) -> tuple[str, list[Any]]:
    """ACK_SQL (ACK_UNLOCKED_SQL) for the ids of each lease token (as
    ids_by_token gives them), and its parameters: the ids as an array
    literal, ``{a,b,c}`` (far cheaper than letting the driver quote a list
    element by element)."""
    params: list[Any] = []
    for token, group in ids.items():
        params += [str(token), "{" + ",".join(map(str, group)) + "}"]
    sql = (ACK_UNLOCKED_SQL if skip_locked else ACK_SQL).format(
        table=table(connection, Message), groups=" OR ".join([ACK_GROUP_SQL] * len(ids))
    )
    return sql, params
