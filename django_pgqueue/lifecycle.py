"""The message state machine: the only module that changes ``Message.status``.

Every transition is one transaction guarded by the state it expects and, for
a leased message, by its lease token (the fencing token):

    waiting --run_now--> waiting (due now)
    waiting --claim--> processing --ack--> (deleted)
                           |--retry_later--> waiting (run_at in the future)
                           |--release--> waiting (attempt not counted)
                           |--dead_letter--> DeadLetter row (message deleted)
                           '--rescue_expired--> waiting, or DeadLetter when exhausted

A guard that matches no row is a named outcome (the lease was lost: the
message was rescued, timed out or finished elsewhere), logged and returned as
False or None, never an exception. So a late acknowledgement never finishes a
rescued message, and a rescue never overwrites a finished one.

``now`` is a parameter wherever time matters; None means the database's clock.
"""

import contextlib
import datetime
import functools
import json
import logging
import uuid
from dataclasses import dataclass

from django.db import connections, transaction
from django.db.models import CharField, DateTimeField, Exists, F, Q, QuerySet, Subquery, Value
from django.db.models.base import ModelState
from django.db.models.expressions import RawSQL
from django.db.models.functions import Coalesce, Greatest, Now
from django.utils import timezone

from django_pgqueue import conf, policy, registry, signals
from django_pgqueue.db import prepared_cursor
from django_pgqueue.models import (
    GROUP_HEAD,
    Category,
    DeadLetter,
    GroupRelease,
    Message,
    Status,
    WorkerHeartbeat,
    timestamp_from_text,
)

logger = logging.getLogger(__name__)

# An idle worker's poll, in one round trip: the database's clock, the next
# due run_at of its queues and the oldest lease expiry (of any queue). One
# query per poll interval, a sleep that does not depend on the worker's clock
# agreeing with the database's, and maintenance only when a lease expired.
# Also whether a message group waits for its next message to be promoted (a
# GroupRelease row): the fallback when its NOTIFY was missed or is off.
# Each subquery reads the head of a partial index. A row written by another
# client may hold 'infinity' or '-infinity', which Python cannot load: the
# first reads as "never" (NULL), the second as "now".
PROBE_SQL = """
SELECT now(),
    (SELECT {finite} FROM (SELECT min(head.run_at) AS t FROM unnest(%s::text[]) AS q(name),
        LATERAL (SELECT run_at FROM {table} WHERE status = 'waiting' AND queue = q.name
        ORDER BY run_at LIMIT 1) AS head) AS due),
    (SELECT {finite} FROM (SELECT min(lease_expires_at) AS t FROM {table}
        WHERE status = 'processing') AS lease),
    EXISTS (SELECT 1 FROM {releases})
""".replace("{finite}", "CASE WHEN isfinite(t) THEN t WHEN t < now() THEN now() END")

# A worker's heartbeat: insert or refresh its row. The worker computes how
# long the row stays "alive" (three heartbeat intervals), so readers need not
# share its settings. An idle worker sends it as part of its poll (PROBE_SQL
# behind a WITH), so the heartbeat costs no query of its own.
HEARTBEAT_SQL = """
INSERT INTO {table} AS w (worker_id, hostname, pid, queues, concurrency, started_at,
    heartbeat_at, expires_at, inflight, processed)
VALUES (%s, %s, %s, %s::jsonb, %s, now(), now(), now() + make_interval(secs => %s), %s, %s)
ON CONFLICT (worker_id) DO UPDATE SET heartbeat_at = now(), expires_at = EXCLUDED.expires_at,
    inflight = EXCLUDED.inflight, processed = EXCLUDED.processed
"""

# Acknowledgement: the ORM cannot return the ids a DELETE removed, and
# QuerySet.delete() adds a transaction of its own (three round trips instead
# of one). The guard is the lease: only rows this lease still holds go.
#
# Messages of one or more claims are acknowledged in one statement: each
# claim's messages share its lease token, so the rows go by token, each group
# an "id = ANY(...)" that the primary key (or a hashed filter) answers. (A
# join of (id, token) pairs against unnest() was planned as a nested loop
# over every leased row: quadratic once several workers hold hundreds.)
ACK_GROUPS_SQL = """
DELETE FROM {table}
WHERE status = 'processing' AND ({groups})
RETURNING id
"""
ACK_GROUP_SQL = "(lease_token = %s::uuid AND id = ANY(%s::bigint[]))"
# The worker's batches of acknowledgements (atomic=False handlers) skip the
# rows another transaction has locked (an admin action, a script's SELECT
# ... FOR UPDATE): one locked row must not hold up the others, nor the claim
# sent with them, for LOCK_TIMEOUT each cycle. The skipped ones are still
# leased (see still_leased) and are acknowledged on a later try.
ACK_UNLOCKED_SQL = """
DELETE FROM {table}
WHERE id IN (
    SELECT id FROM {table} WHERE status = 'processing' AND ({groups}) FOR UPDATE SKIP LOCKED)
RETURNING id
"""

# The worker's limits (PGQUEUE LOCK_TIMEOUT and STATEMENT_TIMEOUT) for the
# current transaction only: set_config(..., true) is SET LOCAL. So they bound
# the worker's own statements and end with their transaction, never reaching
# a handler's queries (an atomic handler's transaction gets them with its
# acknowledgement, after the handler), and they hold behind PgBouncer in
# transaction pooling, where a session's SET would stay on the server
# connection and reach other clients. A setting of None keeps the value the
# session has (the server's, the role's, the project's OPTIONS). The claim
# and the skip-locked acknowledgements never wait for a lock and go without
# (see ack_and_claim_rows).
LIMITS_SQL = (
    "SELECT set_config('lock_timeout', COALESCE(%s, current_setting('lock_timeout')), true), "
    "set_config('statement_timeout', COALESCE(%s, current_setting('statement_timeout')), true)"
)

