"""Helpers for your project's tests: what is enqueued, and running it.

``enqueued()``, ``assert_enqueued()`` and ``assert_not_enqueued()`` look at
the messages waiting in the queue. ``drain()`` runs the ready ones in the
test's own process, thread and database connection, through the worker's
own parts: the claim (``lifecycle.ack_and_claim_rows``, the group
promotion included), the handler run and its acknowledgement
(``worker.executor.Executor``), the failure policy's retry or dead letter
and the signals (``worker.outcomes.Outcomes``). What a handler enqueues
runs too, until nothing is ready.

Inside Django's ``TestCase`` everything happens in the test's transaction:
each handler's ``transaction.on_commit`` callbacks run when its run ends,
as ``captureOnCommitCallbacks(execute=True)`` runs them (a handler that
fails has its callbacks discarded with its savepoint, as a worker's
rollback discards them). In a ``TransactionTestCase`` (or with pytest's
``django_db(transaction=True)``) each step commits as on a worker.

A pytest plugin (``django_pgqueue.pytest_plugin``) offers them all as the
``pgqueue`` fixture.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import sys
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from django.db import connections
from django.test import TestCase
from django.utils import timezone

from django_pgqueue import conf, lifecycle, registry
from django_pgqueue.models import Message, Status
from django_pgqueue.observability.metrics import (
    CANCELLED,
    DEAD_LETTERED,
    DONE,
    RETRIED,
    NullMetrics,
)
from django_pgqueue.schedules import configured, runs, state
from django_pgqueue.sql import claim as claim_sql
from django_pgqueue.worker.acks import Acks
from django_pgqueue.worker.config import WorkerConfig
from django_pgqueue.worker.executor import Executor
from django_pgqueue.worker.job import Job
from django_pgqueue.worker.ledger import Ledger
from django_pgqueue.worker.outcomes import Outcomes
from django_pgqueue.worker.pool import HandlerPool
from django_pgqueue.worker.wakeup import Wakeup

__all__ = [
    "Drained",
    "assert_enqueued",
    "assert_not_enqueued",
    "drain",
    "enqueued",
]

# The messages one claim of drain() takes at most: every ready one, in any
# test's numbers (a later round takes the rest).
CLAIM_LIMIT = 1000
# A failed assertion lists at most this many of the enqueued messages.
SHOWN = 20
# What enqueued() counts as enqueued: waiting (ready, delayed, waiting to be
# retried) and blocked behind an earlier message of its group.
ENQUEUED = (Status.WAITING, Status.BLOCKED)


# --- what is enqueued ------------------------------------------------------------


def enqueued(
    topic: str | None = None,
    queue: str | None = None,
    payload: Mapping[str, Any] | None = None,
) -> list[Message]:
    """The messages waiting in the queue (ready, delayed, waiting to be
    retried, or blocked behind an earlier message of their group) that
    match, oldest first. ``payload`` matches a payload that contains its
    keys with these values (PostgreSQL's ``@>``: nested dicts match the
    same way, lists must contain the given items)."""
    return _matching(topic, queue, payload)


def assert_enqueued(
    topic: str | None = None,
    payload: Mapping[str, Any] | None = None,
    queue: str | None = None,
    count: int | None = None,
) -> list[Message]:
    """Fail unless a message that matches is enqueued (exactly ``count`` of
    them, when given); returns them. The failure lists what is enqueued."""
    found = enqueued(topic, queue, payload)
    if (not found) if count is None else len(found) != count:
        wanted = "at least one" if count is None else f"{count}"
        raise AssertionError(
            f"expected {wanted} enqueued message(s) matching "
            f"{_describe(topic, queue, payload)}, found {len(found)}.\n{_listing()}"
        )
    return found


def assert_not_enqueued(
    topic: str | None = None,
    payload: Mapping[str, Any] | None = None,
    queue: str | None = None,
) -> None:
    """Fail if a message that matches is enqueued; the failure lists them."""
    found = enqueued(topic, queue, payload)
    if found:
        raise AssertionError(
            f"expected no enqueued message matching {_describe(topic, queue, payload)}, "
            f"found {len(found)}.\n{_listing()}"
        )


def _matching(
    topic: str | None,
    queue: str | None,
    payload: Mapping[str, Any] | None,
    limit: int | None = None,
) -> list[Message]:
    """The enqueued messages that match, of every queue database (in the
    order of ``conf.databases()``, then by id), at most ``limit``."""
    found: list[Message] = []
    aliases = conf.databases() if queue is None else [conf.queue_database(queue)]
    for alias in aliases:
        messages = Message.objects.using(alias).filter(status__in=ENQUEUED)
        if topic is not None:
            messages = messages.filter(topic=topic)
        if queue is not None:
            messages = messages.filter(queue=queue)
        if payload is not None:
            messages = messages.filter(payload__contains=payload)
        found += messages.order_by("id")[: None if limit is None else limit - len(found)]
        if limit is not None and len(found) >= limit:
            break
    return found


def _describe(topic: str | None, queue: str | None, payload: object) -> str:
    given = {"topic": topic, "queue": queue, "payload": payload}
    shown = ", ".join(f"{k}={v!r}" for k, v in given.items() if v is not None)
    return shown or "anything"


def _listing() -> str:
    """What is enqueued, for a failed assertion: one line per message."""
    messages = _matching(None, None, None, limit=SHOWN + 1)
    if not messages:
        return "Nothing is enqueued."
    lines = [f"Enqueued ({'first ' + str(SHOWN) if len(messages) > SHOWN else len(messages)}):"]
    for message in messages[:SHOWN]:
        when = "" if message.status == Status.WAITING else f" [{message.status}]"
        lines.append(
            f"  id={message.pk} queue={message.queue!r} topic={message.topic!r} "
            f"payload={_json(message.payload)} run_at={message.run_at.isoformat()}{when}"
        )
    return "\n".join(lines)


def _json(value: object) -> str:
    try:
        return json.dumps(value, sort_keys=True, default=str)
    except ValueError:
        return repr(value)


# --- running it ----------------------------------------------------------------------


@dataclass
class Drained:
    """What ``drain()`` did: each run's message and outcome, in the order
    they ran (a message retried within the drain appears once per run)."""

    runs: list[tuple[Message, str]] = field(default_factory=list)

    @property
    def messages(self) -> list[Message]:
        """The messages run, in order, as their handler saw them."""
        return [message for message, _ in self.runs]

    def count(self, outcome: str) -> int:
        """Runs that ended with ``outcome`` ("done", "retried", "dead_lettered",
        "cancelled", or "lost": the lease was gone and nothing was recorded)."""
        return sum(1 for _, got in self.runs if got == outcome)

    @property
    def done(self) -> int:
        """Runs that succeeded (the message was acknowledged)."""
        return self.count(DONE)

    @property
    def retried(self) -> int:
        """Runs that failed and were scheduled to run again."""
        return self.count(RETRIED)

    @property
    def dead_lettered(self) -> int:
        """Runs that failed and moved their message to the dead letters."""
        return self.count(DEAD_LETTERED)

    @property
    def cancelled(self) -> int:
        """Runs that ended cancelled (``django_pgqueue.cancel`` during the run)."""
        return self.count(CANCELLED)

    def __len__(self) -> int:
        return len(self.runs)


class _Recorder(NullMetrics):
    """The metrics drain()'s parts report to: the outcome of each run, as the
    worker's own Outcomes and Acks report it."""

    def __init__(self) -> None:
        self.outcomes: dict[int, str] = {}

    def finished(self, message: Any, outcome: str, duration: float | None = None) -> None:
        self.outcomes[message.pk] = outcome


