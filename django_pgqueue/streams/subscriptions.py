"""Subscriptions: the only module that changes a ``Subscription`` row, its
state and its checkpoint::

    active --an event fails--> retrying --retry_at, the event succeeds--> active
    retrying --attempts spent, on_failure="block"--> blocked
    retrying --attempts spent, on_failure="dead_letter"--> active (the event is
        a DeadLetter now, the checkpoint past it)
    any --pause--> paused;  paused/blocked/retrying --resume--> active
    any --reset--> the checkpoint moves (a retrying or blocked one becomes active)

Every change happens in a transaction that holds the subscription's
transaction-scoped advisory lock (one worker, or one operator, at a time; no
session state, so it holds behind PgBouncer in transaction pooling) and is
guarded by the checkpoint and state it read: a guard that matches nothing
raises ``Moved`` and the transaction rolls back.

Why an advisory lock and not ``SELECT ... FOR UPDATE``: a row lock gives the
transaction an id, and a transaction with an id holds back every snapshot's
xmin, that is every subscription's view of every stream, until it ends. A
delivery gets an id only once it writes (the subscriber's first write, or
the checkpoint at the end).

Operators' changes (``pause``, ``resume``, ``reset``, ``dead_letter_blocked``)
wait for the lock (up to PGQUEUE["LOCK_TIMEOUT"]), so they land between two
deliveries and never roll one back.
"""

import json
import logging
from dataclasses import dataclass, field

import psycopg
from django.db import DatabaseError, connections, transaction
from django.db.models import F
from django.db.models.expressions import RawSQL
from django.db.models.functions import Now
from django.utils import timezone

from django_pgqueue import conf, signals
from django_pgqueue.exceptions import SubscriptionError
from django_pgqueue.models import DeadLetter, StreamEvent
from django_pgqueue.models.streams import Subscription, SubscriptionState
from django_pgqueue.sql import timeouts as timeouts_sql
from django_pgqueue.streams.subscribers import END
from django_pgqueue.text import first_line

logger = logging.getLogger(__name__)

# classid of the subscriptions' advisory locks ("pgss"); objid: the row's id.
LOCK_KEY = 0x70677373
TRY_LOCK_SQL = "SELECT pg_try_advisory_xact_lock(%s, %s)"
LOCK_SQL = "SELECT pg_advisory_xact_lock(%s, %s)"

# The last event of a stream whose transaction has ended: where a
# subscription that starts (or is reset) at the end goes on from.
HEAD_SQL = """
SELECT e.xid::text, e.position FROM {events} e
WHERE e.stream = %s AND e.xid < pg_snapshot_xmin(pg_current_snapshot())
ORDER BY e.xid DESC, e.position DESC LIMIT 1
"""

# A subscription that delivers again, with fresh attempts.
ACTIVE = {
    "state": SubscriptionState.ACTIVE,
    "attempts": 0,
    "failing_position": None,
    "retry_at": None,
}

# What a stream event's dead letter carries in its headers besides the
# event's own headers.
SUBSCRIPTION_HEADER = "pgqueue_subscription"
POSITION_HEADER = "pgqueue_stream_position"
KEY_HEADER = "pgqueue_stream_key"


class Moved(Exception):
    """The subscription's checkpoint or state changed under a transaction
    that expected them: roll it back."""


def _table(model):
    return connections[conf.database_alias()].ops.quote_name(model._meta.db_table)


@dataclass
class Batch:
    """One transaction's hold on a subscription: the checkpoint and state it
    read (what its changes are guarded by) and the events it passed since."""

    id: int
    name: str
    stream: str
    xid: int
    position: int
    state: str
    now: object = None  # stands in for the database's clock
    worker: str = ""
    passed_xid: int | None = None
    passed_position: int | None = None
    done: int = 0
    signals: list = field(default_factory=list)  # (signal, kwargs) to send after the commit

    def passed(self, xid, position):
        self.passed_xid, self.passed_position, self.done = xid, position, self.done + 1

    @property
    def checkpoint(self):
        if self.done:
            return (self.passed_xid, self.passed_position)
        return (self.xid, self.position)


def ensure(specs):
    """Create the rows of ``specs`` that do not exist yet; return ``{name: id}``
    of those whose row follows the spec's stream. A row of another stream
    (the subscriber was moved to another stream) is logged and left out."""
    using = conf.database_alias()
    with timeouts_sql.worker_transaction(using):  # a worker's delivery thread runs it
        return _ensure(specs, using)