# The wake-up the insert trigger sends, for changes that are not inserts.
NOTIFY_SQL = "SELECT pg_notify('django_pgqueue', queue) FROM unnest(%s::text[]) AS queue"

# Message groups: promote the next message of released groups (the function
# of migration 0009; see models.GroupRelease). Returns how many releases are
# left for another call. Sent in the claim's round trip, before the claim,
# when the worker has reason to think a group was released: the promoted
# heads are claimed at once.
PROMOTE_GROUPS_SQL = "SELECT pgqueue_promote_groups(%s, %s)"
PROMOTE_LIMIT = 1000  # releases per call
# The transaction-scoped advisory lock of one group (two-key form: its own
# space, apart from the maintenance lock's single key), as the promotion
# function takes it.
GROUP_LOCK_SQL = "SELECT pg_advisory_xact_lock(1885827431, hashtext(%s))"

# Maintenance leadership: a transaction-scoped advisory lock, so it works
# behind a transaction-pooling PgBouncer too (no session state) and is
# released by the commit or by the connection's death, never leaked.
MAINTENANCE_LOCK_SQL = "SELECT pg_try_advisory_xact_lock(%s)"
MAINTENANCE_LOCK_KEY = 0x70677175  # "pgqu"

# The first words of the error a rescued run records (lifecycle.rescue_expired):
# its worker stopped beating; its worker beats but the lease ran out; or the
# row had no lease at all.
WORKER_LOST = "worker lost"
LEASE_EXPIRED = "lease expired"
LEASE_MISSING = "lease missing"
LOST_RUN_REASONS = (WORKER_LOST, LEASE_EXPIRED, LEASE_MISSING)


@dataclass(frozen=True)
class RescueResult:
    requeued: int
    dead_lettered: int


def limits():
    """LIMITS_SQL's parameters from the settings; None when both are None."""
    values = [
        conf.milliseconds(conf.get("LOCK_TIMEOUT")),
        conf.milliseconds(conf.get("STATEMENT_TIMEOUT")),
    ]
    return None if values == [None, None] else values


def set_limits(using=None):
    """Put the worker's limits on the current transaction of ``using``."""
    params = limits()
    if params is not None:
        with connections[using or conf.database_alias()].cursor() as cursor:
            cursor.execute(LIMITS_SQL, params)


@contextlib.contextmanager
def worker_transaction(using=None):
    """``transaction.atomic`` with the worker's limits, when it starts the
    transaction; inside a caller's transaction it is a savepoint and the
    caller's settings stay as they are."""
    using = using or conf.database_alias()
    outermost = not connections[using].in_atomic_block
    with transaction.atomic(using=using):
        if outermost:
            set_limits(using)
        yield


def _with_limits(sql, params):
    """``sql`` after LIMITS_SQL, sent together (in autocommit, one implicit
    transaction: the limits hold for ``sql`` and end with it), and the number
    of results to skip before ``sql``'s. Client-side binding only (Django's
    default cursor): a server-bound statement is one statement."""
    extra = limits()
    if extra is None:
        return sql, params, 0
    return f"{LIMITS_SQL};{sql}", [*extra, *params], 1


def _lease_expiry(lease_seconds, now):
    return (now or Now()) + datetime.timedelta(seconds=lease_seconds)


def _log_extra(message, **fields):
    return {"message_id": message.pk, "topic": message.topic, "attempt": message.attempts, **fields}


def _log_lease_lost(message, what):
    """The named outcome of a guard that matched no row."""
    logger.warning(
        "Message id=%s topic=%s attempt=%s %s: lease lost",
        message.pk,
        message.topic,
        message.attempts,
        what,
        extra=_log_extra(message, state="lease_lost"),
    )


def claim(queues, limit, worker_id, lease_seconds, now=None, few_ready=False):
    """Lease up to ``limit`` ready messages of ``queues`` to ``worker_id``.

    One statement per queue (queues in the order given, until ``limit``):
    an UPDATE that sets the lease, a fresh fencing token and counts the
    attempt, of the rows picked by the ORM's
    ``select_for_update(skip_locked=True)`` in claim order (priority, run_at,
    id), returning them. Concurrent workers never wait for each other and
    never take the same row. Returns the messages as leased, in claim order.

    ``few_ready``: the caller expects fewer ready messages than ``limit``
    (the worker, after a claim that came back short). The rows are then
    picked oldest first through the due index, which holds them at its head
    whatever the planner's statistics say; the claim index would, with
    statistics left over from a backlog, walk every delayed message of the
    same priority. While fewer than ``limit`` are ready the result is the
    same (all of them, returned in claim order); if more are, this claim
    takes the oldest rather than the most urgent ones.
    """
    return ack_and_claim((), queues, limit, worker_id, lease_seconds, now, few_ready)[1]


def promote_groups(limit=PROMOTE_LIMIT):
    """Promote the next message of each released group (see
    models.GroupRelease), in a transaction of its own unless the caller has
    one. Returns how many releases are left for another call (groups being
    promoted by another transaction right now, or past ``limit``)."""
    using = conf.database_alias()
    with transaction.atomic(using=using), connections[using].cursor() as cursor:
        cursor.execute(PROMOTE_GROUPS_SQL, [limit, bool(conf.get("NOTIFY"))])
        return cursor.fetchone()[0]


