"""manage.py pgqueue_status: what the queues hold, the dead letters and the
workers, as text or JSON, and an exit status for cron and monitoring.

    pgqueue_status [--queue NAME ...] [--json]
                   [--max-ready N] [--max-age SECONDS] [--max-dead-letters N] [--min-workers N]

Exit status: 0 when no threshold is crossed, 1 when one is (after the whole
report is written; one CRITICAL line per crossing on stderr, like
``migrate --check``), 2 when the command cannot run (a bad option, the queue
database unreachable or not migrated, a failing system check).
"""

import json
import sys

from django.core.management.base import BaseCommand, CommandError, SystemCheckError
from django.db import DatabaseError, OperationalError
from django.utils import timezone

from django_pgqueue import conf
from django_pgqueue.management.options import (
    non_negative_int,
    positive_int,
    queue_name,
    seconds_or_zero,
)
from django_pgqueue.models import DeadLetterState, SubscriptionState
from django_pgqueue.models.streams import LAG_COUNT_CAP
from django_pgqueue.observability import stats

STATES = (stats.READY, stats.DELAYED, stats.BLOCKED, stats.PROCESSING)

# The columns of each section: (title, width, alignment); numbers and ages
# are right-aligned under their titles.
QUEUE_COLUMNS = (
    ("QUEUE / TOPIC", 34, "<"),
    ("READY", 9, ">"),
    ("DELAYED", 9, ">"),
    ("BLOCKED", 9, ">"),
    ("PROCESSING", 10, ">"),
    ("OLDEST READY", 12, ">"),
    ("WORKERS", 7, ">"),
)
DEAD_LETTER_COLUMNS = (
    ("TOPIC", 44, "<"),
    ("CATEGORY", 10, "<"),
    *((state.upper(), 9, ">") for state in DeadLetterState.values),
)
WORKER_COLUMNS = (
    ("ID", 26, "<"),
    ("HOST", 14, "<"),
    ("PID", 7, ">"),
    ("QUEUES", 14, "<"),
    ("STATE", 5, "<"),
    ("HEARTBEAT", 9, ">"),
    ("INFLIGHT", 8, ">"),
    ("PROCESSED", 9, ">"),
)
SUBSCRIPTION_COLUMNS = (
    ("NAME", 26, "<"),
    ("STREAM", 20, "<"),
    ("STATE", 8, "<"),
    ("CHECKPOINT", 10, ">"),
    ("LAG", 8, ">"),
    ("OLDEST", 7, ">"),
    ("WHY", 100, "<"),  # last: long enough for an error's first line
)


