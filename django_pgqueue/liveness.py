"""What a live worker tells the database, and what it asks it while idle.

- ``heartbeat``: the worker's row in the worker table (models.WorkerHeartbeat),
  inserted or refreshed; ``unregister`` deletes it when the worker stops.
  Status pages read the rows, maintenance's rescue tells a dead worker from
  a live one by them, and maintenance deletes the rows of dead workers.
- ``extend_leases``: the leases of the messages the worker runs, pushed
  forward, so that only a dead worker's messages expire and are rescued.
- ``probe``: an idle worker's poll, which can carry the heartbeat.

None of these changes a message's status (that is ``lifecycle``'s).
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from django.db import connections
from django.db.models.functions import Now

from django_pgqueue import conf
from django_pgqueue.models import Message, Status, WorkerHeartbeat
from django_pgqueue.sql import acks as acks_sql
from django_pgqueue.sql import probe as probe_sql
from django_pgqueue.sql import timeouts as timeouts_sql


@dataclass(frozen=True)
class Beat:
    """What a worker's heartbeat records about it."""

    worker_id: str
    hostname: str
    pid: int
    queues: Sequence[str]
    concurrency: int
    alive_for: float  # seconds the row counts as alive without another beat
    inflight: int
    processed: int

    def params(self) -> list[Any]:
        """sql.probe.HEARTBEAT_SQL's parameters."""
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


def heartbeat(beat: Beat) -> None:
    """Record that the worker ``beat`` describes is alive, in one statement."""
    connection = connections[conf.database_alias()]
    statement, params, _skip = timeouts_sql.with_limits(
        probe_sql.heartbeat_statement(connection), beat.params()
    )
    with connection.cursor() as cursor:
        cursor.execute(statement, params)


def unregister(worker_id: str) -> None:
    """Remove a stopping worker's row: it is gone, not dead."""
    with timeouts_sql.worker_transaction():
        WorkerHeartbeat.objects.using(conf.database_alias()).filter(worker_id=worker_id).delete()


def extend_leases(
    messages: Sequence[Message], lease_seconds: float, now: datetime.datetime | None = None
) -> set[int]:
    """Push the leases of ``messages`` forward; returns the ids whose lease
    was lost: rows now in another state or under another lease. A row that is
    gone was acknowledged meanwhile, which is no loss.

    Rows another transaction has locked are skipped (SKIP LOCKED), not
    waited for: one locked row must not keep the other leases from being
    extended. They stay leased and are extended on the next beat."""
    using = conf.database_alias()
    expiry = (Now() if now is None else now) + datetime.timedelta(seconds=lease_seconds)
    lost: set[int] = set()
    with timeouts_sql.worker_transaction(using):
        for token, ids in acks_sql.ids_by_token(messages).items():
            unlocked = (
                Message.objects.using(using)
                .select_for_update(skip_locked=True)
                .filter(pk__in=ids, status=Status.PROCESSING, lease_token=token)
                .values("pk")
            )
            extended = (
                Message.objects.using(using).filter(pk__in=unlocked).update(lease_expires_at=expiry)
            )
            if extended < len(ids):
                lost |= set(
                    Message.objects.using(using)
                    .filter(pk__in=ids)
                    .exclude(status=Status.PROCESSING, lease_token=token)
                    .values_list("pk", flat=True)
                )
    return lost


def cancel_requested(jobs: Sequence[Any]) -> set[int]:
    """The ids of the messages of ``jobs`` (held by this worker: anything
    with a ``message``) whose cancellation was asked, in one query (none
    when there are no jobs)."""
    if not jobs:
        return set()
    return set(
        Message.objects.using(conf.database_alias())
        .filter(
            pk__in=[job.message.pk for job in jobs],
            status=Status.PROCESSING,
            cancel_requested_at__isnull=False,
        )
        .values_list("pk", flat=True)
    )


@dataclass(frozen=True)
class Probe:
    """An idle worker's view of the queue (sql.probe.PROBE_SQL)."""

    now: datetime.datetime  # the database's clock
    next_run_at: datetime.datetime | None  # earliest run_at waiting in the queues
    oldest_lease: datetime.datetime | None  # earliest lease expiry, any queue
    groups_released: bool = False  # a message group waits for its next message's promotion
    # A fingerprint of the queues' run-time state (paused, limits): changed
    # when it changed.
    controls_version: str = ""

    @property
    def ready(self) -> bool:
        return self.next_run_at is not None and self.next_run_at <= self.now

    @property
    def lease_expired(self) -> bool:
        return self.oldest_lease is not None and self.oldest_lease < self.now

    def seconds_until_due(self) -> float | None:
        if self.next_run_at is None:
            return None
        return max((self.next_run_at - self.now).total_seconds(), 0.0)


def probe(queues: Sequence[str], beat: Beat | None = None) -> Probe:
    """What an idle worker needs to know, in one query (see sql.probe.PROBE_SQL);
    with ``beat``, the same statement records the worker's heartbeat."""
    connection = connections[conf.database_alias()]
    statement = probe_sql.probe_statement(connection, with_heartbeat=beat is not None)
    params: list[Any] = [list(queues)]
    if beat is not None:
        params = [*beat.params(), *params]
    statement, params, skip = timeouts_sql.with_limits(statement, params)
    with connection.cursor() as cursor:
        cursor.execute(statement, params)
        for _ in range(skip):
            cursor.nextset()
        return Probe(*cursor.fetchone())
