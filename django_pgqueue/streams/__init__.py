"""Streams (the transactional outbox): ``publish()``, the only place that
inserts ``StreamEvent`` rows.

An event follows the caller's transaction, exactly as ``enqueue`` does: on
the queue's own database (``PGQUEUE["DATABASE"]``) the row is inserted
inside the caller's transaction, so subscribers see it only if the caller
commits; a rollback (or a rolled-back savepoint) discards it and leaves a
gap in the positions, which subscribers pass over. When the caller works on
another database alias, the insert waits for the caller's commit
(``transaction.on_commit``).

Bad input raises ``InvalidMessage`` at the call site and writes nothing; the
checks are the producer's (names, JSON, keys).
"""

import logging

from django.db import connections, transaction
from django.db.models.base import ModelState

from django_pgqueue import conf, signals
from django_pgqueue.db import prepared_cursor
from django_pgqueue.enqueuing import _aliases, _key, _name_problem, _to_json
from django_pgqueue.exceptions import InvalidMessage
from django_pgqueue.models import StreamEvent, Subscription, timestamp_from_text
from django_pgqueue.models.streams import STREAM_NAME_MAX_LENGTH

logger = logging.getLogger(__name__)

# The channel of the wake-ups for subscriptions; the payload is the stream's
# name. PostgreSQL delivers a notification when the publishing transaction
# commits, and folds identical ones: one per transaction and stream.
CHANNEL = "django_pgqueue_streams"

# One statement, one round trip: the ORM cannot return the xid8 default
# as text nor add the wake-up to the INSERT. The payload and headers go in
# as the JSON text they were validated as (never encoded twice). Columns
# left out (position, xid, created_at) take their database defaults.
PUBLISH_SQL = """INSERT INTO {table} (stream, key, payload, headers)
VALUES (%s, %s, %s::jsonb, %s::jsonb)
RETURNING position, xid::text, created_at::text"""
# With PGQUEUE["NOTIFY"]: the wake-up, sent by the same statement. Another
# program's plain INSERT sends none; workers find its events when they poll.
NOTIFY_RETURNING = f", pg_notify('{CHANNEL}', stream)"


def publish(stream, payload, *, key=None, headers=None, using=None):
    """Append an event to ``stream``, in the caller's transaction; return it
    as a ``StreamEvent``.

    ``key`` (a string of up to 255 characters, or None) says what the event
    is about and is handed to subscribers; ``headers`` is a dict of JSON
    values. ``using`` is the alias of the caller's transaction (default
    ``"default"``). ``event.position`` and ``event.xid`` are set once the row
    is inserted: at once on the queue's database, at the caller's commit
    when the queue lives on another alias (None until then).
    """
    problem = _name_problem("stream", stream, STREAM_NAME_MAX_LENGTH)
    if problem:
        raise InvalidMessage(problem)
    payload_json = _to_json("payload", payload)
    if headers is None:
        headers = {}
    if not isinstance(headers, dict) or not all(isinstance(k, str) for k in headers):
        raise InvalidMessage("headers must be a dict with string keys")
    headers_json = _to_json("headers", headers)
    key = _key("key", key)
    caller, alias = _aliases(using)

    event = StreamEvent.__new__(StreamEvent)
    event.__dict__.update(
        position=None,
        stream=stream,
        key=key,
        payload=payload,
        headers=headers,
        xid=None,
        created_at=None,
    )
    event._state = ModelState()
    params = [stream, key, payload_json, headers_json]
    if caller == alias:
        _insert(event, params, alias)
    else:
        # The stream is on another database: its insert cannot join the
        # caller's transaction, so it waits for that transaction's commit.
        transaction.on_commit(lambda: _insert(event, params, alias), using=caller)
    return event