class Command(BaseCommand):
    help = (
        "Show the queues (ready, delayed and processing messages by queue and topic, the "
        "oldest ready message's age, live workers), the dead letters by topic, category and "
        "state, the workers with their last heartbeat, and the stream subscriptions (state, "
        "checkpoint, lag, why one is blocked or retrying). Exit status: 0 when no threshold "
        "is crossed; 1 when one is (the report is still written, and one CRITICAL line per "
        "crossing goes to stderr); 2 when the command cannot run (a bad option, the queue "
        "database unreachable or not migrated, a failing system check)."
    )

    def add_arguments(self, parser):
        parser.add_argument(
            "--queue",
            action="append",
            type=queue_name,
            dest="queues",
            metavar="NAME",
            help="report on this queue only (repeat for more); the thresholds and the dead "
            "letters and workers shown are limited to these queues too "
            "(default: the configured queues, then any other that holds messages or has a live "
            "worker)",
        )
        parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
        thresholds = parser.add_argument_group("thresholds (exit status 1 when one is crossed)")
        thresholds.add_argument(
            "--max-ready",
            type=non_negative_int,
            metavar="N",
            help="more than N ready messages in any one queue",
        )
        thresholds.add_argument(
            "--max-age",
            type=seconds_or_zero,
            metavar="SECONDS",
            help="a queue's oldest ready message has waited more than SECONDS",
        )
        thresholds.add_argument(
            "--max-dead-letters",
            type=non_negative_int,
            metavar="N",
            help="more than N dead letters in state new",
        )
        thresholds.add_argument(
            "--min-workers",
            type=positive_int,
            metavar="N",
            help="fewer than N live workers serve a configured (or --queue) queue",
        )

    def execute(self, *args, **options):
        try:
            return super().execute(*args, **options)
        except SystemCheckError as exc:
            exc.returncode = 2  # 1 means a threshold was crossed; this is "cannot run"
            raise

    def handle(self, *args, queues=None, **options):
        selected = list(dict.fromkeys(queues)) if queues else None
        alias = conf.get("DATABASE")
        try:
            report = _report(selected)
        except OperationalError as exc:
            raise CommandError(
                f"cannot reach the queue database {alias!r}: {_one_line(exc)}", returncode=2
            ) from exc
        except DatabaseError as exc:
            raise CommandError(
                f"cannot read the queue tables in database {alias!r} "
                f"(has manage.py migrate run?): {_one_line(exc)}",
                returncode=2,
            ) from exc

        checked = _thresholds(report, selected, options)
        report["thresholds"] = [threshold for threshold, _ in checked]
        report["ok"] = not any(threshold["crossed"] for threshold in report["thresholds"])
        if options["json"]:
            self.stdout.write(json.dumps(report, indent=2))
        else:
            self._text(report)
        for threshold, line in checked:
            if threshold["crossed"]:
                self.stderr.write(f"CRITICAL: {line}")
        if not report["ok"]:
            sys.exit(1)

    # --- text -----------------------------------------------------------------------

    def _text(self, report):
        write = self.stdout.write
        write("Queues")
        write(_header(QUEUE_COLUMNS))
        for name, queue in report["queues"].items():
            age = _age(queue["oldest_ready_age_seconds"])
            counts = [queue[state] for state in STATES]
            write(_row(QUEUE_COLUMNS, [name, *counts, age, queue["workers_alive"]]))
            for topic, topic_counts in queue["topics"].items():
                counts = [topic_counts[state] for state in STATES]
                write(_row(QUEUE_COLUMNS[: 1 + len(STATES)], ["  " + topic, *counts]))

        write("")
        write("Dead letters")
        by_pair = {}
        for row in report["dead_letters"]:
            by_pair.setdefault((row["topic"], row["category"]), {})[row["state"]] = row["count"]
        if by_pair:
            write(_header(DEAD_LETTER_COLUMNS))
            for (topic, category), by_state in by_pair.items():
                counts = [by_state.get(state, 0) for state in DeadLetterState.values]
                write(_row(DEAD_LETTER_COLUMNS, [topic, category, *counts]))
        else:
            write("no dead letters")

        write("")
        write("Workers")
        if report["workers"]:
            write(_header(WORKER_COLUMNS))
            for worker in report["workers"]:
                values = [
                    worker["worker_id"],
                    worker["hostname"],
                    worker["pid"],
                    ",".join(worker["queues"]),
                    "alive" if worker["alive"] else "stale",
                    _age(worker["heartbeat_age_seconds"]),
                    worker["inflight"],
                    worker["processed"],
                ]
                write(_row(WORKER_COLUMNS, values))
        else:
            write("no workers")

        write("")
        write("Subscriptions")
        if report["subscriptions"]:
            write(_header(SUBSCRIPTION_COLUMNS))
            for row in report["subscriptions"]:
                lag = f"{row['lag']}+" if row["lag"] >= LAG_COUNT_CAP else row["lag"]
                oldest = row["oldest_pending_age_seconds"]
                values = [
                    row["name"],
                    row["stream"],
                    row["state"],
                    row["checkpoint_position"],
                    lag,
                    "" if oldest is None else _age(oldest),
                    _why(row),
                ]
                write(_row(SUBSCRIPTION_COLUMNS, values))
        else:
            write("no subscriptions")


# --- the report -------------------------------------------------------------------------


def _report(selected):
    """Everything the command shows, as JSON-ready values; ``selected`` is the
    --queue list, or None for the configured queues and any other in use."""
    now = timezone.now()  # one instant for the ready/delayed split and the ages
    messages = stats.messages_by_queue_topic_state(now=now)
    ages = stats.oldest_ready_age(now=now)
    workers = stats.workers()
    dead_letters = stats.dead_letters_by_topic_category_state(selected)
    subscriptions = stats.subscriptions_with_lag()  # streams have no queue: never --queue'd

    if selected is not None:
        workers = [w for w in workers if set(w.queues) & set(selected)]
    # Live workers by queue, from the same rows as the Workers section (as
    # stats.live_workers_by_queue() counts them, without a second query).
    alive = {}
    for worker in workers:
        if worker.alive:
            for name in worker.queues:
                alive[name] = alive.get(name, 0) + 1

    if selected is not None:
        names = selected
    else:
        configured = conf.queues()
        in_use = {row[0] for row in messages} | set(alive)
        names = configured + sorted(in_use - set(configured))

    queues = {
        name: {
            **dict.fromkeys(STATES, 0),
            "oldest_ready_age_seconds": round(ages.get(name, 0.0), 3),
            "workers_alive": alive.get(name, 0),
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
            {"topic": topic, "category": category, "state": state, "count": number}
            for topic, category, state, number in dead_letters
        ],
        "workers": [_worker(w) for w in workers],
        "subscriptions": [_subscription(row) for row in subscriptions],
    }