def drain(
    queue: str | None = None,
    topics: Iterable[str] | None = None,
    now: datetime.datetime | None = None,
    *,
    max_messages: int | None = None,
    schedules: bool = True,
) -> Drained:
    """Run the ready messages, here and now, until none is ready; returns a
    ``Drained`` (``done``, ``retried``, ``dead_lettered``, the messages).

    ``queue``: only that queue's (default: every queue's). ``topics``: only
    messages of these topics (the others are left as they were). ``now``:
    run what is due at that time, by the database's clock (delayed
    messages, retries, the schedules' ticks), without sleeping; retries are
    then scheduled after it. Without it each round uses the database's
    clock, as a worker does. ``max_messages``: stop after that many runs (a
    handler that always enqueues another would never let the drain end).
    ``schedules``: first enqueue the due ticks of the project's periodic
    schedules, as a ``--burst`` worker does.

    A handler runs in this thread, on this thread's connection, with the
    claim, acknowledgement, retry, dead-lettering, group hand-off and
    signals of a worker. A handler's ``timeout`` is not enforced here.
    """
    if queue is not None and not isinstance(queue, str):
        raise TypeError(f"queue must be a queue's name or None, not {type(queue).__name__}")
    if now is not None and timezone.is_naive(now):
        raise ValueError("now must be an aware datetime (django.utils.timezone.now() is one)")
    wanted = None if topics is None else frozenset([topics] if isinstance(topics, str) else topics)
    drained = Drained()
    # Each queue database in turn, as the engine of a worker serving it.
    for alias in conf.databases() if queue is None else [conf.queue_database(queue)]:
        left = None if max_messages is None else max_messages - len(drained)
        with conf.on_database(alias):
            drained.runs += _drain_database(alias, queue, wanted, now, left, schedules).runs
    return drained


