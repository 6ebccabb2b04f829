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
# The pick (PICK_SQL, below) reads the rows in claim order with FOR UPDATE
# SKIP LOCKED: concurrent claims never wait for each other and never take
# the same row.
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
# The default partition's stream is read in claim order (priority, run_at,
# id), which the claim index holds; or, when the caller expects few ready
# messages (few_ready), oldest first, the due index's order, which holds the
# ready rows at its head whatever the planner's statistics say.
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

# What a claim sets on the rows it leases, here and in the claim of a queue
# with limits (limited): the lease token, its seconds and the worker come
# from the statement's "clock" (CLAIM_CLOCK: the parameters after the
# time). A leased message leaves the rotation: its round is cleared, so that
# a message put back to waiting (a retry, a rescue) rejoins it.
CLAIM_SET = """SET status = 'processing', attempts = LEAST(m.attempts, 2147483646) + 1,
    lease_token = clock.token,
    lease_expires_at = clock.now + make_interval(secs => clock.lease), locked_by = clock.worker,
    updated_at = clock.now, fair_tag = NULL,
    run_at = CASE WHEN isfinite(m.run_at) THEN m.run_at ELSE clock.now END"""

# The pick: the claimable rows of one queue, as candidates from each of
# three streams, each read from the head of its own partial index with FOR
# UPDATE SKIP LOCKED (models.Message's indexes):
# - "tagged": rows with their round (fair_tag), round by round, oldest
#   first within one (pgqueue_msg_fair_idx): one per partition per round.
#   enqueue() gives a keyed message due at once its round (its partition's
#   previous round + 1, or the queue's current round if later); the claim
#   gives the others theirs (below).
# - "untagged": keyed rows that became ready without a round (a delay, a
#   retry, a release, plain SQL), oldest first (pgqueue_msg_keyed_idx: by
#   run_at, so that the rows not yet due end the scan).
# - "plain": the default partition's rows (no key) without a round, in
#   claim order (pgqueue_msg_claim_idx). A queue without partitions has
#   only this stream; the two others cost it an empty index descent each,
#   and it reads {window} rows (the size asked), as the claim always did.
# The current round is the lowest among the tagged candidates. A candidate
# without a round takes its partition's next one (after the partition's
# last, pgqueue_msg_round_idx), or the current round on: it joins the
# rotation where a new partition would; the first of each partition that
# the claim does not take keeps it (RANKED_SQL). {order} then ranks them all: by
# priority, round, run_at, id ("fair"), or by priority, run_at, id (a queue
# with "fair": False, whose rows get no round).
# {plain_filter} and {keyed_filter}: nothing, or (a queue with limits per
# partition) the exclusion of the partitions without a free slot.
# Parameters: pick_params().
PICK_SQL = """
tagged AS MATERIALIZED (
    SELECT ctid, priority, run_at, id, partition_key, fair_tag FROM {table}
    WHERE queue = %s AND status = 'waiting' AND fair_tag IS NOT NULL
        AND run_at <= {ready_until}{keyed_filter}
    ORDER BY priority DESC, fair_tag, id LIMIT {window} FOR UPDATE SKIP LOCKED),
untagged AS MATERIALIZED (
    SELECT ctid, priority, run_at, id, partition_key FROM {table}
    WHERE queue = %s AND status = 'waiting' AND partition_key IS NOT NULL AND fair_tag IS NULL
        AND run_at <= {ready_until}{keyed_filter}
    ORDER BY run_at, id LIMIT {window} + {rank_extra} FOR UPDATE SKIP LOCKED),
plain AS MATERIALIZED (
    SELECT ctid, priority, run_at, id FROM {table}
    WHERE queue = %s AND status = 'waiting' AND partition_key IS NULL AND fair_tag IS NULL
        AND run_at <= {ready_until}{plain_filter}
    ORDER BY {plain_order}
    LIMIT CASE WHEN EXISTS (SELECT FROM tagged) OR EXISTS (SELECT FROM untagged)
        THEN {window} + {rank_extra} ELSE {window} END
    FOR UPDATE SKIP LOCKED),
round AS (
    SELECT COALESCE(min(fair_tag), 0) AS tag, (
        SELECT fair_tag FROM {table}
        WHERE queue = %s AND partition_key IS NULL AND status = 'waiting'
            AND fair_tag IS NOT NULL
        ORDER BY partition_key DESC NULLS FIRST, fair_tag DESC LIMIT 1) AS default_last
    FROM tagged),
candidates AS (
    SELECT p.ctid, p.priority, p.run_at, p.id, NULL::varchar AS partition_key,
        GREATEST(r.default_last + 1, r.tag) - 1
        + row_number() OVER (ORDER BY p.priority DESC, p.run_at, p.id) AS tag,
        true AS fresh
    FROM plain AS p, round AS r
    UNION ALL
    SELECT ctid, priority, run_at, id, partition_key, fair_tag, false FROM tagged
    UNION ALL
    SELECT u.ctid, u.priority, u.run_at, u.id, u.partition_key,
        GREATEST(last.tag + 1, r.tag) - 1 + row_number() OVER (
            PARTITION BY u.partition_key ORDER BY u.priority DESC, u.run_at, u.id),
        true
    FROM untagged AS u CROSS JOIN round AS r LEFT JOIN LATERAL (
        SELECT fair_tag AS tag FROM {table}
        WHERE queue = %s AND partition_key = u.partition_key AND status = 'waiting'
            AND fair_tag IS NOT NULL
        ORDER BY fair_tag DESC LIMIT 1) AS last ON true)"""