def _ensure(specs, using):
    rows = Subscription.objects.using(using)
    by_name = {spec.name: spec for spec in specs}
    existing = set(rows.filter(name__in=by_name).values_list("name", flat=True))
    new = []
    for spec in specs:
        if spec.name not in existing:
            xid, position = head(spec.stream) if spec.start == END else (0, 0)
            new.append(
                Subscription(
                    name=spec.name,
                    stream=spec.stream,
                    checkpoint_xid=xid,
                    checkpoint_position=position,
                )
            )
    if new:
        rows.bulk_create(new, ignore_conflicts=True)
    ids = {}
    for pk, name, stream in rows.filter(name__in=by_name).values_list("id", "name", "stream"):
        if stream == by_name[name].stream:
            ids[name] = pk
            continue
        logger.error(
            "Subscription %s follows stream %s in the database but is registered for stream %s:"
            " not served. Delete its row to start over on %s, or register it for %s again.",
            *(name, stream, by_name[name].stream, by_name[name].stream, stream),
            extra={"subscription": name, "state": "stream_mismatch"},
        )
    return ids


def head(stream):
    """The (xid, position) of ``stream``'s last event whose transaction has
    ended, or (0, 0)."""
    with connections[conf.database_alias()].cursor() as cursor:
        cursor.execute(HEAD_SQL.format(events=_table(StreamEvent)), [stream])
        row = cursor.fetchone()
    return (int(row[0]), row[1]) if row else (0, 0)


def try_lock(subscription_id):
    """Inside a transaction: take the subscription's lock unless another
    transaction holds it."""
    with connections[conf.database_alias()].cursor() as cursor:
        cursor.execute(TRY_LOCK_SQL, [LOCK_KEY, subscription_id])
        return cursor.fetchone()[0]


# --- a delivery's transitions ---------------------------------------------------------


# advance(): what _save(batch, **ACTIVE) sends, written out so that the
# worker's limits go in the same round trip (sql.timeouts.with_limits). Once per
# batch; the xids go as text (xid8 has no cast from bigint).
ADVANCE_SQL = """UPDATE {subs} SET checkpoint_xid = %s::xid8, checkpoint_position = %s,
    state = 'active', attempts = 0, failing_position = NULL, retry_at = NULL,
    delivered = delivered + %s, delivered_at = CASE WHEN %s > 0
        THEN COALESCE(%s::timestamptz, now()) ELSE delivered_at END,
    updated_at = COALESCE(%s::timestamptz, now())
WHERE id = %s AND checkpoint_xid = %s::xid8 AND checkpoint_position = %s AND state = %s"""


def advance(batch):
    """Every event of the batch succeeded: move the checkpoint past them
    (as ``_save(batch, **ACTIVE)``, in one round trip with the limits)."""
    xid, position = batch.checkpoint
    clock = batch.now or None
    params = [str(xid), position, batch.done, batch.done, clock, clock,
              batch.id, str(batch.xid), batch.position, batch.state]  # fmt: skip
    statement, params, skip = timeouts_sql.with_limits(
        ADVANCE_SQL.format(subs=_table(Subscription)), params
    )
    with connections[conf.database_alias()].cursor() as cursor:
        cursor.execute(statement, params)
        for _ in range(skip):
            cursor.nextset()  # past the limits
        if not cursor.rowcount:
            raise Moved


def retry_later(batch, position, attempts, reason, retry_at):
    """The event at ``position`` failed attempt ``attempts``; try it again at
    ``retry_at``. The checkpoint moves past the events before it."""
    _save(batch, state=SubscriptionState.RETRYING, attempts=attempts,
          failing_position=position, last_error=reason, retry_at=retry_at)  # fmt: skip


def block(batch, position, attempts, reason):
    """Stop at the event at ``position`` until an operator acts."""
    _save(batch, state=SubscriptionState.BLOCKED, attempts=attempts,
          failing_position=position, last_error=reason, retry_at=None)  # fmt: skip
    batch.signals.append(
        (signals.subscription_blocked, {"sender": Subscription, "subscription": batch.name,
         "stream": batch.stream, "position": position, "error": first_line(reason)})
    )  # fmt: skip


