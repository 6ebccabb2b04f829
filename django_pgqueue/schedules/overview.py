"""What the admin, ``pgqueue_schedules list`` and ``pgqueue_status`` show of
each schedule: its expression in words, time zone, next and last tick, the
state of the last tick's message, paused or not, the ticks skipped."""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from django_pgqueue import conf
from django_pgqueue.models import Schedule
from django_pgqueue.schedules import state, ticks
from django_pgqueue.schedules.configured import load, schedules_on
from django_pgqueue.schedules.spec import ScheduleSpec


@dataclass(frozen=True)
class Row:
    name: str
    spec: ScheduleSpec | None  # None: a state row left by a schedule no longer configured
    enabled: bool  # whether it ticks: the run-time override, else the setting
    override: bool | None  # the run-time override (None: the setting decides)
    next_tick: datetime.datetime | None  # None while paused, or never again
    last_tick: datetime.datetime | None
    last_message_id: int | None
    last_message_state: str | None
    skipped: int
    changed_at: datetime.datetime | None
    changed_by: str

    @property
    def paused(self) -> bool:
        return not self.enabled

    def as_json(self) -> dict[str, Any]:
        spec = self.spec

        def iso(value: datetime.datetime | None) -> str | None:
            zone = spec.zone if spec is not None else datetime.UTC
            return None if value is None else value.astimezone(zone).isoformat()

        return {
            "name": self.name,
            "configured": spec is not None,
            "expression": spec.expression if spec else None,
            "description": spec.describe() if spec else None,
            "timezone": spec.timezone if spec else None,
            "target": spec.target if spec else None,
            "paused": self.paused,
            "override": self.override,
            "next_tick": iso(self.next_tick),
            "last_tick": iso(self.last_tick),
            "last_message_id": self.last_message_id,
            "last_message_state": self.last_message_state,
            "skipped": self.skipped,
        }


def specs_here() -> list[ScheduleSpec]:
    """The configured schedules of the database the code works on: those
    whose queue is on it (a worker's engine on it runs them; their state
    rows live there) and those with a state row there; every one when the
    queues are on one database."""
    specs, _ = load()
    if len(conf.databases()) == 1:
        return specs
    here = {spec.name for spec in schedules_on(specs, conf.database_alias())}
    kept = state.states()
    return [spec for spec in specs if spec.name in here or spec.name in kept]


def rows_here() -> list[Row]:
    """The rows of the database the code works on: its schedules
    (``specs_here``), then those no longer configured."""
    return rows(specs_here())


def rows(
    specs: Sequence[ScheduleSpec] | None = None, now: datetime.datetime | None = None
) -> list[Row]:
    """A row per configured schedule (``specs``, default the project's valid
    ones), then one per state row of a schedule no longer configured.
    ``now`` defaults to the database's clock."""
    if specs is None:
        specs, _ = load()
    if now is None:
        now, _ = state.clock_and_last_ticks([])
    by_name = {spec.name: spec for spec in specs}
    states = state.states()
    names = list(by_name) + sorted(set(states) - set(by_name))
    last = state.last_ticks(names)
    message_states = state.message_states(
        row.message_id for row in last.values() if row.message_id is not None
    )
    found = []
    for name in names:
        spec = by_name.get(name)
        row = states.get(name) or Schedule(name=name, skipped=0, changed_by="")
        override = row.enabled
        enabled = spec is not None and (spec.enabled if override is None else override)
        tick = last.get(name)
        message_id = tick.message_id if tick is not None else None
        found.append(
            Row(
                name=name,
                spec=spec,
                enabled=enabled,
                override=override,
                next_tick=ticks.next_tick(spec, now) if spec is not None and enabled else None,
                last_tick=tick.tick if tick is not None else None,
                last_message_id=message_id,
                last_message_state=message_states.get(message_id) if message_id else None,
                skipped=row.skipped,
                changed_at=row.changed_at,
                changed_by=row.changed_by,
            )
        )
    return found
