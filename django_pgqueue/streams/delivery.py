"""Delivery of stream events to subscribers.

One delivery (``deliver``) is one transaction on the queue's database: take
the subscription's lock (``subscriptions.try_lock``: one worker at a time),
read the subscription and its next events (after the checkpoint in ``(xid,
position)`` order, and only below ``pg_snapshot_xmin(pg_current_snapshot())``,
so an event of a transaction that commits late is never passed over), run
the subscriber on each event in a savepoint of its own, then move the
checkpoint past those that succeeded. The subscriber's database writes and
the checkpoint commit together or not at all: exactly once for database
work, at least once for anything else. A worker killed mid-batch leaves the
checkpoint where it was; the next delivery starts again from there, in the
same order. A failing event's savepoint is rolled back and the failure
recorded (retry later, block, or dead-letter) in the same transaction.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from django.db import connections, transaction
from django.utils import timezone

from django_pgqueue import conf, policy, registry, signals, tracing
from django_pgqueue.db import LazySavepoint, transaction_failed
from django_pgqueue.exceptions import Permanent, Retry, describe
from django_pgqueue.fields import finite_sql
from django_pgqueue.models import StreamEvent
from django_pgqueue.models.streams import DELIVERING, Subscription, SubscriptionState
from django_pgqueue.sql import timeouts as timeouts_sql
from django_pgqueue.streams import subscriptions
from django_pgqueue.streams.subscribers import DEAD_LETTER, SubscriberSpec

logger = logging.getLogger(__name__)

# The row and, when it is due, its next events, in one round trip. Sent
# after the lock is taken: its snapshot then sees the checkpoint that the
# previous holder committed. Read through the stream index, after the
# checkpoint and below the snapshot's xmin. ({retry_at} and {created_at}:
# the columns as Python can load them, see statement().) Under the worker's
# limits, which the subscriber's queries after it never get
# (with_limits_for_itself); so are the thread's other statements: the
# probe, ensuring the rows, the checkpoint's moves.
NEXT_SQL = """
SELECT s.state, s.checkpoint_xid::text, s.checkpoint_position, s.attempts,
    s.failing_position, {retry_at}, s.name, s.stream, e.position, e.xid::text, e.key,
    e.payload::text, e.headers::text, {created_at}
FROM {subs} s LEFT JOIN LATERAL (
    SELECT position, xid, key, payload, headers, created_at FROM {events}
    WHERE stream = s.stream AND (xid, position) > (s.checkpoint_xid, s.checkpoint_position)
        AND xid < pg_snapshot_xmin(pg_current_snapshot())
        AND s.state IN ('active', 'retrying')
        AND (s.retry_at IS NULL OR s.retry_at <= COALESCE(%s::timestamptz, now()))
    ORDER BY xid, position LIMIT %s
) AS e ON true
WHERE s.id = %s
ORDER BY e.xid, e.position
"""

# An idle worker's poll of all its subscriptions in one statement: which
# have deliverable events (ready), which have committed events after the
# checkpoint at all (pending: ready, or held back by the snapshot's xmin
# while an older transaction is open), and when a retrying one is due. Each
# EXISTS reads the first index entry after the checkpoint. (A test of
# "xid >= xmin" would not: btree cannot combine it with the row comparison
# into one start key, and would walk the whole backlog.)
PROBE_SQL = """
SELECT s.id, s.state, {retry_at}, now(),
    EXISTS (SELECT 1 FROM {events} e WHERE e.stream = s.stream
        AND (e.xid, e.position) > (s.checkpoint_xid, s.checkpoint_position)
        AND e.xid < pg_snapshot_xmin(pg_current_snapshot())),
    EXISTS (SELECT 1 FROM {events} e WHERE e.stream = s.stream
        AND (e.xid, e.position) > (s.checkpoint_xid, s.checkpoint_position))