def _insert(event, params, alias):
    connection = connections[alias]
    sql = PUBLISH_SQL.format(table=connection.ops.quote_name(StreamEvent._meta.db_table))
    if conf.get("NOTIFY"):
        sql += NOTIFY_RETURNING
    cursor = prepared_cursor(connection)
    cursor.execute(sql, params)
    position, xid, created_at = cursor.fetchone()[:3]
    event.position, event.xid = position, int(xid)
    event.created_at = timestamp_from_text(created_at)
    event._state.adding, event._state.db = False, alias
    logger.debug(
        "Event stream=%s position=%s key=%s published",
        event.stream,
        position,
        event.key,
        extra={"stream": event.stream, "position": position, "state": "published"},
    )
    if signals.event_published.has_listeners(StreamEvent):
        transaction.on_commit(
            lambda: signals.send(
                signals.event_published, sender=StreamEvent, event=event, using=alias
            ),
            using=alias,
        )


# --- retention ----------------------------------------------------------------------------

# The streams that have events: a skip scan of the stream index (one index
# probe per stream, whatever the number of events).
STREAMS_SQL = """
WITH RECURSIVE s(stream) AS (
    (SELECT stream FROM {events} ORDER BY stream LIMIT 1)
    UNION ALL
    SELECT (SELECT stream FROM {events} WHERE stream > s.stream ORDER BY stream LIMIT 1)
    FROM s WHERE s.stream IS NOT NULL
)
SELECT stream FROM s WHERE stream IS NOT NULL
"""

# One stream's events that every subscription of the stream has passed (up
# to the lowest checkpoint; without subscriptions, those whose transaction
# has ended) and that are older than the cutoff: among the first ``limit``
# in delivery order, read through the stream index, so a round costs what
# it deletes even while a subscription lags far behind. Events are
# published in about the order of their times: when the stream's first
# event is not old enough, none is, and the stream costs one index probe.
PRUNE_SQL = """
WITH cutoff AS (
    SELECT COALESCE(%(now)s::timestamptz, now()) - make_interval(secs => %(keep)s) AS t
), horizon AS (
    SELECT xid, position FROM (
        SELECT checkpoint_xid AS xid, checkpoint_position AS position FROM {subs}
        WHERE stream = %(stream)s
        UNION ALL
        SELECT pg_snapshot_xmin(pg_current_snapshot()), 0
    ) AS h ORDER BY xid, position LIMIT 1
)
DELETE FROM {events} WHERE position = ANY(ARRAY(
    SELECT e.position FROM horizon, cutoff, LATERAL (
        SELECT position, created_at FROM {events}
        WHERE stream = %(stream)s AND (xid, position) <= (horizon.xid, horizon.position)
        ORDER BY xid, position LIMIT %(limit)s
    ) AS e
    WHERE e.created_at < cutoff.t AND (
        SELECT first.created_at < cutoff.t FROM {events} AS first
        WHERE first.stream = %(stream)s ORDER BY first.xid, first.position LIMIT 1
    )
))
"""

# Events deleted per maintenance round, at most.
PRUNE_LIMIT = 20_000


def prune_events(now=None, limit=PRUNE_LIMIT):
    """Delete the events that every subscription of their stream has passed
    and that are older than PGQUEUE["STREAM_RETENTION"] (a stream without
    subscriptions: every event older than that); at most ``limit`` in one
    call. Returns how many were deleted. Run by the maintenance round."""
    keep = conf.get("STREAM_RETENTION")
    if keep is None:
        return 0
    connection = connections[conf.get("DATABASE")]
    tables = {
        "events": connection.ops.quote_name(StreamEvent._meta.db_table),
        "subs": connection.ops.quote_name(Subscription._meta.db_table),
    }
    deleted = 0
    with connection.cursor() as cursor:
        cursor.execute(STREAMS_SQL.format(**tables))
        for (stream,) in cursor.fetchall():
            if deleted >= limit:
                break
            params = {"stream": stream, "limit": limit - deleted, "now": now, "keep": keep}
            cursor.execute(PRUNE_SQL.format(**tables), params)
            deleted += cursor.rowcount
    if deleted:
        logger.info("Retention: deleted %s stream event(s)", deleted, extra={"deleted": deleted})
    return deleted
