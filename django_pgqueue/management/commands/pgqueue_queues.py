"""manage.py pgqueue_queues: look at the queues, pause and resume them,
change their limits at run time (the operations of django_pgqueue.controls).

    pgqueue_queues list [--json]
    pgqueue_queues pause NAME [--by WHO]
    pgqueue_queues resume NAME [--by WHO]
    pgqueue_queues limit NAME [--concurrency N] [--rate N/s|N/m|N/h] [--by WHO]
    pgqueue_queues limit NAME --none | --settings

The state is kept in the database: every worker on every host follows it
within a second, and it outlives restarts and deploys.
"""

import argparse
import json

from django.core.management.base import BaseCommand, CommandError

from django_pgqueue import controls
from django_pgqueue.conf import concurrency_problem, rate_problem
from django_pgqueue.exceptions import QueueControlError
from django_pgqueue.management.options import default_actor, free_text, queue_name
from django_pgqueue.management.output import Columns, age
from django_pgqueue.observability import queues as queues_overview

COLUMNS = Columns(
    ("QUEUE", "STATE", "READY", "DELAYED", "BLOCKED", "RUNNING", "OLDEST", "DEAD", "LIMITS"),
    "<20 <7 >7 >7 >7 >7 >8 >5 <40",
)


def concurrency(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    problem = concurrency_problem(value)
    if problem:
        raise argparse.ArgumentTypeError(f"{problem}, not {value}")
    return value


def rate(text):
    problem = rate_problem(text)
    if problem:
        raise argparse.ArgumentTypeError(f"{problem}, not {text!r}")
    return text


class Command(BaseCommand):
    help = "List the queues; pause, resume or limit one at run time."

    def add_arguments(self, parser):
        who = argparse.ArgumentParser(add_help=False)
        who.add_argument(
            "--by", type=free_text, default=None, help="who does it (default: the login name)"
        )
        subcommands = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
        listing = subcommands.add_parser("list", help="every queue, its depth and its state")
        listing.add_argument("--json", action="store_true", help="one JSON array")
        for action, text in [
            ("pause", "no worker claims from the queue (running messages finish)"),
            ("resume", "workers claim from the queue again"),
        ]:
            sub = subcommands.add_parser(action, parents=[who], help=text)
            sub.add_argument("name", type=queue_name, metavar="NAME")
        limiting = subcommands.add_parser(
            "limit",
            parents=[who],
            help="set the queue's limits at run time (all workers together)",
        )
        limiting.add_argument("name", type=queue_name, metavar="NAME")
        limiting.add_argument(
            "--concurrency", type=concurrency, help="at most N messages processing at once"
        )
        limiting.add_argument(
            "--rate", type=rate, help="at most N messages started per second, minute or hour"
        )
        limiting.add_argument(
            "--none", action="store_true", help="no limits, whatever the settings say"
        )
        limiting.add_argument(
            "--settings", action="store_true", help="the limits of PGQUEUE['QUEUES'] again"
        )

    def handle(self, *args, action, **options):
        if action == "list":
            self._list(options["json"])
            return
        by = options["by"] if options["by"] is not None else default_actor()
        name = options["name"]
        try:
            if action == "pause":
                changed = controls.pause_queue(name, by=by)
                self.stdout.write(f"queue {name} {'paused' if changed else 'was paused already'}")
            elif action == "resume":
                changed = controls.resume_queue(name, by=by)
                self.stdout.write(f"queue {name} {'resumed' if changed else 'was not paused'}")
            else:
                self._limit(name, by, options)
        except QueueControlError as exc:
            raise CommandError(str(exc)) from exc

    def _limit(self, name, by, options):
        given = options["concurrency"] is not None or options["rate"] is not None
        if sum([given, options["none"], options["settings"]]) != 1:
            raise CommandError(
                "give --concurrency and/or --rate, or --none, or --settings (one of the three)"
            )
        if options["settings"]:
            controls.clear_limits(name, by=by)
        else:
            controls.set_limits(
                name, concurrency=options["concurrency"], rate=options["rate"], by=by
            )
        limits = controls.limits_for(name, controls.states([name]).get(name))
        self.stdout.write(f"queue {name}: limits {limits}")

    def _list(self, as_json):
        rows = queues_overview.overview()
        if as_json:
            self.stdout.write(json.dumps([row.as_json() for row in rows], indent=2))
            return
        self.stdout.write(COLUMNS.header())
        for row in rows:
            limits = str(row.limits) if row.limits else "-"
            if row.limits_from:
                limits += f" ({row.limits_from})"
            self.stdout.write(
                COLUMNS.row(
                    (
                        row.name,
                        "paused" if row.paused else "running",
                        row.ready,
                        row.delayed,
                        row.blocked,
                        row.processing,
                        "-" if row.oldest_ready_age is None else age(row.oldest_ready_age),
                        row.dead_letters,
                        limits,
                    )
                )
            )
