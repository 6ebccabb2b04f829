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
checks are the messages' (``validation.py``: names, JSON, keys).

The rest of the package: ``subscribers`` (``@subscriber``),
``subscriptions`` (their checkpoints and states), ``delivery`` and
``thread`` (the worker's delivery), ``retention`` (``prune_events``, which
the maintenance round runs).
"""

from __future__ import annotations

import logging
from typing import Any

from django.db import connections, transaction

from django_pgqueue import conf, signals, tracing, validation
from django_pgqueue.db import prepared_cursor
from django_pgqueue.fields import timestamp_from_text
from django_pgqueue.models import StreamEvent
from django_pgqueue.models.streams import STREAM_NAME_MAX_LENGTH
from django_pgqueue.streams.retention import prune_events

__all__ = ["CHANNEL", "prune_events", "publish"]

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


def publish(
    stream: str,
    payload: Any,
    *,
    key: str | None = None,
    headers: dict[str, Any] | None = None,
    using: str | None = None,
) -> StreamEvent:
    """Append an event to ``stream``, in the caller's transaction; return it
    as a ``StreamEvent``.

    ``key`` (a string of up to 255 characters, or None) says what the event
    is about and is handed to subscribers; ``headers`` is a dict of JSON
    values. ``using`` is the alias of the caller's transaction (default
    ``"default"``). ``event.position`` and ``event.xid`` are set once the row
    is inserted: at once on the queue's database, at the caller's commit
    when the queue lives on another alias (None until then).
    """
    tracer = tracing.tracer()
    if tracer is not None:
        with tracing.producing(tracer, stream, None) as (span, carrier):
            headers = tracing.with_context(headers, carrier)
            event = _publish(stream, payload, key, headers, using)
            tracing.sent(span, event.position)
            return event
    return _publish(stream, payload, key, headers, using)


def _publish(
    stream: str, payload: Any, key: str | None, headers: dict[str, Any] | None, using: str | None
) -> StreamEvent:
    validation.check_name("stream", stream, STREAM_NAME_MAX_LENGTH)
    payload_json = validation.to_json("payload", payload)
    headers, headers_json = validation.check_headers(headers)
    key = validation.check_key("key", key)
    caller, alias = validation.check_using(using), conf.stream_database(stream)
    # Built as bulk_create treats its instances: unsaved until the INSERT
    # returns its position, transaction id and time.
    event = StreamEvent(  # type: ignore[misc]  # xid and created_at: from the INSERT
        position=None,
        stream=stream,
        key=key,
        payload=payload,
        headers=headers,
        xid=None,
        created_at=None,
    )
    params = [stream, key, payload_json, headers_json]
    if caller == alias:
        _insert(event, params, alias)
    else:
        # The stream is on another database: its insert cannot join the
        # caller's transaction, so it waits for that transaction's commit.
        transaction.on_commit(lambda: _insert(event, params, alias), using=caller)
    return event


def _insert(event: StreamEvent, params: list[Any], alias: str) -> None:
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
