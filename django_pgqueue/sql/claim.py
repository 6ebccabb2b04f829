"""The claim: the one statement that leases up to a limit of one queue's
ready messages, and the decoding of the rows it returns into the values of
a Message. The claim of a queue with limits builds on it (``limited``).
"""

from __future__ import annotations

import functools
import json
import uuid
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from django.db import connections
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.models import Field, JSONField

from django_pgqueue.models import Message, timestamp_from_text
from django_pgqueue.sql import table

# The claim: lease up to a limit of one queue's ready messages in one
# statement, returning them. Written by hand because the ORM cannot UPDATE
# ... FROM a CTE, return the rows it changed, or find them by address.
#
# "clock" is the database's now() unless the caller gives a time. Outside a
# caller's transaction, clock also makes the commit asynchronous
# ({async_commit}): a claim's commit need not wait for the WAL to reach the
# disk. Safe: had the server crashed and lost such a commit, the message
# would simply be waiting again, and any later durable commit (a handler's,
# an acknowledgement's) flushes the WAL up to it first. (A function in the
# statement, not SET LOCAL before it, keeps the claim one statement, which
# can be prepared.)
#
# The subquery picks the rows in claim order with FOR UPDATE SKIP LOCKED:
# concurrent claims never wait for each other and never take the same row.
# The UPDATE finds the picked rows again by their physical address (ctid, a
# Tid Scan of the array the subquery returns), not by id: a join on id looks
# every row up in the primary key again, a B-tree that gets deeper as the
# table grows, or hashes a sequential scan of the whole table when the
# planner thinks it cheaper; either way the cost of a claim would grow with
# rows it does not touch. The address is safe within the statement: the
# subquery's FOR UPDATE holds the row locked from there to the commit, so
# nothing can move or remove it. Should another transaction update a
# waiting row after this statement's snapshot and before the lock (the lock
# then follows the row to its new version), the new version is invisible to
# the UPDATE's scan: the row is not claimed this time and stays waiting.
#
# The status picked is written in the text, never bound: a prepared claim's
# generic plan must be able to prove the partial indexes' predicate
# (status = 'waiting'); with the status a parameter it could not, and
# PostgreSQL would plan the claim again on every call.
#
# {ready_until} is statement_timestamp() unless the caller fixes the time:
# the planner folds that stable function into a constant when it estimates,
# so with few ready rows among many delayed ones it reads the ready ones
# through the due index instead of walking every delayed entry of the claim
# index (a subquery, as the fixed time needs, hides the value from it).
#
# {order}: claim order (priority, run_at, id), which the claim index holds;
# or, when the caller expects few ready messages (few_ready), oldest first,
# the due index's order, which holds the ready rows at its head whatever the
# planner's statistics say.
#
# {limit}: bound (%s, after the queue) so that one text serves every size:
# it is prepared once and can run with the generic plan, where a text per
# size would be planned again on each of its first calls, and most sizes
# never get past them. Except in a few_ready claim, whose size is nearly
# always the same (a quiet queue has every slot free): there only a limit
# the planner can see keeps the generic plan's estimate down while the
# statistics still describe a drained backlog; with a bound one PostgreSQL
# kept choosing custom plans and planned every such claim.
# benchmarks/scale.py counts the generic and custom plans of both.
#
# A row written by another client may hold what no enqueue writes: the
# attempt count stops at the integer's maximum (one such row must not fail
# every claim of its queue), and a run_at of '-infinity' becomes the claim's
# time (Python has no datetime for it).
# What a claim sets on the rows it leases (parameters: the lease token, its
# seconds, the worker), here and in the claim of a queue with limits (limited).
CLAIM_SET = """SET status = 'processing', attempts = LEAST(m.attempts, 2147483646) + 1,
    lease_token = %s,
    lease_expires_at = clock.now + make_interval(secs => %s), locked_by = %s,
    updated_at = clock.now,
    run_at = CASE WHEN isfinite(m.run_at) THEN m.run_at ELSE clock.now END"""
CLAIM_SQL = (
    """
WITH clock AS (SELECT COALESCE(%s::timestamptz, now()) AS now{async_commit})
UPDATE {table} AS m """
    + CLAIM_SET
    + """
FROM clock
WHERE m.ctid = ANY(ARRAY(
    SELECT ctid FROM {table}
    WHERE queue = %s AND status = 'waiting' AND run_at <= {ready_until}
    ORDER BY {order} LIMIT {limit} FOR UPDATE SKIP LOCKED))
RETURNING {columns}
"""
)
ASYNC_COMMIT_COLUMN = ", set_config('synchronous_commit', 'off', true) AS async_commit"
_CLAIM_ORDER = "priority DESC, run_at, id"
_FEW_READY_ORDER = "run_at"

