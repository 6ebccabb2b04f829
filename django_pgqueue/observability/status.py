"""The status report (``manage.py pgqueue_status``): what the queues hold,
the dead letters, the workers, the stream subscriptions and the periodic
schedules, as JSON-ready values read through ``stats`` at one instant."""

from __future__ import annotations

from typing import Any

from django.utils import timezone

from django_pgqueue import conf, controls
from django_pgqueue.models import SubscriptionState
from django_pgqueue.observability import outcomes, stats
from django_pgqueue.schedules import overview

# What a message in the queue table is doing, in the report's order.
STATES = (stats.READY, stats.DELAYED, stats.BLOCKED, stats.PROCESSING)


def report(selected: list[str] | None) -> dict[str, Any]:
    """Everything the command shows of the database that the code works on
    (``conf.database_alias()``), as JSON-ready values, each row and queue
    saying that database; ``selected`` is the --queue list (of this
    database's queues), or None for the queues configured on this database
    and any other in use in it."""
    alias = conf.database_alias()
    now = timezone.now()  # one instant for the ready/delayed split and the ages
    messages = stats.messages_by_queue_topic_state(now=now)
    ages = stats.oldest_ready_age(now=now)
    partitions = stats.partitions_by_queue(now=now)
    workers = stats.workers()
    dead_letters = stats.dead_letters_by_topic_category_state(selected)
    subscriptions = stats.subscriptions_with_lag()  # streams have no queue: never --queue'd
    declared = [
        spec
        for spec in stats.subscriptions_not_started(row.name for row in subscriptions)
        if conf.stream_database(spec.stream) == alias
    ]

    if selected is not None:
        workers = [w for w in workers if set(w.queues) & set(selected)]
    # Live workers by queue, from the same rows as the Workers section
    # (without a second query).
    alive = stats.live_by_queue(workers)

    if selected is not None:
        names = selected
    else:
        configured = [name for name in conf.queues() if conf.queue_database(name) == alias]
        in_use = {row[0] for row in messages} | set(alive)
        names = configured + sorted(in_use - set(configured))

    queue_states = controls.states(names)
    queues: dict[str, dict[str, Any]] = {
        name: {
            "database": alias,
            **dict.fromkeys(STATES, 0),
            "oldest_ready_age_seconds": round(ages.get(name, 0.0), 3),
            "workers_alive": alive.get(name, 0),
            **_controls(name, queue_states.get(name)),
            "partitions": partitions[name].as_json() if name in partitions else None,
            "topics": {},
        }
        for name in names
    }
    for name, topic, state, number in messages:
        if name in queues:
            queues[name][state] += number
            topics = queues[name]["topics"]
            topics.setdefault(topic, dict.fromkeys(STATES, 0))[state] = number

    return {
        "queues": queues,
        "dead_letters": [
            {
                "database": alias,
                "topic": topic,
                "category": category,
                "state": state,
                "count": number,
            }
            for topic, category, state, number in dead_letters
        ],
        "workers": [{"database": alias, **_worker(w)} for w in workers],
        # Every subscription the code declares, the ones no worker has
        # started yet too (they have no row), and any row left of one that
        # is no longer declared; by name.
        "subscriptions": sorted(
            [{"database": alias, **_subscription(row)} for row in subscriptions]
            + [{"database": alias, **_not_started(spec)} for spec in declared],
            key=lambda row: row["name"],
        ),
        # Schedules have no queue of their own to --queue by: always all.
        "schedules": [{"database": alias, **row.as_json()} for row in overview.rows_here()],
        # Finished messages kept (KEEP_FINISHED): how many, how old.
        "history": outcomes.history_summary(now),
        # Workflows by status (finished ones until they are pruned).
        "workflows": stats.workflows_by_status(),
    }