def lead_group(message):
    """Make ``message``, just inserted (so blocked) in the caller's
    transaction, the head of its group ahead of the group's older blocked
    messages, if the group has no head: a revived dead letter that held its
    group runs first. Returns whether it became the head."""
    using = conf.database_alias()
    connection = connections[using]
    with transaction.atomic(using=using):
        with connection.cursor() as cursor:
            # After the lock, the statements below see what a promotion of
            # this group that held it committed (READ COMMITTED).
            cursor.execute(GROUP_LOCK_SQL, [message.group_key])
        has_head = Message.objects.using(using).filter(
            group_key=message.group_key, status__in=GROUP_HEAD
        )
        led = (
            Message.objects.using(using)
            .filter(pk=message.pk, status=Status.BLOCKED)
            .exclude(Exists(has_head))
            .update(status=Status.WAITING, updated_at=Now())
        )
        if led and conf.get("NOTIFY"):
            with connection.cursor() as cursor:
                cursor.execute(NOTIFY_SQL, [[message.queue]])
    if led:
        message.status = Status.WAITING
    return bool(led)


def ack_and_claim(acks, queues, limit, worker_id, lease_seconds, now=None, few_ready=False):
    """Acknowledge ``acks`` (finished messages of atomic=False handlers, as
    ``ack_many``) and claim (as ``claim``) in one round trip: the worker's
    main loop does both every cycle. Returns (the acknowledged ids, the
    claimed messages).

    The acknowledgement shares the claim's asynchronous commit: after a
    server crash it may be lost and the message delivered again, which
    atomic=False handlers accept (at-least-once).
    """
    result = ack_and_claim_rows(acks, queues, limit, worker_id, lease_seconds, now, few_ready)
    return result.acked, [message_from_row(row) for row in result.rows]


@dataclass(frozen=True)
class ClaimResult:
    acked: set  # ids of the acknowledgements that removed their row
    busy: set  # ids left for a later try: another transaction has their row locked
    rows: list  # the claimed messages as the statement's rows, in claim order
    groups_left: int = 0  # releases the group promotion left for another call


def ack_and_claim_rows(
    acks,
    queues,
    limit,
    worker_id,
    lease_seconds,
    now=None,
    few_ready=False,
    promote=False,
):
    """``ack_and_claim``, the claimed messages as the statement's rows (in
    claim order), for ``message_from_row``: the worker's main loop leaves
    building them to the handler threads. ``promote``: promote the
    next message of released groups first, in the same round trip (after
    the acknowledgements, which may release groups; before the claim, which
    then takes the new heads). Returns a ClaimResult."""
    using = conf.database_alias()
    connection = connections[using]
    async_commit = not connection.in_atomic_block
    token = uuid.uuid4()
    claimed = []
    acked = set()
    busy = set()
    groups_left = 0
    pending = list(acks)
    # One ordered index scan per queue (an IN list over several queues
    # cannot use the index order and would sort every waiting row).
    for name in queues:
        sql, claim_params = claim_statement(
            using,
            name,
            limit - len(claimed),
            worker_id,
            now=now,
            async_commit=async_commit,
            few_ready=few_ready,
        )
        claim_params[1:3] = [token, lease_seconds]
        # No LOCK_TIMEOUT or STATEMENT_TIMEOUT here: the claim and these
        # acknowledgements never wait for a lock (SKIP LOCKED) and read the
        # head of an index; an extra statement on every cycle of the hot
        # path would cost a sixth of the throughput.
        if acks or promote:
            # Several statements in one round trip (one implicit
            # transaction): only client-side binding takes several.
            statements, params = [], []
            if acks:
                ack_sql, ack_params = _ack_statement(connection, acks, skip_locked=True)
                statements.append(ack_sql)
                params += ack_params
            if promote:
                statements.append(PROMOTE_GROUPS_SQL)
                params += [PROMOTE_LIMIT, bool(conf.get("NOTIFY"))]
            with connection.cursor() as cursor:
                cursor.execute(";".join([*statements, sql]), [*params, *claim_params])
                if acks:
                    acked = {row[0] for row in cursor.fetchall()}
                    cursor.nextset()
                if promote:
                    groups_left = cursor.fetchone()[0]
                    cursor.nextset()
                rows = cursor.fetchall()
            promote = False
        else:
            # One statement, run every cycle: prepared when the connection allows.
            cursor = prepared_cursor(connection)
            cursor.execute(sql, claim_params)
            rows = cursor.fetchall()
        if pending:
            busy = _unacknowledged(pending, acked)
        acks = pending = ()
        rows.sort(key=_claim_order)  # RETURNING keeps no order
        claimed += rows
        if len(claimed) >= limit:
            break
    if claimed and logger.isEnabledFor(logging.INFO):  # the hot path: no idle work
        for row in claimed:
            message_id, topic, attempts = row[ROW_ID], row[ROW_TOPIC], row[ROW_ATTEMPTS]
            logger.info(
                "Message id=%s topic=%s attempt=%s claimed by %s",
                message_id,
                topic,
                attempts,
                worker_id,
                extra={
                    "message_id": message_id,
                    "topic": topic,
                    "attempt": attempts,
                    "state": "claimed",
                    "worker": worker_id,
                },
            )
    return ClaimResult(acked, busy, claimed, groups_left)


