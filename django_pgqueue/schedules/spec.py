"""A schedule's entry, checked and parsed into a frozen ``ScheduleSpec``.

An entry of ``PGQUEUE["SCHEDULES"]`` is a dict with exactly one of ``cron``
(five fields, or a name such as ``@daily``) or ``every`` (seconds or a
timedelta, at least one second), exactly one of ``topic`` (with an optional
``payload``) or ``task`` (a Django Task's dotted path, with optional
``args``/``kwargs``), and optional ``queue``, ``priority``, ``timezone``,
``backfill`` and ``enabled``. ``problems`` says everything wrong with an
entry, field by field (the system checks show each one); ``parse`` returns
the spec or raises ``InvalidSchedule`` with the first problem.

Cron expressions are parsed and iterated by cronsim (``ticks.py``), never
by a parser of ours: here the expression is only normalized (the ``@``
names) and handed to cronsim to validate.
"""

from __future__ import annotations

import datetime
import difflib
import zoneinfo
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from cronsim import CronSim, CronSimError
from django.conf import settings

from django_pgqueue import conf, validation
from django_pgqueue.exceptions import InvalidMessage

# The usual names of Vixie cron; @reboot has no meaning for a queue.
CRON_NAMES = {
    "@yearly": "0 0 1 1 *",
    "@annually": "0 0 1 1 *",
    "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * 0",
    "@daily": "0 0 * * *",
    "@midnight": "0 0 * * *",
    "@hourly": "0 * * * *",
}
FIELDS = (
    *("cron", "every", "topic", "payload", "task", "args", "kwargs"),
    *("queue", "priority", "timezone", "backfill", "enabled"),
)
# A tick at most this often: one scheduler round a second keeps up with it.
MIN_EVERY = datetime.timedelta(seconds=1)
# Far beyond any useful schedule; keeps the tick arithmetic in range.
MAX_SECONDS = 100 * 366 * 86400


class InvalidSchedule(ValueError):
    """A schedule entry that cannot be used: ``name``, ``field`` (None for
    the entry as a whole), what is wrong and a ``hint``."""

    def __init__(self, name: str, field: str | None, problem: str, hint: str) -> None:
        where = f"schedule {name!r}" + (f", field {field!r}" if field else "")
        super().__init__(f"{where}: {problem}")
        self.name, self.field, self.problem, self.hint = name, field, problem, hint


@dataclass(frozen=True)
class ScheduleSpec:
    """One schedule, as the scheduler uses it. Exactly one of ``cron`` and
    ``every``, and one of ``topic`` and ``task``, is set."""

    name: str
    cron: str | None  # five fields (an @ name is stored as its expression)
    every: datetime.timedelta | None
    topic: str | None
    task: str | None  # a django.tasks Task's dotted path
    payload: Any = None
    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    queue: str | None = None  # None: the default queue (a task: its own queue_name)
    priority: int | None = None  # None: 0 (a task: its own priority)
    timezone: str = "UTC"
    backfill: datetime.timedelta = datetime.timedelta(0)
    enabled: bool = True
    source: str = "settings"  # or where the @handler that declares it is

    @property
    def zone(self) -> zoneinfo.ZoneInfo:
        return zoneinfo.ZoneInfo(self.timezone)

    @property
    def expression(self) -> str:
        """The cron expression, or "every N seconds"."""
        if self.cron is not None:
            return self.cron
        assert self.every is not None
        return f"every {_seconds_text(self.every.total_seconds())}"

    def describe(self) -> str:
        """The expression in words ("At 03:00 every day", "Every 10 seconds")."""
        if self.cron is not None:
            # cronsim's documented way (any instant: the words do not depend on it).
            return CronSim(self.cron, _ANY_INSTANT).explain()
        return self.expression.capitalize()

    @property
    def target(self) -> str:
        """What a tick enqueues: "topic X" or "task X"."""
        return f"topic {self.topic}" if self.topic is not None else f"task {self.task}"


_ANY_INSTANT = datetime.datetime(2000, 1, 1, tzinfo=datetime.UTC)


def default_timezone() -> str:
    return getattr(settings, "TIME_ZONE", None) or "UTC"


