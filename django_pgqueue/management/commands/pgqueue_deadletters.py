"""manage.py pgqueue_deadletters: list, revive, resolve and categorize dead
letters from the shell (the same operations as django_pgqueue.deadletters).

    pgqueue_deadletters list [filters] [--limit N] [--json]
    pgqueue_deadletters revive [filters] [--queue Q] [--topic-to T] [--force] [--rate N]
    pgqueue_deadletters resolve [filters] --note "..." [--by NAME]
    pgqueue_deadletters categorize [filters] --to CATEGORY [--note "..."]

Filters: --topic, --category, --state, --since, --ids. The three actions
refuse to run without a filter unless --all is given, and take --dry-run.
Each goes through every database that holds the queues (``--database``:
one); with several, each row and result line says its database, and --ids
(numbered per database) needs --database.
"""

import argparse
import datetime
import json
import math
import re

from django.core.management.base import BaseCommand, CommandError
from django.core.serializers.json import DjangoJSONEncoder
from django.utils import timezone

from django_pgqueue import conf, deadletters
from django_pgqueue.exceptions import DeadLetterError
from django_pgqueue.management.options import (
    SECONDS_MAX,
    add_database,
    databases,
    default_actor,
    free_text,
    id_list,
    non_blank_text,
    positive_int,
    queue_name,
    text_list,
    topic_name,
)
from django_pgqueue.management.output import cell
from django_pgqueue.models import Category, DeadLetterState
from django_pgqueue.text import first_line

# The filter options, and the argument of deadletters.select each one gives.
FILTERS = {
    "topic": "topics",
    "category": "categories",
    "state": "states",
    "since": "since",
    "ids": "ids",
}

_AGE = re.compile(r"^(\d+(?:\.\d+)?)([smhdw])$")
_AGE_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days", "w": "weeks"}

# list: the columns of the table, (title, width); the reason takes the rest.
COLUMNS = (
    ("ID", 8),
    ("DEAD-LETTERED", 16),
    ("STATE", 8),
    ("CATEGORY", 10),
    ("TOPIC", 28),
    ("QUEUE", 12),
    ("ATT", 3),
)


def _choices_list(choices, what):
    def parse(text):
        items = text_list(text)
        for item in items:
            if item not in choices.values:
                raise argparse.ArgumentTypeError(
                    f"unknown {what} {item!r}; one of {', '.join(choices.values)}"
                )
        return items

    return parse


category_list = _choices_list(Category, "category")
state_list = _choices_list(DeadLetterState, "state")


def category(text):
    if text not in Category.values:
        raise argparse.ArgumentTypeError(
            f"unknown category {text!r}; one of {', '.join(Category.values)}"
        )
    return text


def since(text):
    """A date (2026-11-01, midnight in the current time zone), an ISO 8601
    datetime, or an age: 30m, 2h, 3d, 1w."""
    text = text.strip()
    match = _AGE.match(text)
    if match:
        amount = float(match.group(1))
        try:
            return timezone.now() - datetime.timedelta(**{_AGE_UNITS[match.group(2)]: amount})
        except OverflowError:
            raise argparse.ArgumentTypeError(f"{text!r} reaches back before year 1") from None
    for parse in (datetime.date.fromisoformat, datetime.datetime.fromisoformat):
        try:
            value = parse(text)
        except ValueError:
            continue
        if not isinstance(value, datetime.datetime):
            value = datetime.datetime.combine(value, datetime.time())
        if timezone.is_naive(value):
            value = timezone.make_aware(value)
        return value
    raise argparse.ArgumentTypeError(
        f"{text!r} is not a date (2026-11-01), a datetime (2026-11-01T08:30) "
        "or an age (30m, 2h, 3d, 1w)"
    )