def _worker(row):
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


def _subscription(row):
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


def _why(row):
    """Why a subscription does not deliver: paused, or the event it is blocked
    at or retrying, and the first line of its error."""
    if row["state"] == SubscriptionState.PAUSED:
        return "paused by an operator"
    if row["failing_position"] is None:
        return ""
    where = f"event {row['failing_position']}"
    if row["state"] == SubscriptionState.RETRYING:
        where += f", attempt {row['attempts'] + 1} in {_age(row['retry_in_seconds'] or 0)}"
    else:
        where += f" failed {_plural(row['attempts'], 'attempt')}"
    return f"{where}: {_first_line(row['error'])}"


# --- thresholds -------------------------------------------------------------------------


def _thresholds(report, selected, options):
    """``[(threshold, line), ...]``: each threshold given, for each queue it
    applies to, with the CRITICAL line to print if it is crossed."""
    checked = []

    def check(name, limit, value, crossed, line, queue=None):
        threshold = {"name": name, "limit": limit, "value": value}
        if queue is not None:
            threshold["queue"] = queue
        threshold["crossed"] = crossed
        checked.append((threshold, line))

    queues = report["queues"]
    limit = options["max_ready"]
    if limit is not None:
        for name, queue in queues.items():
            ready = queue[stats.READY]
            line = f"queue {name!r} has {_plural(ready, 'ready message')} (limit {limit})"
            check("max_ready", limit, ready, ready > limit, line, name)
    limit = options["max_age"]
    if limit is not None:
        for name, queue in queues.items():
            age = queue["oldest_ready_age_seconds"]
            line = (
                f"queue {name!r} has a message ready for {_seconds(age)} seconds and not "
                f"yet claimed (limit {_seconds(limit)})"
            )
            check("max_age", limit, age, age > limit, line, name)
    limit = options["max_dead_letters"]
    if limit is not None:
        new = sum(
            row["count"] for row in report["dead_letters"] if row["state"] == DeadLetterState.NEW
        )
        where = ""
        if selected is not None:
            where = f" in queue{'' if len(selected) == 1 else 's'} " + ", ".join(
                map(repr, selected)
            )
        line = f"{_plural(new, 'new dead letter')}{where} (limit {limit})"
        check("max_dead_letters", limit, new, new > limit, line)
    limit = options["min_workers"]
    if limit is not None:
        for name in selected if selected is not None else conf.queues():
            alive = queues[name]["workers_alive"]
            line = f"queue {name!r} has {_plural(alive, 'live worker')} (minimum {limit})"
            check("min_workers", limit, alive, alive < limit, line, name)
    return checked


# --- formatting -------------------------------------------------------------------------


def _seconds(value):
    """312.5, 300: seconds without a trailing .0 (nor an exponent)."""
    return f"{value:.3f}".rstrip("0").rstrip(".")


def _plural(number, noun):
    return f"{number} {noun}{'' if number == 1 else 's'}"


def _age(seconds):
    """12s, 5m 03s, 2h 05m, 3d 04h: short and readable; JSON has the exact seconds."""
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds}s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m {seconds:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours}h {minutes:02d}m"
    days, hours = divmod(hours, 24)
    return f"{days}d {hours:02d}h"


def _header(columns):
    return _row(columns, [title for title, _, _ in columns])


def _row(columns, values):
    cells = []
    for (_, width, align), value in zip(columns, values, strict=True):
        text = _cell(value, width)
        cells.append(text.rjust(width) if align == ">" else text.ljust(width))
    return " ".join(cells).rstrip()


def _cell(value, width):
    # Names and hosts come from the database: no control characters to the terminal.
    text = "".join(c if c.isprintable() else "?" for c in str(value))
    if len(text) > width:
        text = text[: width - 1] + "…"
    return text


def _one_line(exc):
    return " ".join(str(exc).split())


def _first_line(text):
    lines = (text or "").strip().splitlines()
    return lines[0] if lines else ""
