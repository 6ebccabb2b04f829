"""An idle worker's poll (the database's clock, the next due message, the
oldest lease, a group waiting for promotion, the queues' run-time state)
and the worker's heartbeat, which rides on the poll."""

from __future__ import annotations

from django.db.backends.base.base import BaseDatabaseWrapper

from django_pgqueue.models import (
    GroupRelease,
    Message,
    PartitionLimit,
    QueueState,
    WorkerHeartbeat,
)
from django_pgqueue.sql import table

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
# run-time state (models.QueueState: paused queues, limits; and
# models.PartitionLimit, the limits of named partitions): the fallback of
# its NOTIFY, read again only when the fingerprint changed.
PROBE_SQL = """
SELECT now(),
    (SELECT {finite} FROM (SELECT min(head.run_at) AS t FROM unnest(%s::text[]) AS q(name),
        LATERAL (SELECT run_at FROM {table} WHERE status = 'waiting' AND queue = q.name
        ORDER BY run_at LIMIT 1) AS head) AS due),
    (SELECT {finite} FROM (SELECT min(lease_expires_at) AS t FROM {table}
        WHERE status = 'processing') AS lease),
    EXISTS (SELECT 1 FROM {releases}),
    (SELECT count(*) || ' ' || COALESCE(max(updated_at)::text, '') FROM {queue_states})
    || ' ' || (SELECT count(*) || ' ' || COALESCE(max(updated_at)::text, '') FROM {partitions})
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
        partitions=table(connection, PartitionLimit),
    )
    if with_heartbeat:
        sql = f"WITH beat AS ({heartbeat_statement(connection)}) {sql}"
    return sql