def _drain_database(
    alias: str,
    queue: str | None,
    wanted: frozenset[str] | None,
    now: datetime.datetime | None,
    max_messages: int | None,
    schedules: bool,
) -> Drained:
    runner = _Runner(alias, wanted, now)
    if schedules:
        runner.run_schedules()
    try:
        while max_messages is None or len(runner.drained) < max_messages:
            room = CLAIM_LIMIT if max_messages is None else max_messages - len(runner.drained)
            if not runner.round([queue] if queue else _queues_with_ready(alias), room):
                break
    finally:
        tasks_runner = sys.modules.get("django_pgqueue.tasks.runner")
        if tasks_runner is not None:  # (loaded by a task's run, on Django 6+ only)
            tasks_runner.close_side_connection(alias)
    return runner.drained


def _queues_with_ready(alias: str) -> list[str]:
    """The queues that hold waiting messages (the claim takes the ready
    ones) or blocked ones (the claim's promotion may make one of each group
    ready first)."""
    waiting = Message.objects.using(alias).filter(status__in=ENQUEUED)
    return sorted(waiting.values_list("queue", flat=True).distinct())


class _Runner:
    """The worker's parts, assembled for one thread: one handler at a time,
    each acknowledgement sent as soon as its handler returns."""

    def __init__(self, alias: str, topics: frozenset[str] | None, now: datetime.datetime | None):
        self.alias, self.topics, self.fixed_now = alias, topics, now
        self.drained = Drained()
        self.metrics = _Recorder()
        hostname = socket.gethostname()
        self.config = WorkerConfig(
            worker_id=f"testing:{hostname}:{os.getpid()}:{uuid.uuid4().hex[:6]}",
            hostname=hostname,
            queues=[],
            concurrency=1,
            # One: an atomic=False handler's acknowledgement is sent when it
            # returns (Ledger.finish), and no atomic batch shares a
            # transaction (Executor.run_job's choice, which drain skips).
            batch_size=1,
            prefetch=0,
            burst=True,
            max_messages=None,
            shutdown_timeout=0.0,
            poll_interval=conf.get("POLL_INTERVAL"),
            lease_seconds=conf.get("LEASE_SECONDS"),
            listen=False,
            heartbeat_interval=conf.get("HEARTBEAT_INTERVAL"),
        )
        self.ledger = Ledger(self.config, stuck=lambda: 0)
        self.outcomes = Outcomes(self.config.worker_id, self.metrics)
        wakeup = Wakeup()
        acks = Acks(self.config.worker_id, self.ledger, wakeup, self.outcomes)
        self.executor = Executor(
            self.config, self.ledger, HandlerPool(1), wakeup, acks, self.outcomes, self.metrics
        )

    def clock(self) -> datetime.datetime:
        """The round's time: the one given, else the database's clock now."""
        if self.fixed_now is not None:
            return self.fixed_now
        return state.clock_and_last_ticks([])[0]

    def run_schedules(self) -> None:
        specs = configured.schedules_on(configured.configured(), self.alias)
        if specs:
            while runs.run_round(specs, now=self.clock()).more:
                pass

    def round(self, queues: list[str], limit: int) -> bool:
        """Claim what is ready in ``queues`` and run up to ``limit`` of the
        messages wanted; the others go back as they were. Whether any ran."""
        if not queues:
            return False
        now = self.outcomes.now = self.clock()
        claimed = lifecycle.ack_and_claim_rows(
            [],
            queues,
            CLAIM_LIMIT,
            self.config.worker_id,
            self.config.lease_seconds,
            now=now,
            promote=True,  # every round: a group whose message finished goes on
        ).rows
        jobs = [Job(row=row, spec=registry.lookup(row[claim_sql.ROW_TOPIC])) for row in claimed]
        wanted = [j for j in jobs if self.topics is None or j.message.topic in self.topics]
        ran, left = wanted[:limit], wanted[limit:]
        left += [j for j in jobs if j not in wanted]
        if left:
            lifecycle.release([job.message for job in left])  # the attempt is not counted
        self.ledger.add(ran)
        for job in ran:
            self.run(job)
        return bool(ran)

    def run(self, job: Job) -> None:
        """Run ``job`` as a handler thread would, then record what it came to."""
        connection = connections[self.alias]
        if connection.in_atomic_block:
            # The test's transaction never commits: run the callbacks that
            # this run's commit would have run.
            with TestCase.captureOnCommitCallbacks(using=self.alias, execute=True):
                self._run(job)
        else:
            self._run(job)
        outcome = self.metrics.outcomes.pop(job.message.pk, "lost")
        self.drained.runs.append((job.message, outcome))

    def _run(self, job: Job) -> None:
        if self.executor.start(job):
            self.executor.run_one(job)