def dead_letter_event(batch, position, attempts, category, reason, traceback=""):
    """The one move of a stream event into the dead letters, in the batch's
    transaction: insert the DeadLetter (payload and headers copied in the
    server, as stored) and move the checkpoint past the event, the
    subscription active again. Returns the DeadLetter; ``dead_lettered`` is
    sent after the commit.

    The dead letter's topic is the stream, its message_id the event's
    position, its queue the default queue (alerts go out from there); its
    headers are the event's plus the subscription's name, the position and
    the key. Reviving it enqueues a message of topic <stream>: a handler for
    that topic can redo the work."""
    using = conf.database_alias()
    timeouts_sql.set_limits(using)  # after the subscriber, as _save's
    event = StreamEvent.objects.using(using).only("xid", "stream").get(pk=position)
    now = batch.now or timezone.now()
    dead = DeadLetter.objects.using(using).create(
        message_id=position,
        queue=conf.get("DEFAULT_QUEUE"),
        topic=event.stream,
        category=category,
        reason=reason,
        traceback=traceback,
        attempts=attempts,
        worker=batch.worker,
        # first_failed_at too: a subscription keeps no time of its first failure.
        **dict.fromkeys(["first_failed_at", "last_failed_at", "dead_lettered_at"], now),
        payload={},  # both copied below, in the server
        headers={},
    )
    table = _table(StreamEvent)
    extra = json.dumps({SUBSCRIPTION_HEADER: batch.name, POSITION_HEADER: position})
    DeadLetter.objects.using(using).filter(pk=dead.pk).update(
        payload=RawSQL(f"SELECT payload FROM {table} WHERE position = %s", [position]),
        headers=RawSQL(
            f"SELECT headers || %s::jsonb || jsonb_build_object(%s, key) FROM {table} "
            "WHERE position = %s",
            [extra, KEY_HEADER, position],
        ),
    )
    # What receivers of dead_lettered see: loaded from the row when first
    # read (the stored JSON may be more than Python can load).
    del dead.__dict__["payload"], dead.__dict__["headers"]
    batch.passed(event.xid, position)
    _save(batch, last_error=reason, **ACTIVE)
    logger.error(
        "Subscription %s: event position=%s of stream %s dead-lettered as %s: %s",
        *(batch.name, position, event.stream, category, first_line(reason)),
        extra={"subscription": batch.name, "position": position, "state": "dead_lettered"},
    )
    batch.signals.append(
        (signals.dead_lettered, {"sender": DeadLetter, "dead_letter": dead, "message_id": position})
    )
    return dead


def _save(batch, **fields):
    """Move the checkpoint to the batch's and set ``fields``, guarded by the
    checkpoint and state the batch read."""
    xid, position = batch.checkpoint
    clock = batch.now or Now()
    if batch.done:
        fields.update(delivered=F("delivered") + batch.done, delivered_at=clock)
    # After the subscriber: its queries never get them.
    timeouts_sql.set_limits(conf.database_alias())
    changed = (
        Subscription.objects.using(conf.database_alias())
        .filter(pk=batch.id, checkpoint_xid=batch.xid, checkpoint_position=batch.position)
        .filter(state=batch.state)
        .update(checkpoint_xid=xid, checkpoint_position=position, updated_at=clock, **fields)
    )
    if not changed:
        raise Moved


# --- operators' changes (the admin, scripts) --------------------------------------------


def pause(subscriptions):
    """Pause each subscription (workers leave it alone); returns how many
    changed. ``subscriptions``: names, rows or a queryset."""
    return _each(subscriptions, lambda row: row.state != SubscriptionState.PAUSED,
                 lambda row: _set(row, state=SubscriptionState.PAUSED))  # fmt: skip


def resume(subscriptions):
    """Make paused, blocked and retrying subscriptions deliver again at once,
    with fresh attempts (a blocked one starts with the event that blocked
    it); returns how many changed."""
    return _each(subscriptions, lambda row: row.state != SubscriptionState.ACTIVE,
                 lambda row: _set(row, **ACTIVE))  # fmt: skip


