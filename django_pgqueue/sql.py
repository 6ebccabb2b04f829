"""The SQL that the ORM cannot say, in one place.

Each statement is named and says why it is written by hand. Values are
always bound parameters (``%s``); identifiers that come from the models are
quoted through the connection (``table()``); the rest of the text is fixed.
The functions here build statements and their parameters, decode what the
claim returns, and put the worker's limits on a transaction; running the
statements is the business of the modules that own the state they change
(``lifecycle``, ``groups``, ``maintenance``, ``liveness``).
"""

from __future__ import annotations

import contextlib
import functools
import json
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from datetime import datetime
from typing import Any

from django.db import connections, transaction
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.models import Field, JSONField, Model

from django_pgqueue import conf
from django_pgqueue.models import (
    GroupRelease,
    Message,
    QueueState,
    ScheduleTick,
    WorkerHeartbeat,
    timestamp_from_text,
)


def table(connection: BaseDatabaseWrapper, model: type[Model]) -> str:
    """The table of ``model``, quoted for ``connection``."""
    return connection.ops.quote_name(model._meta.db_table)


# --- the claim ----------------------------------------------------------------

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
# seconds, the worker), here and in sql_limited's claim of a queue with limits.
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


# --- acknowledgements ---------------------------------------------------------

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
# The worker's batches of acknowledgements (atomic=False handlers) skip the
# rows another transaction has locked (an admin action, a script's SELECT
# ... FOR UPDATE): one locked row must not hold up the others, nor the claim
# sent with them, for LOCK_TIMEOUT each cycle. The skipped ones are still
# leased and are acknowledged on a later try.
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
    ids: dict[uuid.UUID | None, list[int]] = {}
    for message in messages:
        ids.setdefault(message.lease_token, []).append(message.id)
    return ids


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


# --- the worker's limits ------------------------------------------------------

# The worker's limits (PGQUEUE LOCK_TIMEOUT and STATEMENT_TIMEOUT) for the
# current transaction only: set_config(..., true) is SET LOCAL. So they bound
# the worker's own statements and end with their transaction, never reaching
# a handler's queries (an atomic handler's transaction gets them with its
# acknowledgement, after the handler), and they hold behind PgBouncer in
# transaction pooling, where a session's SET would stay on the server
# connection and reach other clients. A setting of None keeps the value the
# session has (the server's, the role's, the project's OPTIONS). The claim
# and the skip-locked acknowledgements never wait for a lock and go without.
LIMITS_SQL = (
    "SELECT set_config('lock_timeout', COALESCE(%s, current_setting('lock_timeout')), true), "
    "set_config('statement_timeout', COALESCE(%s, current_setting('statement_timeout')), true)"
)


def limits() -> list[str | None] | None:
    """LIMITS_SQL's parameters from the settings; None when both are None."""
    values = [
        conf.milliseconds(conf.get("LOCK_TIMEOUT")),
        conf.milliseconds(conf.get("STATEMENT_TIMEOUT")),
    ]
    return None if values == [None, None] else values


def with_limits(sql: str, params: Sequence[Any]) -> tuple[str, list[Any], int]:
    """``sql`` after LIMITS_SQL, sent together (in autocommit, one implicit
    transaction: the limits hold for ``sql`` and end with it), and the number
    of results to skip before ``sql``'s. Client-side binding only (Django's
    default cursor): a server-bound statement is one statement."""
    extra = limits()
    if extra is None:
        return sql, list(params), 0
    return f"{LIMITS_SQL};{sql}", [*extra, *params], 1


def set_limits(using: str | None = None) -> None:
    """Put the worker's limits on the current transaction of ``using``."""
    params = limits()
    if params is not None:
        with connections[using or conf.database_alias()].cursor() as cursor:
            cursor.execute(LIMITS_SQL, params)


@contextlib.contextmanager
def worker_transaction(using: str | None = None, savepoint: bool = True) -> Iterator[None]:
    """``transaction.atomic`` with the worker's limits, when it starts the
    transaction; inside a caller's transaction it is a savepoint (unless
    ``savepoint`` is False) and the caller's settings stay as they are."""
    using = using or conf.database_alias()
    outermost = not connections[using].in_atomic_block
    with transaction.atomic(using=using, savepoint=savepoint):
        if outermost:
            set_limits(using)
        yield


# --- wake-ups, groups, maintenance --------------------------------------------

# The wake-up the insert trigger sends, for changes that are not inserts.
NOTIFY_SQL = "SELECT pg_notify('django_pgqueue', queue) FROM unnest(%s::text[]) AS queue"
# The control channel (notify.CONTROL_CHANNEL): a queue was paused, resumed
# or given limits ("queues"), cancellation was asked for running messages
# ("cancel:<id>,<id>..."). Sent in the transaction of the change, so
# delivered at its commit, and only then.
CONTROL_NOTIFY_SQL = (
    "SELECT pg_notify('django_pgqueue_control', payload) FROM unnest(%s::text[]) AS payload"
)

# Message groups: promote the next message of released groups (the function
# of migration 0009; see models.GroupRelease), which the ORM cannot lock and
# update group by group. Returns how many releases are left for another
# call. Parameters: the releases to take (PROMOTE_LIMIT) and whether to
# NOTIFY the queues of the promoted messages.
PROMOTE_GROUPS_SQL = "SELECT pgqueue_promote_groups(%s, %s)"
PROMOTE_LIMIT = 1000  # releases per call
# The transaction-scoped advisory lock of one group, as the promotion
# function takes it (two-key form: a space of its own, apart from the
# maintenance lock's single key).
GROUP_LOCK_SQL = "SELECT pg_advisory_xact_lock(1885827431, hashtext(%s))"