def problems(name: object, entry: object) -> list[InvalidSchedule]:
    """Everything wrong with the entry ``name`` of SCHEDULES, field by field
    (an empty list when it can be parsed)."""
    shown = str(name)
    # Named like topics (a handler's schedule is named after its topic): the
    # name travels in headers, log lines and metric labels.
    problem = conf.name_problem("the schedule name", name, conf.TOPIC_MAX_LENGTH)
    if problem:
        return [InvalidSchedule(shown, None, problem, "Name schedules like topics: a.b-c_d.")]
    if not isinstance(entry, Mapping):
        return [
            InvalidSchedule(
                shown,
                None,
                f"must be a dict, not {type(entry).__name__}",
                'Write {"cron": "0 3 * * *", "topic": "..."} or {"every": 60, "task": "..."}.',
            )
        ]
    found = [_unknown(shown, key) for key in entry if key not in FIELDS]
    found += _one_of(shown, entry, "cron", "every", "when the schedule ticks")
    found += _one_of(shown, entry, "topic", "task", "what a tick enqueues")
    for key, check in _CHECKS.items():
        if key in entry:
            found += [InvalidSchedule(shown, key, *p) for p in check(entry[key], entry)]
    return found


def parse(name: str, entry: Mapping[str, Any], source: str = "settings") -> ScheduleSpec:
    """The spec of a valid entry; ``InvalidSchedule`` (the first problem) if not."""
    found = problems(name, entry)
    if found:
        raise found[0]
    every = entry.get("every")
    return ScheduleSpec(
        name=name,
        cron=_cron_expression(entry["cron"]) if "cron" in entry else None,
        every=None if every is None else _timedelta(every),
        topic=entry.get("topic"),
        task=entry.get("task"),
        payload=entry.get("payload"),
        args=tuple(entry.get("args", ())),
        kwargs=dict(entry.get("kwargs", {})),
        queue=entry.get("queue"),
        priority=entry.get("priority"),
        timezone=entry.get("timezone") or default_timezone(),
        backfill=_timedelta(entry.get("backfill", 0)),
        enabled=entry.get("enabled", True),
        source=source,
    )


def from_handler(topic: str, schedule: object, location: str) -> ScheduleSpec:
    """The spec of ``@handler(topic, schedule=...)``: a cron expression, a
    number of seconds or a timedelta (``every``), or a dict of the entry's
    other fields. The schedule is named after the topic."""
    if isinstance(schedule, str):
        entry: dict[str, Any] = {"cron": schedule}
    elif isinstance(schedule, Mapping):
        entry = dict(schedule)
        for key in ("topic", "task"):
            if key in entry:
                raise InvalidSchedule(
                    topic, key, "is set by the handler", f"Leave {key!r} out of schedule=."
                )
    else:
        entry = {"every": schedule}
    entry["topic"] = topic
    return parse(topic, entry, source=location)


# --- the checks of each field ---------------------------------------------------------

Found = list[tuple[str, str]]  # (problem, hint)


def _unknown(name: str, key: object) -> InvalidSchedule:
    close = difflib.get_close_matches(str(key), FIELDS, n=1)
    hint = (f"Did you mean {close[0]!r}? " if close else "") + f"Known: {', '.join(FIELDS)}."
    return InvalidSchedule(name, str(key), "is not a schedule field", hint)


def _one_of(name: str, entry: Mapping[str, Any], a: str, b: str, what: str) -> list[Any]:
    if (a in entry) == (b in entry):
        said = "both" if a in entry else "neither"
        return [
            InvalidSchedule(
                name,
                f"{a}/{b}",
                f"has {said} of {a!r} and {b!r}",
                f"Give exactly one of {a!r} or {b!r}: {what}.",
            )
        ]
    return []


def _cron_expression(value: str) -> str:
    text = " ".join(value.split())
    return CRON_NAMES.get(text.lower(), text)


def _cron(value: object, entry: Mapping[str, Any]) -> Found:
    hint = "Five fields: minute hour day-of-month month day-of-week, e.g. '0 3 * * *'; or "
    hint += ", ".join(sorted(CRON_NAMES)) + "."
    if not isinstance(value, str):
        return [(f"must be a string, not {type(value).__name__}", hint)]
    expression = _cron_expression(value)
    if len(expression.split()) != 5:
        return [(f"{value!r} has {len(expression.split())} fields, not five", hint)]
    try:
        CronSim(expression, _ANY_INSTANT)
    except (CronSimError, ValueError) as exc:
        return [(f"{value!r} is not a valid cron expression ({exc})", hint)]
    return []


def _every(value: object, entry: Mapping[str, Any]) -> Found:
    seconds = _seconds(value)
    if seconds is None or not MIN_EVERY.total_seconds() <= seconds <= MAX_SECONDS:
        return [
            (
                f"must be at least 1 second (a number of seconds or a timedelta), not {value!r}",
                "E.g. 'every': 60 ticks at the start of every minute.",
            )
        ]
    return []


