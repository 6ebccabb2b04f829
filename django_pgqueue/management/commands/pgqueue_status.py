"""manage.py pgqueue_status: what the queues hold, the dead letters and the
workers, as text or JSON, and an exit status for cron and monitoring.

    pgqueue_status [--queue NAME ...] [--database ALIAS] [--json]
                   [--max-ready N] [--max-age SECONDS] [--max-dead-letters N] [--min-workers N]

It reads every database that holds the queues, DATABASE first (``--database``:
one), and merges their reports (``status.merged``), each queue and row saying
its database; the text gains a DATABASE column when there are several.

Exit status: 0 when no threshold is crossed, 1 when one is (after the whole
report is written; one CRITICAL line per crossing on stderr, like
``migrate --check``), 2 when the command cannot run (a bad option, the queue
database unreachable or not migrated, a failing system check).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from django.core.management.base import BaseCommand, CommandError, SystemCheckError
from django.db import DatabaseError, OperationalError

from django_pgqueue import conf
from django_pgqueue.management.options import (
    add_database,
    databases,
    non_negative_int,
    positive_int,
    queue_name,
    seconds_or_zero,
)
from django_pgqueue.management.output import Columns, age, one_line, plural, seconds
from django_pgqueue.models import DeadLetterState, SubscriptionState
from django_pgqueue.models.streams import LAG_COUNT_CAP
from django_pgqueue.observability import stats, status
from django_pgqueue.observability.status import STATES
from django_pgqueue.text import first_line

QUEUE_COLUMNS = Columns(
    ["QUEUE / TOPIC", "READY", "DELAYED", "BLOCKED", "PROCESSING", "OLDEST READY", "WORKERS"],
    "<34 >9 >9 >9 >10 >12 >7",
)
DEAD_LETTER_COLUMNS = Columns(
    ["TOPIC", "CATEGORY", *(state.upper() for state in DeadLetterState.values)],
    "<44 <10" + " >9" * len(DeadLetterState.values),
)
WORKER_COLUMNS = Columns(
    ["ID", "HOST", "PID", "QUEUES", "STATE", "HEARTBEAT", "INFLIGHT", "PROCESSED"],
    "<26 <14 >7 <14 <5 >9 >8 >9",
)
SCHEDULE_COLUMNS = Columns(
    ["NAME", "SCHEDULE", "TIME ZONE", "STATE", "NEXT TICK", "LAST TICK", "LAST MESSAGE"],
    "<24 <30 <14 <6 <25 <25 <18",
)
SUBSCRIPTION_COLUMNS = Columns(
    ["NAME", "STREAM", "STATE", "CHECKPOINT", "LAG", "OLDEST", "WHY"],
    "<26 <20 <11 >10 >8 >7 <100",  # WHY last: long enough for an error's first line
)


class Command(BaseCommand):
    help = (
        "Show the queues (ready, delayed and processing messages by queue and topic, the "
        "oldest ready message's age, live workers), the dead letters by topic, category and "
        "state, the workers with their last heartbeat, and the stream subscriptions (every one "
        "the code declares, those no worker has started yet as 'not started'; state, "
        "checkpoint, lag, why one is blocked or retrying) and the periodic schedules (next and "
        "last tick, the last message's state, paused or not). Exit status: 0 when no threshold "
        "is crossed; 1 when one is (the report is still written, and one CRITICAL line per "
        "crossing goes to stderr); 2 when the command cannot run (a bad option, the queue "
        "database unreachable or not migrated, a failing system check). With queues on several "
        "databases it reads each (--database: one), every row saying its database."
    )

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
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
        add_database(parser)
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

    def execute(self, *args: Any, **options: Any) -> str | None:
        try:
            return super().execute(*args, **options)
        except SystemCheckError as exc:
            exc.returncode = 2  # 1 means a threshold was crossed; this is "cannot run"
            raise

    def handle(self, *args: Any, queues: list[str] | None = None, **options: Any) -> None:
        selected = list(dict.fromkeys(queues)) if queues else None
        by_database = conf.queues_by_database(selected) if selected else {}
        reports = {}
        for alias in databases(options.get("database")):
            if selected and alias not in by_database:
                continue  # no --queue of this database
            try:
                with conf.on_database(alias):
                    reports[alias] = status.report(by_database.get(alias))
            except OperationalError as exc:
                raise CommandError(
                    f"cannot reach the queue database {alias!r}: {one_line(exc)}", returncode=2
                ) from exc
            except DatabaseError as exc:
                raise CommandError(
                    f"cannot read the queue tables in database {alias!r} "
                    f"(has manage.py migrate run?): {one_line(exc)}",
                    returncode=2,
                ) from exc
        if not reports:
            raise CommandError(
                f"no --queue given lives on database {options['database']!r}", returncode=2
            )
        report = status.merged(reports)

        checked = _thresholds(report, selected, options)
        report["thresholds"] = [threshold for threshold, _ in checked]
        report["ok"] = not any(threshold["crossed"] for threshold in report["thresholds"])
        if options["json"]:
            self.stdout.write(json.dumps(report, indent=2))
        else:
            for line in _text(report):
                self.stdout.write(line)
        for threshold, line in checked:
            if threshold["crossed"]:
                self.stderr.write(f"CRITICAL: {line}")
        if not report["ok"]:
            sys.exit(1)


# --- text -------------------------------------------------------------------------------


def _text(report: dict[str, Any]) -> list[str]:
    """The report as the lines of its tables and summaries; with several
    databases, each table's first column says the row's database."""
    several = len(report["databases"]) > 1

    def table(columns: Columns) -> tuple[Columns, Any]:
        if not several:
            return columns, lambda row, cells: cells
        return columns.led_by("DATABASE", "<12"), lambda row, cells: [row["database"], *cells]

    queue_columns, lead = table(QUEUE_COLUMNS)
    lines = ["Queues", queue_columns.header()]
    for name, queue in report["queues"].items():
        counts = [queue[state] for state in STATES]
        oldest = age(queue["oldest_ready_age_seconds"])
        cells = [name, *counts, oldest, queue["workers_alive"]]
        lines.append(queue_columns.row(lead(queue, cells)))
        if queue["partitions"] is not None:
            lines.append("  " + _partitions_line(queue["partitions"]))
        for topic, topic_counts in queue["topics"].items():
            cells = ["  " + topic, *(topic_counts[s] for s in STATES)]
            lines.append(queue_columns.row(lead(queue, cells)))
    lines += [
        "",
        "Dead letters",
        *_dead_letter_lines(report["dead_letters"], *table(DEAD_LETTER_COLUMNS)),
    ]
    lines += ["", "Workers"]
    if report["workers"]:
        columns, lead = table(WORKER_COLUMNS)
        lines.append(columns.header())
        lines += [columns.row(lead(row, _worker_cells(row))) for row in report["workers"]]
    else:
        lines.append("no workers")
    lines += ["", "Subscriptions"]
    if report["subscriptions"]:
        columns, lead = table(SUBSCRIPTION_COLUMNS)
        lines.append(columns.header())
        for row in report["subscriptions"]:
            lines.append(columns.row(lead(row, _subscription_cells(row))))
    else:
        lines.append("no subscriptions")
    lines += ["", "Schedules"]
    if report["schedules"]:
        columns, lead = table(SCHEDULE_COLUMNS)
        lines.append(columns.header())
        lines += [columns.row(lead(row, _schedule_cells(row))) for row in report["schedules"]]
    else:
        lines.append("no schedules")
    lines += ["", "History", _history_line(report["history"])]
    workflows = ", ".join(f"{status} {n}" for status, n in report["workflows"].items())
    return [*lines, "", "Workflows", workflows]


def _partitions_line(partitions: dict[str, Any]) -> str:
    """A queue's partitions: how many have ready messages, and the busiest."""

    def busiest(rows: list[dict[str, Any]]) -> str:
        return ", ".join(f"{row['partition']} ({row['count']})" for row in rows) or "none"

    return (
        f"partitions: {partitions['ready']} with ready messages; most ready: "
        f"{busiest(partitions['top_ready'])}; most running: {busiest(partitions['top_running'])}"
    )


