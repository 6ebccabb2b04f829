"""manage.py pgqueue_subscriptions: look at and steer stream subscriptions
from the shell (the same operations as django_pgqueue.streams.subscriptions).

    pgqueue_subscriptions list [--database ALIAS]
    pgqueue_subscriptions pause NAME [NAME ...]
    pgqueue_subscriptions resume NAME [NAME ...]
    pgqueue_subscriptions reset NAME [NAME ...] --to POSITION|beginning|end

``list`` goes through every database that holds the queues (``--database``:
one), a DATABASE column when there are several; the other actions find each
subscription on the database that holds it.
"""

import argparse

from django.core.management.base import BaseCommand, CommandError

from django_pgqueue import conf
from django_pgqueue.exceptions import SubscriptionError
from django_pgqueue.management.options import add_database, databases, free_text
from django_pgqueue.models import Subscription
from django_pgqueue.models.streams import LAG_COUNT_CAP
from django_pgqueue.observability import stats
from django_pgqueue.streams import subscriptions
from django_pgqueue.text import first_line


def target(text):
    """--to: a position (0 is the beginning), "beginning" or "end"."""
    if text in ("beginning", "end"):
        return text
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is neither a position (a whole number) nor 'beginning' or 'end'"
        ) from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"a position is 0 or more, not {value}")
    return value


class Command(BaseCommand):
    help = "List, pause, resume and reset the checkpoint of stream subscriptions."

    def add_arguments(self, parser):
        actions = parser.add_subparsers(dest="action", required=True)
        listing = actions.add_parser("list", help="every subscription: state, checkpoint, lag")
        add_database(listing)
        for name, text in [
            ("pause", "workers leave them alone"),
            ("resume", "deliver again at once, with fresh attempts"),
            ("reset", "move the checkpoint (events after --to are delivered)"),
        ]:
            action = actions.add_parser(name, help=text)
            action.add_argument("names", nargs="+", type=free_text, metavar="NAME")
        actions.choices["reset"].add_argument(
            "--to",
            type=target,
            required=True,
            help="a stored event's position (0: the beginning), 'beginning' or 'end'",
        )

    def handle(self, *args, action, **options):
        if action == "list":
            return self._list(databases(options["database"]))
        names = options["names"]
        changed = 0
        try:
            for alias, here in _by_database(names).items():
                with conf.on_database(alias):
                    if action == "reset":
                        changed += subscriptions.reset(here, options["to"])
                    else:
                        changed += getattr(subscriptions, action)(here)
        except SubscriptionError as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(f"{action}: {changed} of {len(names)} subscription(s) changed")
        return None

    def _list(self, aliases):
        several = len(aliases) > 1
        lead = f"{'DATABASE':<12} " if several else ""
        header = f"{'NAME':<32} {'STREAM':<24} {'STATE':<9} {'CHECKPOINT':>12} {'LAG':>9}  ERROR"
        self.stdout.write(lead + header)
        for alias in aliases:
            with conf.on_database(alias):
                found = stats.subscriptions_with_lag()
            lead = f"{alias:<12} " if several else ""
            for row in found:
                lag = f"{row.lag}+" if row.lag >= LAG_COUNT_CAP else str(row.lag)
                self.stdout.write(
                    f"{lead}{row.name:<32} {row.stream:<24} {row.state:<9} "
                    f"{row.checkpoint_position:>12} {lag:>9}  "
                    f"{first_line(row.last_error)[:60]}".rstrip()
                )


def _by_database(names):
    """``{alias: [name, ...]}``: each subscription name on the database that
    holds its row (a name found nowhere: on DATABASE, which says so)."""
    grouped: dict[str, list[str]] = {}
    for name in dict.fromkeys(names):
        where = next(
            (
                alias
                for alias in conf.databases()
                if Subscription.objects.using(alias).filter(name=name).exists()
            ),
            conf.get("DATABASE"),
        )
        grouped.setdefault(where, []).append(name)
    return grouped