# The claim returns every column of the message, in the model's order, so
# that a row becomes a Message without another query (decode_claim_row,
# lifecycle.message_from_row). Timestamps come as text: timestamp_from_text
# loads them far more cheaply than the driver's timestamptz loader, and
# loads the infinities another client may have written.
CLAIM_FIELDS: list[Field[Any, Any]] = list(Message._meta.concrete_fields)
CLAIM_ATTNAMES = [f.attname for f in CLAIM_FIELDS]
_TIMESTAMP_COLUMNS = [
    i for i, f in enumerate(CLAIM_FIELDS) if f.get_internal_type() == "DateTimeField"
]
_JSON_COLUMNS = [(i, f) for i, f in enumerate(CLAIM_FIELDS) if isinstance(f, JSONField)]
_JSON_DECODER = json.JSONDecoder()  # what json.loads uses without options
# Positions in the claim's rows.
ROW_ID, ROW_TOPIC, ROW_ATTEMPTS, ROW_PRIORITY, ROW_RUN_AT = (
    CLAIM_ATTNAMES.index(name) for name in ("id", "topic", "attempts", "priority", "run_at")
)


def claim_statement(
    using: str,
    queue: str,
    limit: int,
    worker_id: str,
    now: datetime | None = None,
    lease_seconds: float = 60,
    *,
    async_commit: bool = False,
    few_ready: bool = False,
    token: uuid.UUID | None = None,
) -> tuple[str, list[Any]]:
    """The claim's UPDATE for one queue (CLAIM_SQL) and its parameters, under
    ``token`` (a fresh lease token by default; params[1]). Also for EXPLAIN."""
    sql = _claim_sql(using, now is not None, async_commit, limit if few_ready else None)
    params: list[Any] = [now, token or uuid.uuid4(), lease_seconds, worker_id, queue]
    if not few_ready:
        params.append(limit)
    return sql, params


@functools.lru_cache(maxsize=128)
def _claim_sql(using: str, fixed_now: bool, async_commit: bool, written_limit: int | None) -> str:
    """CLAIM_SQL for ``using``; ``written_limit``: a few_ready claim's limit,
    written into the text (else the limit is bound)."""
    connection = connections[using]
    return CLAIM_SQL.format(
        async_commit=ASYNC_COMMIT_COLUMN if async_commit else "",
        table=table(connection, Message),
        ready_until="(SELECT now FROM clock)" if fixed_now else "statement_timestamp()",
        order=_CLAIM_ORDER if written_limit is None else _FEW_READY_ORDER,
        limit="%s" if written_limit is None else str(int(written_limit)),
        columns=claim_columns(connection),
    )


def claim_columns(connection: BaseDatabaseWrapper) -> str:
    """The claim's RETURNING list: every column, timestamps as text."""
    quote = connection.ops.quote_name
    return ", ".join(
        f"m.{quote(str(f.column))}" + ("::text" if i in _TIMESTAMP_COLUMNS else "")
        for i, f in enumerate(CLAIM_FIELDS)
    )


def decode_claim_row(row: Sequence[Any]) -> tuple[list[Any], str | None]:
    """The values of a claim's row as the model's fields hold them, and why
    a JSON column could not be loaded (None when all could). The JSON as
    JSONField.from_db_value decodes it, minus its checks for key lookups
    and the parse of the usual empty headers; the timestamps by
    timestamp_from_text."""
    values = list(row)
    undecodable = None
    for index, json_field in _JSON_COLUMNS:
        text = values[index]
        if text == "{}":
            values[index] = {}
        elif text is not None:
            try:
                values[index] = _load_json(text, json_field.decoder)
            except RecursionError:
                # Only another client's SQL can store this (enqueue refuses it).
                values[index] = None
                undecodable = f"the {json_field.attname} is nested too deeply for Python's"
                undecodable += " JSON decoder"
    for index in _TIMESTAMP_COLUMNS:
        values[index] = timestamp_from_text(values[index])
    return values, undecodable


def _load_json(text: str, decoder: type[json.JSONDecoder] | None) -> Any:
    """``json.loads(text, cls=decoder)``. PostgreSQL's text of a jsonb value
    is one document without surrounding space, which raw_decode reads
    without json.loads' two whitespace scans (regex calls, per message);
    anything else goes through json.loads."""
    if decoder is None:
        try:
            value, end = _JSON_DECODER.raw_decode(text)
        except ValueError:
            pass
        else:
            if end == len(text):
                return value
    return json.loads(text, cls=decoder)