def rate(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be more than zero messages per second, not {text}")
    if 1 / value > SECONDS_MAX:  # the wait after each message
        raise argparse.ArgumentTypeError(
            f"must be at least one message every {SECONDS_MAX:.0f} seconds, not {text}"
        )
    return value


class Command(BaseCommand):
    help = "List, revive, resolve and categorize dead letters."

    def add_arguments(self, parser):
        filters = argparse.ArgumentParser(add_help=False)
        group = filters.add_argument_group("filters (all must match)")
        group.add_argument("--topic", type=text_list, help="comma-separated topics")
        group.add_argument(
            "--category",
            type=category_list,
            help=f"comma-separated categories: {', '.join(Category.values)}",
        )
        group.add_argument(
            "--state",
            type=state_list,
            help=f"comma-separated states: {', '.join(DeadLetterState.values)}",
        )
        group.add_argument(
            "--since",
            type=since,
            help="dead-lettered at or after: a date (2026-11-01), a datetime, or an age "
            "(30m, 2h, 3d, 1w)",
        )
        group.add_argument("--ids", type=id_list, help="comma-separated dead-letter ids")
        add_database(group, "act on")

        action = argparse.ArgumentParser(add_help=False)
        action.add_argument(
            "--all", action="store_true", help="act on every dead letter when no filter is given"
        )
        action.add_argument(
            "--dry-run", action="store_true", help="count what would change; change nothing"
        )
        action.add_argument(
            "--by",
            type=free_text,
            default=None,
            help="who does it, for the audit fields (default: the login name)",
        )

        subcommands = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
        listing = subcommands.add_parser("list", parents=[filters], help="show dead letters")
        listing.add_argument(
            "--limit", type=positive_int, default=100, help="show at most N (default: 100)"
        )
        listing.add_argument("--json", action="store_true", help="one JSON array, all fields")

        reviving = subcommands.add_parser(
            "revive", parents=[filters, action], help="put dead letters back into the queue"
        )
        reviving.add_argument("--queue", type=queue_name, help="revive into this queue instead")
        reviving.add_argument("--topic-to", type=topic_name, help="revive under this topic instead")
        reviving.add_argument(
            "--force", action="store_true", help="revive already revived or resolved ones too"
        )
        reviving.add_argument(
            "--rate",
            type=rate,
            help="revive at most N messages per second instead of all at once",
        )
        reviving.add_argument("--note", type=non_blank_text, help="a note for the audit trail")

        resolving = subcommands.add_parser(
            "resolve", parents=[filters, action], help="close dead letters without reviving"
        )
        resolving.add_argument("--note", type=non_blank_text, required=True, help="why (required)")

        categorizing = subcommands.add_parser(
            "categorize", parents=[filters, action], help="set the category of dead letters"
        )
        categorizing.add_argument(
            "--to",
            type=category,
            required=True,
            help=f"the category: {', '.join(Category.values)}",
        )
        categorizing.add_argument("--note", type=non_blank_text, help="a note for the audit trail")

    def handle(self, *args, action, **options):
        aliases = databases(options["database"])
        if options["ids"] is not None and len(aliases) > 1:
            raise CommandError(
                "--ids names dead letters of one database (each numbers its own): "
                f"give --database (one of {', '.join(aliases)})"
            )
        if action == "list":
            try:
                self._list(aliases, options)
            except DeadLetterError as exc:
                raise CommandError(str(exc)) from exc
            return
        if not options["all"] and not any(options[name] is not None for name in FILTERS):
            raise CommandError(
                f"refusing to {action} every dead letter: give a filter "
                f"({', '.join('--' + name for name in FILTERS)}) or --all"
            )
        for alias in aliases:
            with conf.on_database(alias):
                result = self._act(action, options)
            self.stdout.write(f"{alias}: {result}" if len(aliases) > 1 else str(result))

    def _act(self, action, options):
        """Run ``action`` on the dead letters the filters select in the
        database the code works on: its result."""
        try:
            selected = deadletters.select(**{arg: options[name] for name, arg in FILTERS.items()})
            by = options["by"] if options["by"] is not None else default_actor()
            common = {"by": by, "dry_run": options["dry_run"]}
            if action == "revive":
                return deadletters.revive(
                    selected,
                    queue=options["queue"],
                    topic=options["topic_to"],
                    force=options["force"],
                    rate=options["rate"],
                    note=options["note"],
                    **common,
                )
            if action == "resolve":
                return deadletters.resolve(selected, note=options["note"], **common)
            return deadletters.categorize(selected, options["to"], note=options["note"], **common)
        except DeadLetterError as exc:
            raise CommandError(str(exc)) from exc

    def _list(self, aliases, options):
        """The newest dead letters of every database in ``aliases``, newest
        first, at most --limit in all."""
        limit, total, found = options["limit"], 0, []
        for alias in aliases:
            with conf.on_database(alias):
                selected = deadletters.select(
                    **{arg: options[name] for name, arg in FILTERS.items()}
                )
                total += selected.count()
                found += [
                    (alias, row) for row in selected.order_by("-dead_lettered_at", "-id")[:limit]
                ]
        found.sort(key=lambda pair: (pair[1].dead_lettered_at, pair[1].pk), reverse=True)
        found = found[:limit]
        if options["json"]:
            rows = [{"database": alias, **_as_dict(row)} for alias, row in found]
            self.stdout.write(json.dumps(rows, cls=DjangoJSONEncoder, indent=2))
            return
        if not found:
            self.stdout.write("no dead letters")
            return
        columns = ((("DATABASE", 12),) if len(aliases) > 1 else ()) + COLUMNS
        self.stdout.write(" ".join(title.ljust(width) for title, width in columns) + " REASON")
        for alias, row in found:
            when = timezone.localtime(row.dead_lettered_at).strftime("%Y-%m-%d %H:%M")
            values = [row.pk, when, row.state, row.category, row.topic, row.queue, row.attempts]
            if len(aliases) > 1:
                values = [alias, *values]
            cells = [
                cell(value, width).ljust(width)
                for value, (_, width) in zip(values, columns, strict=True)
            ]
            self.stdout.write(" ".join(cells) + " " + cell(first_line(row.reason), 60).rstrip())
        shown = f"{len(found)} of {total}" if len(found) < total else f"{total}"
        more = " (--limit shows more)" if len(found) < total else ""
        self.stdout.write(f"{shown} dead letter{'' if total == 1 else 's'}{more}")


def _as_dict(row):
    return {field.attname: getattr(row, field.attname) for field in row._meta.concrete_fields}