def reset(subscriptions, position):
    """Move each subscription's checkpoint: delivery goes on after the event
    at ``position`` of its stream (in delivery order). ``0`` or
    ``"beginning"``: every stored event is delivered again; ``"end"``: every
    event whose transaction has ended is passed over. A retrying or blocked
    subscription becomes active (fresh attempts); a paused one stays paused.

    A position with no stored event of the stream raises SubscriptionError
    before anything changes. Returns how many subscriptions it reset."""
    if position == "beginning":
        position = 0
    if position != "end" and not (
        isinstance(position, int) and not isinstance(position, bool) and position >= 0
    ):
        raise SubscriptionError(
            f"position must be a whole number of at least 0, 'beginning' or 'end', not {position!r}"
        )
    names = _names(subscriptions)
    streams = dict(
        Subscription.objects.using(conf.database_alias())
        .filter(name__in=names)
        .values_list("name", "stream")
    )
    for stream in set(streams.values()):
        checkpoint_for(stream, position)  # every one, before the first change

    def change(row):
        xid, at = checkpoint_for(row.stream, position)
        fields = {**ACTIVE, "checkpoint_xid": xid, "checkpoint_position": at}
        if row.state == SubscriptionState.PAUSED:
            del fields["state"]
        _set(row, **fields)

    return _each(names, lambda row: True, change)


def checkpoint_for(stream, position):
    """The (xid, position) checkpoint after the event at ``position`` of
    ``stream`` (see ``reset``); SubscriptionError when it has no such event."""
    if position == "end":
        return head(stream)
    if position == 0:
        return (0, 0)
    events = StreamEvent.objects.using(conf.database_alias()).filter(stream=stream)
    xid = events.filter(pk=position).values_list("xid", flat=True).first()
    if xid is None:
        stored = events.order_by("pk").values_list("pk", flat=True)
        first, last = stored.first(), stored.last()
        where = f"it holds positions {first} to {last}" if first else "it holds no events"
        raise SubscriptionError(f"stream {stream!r} has no event at position {position} ({where})")
    return (xid, position)


def dead_letter_blocked(subscriptions, category, by=""):
    """Move the event each blocked subscription stopped at to the dead
    letters (with ``category``; the reason is its last error) and let the
    subscription go on after it; returns how many moved."""
    committed = []

    def move(row):
        batch = Batch(row.pk, row.name, row.stream, row.checkpoint_xid, row.checkpoint_position,
                      row.state, worker=by)  # fmt: skip
        reason = f"{row.last_error or 'blocked'}\n(moved to the dead letters by {by or 'hand'})"
        dead_letter_event(batch, row.failing_position, row.attempts, category, reason)
        transaction.on_commit(lambda: committed.extend(batch.signals), using=conf.database_alias())

    moved = _each(
        subscriptions,
        lambda row: row.state == SubscriptionState.BLOCKED and row.failing_position is not None,
        move,
    )
    for signal, kwargs in committed:
        signals.send(signal, **kwargs)
    return moved


def _each(subscriptions, wanted, change):
    """For each subscription (names, rows or a queryset), in a transaction of
    its own that holds its lock: ``change(row)`` if ``wanted(row)``. Returns
    how many changed."""
    changed = 0
    for name in _names(subscriptions):
        with transaction.atomic(using=conf.database_alias()):
            row = _locked(name)
            if wanted(row):
                change(row)
                changed += 1
    return changed


def _names(subscriptions):
    if isinstance(subscriptions, str):
        return [subscriptions]
    if hasattr(subscriptions, "values_list"):
        return list(subscriptions.order_by("name").values_list("name", flat=True))
    return [getattr(item, "name", item) for item in subscriptions]


def _locked(name):
    """The subscription's row, read once its lock is held (in a transaction)."""
    using = conf.database_alias()
    timeouts_sql.set_limits(using)
    rows = Subscription.objects.using(using)
    pk = rows.filter(name=name).values_list("pk", flat=True).first()
    if pk is None:
        raise SubscriptionError(f"there is no subscription named {name!r}")
    try:
        with connections[using].cursor() as cursor:
            cursor.execute(LOCK_SQL, [LOCK_KEY, pk])
    except DatabaseError as exc:
        if not isinstance(exc.__cause__, psycopg.errors.LockNotAvailable):
            raise
        raise SubscriptionError(
            f"subscription {name!r} is being delivered to and its batch outlasted "
            "PGQUEUE['LOCK_TIMEOUT']; try again"
        ) from None
    return rows.get(pk=pk)


def _set(row, **fields):
    Subscription.objects.using(conf.database_alias()).filter(pk=row.pk).update(
        updated_at=Now(), **fields
    )
    logger.info(
        "Subscription %s: %s",
        row.name,
        ", ".join(f"{name}={value}" for name, value in fields.items()),
        extra={"subscription": row.name, "state": fields.get("state", row.state)},
    )
