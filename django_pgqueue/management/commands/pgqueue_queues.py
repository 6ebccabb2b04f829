"""manage.py pgqueue_queues: look at the queues, pause and resume them,
change their limits at run time (the operations of django_pgqueue.controls).

    pgqueue_queues list [--json] [--database ALIAS]
    pgqueue_queues pause NAME [--by WHO]
    pgqueue_queues resume NAME [--by WHO]
    pgqueue_queues limit NAME [--concurrency N] [--rate N/s|N/m|N/h] [--by WHO]
    pgqueue_queues limit NAME --none | --settings
    pgqueue_queues partition-limits [NAME [KEY | --default-partition]]
    pgqueue_queues partition-limits NAME KEY|--default-partition [--concurrency N]
        [--rate N/s|N/m|N/h] [--by WHO]
    pgqueue_queues partition-limits NAME KEY|--default-partition --none | --settings

``partition-limits`` gives one partition of a queue (its messages of one
``partition_key``; ``--default-partition``: those without one) limits of
its own, in place of those the queue's ``"partition"`` settings give every
partition; ``--settings`` gives it those back. Without a change, it shows
the limits of the partitions (of every queue, of NAME, or of one).

``list`` goes through every database that holds the queues (``--database``:
one), a DATABASE column when there are several; the other actions work on
the queue's own database. The state is kept in the database: every worker on every host follows it
within a second, and it outlives restarts and deploys.
"""

import argparse
import json
from itertools import groupby
from operator import attrgetter

from django.core.management.base import BaseCommand, CommandError

from django_pgqueue import conf, controls
from django_pgqueue.conf import KEY_MAX_LENGTH, concurrency_problem, rate_problem
from django_pgqueue.exceptions import QueueControlError
from django_pgqueue.management.options import (
    add_database,
    databases,
    default_actor,
    free_text,
    queue_name,
)
from django_pgqueue.management.output import Columns, age
from django_pgqueue.observability import queues as queues_overview

COLUMNS = Columns(
    ("QUEUE", "STATE", "READY", "DELAYED", "BLOCKED", "RUNNING", "OLDEST", "DEAD", "LIMITS"),
    "<20 <7 >7 >7 >7 >7 >8 >5 <72",
)
PARTITION_COLUMNS = Columns(("QUEUE", "PARTITION", "LIMITS", "FROM"), "<20 <24 <32 <30")
ONE_CHANGE = "give --concurrency and/or --rate, or --none, or --settings (one of the three)"


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


def partition_key(text):
    """A partition's key as messages carry it: not empty (an empty key in a
    script is more often a missing value than the default partition, which
    is --default-partition)."""
    if not text:
        raise argparse.ArgumentTypeError(
            "must not be empty (the default partition: --default-partition)"
        )
    if len(text) > KEY_MAX_LENGTH:
        raise argparse.ArgumentTypeError(
            f"is {len(text)} characters long; the limit is {KEY_MAX_LENGTH}"
        )
    return free_text(text)


def _partition_label(key):
    return key or "(default)"


