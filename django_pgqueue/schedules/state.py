"""The database side of the schedules: each schedule's run-time state
(``Schedule``: paused or resumed, skipped ticks) and its tick ledger
(``ScheduleTick``).

The one writer of both. "This tick, once" is ``record_ticks``: the ledger's
unique (schedule, tick) constraint lets one transaction record a tick, and
the caller enqueues its message in that same transaction (``runs``), so a
tick is one message or none, never two, whoever else tries it.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from django.db import connections
from django.db.models import F, OuterRef, Q, Subquery
from django.db.models.functions import Now

from django_pgqueue import conf
from django_pgqueue.models import DeadLetter, Message, Schedule, ScheduleTick
from django_pgqueue.sql import schedules as schedules_sql

# The ledger keeps this many of a schedule's newest ticks (the admin shows
# them), and every tick a scheduler may still try to enqueue (younger than
# its window, ticks.window), whichever is more.
KEEP_TICKS = 100
# Ticks of a schedule that is no longer configured go after this long.
ORPHAN_RETENTION = datetime.timedelta(days=30)

# What became of a tick's message, when it has left the queue table.
FINISHED = "finished"
DEAD_LETTERED = "dead-lettered"


@dataclass(frozen=True)
class Locked:
    """A schedule's state row, locked by this round."""

    name: str
    enabled: bool | None  # the run-time override (None: the setting decides)
    skipped_through: datetime.datetime | None


def ensure(names: Iterable[str]) -> None:
    """Give each schedule its state row (the row schedulers lock), if it has none."""
    rows = [Schedule(name=name) for name in names]
    if rows:
        Schedule.objects.using(conf.database_alias()).bulk_create(rows, ignore_conflicts=True)


def lock(names: Sequence[str], idle_limit: bool = True) -> list[Locked]:
    """Inside a transaction: lock the state rows of ``names``, skipping those
    another scheduler holds (it is enqueuing their ticks right now). With
    ``idle_limit`` (the transaction is the round's own, not a caller's), the
    server ends the transaction should it idle (sql.schedules.SCHEDULE_IDLE_LIMIT)."""
    if idle_limit:
        with connections[conf.database_alias()].cursor() as cursor:
            cursor.execute(
                schedules_sql.SCHEDULE_IDLE_LIMIT_SQL, [schedules_sql.SCHEDULE_IDLE_LIMIT]
            )
    rows = (
        Schedule.objects.using(conf.database_alias())
        .select_for_update(skip_locked=True)
        .filter(name__in=names)
        .order_by("name")
        .values_list("name", "enabled", "skipped_through")
    )
    return [Locked(*row) for row in rows]


def clock_and_last_ticks(
    names: Sequence[str],
) -> tuple[datetime.datetime, dict[str, datetime.datetime | None]]:
    """The database's time and each schedule's latest recorded tick (None
    for one that never ticked)."""
    connection = connections[conf.database_alias()]
    with connection.cursor() as cursor:
        cursor.execute(
            schedules_sql.schedule_statement(connection, schedules_sql.SCHEDULE_CURSORS_SQL),
            [list(names)],
        )
        rows = cursor.fetchall()
    return rows[0][0], {name: tick for _, name, tick in rows if name is not None}


def record_ticks(
    name: str, ticks: Sequence[datetime.datetime]
) -> list[tuple[int, datetime.datetime]]:
    """Inside a transaction: record ``ticks`` of schedule ``name``; returns
    (ledger id, tick) of those no one had recorded, whose messages the
    caller now enqueues in the same transaction."""
    if not ticks:
        return []
    connection = connections[conf.database_alias()]
    with connection.cursor() as cursor:
        cursor.execute(
            schedules_sql.schedule_statement(connection, schedules_sql.SCHEDULE_TICKS_SQL),
            [name, list(ticks)],
        )
        return [(pk, tick) for pk, tick in cursor.fetchall()]