# In a round, the oldest first: a row ranked as it is read (a retry, a
# delayed message) is as old as its run_at, not its id.
FAIR_ORDER = "priority DESC, tag, run_at, id"
# How many rows without a round the pick reads from each such stream beyond
# the claim's size, in a queue with partitions (RANKED_SQL).
RANK_EXTRA = 1
STRICT_ORDER = "priority DESC, run_at, id"


def pick_sql(
    table_name: str,
    ready_until: str,
    window: str,
    *,
    plain_order: str = "priority DESC, run_at, id",
    plain_filter: str = "",
    keyed_filter: str = "",
    fair: bool = True,
) -> str:
    """PICK_SQL's CTEs (after a WITH that defines ``clock``); ``fair``: the
    claim ranks by round (else the streams are read {window} deep)."""
    return PICK_SQL.format(
        rank_extra=RANK_EXTRA if fair else 0,
        table=table_name,
        ready_until=ready_until,
        window=window,
        plain_order=plain_order,
        plain_filter=plain_filter,
        keyed_filter=keyed_filter,
    )


def pick_params(queue: str, window: int | None) -> list[Any]:
    """PICK_SQL's parameters (``window``: None when written in the text)."""
    if window is None:
        return [queue, queue, queue, queue, queue]
    return [queue, window, queue, window, queue, window, window, queue, queue]


# The claim's time ({now}: the database's now(), or statement_timestamp()),
# its lease token, the lease's seconds and the worker.
CLAIM_CLOCK = """clock AS (
    SELECT COALESCE(%s::timestamptz, {now}) AS now, %s::uuid AS token,
        %s::float8 AS lease, %s::varchar AS worker{async_commit})"""
CLAIM_SQL = (
    """
WITH """
    + CLAIM_CLOCK
    + """,{pick},
chosen AS MATERIALIZED (SELECT ctid FROM candidates ORDER BY {order} LIMIT {limit}){ranked}
UPDATE {table} AS m """
    + CLAIM_SET
    + """
FROM clock
WHERE m.ctid = ANY(ARRAY(SELECT ctid FROM chosen))
RETURNING {columns}
"""
)
# The claim of a queue believed to have no partitions (the worker's, until
# a claim says otherwise: lifecycle.ack_and_claim_rows): the default
# partition's stream alone, read from the claim index as every claim was
# before partitions, without the pick's other streams and ranks (a plan of
# a few nodes, not fifty: a quarter of a small claim's time). Each row it
# returns ends with whether the queue has rows this claim cannot see (with
# a round, or keyed): the caller then claims the rest with CLAIM_SQL. It
# reads the head of each of their indexes, in its order: an EXISTS let the
# planner read the table from its start for a first row, and while another
# queue held a million rows with a round it did, at every claim.
# Parameters: the clock's, the queue three times, [the limit].
PLAIN_CLAIM_SQL = (
    """
WITH clock AS (
    SELECT COALESCE(%s::timestamptz, now()) AS now, %s::uuid AS token,
        %s::float8 AS lease, %s::varchar AS worker,
        (SELECT fair_tag FROM {table}
         WHERE queue = %s AND status = 'waiting' AND fair_tag IS NOT NULL
         ORDER BY priority DESC, fair_tag LIMIT 1) IS NOT NULL
        OR (SELECT run_at FROM {table}
            WHERE queue = %s AND status = 'waiting' AND partition_key IS NOT NULL
                AND fair_tag IS NULL
            ORDER BY run_at LIMIT 1) IS NOT NULL AS unseen{async_commit})
UPDATE {table} AS m """
    + CLAIM_SET
    + """
FROM clock
WHERE m.ctid = ANY(ARRAY(
    SELECT ctid FROM {table}
    WHERE queue = %s AND status = 'waiting' AND partition_key IS NULL AND fair_tag IS NULL
        AND run_at <= {ready_until}
    ORDER BY {order} LIMIT {limit} FOR UPDATE SKIP LOCKED))
RETURNING {columns}, clock.unseen
"""
)


def split_plain_claim(rows: list[tuple[Any, ...]]) -> tuple[list[tuple[Any, ...]], bool | None]:
    """PLAIN_CLAIM_SQL's rows as (the claimed messages' rows, whether the
    queue has rows it cannot see: None when it claimed none, which says
    nothing)."""
    if not rows:
        return rows, None
    return [row[:-1] for row in rows], rows[0][-1]