FROM {subs} s WHERE s.id = ANY(%s)
"""

# A batch takes no more events once it has run this long (seconds): once a
# subscriber has written, the batch's transaction holds back every
# snapshot's xmin, that is every subscription's view of new events.
BATCH_SECONDS = 1.0
# Nor once this many of its events have opened a savepoint (run queries):
# each savepoint that writes takes a subtransaction id, and past 64 in one
# transaction PostgreSQL's snapshots overflow to pg_subtrans, which slows
# every session.
BATCH_SAVEPOINTS = 50

# One event's savepoint (db.LazySavepoint): opened before the subscriber's
# first query, the previous event's released in the same round trip.
SAVEPOINT_NAME = "pgqueue_event"

# Outcomes of deliver().
DELIVERED, IDLE, BUSY, NOT_DUE, STOPPED, GONE = (
    "delivered", "idle", "busy", "not due", "stopped", "gone",
)  # fmt: skip
RETRYING, BLOCKED, DEAD_LETTERED, MOVED = "retrying", "blocked", "dead-lettered", "moved"


@dataclass(frozen=True)
class Event:
    """What a subscriber is called with."""

    subscription: str
    stream: str
    position: int
    xid: int
    key: str | None
    payload: object
    headers: dict
    created_at: datetime.datetime
    attempts: int  # this attempt's number, from 1

    @property
    def topic(self) -> str:
        """The stream, for the "topic" condition of PGQUEUE["CLASSIFY_RULES"]."""
        return self.stream


@dataclass(frozen=True)
class Delivery:
    outcome: str
    delivered: int = 0  # events whose handling committed
    more: bool = False  # a full batch: more may be waiting
    retry_at: datetime.datetime | None = None


@dataclass(frozen=True)
class Probe:
    id: int
    state: str
    retry_at: datetime.datetime | None
    now: datetime.datetime
    ready: bool  # deliverable events after the checkpoint
    pending: bool  # committed events after the checkpoint, deliverable or not

    @property
    def held(self) -> bool:
        """Committed events wait for an older transaction to end."""
        return self.pending and not self.ready

    @property
    def due(self) -> bool:
        if not self.ready or self.state not in DELIVERING:
            return False
        return self.retry_at is None or self.retry_at <= self.now


# A context manager around each call of the subscriber (deliver's ``watch``).
Watch = Callable[["Event"], contextlib.AbstractContextManager[object]]


class BrokenTransaction(Exception):
    """The subscriber swallowed a database error: its transaction cannot commit."""


class EventNotUndone(Exception):
    """A failed event's writes cannot be rolled back alone: the whole batch is."""


def _event_not_undone() -> EventNotUndone:
    return EventNotUndone("a failed event's writes cannot be undone on their own")


def statement(template: str) -> str:
    """``NEXT_SQL`` or ``PROBE_SQL`` with the tables' and columns' names filled in."""
    ops = connections[conf.database_alias()].ops
    return template.format(
        subs=ops.quote_name(Subscription._meta.db_table),
        events=ops.quote_name(StreamEvent._meta.db_table),
        # Another client's SQL may have written 'infinity' (fields.py).
        retry_at=finite_sql("s.retry_at"),
        created_at=finite_sql("e.created_at"),
    )


def batch_size(spec: SubscriberSpec) -> int:
    """Events per transaction for ``spec``: its own batch_size, or the setting."""
    return spec.batch_size or conf.get("STREAM_BATCH_SIZE")


def probe(ids: Iterable[int]) -> list[Probe]:
    """One Probe per existing subscription among ``ids``."""
    # In autocommit: the limits hold for this statement's implicit transaction.
    probe_sql, params, skip = timeouts_sql.with_limits(statement(PROBE_SQL), [list(ids)])
    with connections[conf.database_alias()].cursor() as cursor:
        cursor.execute(probe_sql, params)
        for _ in range(skip):
            cursor.nextset()  # past the limits
        return [Probe(*row) for row in cursor.fetchall()]