# The claim, one statement. The rows come from the ORM's
# select_for_update(skip_locked=True) queryset, compiled once per limit into
# the IN (...) subquery; "clock" is the database's now() unless the caller
# gives one. Outside a caller's transaction, clock also sets the commit
# asynchronous ({async_commit}): a claim's commit need not wait for the WAL
# to reach the disk (about a millisecond less per claim). Safe: had the
# server crashed and lost such a commit, the message would simply be waiting
# again, and any later durable commit (a handler's, an acknowledgement's)
# flushes the WAL up to it first. (A function in the statement, not SET
# LOCAL before it, keeps the claim one statement, which can be prepared.)
# The UPDATE finds the picked rows again by their physical address (ctid, a
# Tid Scan of the array the subquery returns), not by id: a join on id looks
# every row up in the primary key again, and that B-tree gets a level deeper
# as the table grows (a million delayed messages: 4 buffers a row instead of
# 3), or hashes a sequential scan of the whole table when the planner thinks
# it cheaper (a mid-sized backlog); either way the cost of a claim grew with
# rows it does not touch. The address is safe to use within the statement:
# the subquery's FOR UPDATE holds the row locked from there to the commit,
# so nothing can move or remove it. Should another transaction have updated
# a waiting row after this statement's snapshot and before the lock (the
# lock then follows the row to its new version), the new version is
# invisible to the UPDATE's scan: the row is simply not claimed this time
# and stays waiting, its lock released at the commit.
# A row written by another client may hold what no enqueue writes: the
# attempt count stops at the integer's maximum (one such row must not fail
# every claim of its queue), and a run_at of '-infinity' becomes the claim's
# time (Python has no datetime for it).
CLAIM_SQL = """
WITH clock AS (SELECT COALESCE(%s::timestamptz, now()) AS now{async_commit})
UPDATE {table} AS m SET status = 'processing', attempts = LEAST(m.attempts, 2147483646) + 1,
    lease_token = %s,
    lease_expires_at = clock.now + make_interval(secs => %s), locked_by = %s,
    updated_at = clock.now,
    run_at = CASE WHEN isfinite(m.run_at) THEN m.run_at ELSE clock.now END
FROM clock
WHERE m.ctid = ANY(ARRAY({pick}))
RETURNING {columns}
"""
_ASYNC_COMMIT_COLUMN = ", set_config('synchronous_commit', 'off', true) AS async_commit"

# The same for the acknowledgements sent on their own (ack_many).
ASYNC_COMMIT_SQL = "SET LOCAL synchronous_commit = off;"

_CLAIM_FIELDS = list(Message._meta.concrete_fields)
# The status the claim picks, written into the statement rather than bound:
# a prepared claim's generic plan must be able to prove the partial
# indexes' predicate (status = 'waiting'); with the status as a parameter it
# could not, and PostgreSQL would plan the claim again on every call.
_WAITING_LITERAL = RawSQL("'waiting'", (), output_field=CharField())
_QUEUE_SENTINEL = "\x00queue"  # no queue name can contain NUL


def claim_statement(
    using,
    queue,
    limit,
    worker_id,
    now=None,
    lease_seconds=60,
    *,
    async_commit=False,
    few_ready=False,
):
    """The claim's UPDATE for one queue and its parameters (also for EXPLAIN),
    under a lease token of its own (the caller may put its own in params[1])."""
    written_limit = limit if few_ready else None  # see _LIMIT_SENTINEL
    sql, pick_params = _claim_sql(using, now is not None, async_commit, few_ready, written_limit)
    params = [now, uuid.uuid4(), lease_seconds, worker_id]
    params += [queue if p == _QUEUE_SENTINEL else p for p in pick_params]
    return sql, params if few_ready else [*params, limit]


# The LIMIT is bound, not written into the statement: the worker claims
# whatever its free capacity is (1 to a batch), and one statement text for
# every size is prepared once and can run with the generic plan (PostgreSQL
# takes it when its estimate is no worse than the custom plans'), where a
# text per size is planned again on each of its first ten calls (psycopg's
# prepare threshold, then PostgreSQL's five custom plans) and most sizes
# never get that far; planning is what grows with a large table. (With a
# backlog of ready messages PostgreSQL still prefers custom plans here, by
# a hair: its generic estimate for an unknown queue is a few percent above
# the custom plan plus planning, so a full claim is planned each time, 0.1
# to 0.3 ms: benchmarks/scale.py counts the generic and custom plans.)
#
# Except in a claim that expects few messages (few_ready, after a claim came
# back short): that one writes its limit into the text. Its size is nearly
# always the same (on a quiet queue every slot is free: a batch), and only a
# limit the planner can see keeps the generic plan's estimate down while the
# statistics still describe a drained backlog: a bound limit is estimated
# as a tenth of the rows those promise, so PostgreSQL kept choosing custom
# plans and planned every such claim (benchmarks/scale.py, "claim p50,
# sparse-busy-stats": 1.4x its baseline with a bound limit).
#
# Django compiles a slice into a literal; this number, no real limit, marks
# where the limit goes.
_LIMIT_SENTINEL = 987654321


