"""Stream retention: the maintenance round deletes the events that every
subscription of their stream has passed, once they are older than
``PGQUEUE["STREAM_RETENTION"]``. The only place that deletes ``StreamEvent``
rows."""

from __future__ import annotations

import datetime
import logging

from django.db import connections

from django_pgqueue import conf
from django_pgqueue.models import StreamEvent, Subscription

logger = logging.getLogger(__name__)

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


def prune_events(now: datetime.datetime | None = None, limit: int = PRUNE_LIMIT) -> int:
    """Delete the events that every subscription of their stream has passed
    and that are older than PGQUEUE["STREAM_RETENTION"] (a stream without
    subscriptions: every event older than that); at most ``limit`` in one
    call. Returns how many were deleted. Run by the maintenance round."""
    keep = conf.get("STREAM_RETENTION")
    if keep is None:
        return 0
    connection = connections[conf.database_alias()]
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
