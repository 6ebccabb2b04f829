"""The claim: waiting -> processing, in the worker's round trip.

Each cycle the worker's loop acknowledges what its atomic=False handlers
finished and leases the next ready messages in one round trip
(``ack_and_claim_rows``); its handler threads turn the claimed rows into
messages (``message_from_row``). The statements are sql.claim.CLAIM_SQL and
sql.acks.ACK_SQL under a brief lock wait (or ACK_UNLOCKED_SQL: sql.acks).
"""

from __future__ import annotations

import datetime
import logging
import uuid
from collections import Counter
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from django.db import OperationalError, connections

from django_pgqueue import conf
from django_pgqueue.conf.limits import Limits
from django_pgqueue.db import lock_timed_out, prepared_cursor
from django_pgqueue.lifecycle.acks import unacknowledged
from django_pgqueue.lifecycle.guards import UNDECODABLE, logger
from django_pgqueue.models import Message, timestamp_from_text
from django_pgqueue.sql import acks as acks_sql
from django_pgqueue.sql import claim as claim_sql
from django_pgqueue.sql import groups as groups_sql
from django_pgqueue.sql import history as history_sql
from django_pgqueue.sql import limited as limited_sql
from django_pgqueue.sql.claim import ROW_ATTEMPTS, ROW_ID, ROW_PRIORITY, ROW_RUN_AT, ROW_TOPIC


@dataclass(frozen=True)
class LimitState:
    """A queue with limits, as its claim left it (sql.limited.LIMITED_STATE_SQL)."""

    processing: int  # its messages processing, all workers'
    started: int  # starts in its rate's window (0 without a rate)
    seconds_to_slot: float  # until the oldest of them leaves the window
    # Its partitions gave fewer than asked (a queue with limits per
    # partition): some may be full, or the queue is short of ready messages.
    short: bool = False

    def full(self, limits: Limits) -> tuple[bool, bool]:
        """(no slot of the concurrency is free, none of the rate is)."""
        concurrency, rate = limits.concurrency, limits.rate
        return (
            concurrency is not None and self.processing >= concurrency,
            rate is not None and self.started >= rate.count,
        )


@dataclass(frozen=True)
class ClaimResult:
    acked: set[int]  # ids of the acknowledgements that removed their row
    busy: set[int]  # ids left for a later try: another transaction has their row locked
    rows: list[tuple[Any, ...]]  # the claimed messages as the claim's rows, in claim order
    groups_left: int = 0  # releases the group promotion left for another call
    # The queues with limits that were claimed from, as their claim left them.
    limited: dict[str, LimitState] = field(default_factory=dict)
    # Of the plain_queues claimed from: whether they have rows with a round
    # or a partition key (the whole pick claims those).
    partitioned: dict[str, bool] = field(default_factory=dict)