def _history_line(history: dict[str, Any]) -> str:
    """How many finished messages are kept, their size and the oldest's age."""
    if not history["keep_finished_seconds"] and not history["rows"]:
        return "off (KEEP_FINISHED is 0)"
    rows = f"{'about ' if history['rows_estimated'] else ''}{plural(history['rows'], 'message')}"
    oldest = history["oldest_age_seconds"]
    return (
        f"{rows} finished, {history['bytes'] // 1024} kB, "
        f"oldest {age(oldest) if oldest is not None else '-'} ago, "
        f"kept {seconds(history['keep_finished_seconds'])}s"
    )


def _schedule_cells(row: dict[str, Any]) -> list[object]:
    last = row["last_message_state"] or ""
    if row["last_message_id"] is not None:
        last = f"#{row['last_message_id']} {last}"
    return [
        row["name"],
        row["description"] or "(no longer configured)",
        row["timezone"] or "",
        "paused" if row["paused"] else "active",
        row["next_tick"] or "-",
        row["last_tick"] or "-",
        last or "-",
    ]


def _dead_letter_lines(
    dead_letters: list[dict[str, Any]], columns: Columns, lead: Any
) -> list[str]:
    """A row per database, topic and category, a column per state."""
    by_pair: dict[tuple[str, str, str], dict[str, int]] = {}
    for row in dead_letters:
        pair = (row["database"], row["topic"], row["category"])
        by_pair.setdefault(pair, {})[row["state"]] = row["count"]
    if not by_pair:
        return ["no dead letters"]
    lines = [columns.header()]
    for (database, topic, category), by_state in by_pair.items():
        counts = [by_state.get(state, 0) for state in DeadLetterState.values]
        lines.append(columns.row(lead({"database": database}, [topic, category, *counts])))
    return lines


