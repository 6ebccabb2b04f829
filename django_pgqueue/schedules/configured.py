"""Every schedule of the project: the entries of ``PGQUEUE["SCHEDULES"]`` and
the ``schedule=`` of the registered handlers, by name."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from django.core.exceptions import ImproperlyConfigured
from django.utils.module_loading import import_string

from django_pgqueue import conf, registry
from django_pgqueue.schedules.spec import InvalidSchedule, ScheduleSpec, parse, problems


def load() -> tuple[list[ScheduleSpec], list[InvalidSchedule]]:
    """(the valid schedules by name, the problems of the others). A name
    declared both in the settings and on a handler is a problem."""
    entries = conf.get("SCHEDULES") or {}
    specs: dict[str, ScheduleSpec] = {}
    found: list[InvalidSchedule] = []
    if not isinstance(entries, Mapping):
        found.append(
            InvalidSchedule(
                "SCHEDULES",
                None,
                f"PGQUEUE['SCHEDULES'] must be a dict, not {type(entries).__name__}",
                "A dict of schedule names to entries.",
            )
        )
        entries = {}
    for name, entry in entries.items():
        entry_problems = problems(name, entry)
        if entry_problems:
            found += entry_problems
        else:
            specs[name] = parse(name, entry)
    for handler in registry.all_handlers():
        spec = handler.schedule
        if spec is None:
            continue
        if spec.name in specs:
            found.append(
                InvalidSchedule(
                    spec.name,
                    None,
                    f"is declared twice: in PGQUEUE['SCHEDULES'] and by {handler.location}",
                    "Keep one of them: remove the entry, or the handler's schedule=.",
                )
            )
            continue
        specs[spec.name] = spec
    return [specs[name] for name in sorted(specs)], found


def configured() -> list[ScheduleSpec]:
    """The project's schedules by name; ImproperlyConfigured when one is bad
    (``manage.py check`` lists every problem)."""
    specs, found = load()
    if found:
        raise ImproperlyConfigured(f"{found[0]} ({found[0].hint}); manage.py check lists all")
    return specs


def get(name: str) -> ScheduleSpec:
    """The schedule ``name``; KeyError naming the known ones if there is none."""
    specs = {spec.name: spec for spec in configured()}
    if name not in specs:
        known = ", ".join(specs) or "none"
        raise KeyError(f"no schedule {name!r} (configured: {known})")
    return specs[name]


def queue_of(spec: ScheduleSpec) -> str:
    """The queue ``spec``'s ticks go to: its ``queue``, else, for a task, the
    task's own ``queue_name``, else the default queue. (A task that cannot be
    imported: the default queue; its ticks fail to enqueue anyway, logged.)"""
    if spec.queue is not None:
        return spec.queue
    if spec.task is not None:
        try:
            return str(import_string(spec.task).queue_name)
        except (ImportError, AttributeError):
            pass
    return str(conf.get("DEFAULT_QUEUE"))


def schedules_on(specs: Sequence[ScheduleSpec], alias: str) -> list[ScheduleSpec]:
    """Those of ``specs`` whose queue is on the database ``alias``: what a
    worker's engine on ``alias`` runs (their state rows live there too)."""
    if len(conf.databases()) == 1:  # one database: every schedule (no import)
        return list(specs)
    return [spec for spec in specs if conf.queue_database(queue_of(spec)) == alias]