# Maintenance leadership: a transaction-scoped advisory lock, so it works
# behind a transaction-pooling PgBouncer too (no session state) and is
# released by the commit or by the connection's death, never leaked.
MAINTENANCE_LOCK_SQL = "SELECT pg_try_advisory_xact_lock(%s)"


# --- the idle poll and the heartbeat ------------------------------------------

# An idle worker's poll, in one round trip: the database's clock, the next
# due run_at of its queues and the oldest lease expiry (of any queue). One
# query per poll interval, a sleep that does not depend on the worker's clock
# agreeing with the database's, and maintenance only when a lease expired.
# Also whether a message group waits for its next message to be promoted (a
# GroupRelease row): the fallback when its NOTIFY was missed or is off.
# Each subquery reads the head of a partial index (the ORM cannot say the
# LATERAL join per queue). A row written by another client may hold
# 'infinity' or '-infinity', which Python cannot load: the first reads as
# "never" (NULL), the second as "now". Last, a fingerprint of the queues'
# run-time state (models.QueueState: paused queues, limits): the fallback
# of its NOTIFY, read again only when the fingerprint changed.
PROBE_SQL = """
SELECT now(),
    (SELECT {finite} FROM (SELECT min(head.run_at) AS t FROM unnest(%s::text[]) AS q(name),
        LATERAL (SELECT run_at FROM {table} WHERE status = 'waiting' AND queue = q.name
        ORDER BY run_at LIMIT 1) AS head) AS due),
    (SELECT {finite} FROM (SELECT min(lease_expires_at) AS t FROM {table}
        WHERE status = 'processing') AS lease),
    EXISTS (SELECT 1 FROM {releases}),
    (SELECT count(*) || ' ' || COALESCE(max(updated_at)::text, '') FROM {queue_states})
""".replace("{finite}", "CASE WHEN isfinite(t) THEN t WHEN t < now() THEN now() END")

# A worker's heartbeat: insert or refresh its row (the ORM's
# update_or_create takes two statements and a transaction). The worker
# computes how long the row stays "alive" (three heartbeat intervals), so
# readers need not share its settings. An idle worker sends it as part of
# its poll (PROBE_SQL behind a WITH), so the heartbeat costs no query of its
# own.
HEARTBEAT_SQL = """
INSERT INTO {table} AS w (worker_id, hostname, pid, queues, concurrency, started_at,
    heartbeat_at, expires_at, inflight, processed)
VALUES (%s, %s, %s, %s::jsonb, %s, now(), now(), now() + make_interval(secs => %s), %s, %s)
ON CONFLICT (worker_id) DO UPDATE SET heartbeat_at = now(), expires_at = EXCLUDED.expires_at,
    inflight = EXCLUDED.inflight, processed = EXCLUDED.processed
"""


def heartbeat_statement(connection: BaseDatabaseWrapper) -> str:
    """HEARTBEAT_SQL for ``connection``."""
    return HEARTBEAT_SQL.format(table=table(connection, WorkerHeartbeat))


def probe_statement(connection: BaseDatabaseWrapper, with_heartbeat: bool = False) -> str:
    """PROBE_SQL for ``connection`` (its parameter: the queues); with
    ``with_heartbeat``, HEARTBEAT_SQL before it in a WITH (the heartbeat's
    parameters first)."""
    sql = PROBE_SQL.format(
        table=table(connection, Message),
        releases=table(connection, GroupRelease),
        queue_states=table(connection, QueueState),
    )
    if with_heartbeat:
        sql = f"WITH beat AS ({heartbeat_statement(connection)}) {sql}"
    return sql


# --- schedules ------------------------------------------------------------------

# A scheduler round holds its schedules' row locks until it commits, and the
# other schedulers skip what is locked. Should the round's client vanish
# while its connection stays open (a host cut off from the network, a
# process stopped), the server ends the transaction, and frees the locks,
# after it sat idle this long; a live round is idle for milliseconds.
SCHEDULE_IDLE_LIMIT_SQL = "SELECT set_config('idle_in_transaction_session_timeout', %s, true)"
SCHEDULE_IDLE_LIMIT = "30s"

# A scheduler round's clock and cursors, after it locked the schedules'
# state rows: the database's time (every host agrees on it, so no host's
# clock skew can double or skip a tick) and each schedule's latest tick in
# the ledger. A statement of its own after the lock: under READ COMMITTED it
# sees the ticks another scheduler committed just before the lock was
# granted. One row even for no names (the clock); the newest tick is read
# from the head of the (schedule, tick) unique index, which the ORM's
# GROUP BY max() would not do.
SCHEDULE_CURSORS_SQL = """
SELECT clock.now, s.name, (SELECT t.tick FROM {ticks} AS t WHERE t.schedule = s.name
    ORDER BY t.tick DESC LIMIT 1)
FROM (SELECT statement_timestamp()) AS clock(now)
LEFT JOIN unnest(%s::text[]) AS s(name) ON true
"""

# Record ticks of a schedule in the ledger, each once: the ticks that
# another scheduler recorded already are left out (ON CONFLICT DO NOTHING on
# the unique (schedule, tick)), and only the ticks this statement recorded
# come back, which the ORM's bulk_create(ignore_conflicts=True) cannot tell.
# The caller enqueues their messages in the same transaction.
SCHEDULE_TICKS_SQL = """
INSERT INTO {ticks} (schedule, tick)
SELECT %s, tick FROM unnest(%s::timestamptz[]) AS tick ORDER BY tick
ON CONFLICT (schedule, tick) DO NOTHING
RETURNING id, tick
"""


def schedule_statement(connection: BaseDatabaseWrapper, sql: str) -> str:
    """A SCHEDULE_*_SQL statement for ``connection``."""
    return sql.format(ticks=table(connection, ScheduleTick))