@functools.lru_cache(maxsize=128)
def _claim_sql(using, fixed_now, async_commit, few_ready, written_limit=None):
    """The claim statement, and its subquery's parameters (the queue name as
    _QUEUE_SENTINEL; the limit, bound last, is not among them). With
    ``written_limit`` the limit is that number in the text instead.

    Readiness is ``run_at <= statement_timestamp()`` unless the caller fixes
    the time: the planner folds that stable function into a constant when
    it estimates, so with few ready rows among many delayed ones it reads
    the ready ones through the due index instead of walking every delayed
    entry of the claim index (a subquery would hide the value from it)."""
    connection = connections[using]
    quote = connection.ops.quote_name
    # The picked rows' physical address (see CLAIM_SQL); the value is only
    # ever compared in SQL, never read by Python.
    row_tid = RawSQL(f"{quote(Message._meta.db_table)}.ctid", (), output_field=CharField())
    ready_until = (
        RawSQL("(SELECT now FROM clock)", (), output_field=DateTimeField()) if fixed_now else Now()
    )
    pick = (
        Message.objects.using(using)
        .select_for_update(skip_locked=True)
        .filter(status=_WAITING_LITERAL, queue=_QUEUE_SENTINEL)
        .filter(run_at__lte=ready_until)
        # Oldest first when few are ready: the due index's order (see claim()).
        .order_by(*(("run_at",) if few_ready else ("-priority", "run_at", "id")))
        .annotate(row_tid=row_tid)
        .values("row_tid")[:_LIMIT_SENTINEL]
    )
    # select_for_update compiles only inside a transaction; nothing runs here.
    with transaction.atomic(using=using):
        pick_sql, pick_params = pick.query.get_compiler(using=using).as_sql()
    marker = f"LIMIT {_LIMIT_SENTINEL}"
    if pick_sql.count(marker) != 1:
        raise RuntimeError(f"the claim's subquery has no {marker!r}: {pick_sql}")
    # The LIMIT comes after every other parameter of the subquery (WHERE,
    # ORDER BY), so its placeholder is the last one.
    written = "%s" if written_limit is None else str(int(written_limit))
    pick_sql = pick_sql.replace(marker, f"LIMIT {written}")
    sql = CLAIM_SQL.format(
        async_commit=_ASYNC_COMMIT_COLUMN if async_commit else "",
        table=quote(Message._meta.db_table),
        pick=pick_sql,
        columns=", ".join(
            f"m.{quote(field.column)}" + ("::text" if field in _TIMESTAMP_FIELDS else "")
            for field in _CLAIM_FIELDS
        ),
    )
    return sql, tuple(pick_params)


_JSON_FIELDS = [
    (field.attname, field) for field in _CLAIM_FIELDS if field.get_internal_type() == "JSONField"
]
# Read as text and parsed by timestamp_from_text (see there why).
_TIMESTAMP_FIELDS = [f for f in _CLAIM_FIELDS if f.get_internal_type() == "DateTimeField"]
_TIMESTAMP_ATTNAMES = [field.attname for field in _TIMESTAMP_FIELDS]
_CLAIM_ATTNAMES = [field.attname for field in _CLAIM_FIELDS]
# Positions in the claim's rows.
ROW_ID, ROW_TOPIC, ROW_ATTEMPTS, ROW_PRIORITY, ROW_RUN_AT = (
    _CLAIM_ATTNAMES.index(name) for name in ("id", "topic", "attempts", "priority", "run_at")
)


# The attribute of a claimed Message whose payload or headers Python could
# not load: why (see message_from_row).
UNDECODABLE = "_pgqueue_undecodable"


def message_from_row(row):
    """A Message from the claim's RETURNING row, as ``Model.from_db`` would
    build it, without ``Model.__init__`` (the claim is the hot path)."""
    message = Message.__new__(Message)
    values = dict(zip(_CLAIM_ATTNAMES, row, strict=True))
    for attname, field in _JSON_FIELDS:
        text = values[attname]
        # What JSONField.from_db_value does, minus its checks for key lookups
        # (and the parse of the usual empty headers).
        if text == "{}":
            values[attname] = {}
        elif text is not None:
            try:
                values[attname] = json.loads(text, cls=field.decoder)
            except RecursionError:
                # Only another client's SQL can store this (enqueue refuses
                # it): the worker dead-letters the message without loading it.
                values[attname] = None
                values[UNDECODABLE] = (
                    f"the {attname} is nested too deeply for Python's JSON decoder"
                )
    for attname in _TIMESTAMP_ATTNAMES:
        values[attname] = timestamp_from_text(values[attname])
    state = values["_state"] = ModelState()
    state.adding, state.db = False, conf.database_alias()
    message.__dict__ = values
    return message


def _claim_order(row):
    return (-row[ROW_PRIORITY], timestamp_from_text(row[ROW_RUN_AT]), row[ROW_ID])


def _leased(message, using):
    """The message's row, if this lease still holds it."""
    return Message.objects.using(using).filter(
        pk=message.pk, status=Status.PROCESSING, lease_token=message.lease_token
    )


def ack(message):
    """Finish ``message``: delete its row if this lease still holds it.

    Called inside the handler's transaction for atomic handlers, so the
    handler's writes and the removal commit together. False: the lease was
    lost, and the caller must roll back.
    """
    if ack_leased([message]):
        return True
    _log_lease_lost(message, "not acknowledged")
    return False


def ack_many(messages):
    """Finish many messages (non-atomic handlers) in one DELETE.

    Returns the ids that were still held by their lease and are now finished
    (``ack_unlocked`` also tells which were skipped because another
    transaction has their row locked). Outside a transaction its commit,
    like the claim's, does not wait for the WAL to reach the disk: a lost
    acknowledgement only means the message runs again, which atomic=False
    handlers accept.
    """
    return ack_unlocked(messages)[0]