def set_messages(recorded: Sequence[tuple[int, int | None]]) -> None:
    """Point ledger rows (id, message id) at the messages of their ticks."""
    rows = [ScheduleTick(pk=pk, message_id=message_id) for pk, message_id in recorded]
    ScheduleTick.objects.using(conf.database_alias()).bulk_update(rows, ["message_id"])


def skip(name: str, through: datetime.datetime, count: int) -> None:
    """Move the cursor of ``name`` past every tick up to ``through``,
    counting ``count`` of them as missed (0 for the ticks of a pause)."""
    Schedule.objects.using(conf.database_alias()).filter(name=name).update(
        skipped_through=through, skipped=F("skipped") + count
    )


def set_enabled(name: str, enabled: bool | None, by: str = "") -> Schedule:
    """Pause (False), resume (True) or reset (None: the setting decides) the
    schedule ``name`` at run time. Persisted: it survives restarts and
    deploys, and wins over the setting's ``enabled`` until reset."""
    using = conf.database_alias()
    ensure([name])
    Schedule.objects.using(using).filter(name=name).update(
        enabled=enabled, changed_at=Now(), changed_by=by[:150]
    )
    return Schedule.objects.using(using).get(name=name)


def states(names: Iterable[str] | None = None) -> dict[str, Schedule]:
    """The state rows by name (of ``names``, or all)."""
    rows = Schedule.objects.using(conf.database_alias()).all()
    if names is not None:
        rows = rows.filter(name__in=list(names))
    return {row.name: row for row in rows}


def last_ticks(names: Iterable[str]) -> dict[str, ScheduleTick]:
    """Each schedule's newest ledger row (its last tick enqueued)."""
    using = conf.database_alias()
    newest = ScheduleTick.objects.using(using).filter(schedule=OuterRef("schedule"))
    rows = ScheduleTick.objects.using(using).filter(
        schedule__in=list(names),
        pk=Subquery(newest.order_by("-tick").values("pk")[:1]),
    )
    return {row.schedule: row for row in rows}


def recent_ticks(name: str, limit: int = 20) -> list[ScheduleTick]:
    """The newest ledger rows of ``name``, newest first."""
    rows = ScheduleTick.objects.using(conf.database_alias()).filter(schedule=name)
    return list(rows.order_by("-tick")[:limit])


def message_states(message_ids: Iterable[int]) -> dict[int, str]:
    """What each message is doing: its status while in the queue table
    (waiting, blocked, processing...), "dead-lettered", or "finished" once
    it left the queue otherwise."""
    ids = {pk for pk in message_ids if pk is not None}
    if not ids:
        return {}
    using = conf.database_alias()
    found: dict[int, str] = dict(
        Message.objects.using(using).filter(pk__in=ids).values_list("pk", "status")
    )
    dead = DeadLetter.objects.using(using).filter(message_id__in=ids - set(found))
    found.update(dict.fromkeys(dead.values_list("message_id", flat=True), DEAD_LETTERED))
    return {pk: found.get(pk, FINISHED) for pk in ids}


def prune(horizons: dict[str, datetime.datetime], now: datetime.datetime) -> int:
    """Delete ledger rows no one needs: of each configured schedule (the
    keys of ``horizons``), those older than its horizon (no scheduler tries
    ticks that old) beyond its newest KEEP_TICKS; of any other schedule,
    those older than ORPHAN_RETENTION. Returns how many went."""
    ledger = ScheduleTick.objects.using(conf.database_alias())
    deleted = 0
    for name, horizon in horizons.items():
        newest = ledger.filter(schedule=name).order_by("-tick").values("tick")
        keep_from = newest[KEEP_TICKS : KEEP_TICKS + 1]  # NULL (deletes none) if fewer
        count, _ = ledger.filter(schedule=name, tick__lt=horizon, tick__lte=keep_from).delete()
        deleted += count
    orphans = ~Q(schedule__in=list(horizons)) & Q(tick__lt=now - ORPHAN_RETENTION)
    count, _ = ledger.filter(orphans).delete()
    return deleted + count
