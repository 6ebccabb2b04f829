"""The tick arithmetic: pure functions of a schedule and ``now``.

Every scheduler, on every host, must compute the same instants, so that the
tick ledger's unique (schedule, tick) constraint can tell a tick already
enqueued from a new one:

- ``every``: the whole multiples of the interval since 1970-01-01 00:00
  UTC (``every: 60`` ticks at the start of each minute), whatever the host
  or the moment the scheduler started;
- ``cron``: the instants cronsim yields in the schedule's time zone. Across
  daylight saving time it follows Debian cron. A job at a fixed time (the
  minute and hour fields are numbers, e.g. ``30 2 * * *``) runs once on
  both nights: when the clock skips 02:30 it runs at the first instant
  after the gap (03:00 in Europe/Berlin), and when the clock repeats 02:30
  it runs at the first of the two (02:30 summer time, +02:00), not the
  second. A job whose minute or hour field is a wildcard or a step
  (``*/15 * * * *``, ``0 * * * *``) follows the real clock: it has no run
  in the skipped hour, and runs in both passes of the repeated one.

``due`` splits the ticks since the last one into those still to enqueue and
those missed for good. A tick is late by ``now - tick``; up to
``max(backfill, ON_TIME)`` late it is enqueued, older it is skipped.
``ON_TIME`` covers the scheduler's own delays (its round every tick, a busy
database, a restart): they are no downtime, and no tick should be lost to
them even with the default backfill of 0.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterator
from dataclasses import dataclass

from cronsim import CronSim

from django_pgqueue.schedules.spec import ScheduleSpec

UTC = datetime.UTC
EPOCH = datetime.datetime(1970, 1, 1, tzinfo=UTC)
ON_TIME = datetime.timedelta(seconds=30)
# Ticks enqueued by one round at most; a longer backfill goes on in the next
# rounds, which follow at once.
ROUND_LIMIT = 1000
# Missed ticks of a cron schedule are counted by iterating over them; past
# this many the count stops (the log line says "at least").
COUNT_LIMIT = 100_000
_MICROSECOND = datetime.timedelta(microseconds=1)


@dataclass(frozen=True)
class Due:
    """What a round has to do for one schedule."""

    ticks: tuple[datetime.datetime, ...]  # to enqueue, oldest first (UTC)
    skipped: int  # ticks missed for good (older than the window)
    # Every tick up to this instant is skipped (None: none is); the
    # schedule's cursor moves here.
    skipped_through: datetime.datetime | None
    more: bool = False  # ticks beyond ROUND_LIMIT are due too
    counted_all: bool = True  # False: ``skipped`` stopped at COUNT_LIMIT


def window(spec: ScheduleSpec) -> datetime.timedelta:
    """How late a tick may be and still be enqueued."""
    return max(spec.backfill, ON_TIME)


def ticks_after(
    spec: ScheduleSpec, after: datetime.datetime, until: datetime.datetime | None = None
) -> Iterator[datetime.datetime]:
    """The schedule's ticks strictly after ``after`` (and at most ``until``),
    oldest first, as UTC datetimes."""
    if spec.every is not None:
        step = _microseconds(spec.every)
        k = _microseconds(after - EPOCH) // step + 1
        while True:
            tick = EPOCH + datetime.timedelta(microseconds=k * step)
            if until is not None and tick > until:
                return
            yield tick
            k += 1
    assert spec.cron is not None
    local = after.astimezone(spec.zone)
    for candidate in CronSim(spec.cron, local):
        tick = candidate.astimezone(UTC)
        # cronsim steps through wall-clock time for fixed-time jobs: started
        # in the second pass of a repeated hour, it may first yield an
        # instant of the first pass, which is before ``after``.
        if tick <= after:
            continue
        if until is not None and tick > until:
            return
        yield tick


def next_tick(spec: ScheduleSpec, after: datetime.datetime) -> datetime.datetime | None:
    """The first tick after ``after`` (None: the expression never matches again)."""
    return next(ticks_after(spec, after), None)


def count_ticks(
    spec: ScheduleSpec, after: datetime.datetime, before: datetime.datetime, limit: int
) -> tuple[int, bool]:
    """(how many ticks lie in (after, before), whether all were counted:
    a cron schedule's count stops at ``limit``)."""
    if before <= after:
        return 0, True
    if spec.every is not None:
        step = _microseconds(spec.every)
        first = _microseconds(after - EPOCH) // step + 1
        last = (_microseconds(before - EPOCH) - 1) // step  # strictly before
        return max(0, last - first + 1), True
    count = 0
    for _ in ticks_after(spec, after, before - _MICROSECOND):
        count += 1
        if count >= limit:
            return count, False
    return count, True


def due(
    spec: ScheduleSpec,
    last_tick: datetime.datetime | None,
    now: datetime.datetime,
    limit: int = ROUND_LIMIT,
) -> Due:
    """The ticks to enqueue now and those missed for good.

    ``last_tick``: the schedule's cursor (its last tick enqueued or skipped);
    None for a schedule that never ticked, which starts with its latest
    tick if that is on time (at most ``ON_TIME`` late: a worker started at
    03:00:05 still runs the 03:00 job), never with a past it did not have.
    ``now`` is the database's clock.
    """
    if last_tick is None:
        on_time = list(ticks_after(spec, now - ON_TIME - _MICROSECOND, now))
        return Due(tuple(on_time[-1:]), 0, None)
    oldest = now - window(spec)
    skipped, counted_all, skipped_through = 0, True, None
    if last_tick < oldest - _MICROSECOND:
        skipped, counted_all = count_ticks(spec, last_tick, oldest, COUNT_LIMIT)
        start = oldest - _MICROSECOND  # ticks from ``oldest`` on
        if skipped:
            skipped_through = start
    else:
        start = last_tick
    ticks: list[datetime.datetime] = []
    more = False
    for tick in ticks_after(spec, start, now):
        if len(ticks) == limit:
            more = True
            break
        ticks.append(tick)
    return Due(tuple(ticks), skipped, skipped_through, more, counted_all)


def _microseconds(delta: datetime.timedelta) -> int:
    return (delta.days * 86400 + delta.seconds) * 1_000_000 + delta.microseconds