def ack_unlocked(messages):
    """``ack_many``, skipping rows another transaction has locked; returns
    (the ids finished, the ids still leased but locked: acknowledge them
    again later)."""
    async_commit = not connections[conf.database_alias()].in_atomic_block
    # One statement, whatever the claims.
    finished = ack_leased(messages, async_commit, skip_locked=True)
    return finished, _unacknowledged(messages, finished)


def _unacknowledged(messages, finished):
    """The ids of ``messages`` not in ``finished`` that their lease still
    holds (their row was locked); the others lost their lease (logged)."""
    missing = [m for m in messages if m.pk not in finished]
    busy = still_leased(missing) if missing else set()
    for message in missing:
        if message.pk not in busy:
            _log_lease_lost(message, "not acknowledged")
    return busy


def still_leased(messages):
    """The ids of ``messages`` that their own lease still holds: one plain
    SELECT, which never waits for a row lock."""
    held = Q()
    for token, group in _by_token(messages).items():
        held |= Q(pk__in=[m.pk for m in group], lease_token=token)
    return set(
        Message.objects.using(conf.database_alias())
        .filter(held, status=Status.PROCESSING)
        .values_list("pk", flat=True)
    )


def ack_leased(messages, async_commit=False, skip_locked=False):
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
    connection = connections[conf.database_alias()]
    sql, params = _ack_statement(connection, messages, skip_locked)
    if async_commit:
        sql = ASYNC_COMMIT_SQL + sql
    skip = 0
    if not skip_locked:  # only a statement that may wait for a lock needs the limits
        sql, params, skip = _with_limits(sql, params)
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        for _ in range(skip + async_commit):
            cursor.nextset()  # past the limits and the SET LOCAL
        return {row[0] for row in cursor.fetchall()}


def _ack_statement(connection, messages, skip_locked=False):
    """ACK_GROUPS_SQL (ACK_UNLOCKED_SQL) for ``messages`` and its parameters:
    one group per lease token, the ids as an array literal, ``{a,b,c}`` (far
    cheaper than letting the driver quote a list element by element)."""
    groups = _by_token(messages)
    params = []
    for token, group in groups.items():
        params += [str(token), "{" + ",".join(str(m.id) for m in group) + "}"]
    sql = (ACK_UNLOCKED_SQL if skip_locked else ACK_GROUPS_SQL).format(
        table=connection.ops.quote_name(Message._meta.db_table),
        groups=" OR ".join([ACK_GROUP_SQL] * len(groups)),
    )
    return sql, params


def retry_later(message, delay, category, error, now=None):
    """Put ``message`` back to wait ``delay`` seconds, recording the failure.

    The attempt stays counted. False: the lease was lost.
    """
    now_value = now or Now()
    with worker_transaction():
        updated = _leased(message, conf.database_alias()).update(
            status=Status.WAITING,
            run_at=now_value + datetime.timedelta(seconds=delay),
            lease_token=None,
            lease_expires_at=None,
            locked_by="",
            last_error=error,
            last_error_category=category,
            first_failed_at=Coalesce("first_failed_at", now_value),
            updated_at=now_value,
        )
    if not updated:
        _log_lease_lost(message, "retry not recorded")
    return bool(updated)


def release(messages):
    """Hand leased messages back without counting the attempt (graceful
    shutdown). Returns how many were still held."""
    using = conf.database_alias()
    released = 0
    with worker_transaction(using):
        for token, batch in _by_token(messages).items():
            released += (
                Message.objects.using(using)
                .filter(pk__in=[m.pk for m in batch], status=Status.PROCESSING, lease_token=token)
                .update(
                    status=Status.WAITING,
                    attempts=Greatest(F("attempts") - 1, Value(0)),
                    lease_token=None,
                    lease_expires_at=None,
                    locked_by="",
                    updated_at=Now(),
                )
            )
    return released


def run_now(messages, now=None):
    """Clear the delay of waiting messages (a queryset or ids): those due
    later become due ``now``. One UPDATE guarded by ``status = 'waiting'``;
    leased and already due messages are left alone. Returns how many changed.
    """
    using = conf.database_alias()
    if isinstance(messages, QuerySet):
        selected = messages.using(using).values("pk")
    else:
        selected = [getattr(m, "pk", m) for m in messages]
    now_value = now or Now()
    delayed = Message.objects.using(using).filter(
        pk__in=selected, status=Status.WAITING, run_at__gt=now_value
    )
    with transaction.atomic(using=using):
        queues = list(delayed.values_list("queue", flat=True).distinct())
        updated = delayed.update(run_at=now_value, updated_at=now_value)
        if updated and conf.get("NOTIFY"):
            # An UPDATE does not fire the insert trigger: wake the workers of
            # these queues the same way (delivered at commit).
            with connections[using].cursor() as cursor:
                cursor.execute(NOTIFY_SQL, [queues])
    logger.info("Messages run now: %s", updated, extra={"state": "run_now", "count": updated})
    return updated


