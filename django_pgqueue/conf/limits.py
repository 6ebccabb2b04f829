"""The limits of a queue (``PGQUEUE["QUEUES"]`` in its dict form, or set at
run time: ``models.QueueState``): how many of its messages may run at once,
all workers together (``concurrency``), and how many may start per second,
minute or hour (``rate``, "100/m").

    PGQUEUE = {"QUEUES": {
        "default": {},
        "payments": {"concurrency": 3},
        "emails": {"rate": "100/m"},
    }}

The list form (``["default", "emails"]``) names queues without limits.

A queue's entry may also give it a ``weight`` (a whole number, 1 by
default when another queue has one): not a limit, but its share of the
claims of a worker that serves it beside others (``QueueShares``).

Limits of each partition of the queue (its messages of one
``partition_key``; those without one share the default partition) go
under ``"partition"``, and ``"fair": False`` turns off the claim's
rotation between partitions (strict priority, run_at, id order):

    PGQUEUE = {"QUEUES": {
        "reports": {"concurrency": 20, "partition": {"concurrency": 2}},
        "webhooks": {"partition": {"rate": "30/m"}},
        "ledger": {"fair": False},
    }}
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

# "N/s", "N/m", "N/h": at most N starts in any window of that length.
RATE_RE = re.compile(r"^([1-9][0-9]{0,8})/([smh])\Z")
RATE_PERIODS = {"s": 1, "m": 60, "h": 3600}
# The longest period a rate can have: starts older than this never count.
LONGEST_PERIOD = max(RATE_PERIODS.values())
CONCURRENCY_MAX = 1_000_000
LIMIT_KEYS = ("concurrency", "rate")
QUEUE_KEYS = (*LIMIT_KEYS, "partition", "fair", "weight", "database")
WEIGHT_MAX = 1000


@dataclass(frozen=True)
class Rate:
    """At most ``count`` messages start in any ``seconds``-long window."""

    count: int
    seconds: int

    def __str__(self) -> str:
        unit = next(u for u, s in RATE_PERIODS.items() if s == self.seconds)
        return f"{self.count}/{unit}"


@dataclass(frozen=True)
class Limits:
    """A queue's limits; None: no limit of that kind. ``partition``: the
    limits of each of its partitions (the settings' ``"partition"``);
    ``named_partitions``: some of its partitions have limits of their own
    (``models.PartitionLimit``, which the claim reads)."""

    concurrency: int | None = None
    rate: Rate | None = None
    partition: Limits | None = None
    named_partitions: bool = False

    def __bool__(self) -> bool:
        return (
            self.concurrency is not None
            or self.rate is not None
            or self.partition is not None
            or self.named_partitions
        )

    @property
    def partitioned(self) -> bool:
        """Whether its claim counts per partition."""
        return self.partition is not None or self.named_partitions

    def __str__(self) -> str:
        parts = []
        if self.concurrency is not None:
            parts.append(f"concurrency {self.concurrency}")
        if self.rate is not None:
            parts.append(f"rate {self.rate}")
        if self.partition is not None:
            parts.append(f"each partition {self.partition}")
        return ", ".join(parts) or "none"


NO_LIMITS = Limits()


def rate_problem(value: object) -> str | None:
    """Why ``value`` is not a rate ("100/m"), or None."""
    if not isinstance(value, str) or not RATE_RE.match(value):
        return (
            "must be a rate like '20/s', '100/m' or '500/h' (a whole number of at least 1, "
            "then /s, /m or /h)"
        )
    return None


def parse_rate(value: str) -> Rate:
    """``value`` ("100/m") as a Rate; ValueError says what is wrong."""
    match = RATE_RE.match(value) if isinstance(value, str) else None
    if match is None:
        raise ValueError(f"rate {value!r} {rate_problem(value)}")
    return Rate(int(match.group(1)), RATE_PERIODS[match.group(2)])


def concurrency_problem(value: object) -> str | None:
    """Why ``value`` is not a concurrency limit, or None."""
    if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= CONCURRENCY_MAX:
        return None
    return f"must be a whole number from 1 to {CONCURRENCY_MAX}"


def weight_problem(value: object) -> str | None:
    """Why ``value`` is not a queue's weight, or None."""
    if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= WEIGHT_MAX:
        return None
    return f"must be a whole number from 1 to {WEIGHT_MAX}"


def fair_problem(value: object) -> str | None:
    """Why ``value`` is not a queue's "fair" flag, or None."""
    if isinstance(value, bool):
        return None
    return "must be True (the default: a rotation between partitions) or False (strict order)"


def partition_limits_problem(value: object) -> str | None:
    """Why ``value`` (a queue's "partition" entry) is not a dict of the
    limits of each partition, or None."""
    if not isinstance(value, dict):
        return "must be a dict of the limits of each partition ({} or None for none)"
    return _entries_problem(value, LIMIT_KEYS)


_PROBLEMS = {
    "concurrency": concurrency_problem,
    "rate": rate_problem,
    "partition": partition_limits_problem,
    "fair": fair_problem,
    "weight": weight_problem,
    # A queue's database alias: checked against DATABASES by problems.py.
    "database": lambda value: None,
}


def limits_problem(value: object) -> str | None:
    """Why ``value`` (a queue's entry in the dict form of QUEUES) is not a
    dict of limits (and perhaps a weight), or None."""
    if value is None:
        return None
    if not isinstance(value, dict):
        return "must be a dict of limits ({} or None for none)"
    return _entries_problem(value, QUEUE_KEYS)


def _entries_problem(value: dict[Any, Any], known: tuple[str, ...]) -> str | None:
    """Why an entry of ``value`` (a dict of limits whose keys may be
    ``known``) is wrong, or None. None as a value: no limit."""
    for key, limit in value.items():
        if key not in known:
            return f"has an unknown limit {key!r} (known: {', '.join(known)})"
        if limit is None:
            continue
        problem = _PROBLEMS[key](limit)
        if problem:
            return f"{key} {problem}"
    return None


def limits_of(value: dict[str, Any]) -> Limits:
    """A queue's entry in the dict form of QUEUES as Limits (validated by
    the checks: ``limits_problem``)."""
    rate = value.get("rate")
    partition = value.get("partition") or {}
    partition_rate = partition.get("rate")
    each = Limits(
        partition.get("concurrency"), None if partition_rate is None else parse_rate(partition_rate)
    )
    return Limits(
        value.get("concurrency"),
        None if rate is None else parse_rate(rate),
        partition=each if each else None,
    )


def configured_unfair(queues: object) -> frozenset[str]:
    """The queues that the setting QUEUES (``queues``) gives "fair": False."""
    if not isinstance(queues, dict):
        return frozenset()
    return frozenset(name for name, value in queues.items() if (value or {}).get("fair") is False)


def configured_limits(queues: object) -> dict[str, Limits]:
    """{queue: Limits} of the queues that the setting QUEUES (``queues``)
    gives limits; the list form gives none."""
    if not isinstance(queues, dict):
        return {}
    found = {name: limits_of(value or {}) for name, value in queues.items()}
    return {name: limits for name, limits in found.items() if limits}


def configured_weights(queues: object) -> dict[str, int]:
    """{queue: weight} of every queue of the setting QUEUES (``queues``) when
    one of them has a weight (the others: 1), else {} (strict order)."""
    if not isinstance(queues, dict):
        return {}
    weights = {name: (value or {}).get("weight") for name, value in queues.items()}
    if all(weight is None for weight in weights.values()):
        return {}
    return {name: weight or 1 for name, weight in weights.items()}