def _topic(value: object, entry: Mapping[str, Any]) -> Found:
    problem = conf.name_problem("the topic", value, conf.TOPIC_MAX_LENGTH)
    return [(problem, "The topic of the handler that runs the ticks.")] if problem else []


def _task(value: object, entry: Mapping[str, Any]) -> Found:
    if not isinstance(value, str) or "." not in value:
        return [
            (
                f"must be a task's dotted path, not {value!r}",
                "E.g. 'shop.tasks.cleanup' for a function decorated with @task in shop/tasks.py.",
            )
        ]
    return []  # whether it imports, and is a Task of our backend: checks.py


def _payload(value: object, entry: Mapping[str, Any]) -> Found:
    if "payload" in entry and "task" in entry:
        return [("goes with 'topic' only", "A task takes 'args' and 'kwargs'.")]
    return _json("payload", value)


def _args(value: object, entry: Mapping[str, Any]) -> Found:
    if "topic" in entry:
        return [("goes with 'task' only", "A topic's message takes a 'payload'.")]
    if not isinstance(value, list | tuple):
        return [(f"must be a list, not {type(value).__name__}", "The task's positional args.")]
    return _json("args", list(value))


def _kwargs(value: object, entry: Mapping[str, Any]) -> Found:
    if "topic" in entry:
        return [("goes with 'task' only", "A topic's message takes a 'payload'.")]
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        return [("must be a dict with string keys", "The task's keyword args.")]
    return _json("kwargs", dict(value))


def _json(what: str, value: object) -> Found:
    try:
        validation.to_json(what, value)
    except InvalidMessage as exc:
        return [(str(exc), "Messages carry JSON: numbers, strings, lists, dicts.")]
    return []


def _queue(value: object, entry: Mapping[str, Any]) -> Found:
    problem = conf.name_problem("the queue", value, conf.QUEUE_MAX_LENGTH)
    return [(problem, "A queue a worker serves (--queues).")] if problem else []


def _priority(value: object, entry: Mapping[str, Any]) -> Found:
    if conf.is_int(value) and conf.PRIORITY_MIN <= value <= conf.PRIORITY_MAX:
        return []
    return [
        (
            f"must be a whole number from {conf.PRIORITY_MIN} to {conf.PRIORITY_MAX}, not "
            f"{value!r}",
            "Higher runs first; the default is 0.",
        )
    ]


def _timezone(value: object, entry: Mapping[str, Any]) -> Found:
    hint = "An IANA time zone name such as 'Europe/Berlin' or 'UTC' (default: TIME_ZONE)."
    if not isinstance(value, str) or not value:
        return [(f"must be a time zone name, not {value!r}", hint)]
    try:
        zoneinfo.ZoneInfo(value)
    except (zoneinfo.ZoneInfoNotFoundError, ValueError):
        return [(f"{value!r} is not a known time zone", hint)]
    return []


def _backfill(value: object, entry: Mapping[str, Any]) -> Found:
    seconds = _seconds(value)
    if seconds is None or not 0 <= seconds <= MAX_SECONDS:
        return [
            (
                f"must be a number of seconds (or a timedelta) of at least 0, not {value!r}",
                "After downtime, ticks at most this old are still enqueued; older ones are "
                "skipped. 0 (the default) skips every missed tick.",
            )
        ]
    return []


def _enabled(value: object, entry: Mapping[str, Any]) -> Found:
    if isinstance(value, bool):
        return []
    return [("must be True or False", "pgqueue_schedules pause NAME pauses it at run time.")]


_CHECKS = {
    "cron": _cron,
    "every": _every,
    "topic": _topic,
    "task": _task,
    "payload": _payload,
    "args": _args,
    "kwargs": _kwargs,
    "queue": _queue,
    "priority": _priority,
    "timezone": _timezone,
    "backfill": _backfill,
    "enabled": _enabled,
}


def _seconds(value: object) -> float | None:
    if isinstance(value, datetime.timedelta):
        return value.total_seconds()
    if conf.is_int(value) or isinstance(value, float):
        return float(value)
    return None


def _timedelta(value: object) -> datetime.timedelta:
    if isinstance(value, datetime.timedelta):
        return value
    assert isinstance(value, int | float)
    return datetime.timedelta(seconds=value)


def _seconds_text(seconds: float) -> str:
    for unit, size in (("day", 86400), ("hour", 3600), ("minute", 60)):
        if seconds >= size and seconds % size == 0:
            count = int(seconds // size)
            return f"{count} {unit}{'s' if count != 1 else ''}"
    shown = f"{seconds:g}"
    return f"{shown} second{'s' if shown != '1' else ''}"