def extend_leases(messages, lease_seconds, now=None):
    """Push the leases of ``messages`` forward; returns the ids whose lease
    was lost: rows now in another state or under another lease. A row that is
    gone was acknowledged meanwhile, which is no loss.

    Rows another transaction has locked are skipped (SKIP LOCKED), not
    waited for: one locked row must not keep the other leases from being
    extended. They stay leased and are extended on the next beat."""
    using = conf.database_alias()
    lost = set()
    with worker_transaction(using):
        for token, batch in _by_token(messages).items():
            ids = [m.pk for m in batch]
            unlocked = (
                Message.objects.using(using)
                .select_for_update(skip_locked=True)
                .filter(pk__in=ids, status=Status.PROCESSING, lease_token=token)
                .values("pk")
            )
            extended = (
                Message.objects.using(using)
                .filter(pk__in=unlocked)
                .update(lease_expires_at=_lease_expiry(lease_seconds, now))
            )
            if extended < len(ids):
                lost |= set(
                    Message.objects.using(using)
                    .filter(pk__in=ids)
                    .exclude(status=Status.PROCESSING, lease_token=token)
                    .values_list("pk", flat=True)
                )
    return lost


def dead_letter(
    message, category, reason, traceback="", worker="", expect=Status.PROCESSING, now=None
):
    """Move ``message`` to the dead-letter table: insert the DeadLetter and
    delete the Message in one transaction, if the message is still in state
    ``expect`` (and, when leased, still held by this lease).

    Returns the DeadLetter, or None when the guard matched nothing. The
    ``dead_lettered`` signal is sent after the commit.
    """
    using = conf.database_alias()
    now = now or timezone.now()
    with worker_transaction(using):
        # The payload and headers are copied in the server, never loaded
        # here: they are what was stored, even JSON that Python cannot load.
        rows = (
            Message.objects.using(using)
            .select_for_update()
            .defer("payload", "headers")
            .filter(pk=message.pk, status=expect)
        )
        if expect == Status.PROCESSING:
            rows = rows.filter(lease_token=message.lease_token)
        row = rows.first()
        if row is None:
            _log_lease_lost(message, f"not dead-lettered (no longer {expect})")
            return None
        dead = DeadLetter.objects.using(using).create(
            message_id=row.pk,
            queue=row.queue,
            topic=row.topic,
            payload={},  # copied below, in the server
            headers={},
            priority=row.priority,
            group_key=row.group_key,
            dedup_key=row.dedup_key,
            category=category,
            reason=reason,
            traceback=traceback,
            attempts=row.attempts,
            max_attempts=row.max_attempts,
            first_failed_at=row.first_failed_at or now,
            last_failed_at=now,
            dead_lettered_at=now,
            worker=worker,
            holds_group=policy.dead_letter_blocks_group(row, registry.lookup(row.topic)),
        )
        stored = Message.objects.using(using).filter(pk=row.pk)
        DeadLetter.objects.using(using).filter(pk=dead.pk).update(
            payload=Subquery(stored.values("payload")), headers=Subquery(stored.values("headers"))
        )
        # What the receivers of dead_lettered see: the message's own values
        # when it has them (the worker's), else loaded when first read.
        for attname in ("payload", "headers"):
            if attname in message.__dict__ and not message.__dict__.get(UNDECODABLE):
                setattr(dead, attname, getattr(message, attname))
            else:
                del dead.__dict__[attname]
        Message.objects.using(using).filter(pk=row.pk).delete()
        transaction.on_commit(
            lambda: signals.send(
                signals.dead_lettered, sender=DeadLetter, dead_letter=dead, message_id=row.pk
            ),
            using=using,
        )
    logger.info(
        "Message id=%s topic=%s attempt=%s dead-lettered as %s: %s",
        row.pk,
        row.topic,
        row.attempts,
        category,
        reason.splitlines()[0] if reason else "",
        extra=_log_extra(row, state="dead_lettered", category=category, worker=worker),
    )
    return dead


def rescue_expired(now=None, limit=1000):
    """Return messages whose lease expired (their worker died) to the queue,
    with the failure recorded and the attempt counted; dead-letter those that
    have used up their attempts.

    A ``processing`` row without a lease (constraint
    ``pgqueue_msg_processing_has_lease`` forbids it; a row from before it, or
    written with the constraint dropped) counts as expired: nothing else
    would ever return it.

    Rows are locked with SKIP LOCKED and re-checked in the UPDATE's WHERE, so
    a message being acknowledged right now is left alone. Each requeued
    message sends ``message_retried`` with ``lost=True`` after the commit
    (a dead-lettered one sends ``dead_lettered``): a lost run is an attempt,
    and every receiver sees it.
    """
    using = conf.database_alias()
    now_value = now or Now()
    expired_lease = (
        Q(lease_expires_at__lt=now_value)
        | Q(lease_expires_at__isnull=True)
        | Q(lease_token__isnull=True)
    )
    with worker_transaction(using):
        expired = list(
            Message.objects.using(using)
            .select_for_update(skip_locked=True)
            .filter(expired_lease, status=Status.PROCESSING)
            .defer("payload", "headers")  # not needed, and maybe not loadable
            .order_by(F("lease_expires_at").asc(nulls_first=True))[:limit]
        )
        beats = _last_beats({m.locked_by for m in expired if m.locked_by}, using)
        requeue, exhausted = [], []
        for message in expired:
            spec = registry.lookup(message.topic)
            limit_reached = message.attempts >= policy.max_attempts_for(message, spec)
            (exhausted if limit_reached else requeue).append(message)
        for message in requeue:
            error = _lost_reason(message, beats)
            # The row is locked by this transaction since it was read: the
            # state it was picked in is the state it is in.
            Message.objects.using(using).filter(pk=message.pk).update(
                status=Status.WAITING,
                run_at=now_value,
                lease_token=None,
                lease_expires_at=None,
                locked_by="",
                last_error=error,
                last_error_category=Category.TRANSIENT,
                first_failed_at=Coalesce("first_failed_at", now_value),
                updated_at=now_value,
            )
            logger.warning(
                "Message id=%s topic=%s attempt=%s rescued: %s",
                message.pk,
                message.topic,
                message.attempts,
                error,
                extra=_log_extra(message, state="rescued", worker=message.locked_by),
            )
            transaction.on_commit(
                functools.partial(
                    signals.send,
                    signals.message_retried,
                    sender=Message,
                    message=message,
                    category=Category.TRANSIENT,
                    reason=error,
                    delay=0.0,
                    worker=message.locked_by,
                    lost=True,
                ),
                using=using,
            )
        for message in exhausted:
            dead_letter(
                message,
                Category.TRANSIENT,
                f"{_lost_reason(message, beats)} on the last of {message.attempts} attempts",
                worker=message.locked_by,
                now=now,
            )
    return RescueResult(requeued=len(requeue), dead_lettered=len(exhausted))