def ack_and_claim_rows(
    acks: Sequence[Message],
    queues: Sequence[str],
    limit: int,
    worker_id: str,
    lease_seconds: float,
    now: datetime.datetime | None = None,
    few_ready: bool = False,
    promote: bool = False,
    limits: Mapping[str, Limits] | None = None,
    shares: Sequence[str] | None = None,
    plain_queues: Collection[str] = (),
    wait_briefly: bool = True,
) -> ClaimResult:
    """Acknowledge ``acks`` (finished messages of atomic=False handlers, as
    ``ack_unlocked``) and lease up to ``limit`` ready messages of ``queues``
    to ``worker_id``, in one round trip: the worker's loop does both every
    cycle. Returns a ClaimResult with the claimed messages as the claim's
    rows, in claim order (the worker leaves ``message_from_row`` to its
    handler threads). The acknowledgements share the claim's asynchronous
    commit: after a server crash one may be lost and its message delivered
    again, which atomic=False handlers accept.

    One claim statement (sql.claim.CLAIM_SQL) per queue, in the order given, until
    ``limit``: an ordered index scan each, where an IN list over several
    queues would sort every waiting row. Each claimed message gets the
    claim's fresh lease token and counts an attempt. ``few_ready``: the
    caller expects fewer ready messages than ``limit`` (the worker, after a
    short claim): picked oldest first through the due index; the same result
    while fewer than ``limit`` are ready, else the oldest rather than the
    most urgent. ``promote``: promote the next message of released groups
    first, after the acknowledgements (which may release groups) and before
    the claim (which then takes the new heads). ``limits``: the queues with
    limits (concurrency, rate) and theirs: their claim takes no more than
    their free slots (sql_limited), and the result says how it left them.
    ``shares``: the queue of each of the ``limit`` slots, in turn (a worker
    given weights, worker.shares): the claim is shared between the queues
    so (``_claim_shared``), not taken from them in order. ``plain_queues``:
    the queues (without limits) the caller believes have no partitions:
    claimed with the default partition's stream alone
    (sql.claim.PLAIN_CLAIM_SQL), which also says whether they have other
    rows (``ClaimResult.partitioned``; then the rest of the claim takes
    the whole pick). ``wait_briefly``: the acknowledgements wait for a row
    another transaction has locked at most sql.acks.BRIEF_LOCK_WAIT, then
    go again skipping such rows, with the claim (outside a transaction
    only; False: they skip them at once, as for acknowledgements that found
    their row locked before).
    """
    using = conf.database_alias()
    connection = connections[using]
    async_commit = not connection.in_atomic_block
    token = uuid.uuid4()
    claimed: list[tuple[Any, ...]] = []
    acked: set[int] = set()
    busy: set[int] = set()
    groups_left = 0
    limited: dict[str, LimitState] = {}
    partitioned: dict[str, bool] = {}
    pending = list(acks)
    unfair = conf.unfair_queues()
    plain = set(plain_queues)

    def claim_from(name: str, size: int) -> list[tuple[Any, ...]]:
        """Up to ``size`` messages of queue ``name``, in claim order (the
        first statement also carries the acknowledgements and promotion)."""
        nonlocal pending, promote, acked, busy, groups_left, wait_briefly
        queue_limits = limits.get(name) if limits else None
        alone = queue_limits is None and name in plain
        if queue_limits is None:
            statement, claim_params = claim_sql.claim_statement(
                using,
                name,
                size,
                worker_id,
                now,
                lease_seconds,
                async_commit=async_commit,
                few_ready=few_ready,
                token=token,
                fair=name not in unfair,
                plain=alone,
            )
            claim_statements = [statement]
        else:
            rate = queue_limits.rate
            each = queue_limits.partition
            each_rate = None if each is None else each.rate
            claim_statements, claim_params = limited_sql.limited_claim_statements(
                using,
                name,
                size,
                worker_id,
                queue_limits.concurrency,
                None if rate is None else (rate.count, rate.seconds),
                now,
                lease_seconds,
                async_commit=async_commit,
                token=token,
                fair=name not in unfair,
                partitioned=queue_limits.partitioned,
                partition_concurrency=None if each is None else each.concurrency,
                partition_rate=None if each_rate is None else (each_rate.count, each_rate.seconds),
                partition_starts=each_rate is not None or queue_limits.named_partitions,
            )
        # No LOCK_TIMEOUT or STATEMENT_TIMEOUT here: the claim never waits
        # for a row lock (SKIP LOCKED), these acknowledgements wait at most
        # the brief lock wait, and both read the head of an index, so the
        # limits would only add a statement to every cycle of the hot path.
        # (A limited claim waits for its queue's advisory lock only while
        # another claim of it runs.)
        if pending or promote or queue_limits is not None:
            # Several statements in one round trip (one implicit
            # transaction): only client-side binding takes several.
            statements: list[str] = []
            params: list[Any] = []
            brief = bool(pending) and wait_briefly and async_commit
            if pending:
                ack_sql, ack_params = history_sql.ack_statement(
                    connection, acks_sql.ids_by_token(pending), skip_locked=not brief
                )
                if brief:
                    ack_sql = (
                        f"{acks_sql.BRIEF_LOCK_WAIT_SQL};{ack_sql};{acks_sql.LOCK_WAIT_BACK_SQL}"
                    )
                statements.append(ack_sql)
                params += ack_params
            if promote:
                statements.append(groups_sql.PROMOTE_GROUPS_SQL)
                params += [groups_sql.PROMOTE_LIMIT, bool(conf.get("NOTIFY"))]
            cursor = connection.cursor()
            try:
                cursor.execute(";".join([*statements, *claim_statements]), [*params, *claim_params])
            except OperationalError as exc:
                cursor.close()
                if not (brief and lock_timed_out(exc)):
                    raise
                # A row held past the brief wait: nothing of the round trip
                # happened (one implicit transaction); again, skipping it.
                wait_briefly = False
                return claim_from(name, size)
            with cursor:
                if brief:
                    cursor.nextset()  # past the brief lock wait
                if pending:
                    acked = {row[0] for row in cursor.fetchall()}
                    cursor.nextset()
                if brief:
                    cursor.nextset()  # past the session's lock_timeout back
                if promote:
                    groups_left = cursor.fetchone()[0]
                    cursor.nextset()
                if queue_limits is not None:
                    cursor.nextset()  # past the queue's lock
                rows = cursor.fetchall()
                if queue_limits is not None:
                    cursor.nextset()
                    processing, started, seconds = cursor.fetchone()
                    short = queue_limits.partitioned and len(rows) < size
                    limited[name] = LimitState(processing, started, float(seconds), short)
            if pending:
                busy = unacknowledged(pending, acked)
            pending, promote = [], False
        else:
            # One statement, run every cycle: prepared when the connection allows.
            cursor = prepared_cursor(connection)
            cursor.execute(claim_statements[0], claim_params)
            rows = cursor.fetchall()
        if alone:
            rows, unseen = claim_sql.split_plain_claim(rows)
            if unseen is not False and len(rows) < size:
                # Rows the claim could not see wait, or it claimed none (and
                # so could not say): the whole pick for the rest.
                plain.discard(name)
                more = claim_from(name, size - len(rows))
                if unseen is None and more:
                    unseen = True  # the pick found what the claim index has not
                rows += more
            if unseen is not None:
                partitioned[name] = unseen
        rows.sort(key=_claim_order)  # RETURNING keeps no order
        return rows

    if shares is None:
        for name in queues:
            claimed += claim_from(name, limit - len(claimed))
            if len(claimed) >= limit:
                break
    else:
        claimed = _claim_shared(claim_from, queues, shares)
    # One line per message is DEBUG (the worker's summary is INFO); the hot
    # path builds nothing for a record nobody keeps.
    if claimed and logger.isEnabledFor(logging.DEBUG):
        for row in claimed:
            fields = {
                "message_id": row[ROW_ID],
                "topic": row[ROW_TOPIC],
                "attempt": row[ROW_ATTEMPTS],
            }
            logger.debug(
                "Message id=%s topic=%s attempt=%s claimed by %s",
                *fields.values(),
                worker_id,
                extra={**fields, "state": "claimed", "worker": worker_id},
            )
    return ClaimResult(acked, busy, claimed, groups_left, limited, partitioned)


