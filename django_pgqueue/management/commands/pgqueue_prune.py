"""manage.py pgqueue_prune: delete now what is past its retention, as the
workers' maintenance does every minute.

    pgqueue_prune [--dry-run] [--budget SECONDS] [--database ALIAS]

Finished messages older than KEEP_FINISHED, the overview's counts older
than two days, resolved and revived dead letters older than
KEEP_RESOLVED_DEAD_LETTERS, finished Tasks results older than
KEEP_TASK_RESULTS and the rows of workers dead for a day: in batches of at
most 10,000 rows, each its own short transaction under the maintenance
lock. Prints what it removed (``--dry-run``: what it would remove). It goes
through every database that holds the queues (``--database``: one), each
line led by its database when there are several; the budget is shared.

Exit status: 0 when everything due was removed; 1 when the time budget ran
out or a worker's maintenance held the lock (run it again: what is left is
still due); 2 when the command cannot run.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from django.core.management.base import BaseCommand, CommandError
from django.db import DatabaseError

from django_pgqueue import conf, maintenance
from django_pgqueue.management.options import add_database, databases, seconds
from django_pgqueue.management.output import one_line

LABELS = {
    "history": "finished messages (history)",
    "counts": "per-minute outcome counts",
    "dead_letters": "resolved or revived dead letters",
    "task_results": "finished Tasks results",
    "workers": "rows of dead workers",
    "workflows": "finished workflows (with their steps)",
}


class Command(BaseCommand):
    help = (
        "Delete what is past its retention now: finished messages (KEEP_FINISHED), resolved "
        "and revived dead letters (KEEP_RESOLVED_DEAD_LETTERS), finished Tasks results "
        "(KEEP_TASK_RESULTS), dead workers' rows; in batches of at most 10,000 rows. Prints "
        "what it removed."
    )

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--dry-run",
            action="store_true",
            help="delete nothing: print how many rows of each kind are due",
        )
        parser.add_argument(
            "--budget",
            type=seconds,
            default=300.0,
            metavar="SECONDS",
            help="stop after this long (default 300); what is left stays due",
        )
        add_database(parser, "prune")

    def handle(
        self, *args: Any, dry_run: bool = False, budget: float = 300.0, **options: Any
    ) -> None:
        aliases = databases(options.get("database"))
        deadline = time.monotonic() + budget
        verb = "due (dry run, nothing deleted)" if dry_run else "deleted"
        for alias in aliases:
            lead = f"{alias}: " if len(aliases) > 1 else ""
            try:
                with conf.on_database(alias):
                    result = maintenance.prune(
                        dry_run=dry_run, budget=max(deadline - time.monotonic(), 0.0)
                    )
            except DatabaseError as exc:
                where = f" database {alias!r}" if len(aliases) > 1 else ""
                raise CommandError(f"cannot prune{where}: {one_line(exc)}", returncode=2) from exc
            for kind, count in result.counts.items():
                self.stdout.write(f"{lead}{LABELS[kind]}: {count} {verb}")
            if not result.complete:
                self.stderr.write(
                    f"{lead}stopped before the end (time budget spent, or a worker's "
                    "maintenance holds the lock): run it again"
                )
                sys.exit(1)