def _last_beats(worker_ids, using):
    """{worker id: its last heartbeat} of those of ``worker_ids`` that have a row."""
    if not worker_ids:
        return {}
    return dict(
        WorkerHeartbeat.objects.using(using)
        .filter(worker_id__in=worker_ids)
        .values_list("worker_id", "heartbeat_at")
    )


def _lost_reason(message, beats):
    """Why ``message``'s run ended without an outcome: its worker stopped
    beating, or kept beating but could not keep the lease; or it never had
    a lease."""
    if message.lease_token is None or message.lease_expires_at is None:
        return f"{LEASE_MISSING}: processing without a lease (locked by {message.locked_by!r})"
    beat = beats.get(message.locked_by)
    if beat is not None and beat > message.lease_expires_at:
        # The worker beat after the lease ran out, so it was alive: the
        # heartbeat extends leases with SKIP LOCKED, and a row that another
        # transaction kept locked past the lease (the handler's own
        # acknowledgement waiting on a lock, a long admin edit) expires
        # under a worker that is alive and well.
        return (
            f"{LEASE_EXPIRED}: the lease of {message.locked_by} expired while that worker "
            "was still alive (its heartbeat could not extend it: the row was locked by "
            "another transaction, or the worker could not reach the database in time)"
        )
    return f"{WORKER_LOST}: the lease of {message.locked_by or 'a worker'} expired"


def try_maintenance_lock():
    """Inside a transaction: take the maintenance lock if no one holds it."""
    with connections[conf.database_alias()].cursor() as cursor:
        cursor.execute(MAINTENANCE_LOCK_SQL, [MAINTENANCE_LOCK_KEY])
        return cursor.fetchone()[0]


@dataclass(frozen=True)
class Probe:
    now: datetime.datetime  # the database's clock
    next_run_at: datetime.datetime | None  # earliest run_at waiting in the queues
    oldest_lease: datetime.datetime | None  # earliest lease expiry, any queue
    groups_released: bool = False  # a message group waits for its next message's promotion

    @property
    def ready(self):
        return self.next_run_at is not None and self.next_run_at <= self.now

    @property
    def lease_expired(self):
        return self.oldest_lease is not None and self.oldest_lease < self.now

    def seconds_until_due(self):
        if self.next_run_at is None:
            return None
        return max((self.next_run_at - self.now).total_seconds(), 0.0)


def probe(queues, beat=None):
    """What an idle worker needs to know, in one query (see PROBE_SQL); with
    ``beat`` (a Beat), the same statement records the worker's heartbeat."""
    connection = connections[conf.database_alias()]
    quote = connection.ops.quote_name
    sql = PROBE_SQL.format(
        table=quote(Message._meta.db_table), releases=quote(GroupRelease._meta.db_table)
    )
    params = [list(queues)]
    if beat is not None:
        sql = f"WITH beat AS ({_heartbeat_sql(connection)}) {sql}"
        params = [*beat.params(), *params]
    sql, params, skip = _with_limits(sql, params)
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        for _ in range(skip):
            cursor.nextset()
        return Probe(*cursor.fetchone())


@dataclass(frozen=True)
class Beat:
    """What a worker's heartbeat records about it."""

    worker_id: str
    hostname: str
    pid: int
    queues: list
    concurrency: int
    alive_for: float  # seconds the row counts as alive without another beat
    inflight: int
    processed: int

    def params(self):
        return [
            self.worker_id,
            self.hostname,
            self.pid,
            json.dumps(list(self.queues)),
            self.concurrency,
            self.alive_for,
            self.inflight,
            self.processed,
        ]


def _heartbeat_sql(connection):
    return HEARTBEAT_SQL.format(table=connection.ops.quote_name(WorkerHeartbeat._meta.db_table))


def heartbeat(beat):
    """Record that the worker ``beat`` describes is alive, in one statement."""
    connection = connections[conf.database_alias()]
    sql, params, _skip = _with_limits(_heartbeat_sql(connection), beat.params())
    with connection.cursor() as cursor:
        cursor.execute(sql, params)


def unregister(worker_id):
    """Remove a stopping worker's row: it is gone, not dead."""
    with worker_transaction():
        WorkerHeartbeat.objects.using(conf.database_alias()).filter(worker_id=worker_id).delete()


def _by_token(messages):
    groups = {}
    for message in messages:
        groups.setdefault(message.lease_token, []).append(message)
    return groups