def _claim_shared(
    claim_from: Callable[[str, int], list[tuple[Any, ...]]],
    queues: Sequence[str],
    shares: Sequence[str],
) -> list[tuple[Any, ...]]:
    """A claim of ``len(shares)`` messages shared between ``queues``: each
    queue takes the slots ``shares`` gives it (worker.shares), a queue short
    of work leaves the rest of its slots to the others, in order, and the
    messages come back in the slots' turn (a, a, b, a...), so that the
    handler threads start them in that turn too."""
    quotas = Counter(shares)
    by_queue: dict[str, list[tuple[Any, ...]]] = {}
    for name in queues:
        if quotas[name]:
            by_queue[name] = claim_from(name, quotas[name])
    left = len(shares) - sum(len(rows) for rows in by_queue.values())
    for name in queues:
        if left <= 0:
            break
        if len(by_queue.get(name, ())) < quotas[name]:
            continue  # it gave fewer than its share: it has no more
        more = claim_from(name, left)
        by_queue.setdefault(name, []).extend(more)
        left -= len(more)
    taken = {name: iter(rows) for name, rows in by_queue.items()}
    claimed = [row for name in shares if (row := next(taken.get(name, iter(())), None))]
    for rows in taken.values():
        claimed.extend(rows)  # what the others left: after the turn
    return claimed


def _claim_order(row: Sequence[Any]) -> tuple[int, datetime.datetime | None, int]:
    return (-row[ROW_PRIORITY], timestamp_from_text(row[ROW_RUN_AT]), row[ROW_ID])


def message_from_row(row: Sequence[Any], database: str | None = None) -> Message:
    """A Message from a row of the claim (``ClaimResult.rows``), built as a
    queryset builds one (``Model.from_db``) from the row's decoded values;
    ``database``: the alias it was claimed from (default: the queue's)."""
    values, undecodable = claim_sql.decode_claim_row(row)
    message = Message.from_db(database or conf.database_alias(), claim_sql.CLAIM_ATTNAMES, values)
    if undecodable is not None:
        # The worker dead-letters such a message without loading it.
        setattr(message, UNDECODABLE, undecodable)
    return message