def _worker_cells(worker: dict[str, Any]) -> list[object]:
    return [
        worker["worker_id"],
        worker["hostname"],
        worker["pid"],
        ",".join(worker["queues"]),
        "alive" if worker["alive"] else "stale",
        age(worker["heartbeat_age_seconds"]),
        worker["inflight"],
        worker["processed"],
    ]


def _subscription_cells(row: dict[str, Any]) -> list[object]:
    if row["state"] == stats.NOT_STARTED:
        return [row["name"], row["stream"], row["state"], "-", "-"]  # the state says why
    oldest = row["oldest_pending_age_seconds"]
    return [
        row["name"],
        row["stream"],
        row["state"],
        row["checkpoint_position"],
        f"{row['lag']}+" if row["lag"] >= LAG_COUNT_CAP else row["lag"],
        "" if oldest is None else age(oldest),
        _why(row),
    ]


def _why(row: dict[str, Any]) -> str:
    """Why a subscription does not deliver: paused, or the event it is blocked
    at or retrying, and the first line of its error."""
    if row["state"] == SubscriptionState.PAUSED:
        return "paused by an operator"
    if row["failing_position"] is None:
        return ""
    where = f"event {row['failing_position']}"
    if row["state"] == SubscriptionState.RETRYING:
        where += f", attempt {row['attempts'] + 1} in {age(row['retry_in_seconds'] or 0)}"
    else:
        where += f" failed {plural(row['attempts'], 'attempt')}"
    return f"{where}: {first_line(row['error'])}"


# --- thresholds -------------------------------------------------------------------------


def _thresholds(
    report: dict[str, Any], selected: list[str] | None, options: dict[str, Any]
) -> list[tuple[dict[str, Any], str]]:
    """``[(threshold, line), ...]``: each threshold given, for each queue it
    applies to, with the CRITICAL line to print if it is crossed."""
    checked = []

    def check(
        name: str, limit: float, value: float, crossed: bool, line: str, queue: str | None = None
    ) -> None:
        threshold: dict[str, Any] = {"name": name, "limit": limit, "value": value}
        if queue is not None:
            threshold["queue"] = queue
        threshold["crossed"] = crossed
        checked.append((threshold, line))

    queues = report["queues"]
    limit = options["max_ready"]
    if limit is not None:
        for name, queue in queues.items():
            ready = queue[stats.READY]
            line = f"queue {name!r} has {plural(ready, 'ready message')} (limit {limit})"
            # A paused queue's backlog grows by design: no alarm for it.
            check("max_ready", limit, ready, ready > limit and not queue["paused"], line, name)
    limit = options["max_age"]
    if limit is not None:
        for name, queue in queues.items():
            waited = queue["oldest_ready_age_seconds"]
            line = (
                f"queue {name!r} has a message ready for {seconds(waited)} seconds and not "
                f"yet claimed (limit {seconds(limit)})"
            )
            check("max_age", limit, waited, waited > limit and not queue["paused"], line, name)
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
        line = f"{plural(new, 'new dead letter')}{where} (limit {limit})"
        check("max_dead_letters", limit, new, new > limit, line)
    limit = options["min_workers"]
    if limit is not None:
        for name in selected if selected is not None else conf.queues():
            if name not in queues:
                continue  # on a database not reported (--database)
            alive = queues[name]["workers_alive"]
            line = f"queue {name!r} has {plural(alive, 'live worker')} (minimum {limit})"
            check("min_workers", limit, alive, alive < limit, line, name)
    return checked