def deliver(
    spec: SubscriberSpec,
    subscription_id: int | None = None,
    worker: str = "",
    now: datetime.datetime | None = None,
    watch: Watch | None = None,
) -> Delivery:
    """Deliver the next batch of events to ``spec``'s subscription, in one
    transaction; returns a Delivery.

    ``subscription_id``: its row's id (``subscriptions.ensure`` returns it);
    without it the row is looked up, and created if missing. ``now`` stands
    in for the database's clock. ``watch(event)``: a context manager around
    each call of the subscriber (the worker's health check times them).
    """
    using = conf.database_alias()
    if connections[using].in_atomic_block:
        # Inside a caller's transaction the delivery would be a savepoint,
        # and the caller's own transaction id would hold the events back.
        raise RuntimeError("deliver() cannot be called inside a transaction")
    if subscription_id is None:
        subscription_id = subscriptions.ensure([spec]).get(spec.name)
        if subscription_id is None:
            return Delivery(GONE)
    batch = None
    limit = batch_size(spec)
    try:
        with transaction.atomic(using=using):
            if not subscriptions.try_lock(subscription_id):
                return Delivery(BUSY)
            next_sql, params, skip = timeouts_sql.with_limits_for_itself(
                statement(NEXT_SQL), [now, limit, subscription_id]
            )
            with connections[using].cursor() as cursor:
                cursor.execute(next_sql, params)
                for _ in range(skip):
                    cursor.nextset()  # past the limits
                rows = cursor.fetchall()
            if not rows:
                return Delivery(GONE)
            state, xid, position, attempts, failing, retry_at, name, stream = rows[0][:8]
            if state not in DELIVERING:
                return Delivery(STOPPED)
            events = [row[8:] for row in rows if row[8] is not None]
            if not events:
                if state == SubscriptionState.RETRYING and retry_at is not None:
                    return Delivery(NOT_DUE, retry_at=retry_at)
                return Delivery(IDLE)
            batch = subscriptions.Batch(
                subscription_id, name, stream, int(xid), position, state, now=now, worker=worker
            )
            outcome = _run(spec, batch, events, limit, attempts, failing, watch)
    except subscriptions.Moved:
        logger.warning(
            "Subscription %s: its checkpoint or state changed during the delivery; "
            "the batch was rolled back and will be delivered again",
            spec.name,
            extra={"subscription": spec.name, "state": "moved"},
        )
        return Delivery(MOVED)
    for signal, kwargs in batch.signals:
        signals.send(signal, **kwargs)
    return outcome


def _run(
    spec: SubscriberSpec,
    batch: subscriptions.Batch,
    events: list[tuple[Any, ...]],
    limit: int,
    attempts: int,
    failing: int | None,
    watch: Watch | None = None,
) -> Delivery:
    connection = connections[conf.database_alias()]
    deadline, more = time.monotonic() + BATCH_SECONDS, len(events) >= limit
    savepoint = LazySavepoint(connection, SAVEPOINT_NAME, _event_not_undone)
    with connection.execute_wrapper(savepoint):
        for row in events:
            if batch.done and (savepoint.opened >= BATCH_SAVEPOINTS or time.monotonic() > deadline):
                more = True  # the rest in the next batch
                break
            event, problem = _event(spec, row, attempts + 1 if row[0] == failing else 1)
            tracer = tracing.tracer()
            span = None if tracer is None else _start_span(tracer, spec, event)
            callbacks = len(connection.run_on_commit)
            savepoint.arm()
            try:
                if problem:
                    raise Permanent(problem)
                with watch(event) if watch is not None else contextlib.nullcontext():
                    if span is None:
                        registry.call(spec, event, "subscriber")
                    else:
                        with tracing.active(span, record=False):  # _failed records
                            registry.call(spec, event, "subscriber")
                if connection.needs_rollback or transaction_failed(connection):
                    raise BrokenTransaction(
                        "the subscriber caught a database error and returned: its transaction "
                        "cannot commit (wrap queries that may fail in transaction.atomic())"
                    )
                savepoint.disarm()
            except BaseException as exc:  # noqa: BLE001  (a subscriber may raise anything)
                if _interrupts_the_program(exc):
                    raise  # the batch rolls back; nothing is recorded
                # Undo this event alone: its writes and its on_commit callbacks.
                # (If that cannot be done, this raises: the batch rolls back.)
                savepoint.rollback()
                connection.needs_rollback = False
                del connection.run_on_commit[callbacks:]
                delivery = _failed(spec, batch, event, exc, span)
                if span is not None:
                    tracing.end(span, delivery.outcome)
                return delivery
            if span is not None:
                tracing.end(span, DELIVERED)
            batch.passed(event.xid, event.position)
    subscriptions.advance(batch)
    logger.info(
        "Subscription %s: %s event(s) of stream %s delivered, up to position %s",
        *(spec.name, batch.done, spec.stream, batch.checkpoint[1]),
        extra={"subscription": spec.name, "stream": spec.stream, "state": "delivered"},
    )
    return Delivery(DELIVERED, delivered=batch.done, more=more)