# The rows to_rank names get their rounds: by address, as the claim (a join
# of the table to the candidates on ctid may read the whole table;
# array_position() over a window of addresses costs far less).
_RANK_UPDATE = """
ranked AS (
    UPDATE {table} AS t SET fair_tag = (
        SELECT r.tags[array_position(r.ctids, t.ctid)] FROM to_rank AS r)
    WHERE t.ctid = ANY((SELECT ctids FROM to_rank)::tid[]))"""
# Of the candidates ranked as they were read (the default partition's, and
# keyed ones without a round), each partition's first that the claim did
# not take keeps the round it was given: the next claim ranks the
# partition's others after it, so a partition that had its turn in a round
# does not get another in it (ranked afresh, it would be given the current
# round again at each claim). One row per partition, once: the pick reads
# those streams one row deeper than the claim's size in a queue with
# partitions, so that a partition whose rows the claim takes leaves one to
# remember its turn by. It is locked by the pick; once ranked, it is read
# from pgqueue_msg_fair_idx. A queue without partitions takes every
# candidate, so has none to rank.
RANKED_SQL = (
    """,
to_rank AS (
    SELECT array_agg(a.ctid) AS ctids, array_agg(a.tag) AS tags FROM (
        SELECT DISTINCT ON (c.partition_key) c.ctid, c.tag FROM candidates AS c
        WHERE c.fresh AND NOT EXISTS (SELECT 1 FROM chosen AS h WHERE h.ctid = c.ctid)
        ORDER BY c.partition_key, c.tag) AS a),"""
    + _RANK_UPDATE
)
# In a queue with "fair": False, a keyed row's "round" is its run_at in
# microseconds (enqueue() gives it so, sql.insert): pgqueue_msg_fair_idx then
# holds its keyed rows in strict priority, run_at, id order, as the claim
# index holds the others. The claim gives it to the keyed candidates read
# without one (a retry, a delay, plain SQL) that it does not take ('-infinity':
# the smallest).
RANKED_STRICT_SQL = (
    """,
to_rank AS (
    SELECT array_agg(c.ctid) AS ctids,
        array_agg(CASE WHEN isfinite(c.run_at)
            THEN (extract(epoch FROM c.run_at) * 1000000)::bigint
            ELSE -9223372036854775807 END) AS tags
    FROM candidates AS c
    WHERE c.fresh AND c.partition_key IS NOT NULL
        AND NOT EXISTS (SELECT 1 FROM chosen AS h WHERE h.ctid = c.ctid)),"""
    + _RANK_UPDATE
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
    fair: bool = True,
    plain: bool = False,
) -> tuple[str, list[Any]]:
    """The claim's UPDATE for one queue (CLAIM_SQL) and its parameters, under
    ``token`` (a fresh lease token by default; params[1]). Also for
    EXPLAIN. ``fair``: rotate between the queue's partitions (else strict
    priority, run_at, id order: "fair": False). ``plain``: the claim of a
    queue believed to have no partitions (PLAIN_CLAIM_SQL; its rows go
    through split_plain_claim)."""
    written_limit = limit if few_ready else None
    sql = _claim_sql(using, now is not None, async_commit, written_limit, fair, plain)
    params: list[Any] = [now, token or uuid.uuid4(), lease_seconds, worker_id]
    if plain:
        params += [queue, queue, queue]
    else:
        params += pick_params(queue, None if few_ready else limit)
    if not few_ready:
        params.append(limit)
    return sql, params


@functools.lru_cache(maxsize=128)
def _claim_sql(
    using: str,
    fixed_now: bool,
    async_commit: bool,
    written_limit: int | None,
    fair: bool,
    plain: bool,
) -> str:
    """CLAIM_SQL (or PLAIN_CLAIM_SQL) for ``using``; ``written_limit``: a
    few_ready claim's limit, written into the text (else the limit is
    bound)."""
    connection = connections[using]
    limit = "%s" if written_limit is None else str(int(written_limit))
    table_name = table(connection, Message)
    ready_until = "(SELECT now FROM clock)" if fixed_now else "statement_timestamp()"
    plain_order = _CLAIM_ORDER if written_limit is None else _FEW_READY_ORDER
    if plain:
        return PLAIN_CLAIM_SQL.format(
            async_commit=ASYNC_COMMIT_COLUMN if async_commit else "",
            table=table_name,
            ready_until=ready_until,
            order=plain_order,
            limit=limit,
            columns=claim_columns(connection),
        )
    return CLAIM_SQL.format(
        now="now()",
        async_commit=ASYNC_COMMIT_COLUMN if async_commit else "",
        pick=pick_sql(table_name, ready_until, limit, plain_order=plain_order, fair=fair),
        table=table_name,
        order=FAIR_ORDER if fair else STRICT_ORDER,
        ranked=(RANKED_SQL if fair else RANKED_STRICT_SQL).format(table=table_name),
        limit=limit,
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