class Command(BaseCommand):
    help = "List the queues; pause, resume or limit one, or one of its partitions, at run time."

    def add_arguments(self, parser):
        who = argparse.ArgumentParser(add_help=False)
        who.add_argument(
            "--by", type=free_text, default=None, help="who does it (default: the login name)"
        )
        subcommands = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
        listing = subcommands.add_parser("list", help="every queue, its depth and its state")
        listing.add_argument("--json", action="store_true", help="one JSON array")
        add_database(listing)
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
            "--settings",
            action="store_true",
            dest="from_settings",  # not "settings": Django's own --settings option's
            help="the limits of PGQUEUE['QUEUES'] again",
        )
        self._add_partition_limits(subcommands, who)

    def _add_partition_limits(self, subcommands, who):
        sub = subcommands.add_parser(
            "partition-limits",
            parents=[who],
            help="show the limits of the queues' partitions, or set one partition's at run "
            "time (all workers together), in place of the queue's 'partition' settings",
        )
        sub.add_argument(
            "name", type=queue_name, nargs="?", metavar="NAME", help="the queue (default: all)"
        )
        sub.add_argument(
            "key",
            type=partition_key,
            nargs="?",
            metavar="KEY",
            help="the partition: its messages' partition_key",
        )
        sub.add_argument(
            "--default-partition",
            action="store_true",
            help="the default partition (the messages without a partition_key), not KEY",
        )
        sub.add_argument(
            "--concurrency",
            type=concurrency,
            help="at most N of the partition's messages processing at once",
        )
        sub.add_argument(
            "--rate",
            type=rate,
            help="at most N of the partition's messages started per second, minute or hour",
        )
        sub.add_argument(
            "--none",
            action="store_true",
            help="no limits for the partition, whatever the settings say",
        )
        sub.add_argument(
            "--settings",
            action="store_true",
            dest="from_settings",
            help="the limits of the queue's 'partition' entry in PGQUEUE['QUEUES'] again",
        )

    def handle(self, *args, action, **options):
        if action == "list":
            self._list(databases(options["database"]), options["json"])
            return
        name = options["name"]
        if name is None:  # partition-limits of every queue: _partition_table reads each database
            self._act(action, name, options)
            return
        with conf.on_database(conf.queue_database(name)):  # its state is on its database
            self._act(action, name, options)

    def _act(self, action, name, options):
        by = options["by"] if options["by"] is not None else default_actor()
        try:
            if action == "pause":
                changed = controls.pause_queue(name, by=by)
                self.stdout.write(f"queue {name} {'paused' if changed else 'was paused already'}")
            elif action == "resume":
                changed = controls.resume_queue(name, by=by)
                self.stdout.write(f"queue {name} {'resumed' if changed else 'was not paused'}")
            elif action == "limit":
                self._limit(name, by, options)
            else:
                self._partition_limits(name, by, options)
        except QueueControlError as exc:
            raise CommandError(str(exc)) from exc

    def _limit(self, name, by, options):
        given = options["concurrency"] is not None or options["rate"] is not None
        if sum([given, options["none"], options["from_settings"]]) != 1:
            raise CommandError(ONE_CHANGE)
        if options["from_settings"]:
            controls.clear_limits(name, by=by)
        else:
            controls.set_limits(
                name, concurrency=options["concurrency"], rate=options["rate"], by=by
            )
        limits = controls.limits_for(name, controls.states([name]).get(name))
        self.stdout.write(f"queue {name}: limits {limits}")

    def _partition_limits(self, name, by, options):
        if options["key"] is not None and options["default_partition"]:
            raise CommandError("give KEY or --default-partition, not both")
        key = "" if options["default_partition"] else options["key"]
        if name is None and key is not None:
            raise CommandError("name the queue: NAME --default-partition")
        given = options["concurrency"] is not None or options["rate"] is not None
        changes = sum([given, options["none"], options["from_settings"]])
        if changes == 0:
            if key is None:
                self._partition_table(name)
            else:
                self._partition_line(name, key)
            return
        if key is None:
            raise CommandError(
                "name the queue and the partition to change: NAME KEY or NAME --default-partition"
            )
        if changes != 1:
            raise CommandError(ONE_CHANGE)
        if options["from_settings"]:
            if not controls.clear_partition_limits(name, key, by=by):
                self.stdout.write(
                    f"queue {name}: {controls.partition_name(key)} had no limits of its own"
                )
        else:
            controls.set_partition_limits(
                name, key, concurrency=options["concurrency"], rate=options["rate"], by=by
            )
        self._partition_line(name, key)

    def _partition_line(self, name, key):
        """What holds for one partition, and where it comes from."""
        own = next((r for r in controls.partition_limits(name) if r.partition_key == key), None)
        limits = controls.partition_limits_for(name, own)
        source = "settings" if own is None else "run time"
        self.stdout.write(
            f"queue {name}, {controls.partition_name(key)}: limits {limits} ({source})"
        )

    def _partition_table(self, name):
        """The settings' limits of each partition and the partitions' own,
        of every queue that has any (or of the queue ``name``)."""
        configured = {q: limits.partition for q, limits in conf.queue_limits().items()}
        rows = []
        for alias in [conf.queue_database(name)] if name is not None else conf.databases():
            with conf.on_database(alias):
                rows += controls.partition_limits(name)  # by queue
        rows.sort(key=attrgetter("queue", "partition_key"))
        own = {queue: list(group) for queue, group in groupby(rows, attrgetter("queue"))}
        names = (
            [name]
            if name is not None
            else sorted({q for q, each in configured.items() if each is not None} | set(own))
        )
        self.stdout.write(PARTITION_COLUMNS.header())
        for queue in names:
            each = configured.get(queue)
            self.stdout.write(PARTITION_COLUMNS.row((queue, "(each)", each or "none", "settings")))
            for row in own.get(queue, []):
                limits = controls.partition_limits_of(row)
                source = f"run time, by {row.changed_by}" if row.changed_by else "run time"
                self.stdout.write(
                    PARTITION_COLUMNS.row(
                        (queue, _partition_label(row.partition_key), limits, source)
                    )
                )

    def _list(self, aliases, as_json):
        rows = queues_overview.every_database(aliases)
        if as_json:
            self.stdout.write(json.dumps([row.as_json() for row in rows], indent=2))
            return
        several = len(aliases) > 1
        columns = COLUMNS.led_by("DATABASE", "<12") if several else COLUMNS
        self.stdout.write(columns.header())
        for row in rows:
            limits = str(row.limits) if row.limits else "-"
            if row.limits_from:
                limits += f" ({row.limits_from})"
            self.stdout.write(
                columns.row(
                    (
                        *((row.database,) if several else ()),
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
            if row.partition_limits:
                self.stdout.write(f"  partitions' own limits: {row.partition_limits_text}")