def _interrupts_the_program(exc: BaseException) -> bool:
    """Whether ``exc``, raised from a subscriber's call, is the operator's
    Ctrl-C rather than the subscriber's failure: a KeyboardInterrupt on the
    main thread, where Python raises SIGINT's wherever the code happens to
    be (a delivery run from a script or a shell). Anything else a subscriber
    raises, SystemExit included, is its failure, retried and then recorded,
    as a task's is. The worker delivers in a thread of its own, which no
    signal reaches: its shutdown sets a flag that stops the thread between
    batches, and raises nothing into a subscriber."""
    return (
        isinstance(exc, KeyboardInterrupt) and threading.current_thread() is threading.main_thread()
    )


def _start_span(tracer: Any, spec: SubscriberSpec, event: Event) -> Any:
    """The CONSUMER span of delivering ``event`` to ``spec`` (tracing on)."""
    return tracing.start_consumer(
        tracer, event.headers, spec.stream, spec.stream, event.position, event.attempts,
        subscription=spec.name,
    )  # fmt: skip


def _failed(
    spec: SubscriberSpec,
    batch: subscriptions.Batch,
    event: Event,
    exc: BaseException,
    span: Any = None,
) -> Delivery:
    """``event`` failed (its savepoint is rolled back): retry it later, block
    the subscription, or move the event to the dead letters; the checkpoint
    moves past the events before it. ``span``: its delivery's span (tracing
    on), which records the failure and what follows."""
    if span is not None:
        tracing.failed(span, exc)
    category = policy.classify(exc, event)
    retry_after = exc.after if isinstance(exc, Retry) else None
    max_attempts = spec.max_attempts or conf.get("MAX_ATTEMPTS")
    decision = policy.decide(category, event.attempts, max_attempts, spec, retry_after)
    reason = describe(exc)
    where = (spec.name, event.position, spec.stream, event.attempts, category, reason)
    extra = {"subscription": spec.name, "position": event.position, "category": category}
    if decision.action == policy.RETRY:
        clock = batch.now if isinstance(batch.now, datetime.datetime) else timezone.now()
        retry_at = clock + datetime.timedelta(seconds=decision.delay)
        subscriptions.retry_later(batch, event.position, event.attempts, reason, retry_at)
        if span is not None:
            tracing.retried(span, category, reason, decision.delay)
        logger.warning(
            "Subscription %s: event position=%s of stream %s failed (attempt %s, %s): %s; "
            "retrying in %.1fs",
            *where,
            decision.delay,
            extra={**extra, "state": "retrying"},
        )
        return Delivery(RETRYING, delivered=batch.done, retry_at=retry_at)
    if spec.on_failure == DEAD_LETTER:
        trace = "".join(traceback.format_exception(exc))
        done = batch.done
        subscriptions.dead_letter_event(
            batch, event.position, event.attempts, category, reason, trace
        )
        if span is not None:
            tracing.dead_lettered(span, category, reason)
        return Delivery(DEAD_LETTERED, delivered=done)
    subscriptions.block(batch, event.position, event.attempts, reason)
    logger.error(
        "Subscription %s: blocked at event position=%s of stream %s after %s attempt(s) "
        "(%s): %s; resume it, reset its checkpoint or dead-letter the event (admin)",
        *where,
        extra={**extra, "state": "blocked"},
    )
    return Delivery(BLOCKED, delivered=batch.done)


def _event(spec: SubscriberSpec, row: tuple[Any, ...], attempts: int) -> tuple[Event, str | None]:
    """The Event of a NEXT_SQL row, and why it cannot be read (or None)."""
    position, xid, key, payload_text, headers_text, created_at = row
    problem, payload, headers = None, None, {}
    try:
        payload, headers = json.loads(payload_text), json.loads(headers_text)
    except RecursionError:
        problem = "the event's JSON is nested too deeply for Python's JSON decoder"
    except ValueError as exc:
        problem = f"the event's JSON cannot be read: {exc}"
    event = Event(
        subscription=spec.name,
        stream=spec.stream,
        position=position,
        xid=int(xid),
        key=key,
        payload=payload,
        headers=headers if isinstance(headers, dict) else {},
        created_at=created_at,
        attempts=attempts,
    )
    return event, problem