def merged(reports: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One report of the ``{alias: report}`` of several databases: their
    rows one after the other, each saying its database; a queue found in two
    databases (messages left behind where it lived before) is keyed
    ``"name@alias"`` in the second. A queue's live workers are those alive in
    any database's worker table (a worker counted once); the history and
    the workflows are summed."""
    parts = list(reports.values())
    result: dict[str, Any] = {"databases": list(reports), "queues": {}}
    names: dict[str, str] = {}  # merged key: queue name
    for part in parts:
        for name, queue in part["queues"].items():
            key = name if name not in result["queues"] else f"{name}@{queue['database']}"
            result["queues"][key], names[key] = queue, name
    for key in ("dead_letters", "workers", "subscriptions", "schedules"):
        result[key] = [row for part in parts for row in part[key]]
    alive: dict[str, set[str]] = {}
    for worker in result["workers"]:
        if worker["alive"]:
            for name in worker["queues"]:
                alive.setdefault(name, set()).add(worker["worker_id"])
    for key, queue in result["queues"].items():
        queue["workers_alive"] = len(alive.get(names[key], ()))
    histories = [part["history"] for part in parts]
    ages = [h["oldest_age_seconds"] for h in histories if h["oldest_age_seconds"] is not None]
    result["history"] = {
        "keep_finished_seconds": histories[0]["keep_finished_seconds"],
        "rows": sum(h["rows"] for h in histories),
        "rows_estimated": any(h["rows_estimated"] for h in histories),
        "bytes": sum(h["bytes"] for h in histories),
        "oldest_age_seconds": max(ages) if ages else None,
    }
    result["workflows"] = {
        status: sum(part["workflows"].get(status, 0) for part in parts)
        for status in parts[0]["workflows"]
    }
    return result


def _controls(name: str, state: Any) -> dict[str, Any]:
    """A queue's run-time state: paused, and the limits that hold."""
    limits = controls.limits_for(name, state)
    return {
        "paused": bool(state is not None and state.paused),
        "concurrency": limits.concurrency,
        "rate": None if limits.rate is None else str(limits.rate),
    }


def _worker(row: Any) -> dict[str, Any]:
    return {
        "worker_id": row.worker_id,
        "hostname": row.hostname,
        "pid": row.pid,
        "queues": list(row.queues),
        "concurrency": row.concurrency,
        "alive": row.alive,
        "heartbeat_at": row.heartbeat_at.isoformat(),
        "heartbeat_age_seconds": round(row.heartbeat_age, 3),
        "inflight": row.inflight,
        "processed": row.processed,
        "started_at": row.started_at.isoformat(),
    }


def _subscription(row: Any) -> dict[str, Any]:
    # last_error is kept after the subscription recovers: it explains the
    # state only while the subscription is retrying or blocked.
    failing = row.state in (SubscriptionState.RETRYING, SubscriptionState.BLOCKED)
    oldest = row.oldest_pending_at
    retry_at = row.retry_at if row.state == SubscriptionState.RETRYING else None
    return {
        "name": row.name,
        "stream": row.stream,
        "state": row.state,
        "checkpoint_position": row.checkpoint_position,
        "head_position": row.head_position,
        "lag": row.lag,  # committed events after the checkpoint, up to LAG_COUNT_CAP
        "oldest_pending_age_seconds": (
            None if oldest is None else round(max((row.now - oldest).total_seconds(), 0.0), 3)
        ),
        "delivered": row.delivered,
        "failing_position": row.failing_position if failing else None,
        "attempts": row.attempts,  # failed attempts at failing_position
        "retry_at": retry_at.isoformat() if retry_at else None,
        "retry_in_seconds": (
            round(max((retry_at - row.now).total_seconds(), 0.0), 3) if retry_at else None
        ),
        "error": row.last_error if failing else None,
    }


def _not_started(spec: Any) -> dict[str, Any]:
    """A declared subscription without a row: nothing read, nothing to say."""
    return {
        "name": spec.name,
        "stream": spec.stream,
        "state": stats.NOT_STARTED,
        "checkpoint_position": None,
        "head_position": None,
        "lag": None,
        "oldest_pending_age_seconds": None,
        "delivered": 0,
        "failing_position": None,
        "attempts": 0,
        "retry_at": None,
        "retry_in_seconds": None,
        "error": None,
    }
