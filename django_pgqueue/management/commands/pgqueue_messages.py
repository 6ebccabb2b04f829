"""manage.py pgqueue_messages: act on messages in the queue from the shell
(the same operations as the Python API).

    pgqueue_messages cancel --ids 12,13 [--by WHO] [--dry-run]
    pgqueue_messages cancel --topic orders.sync [--queue default] [--by WHO] [--dry-run]

``cancel``: waiting, delayed and blocked messages are cancelled at once;
running ones are asked to stop (their handler's ``cancel_requested()``),
and end cancelled unless their handler finishes first. Prints the counts
by outcome.
"""

from django.core.management.base import BaseCommand, CommandError

from django_pgqueue import conf, lifecycle
from django_pgqueue.exceptions import QueueControlError
from django_pgqueue.management.options import (
    default_actor,
    free_text,
    id_list,
    queue_name,
    topic_list,
)
from django_pgqueue.models import UNFINISHED, Message


class Command(BaseCommand):
    help = "Act on messages in the queue: cancel them."

    def add_arguments(self, parser):
        subcommands = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
        cancelling = subcommands.add_parser(
            "cancel",
            help="cancel messages: waiting ones at once, running ones are asked to stop",
        )
        which = cancelling.add_mutually_exclusive_group(required=True)
        which.add_argument("--ids", type=id_list, help="comma-separated message ids")
        which.add_argument(
            "--topic", type=topic_list, help="every unfinished message of these topics"
        )
        cancelling.add_argument(
            "--queue", type=queue_name, help="with --topic: only those of this queue"
        )
        cancelling.add_argument(
            "--by", type=free_text, default=None, help="who does it (default: the login name)"
        )
        cancelling.add_argument(
            "--dry-run", action="store_true", help="count what would be cancelled; change nothing"
        )

    def handle(self, *args, action, ids=None, topic=None, queue=None, **options):
        if queue is not None and topic is None:
            raise CommandError("--queue goes with --topic")
        selected = Message.objects.using(conf.database_alias()).filter(status__in=UNFINISHED)
        if ids is not None:
            selected = Message.objects.using(conf.database_alias()).filter(pk__in=ids)
        else:
            selected = selected.filter(topic__in=topic)
            if queue is not None:
                selected = selected.filter(queue=queue)
        if options["dry_run"]:
            self._dry_run(selected, ids)
            return
        by = options["by"] if options["by"] is not None else default_actor()
        try:
            result = lifecycle.cancel(ids if ids is not None else selected, by=by)
        except QueueControlError as exc:
            raise CommandError(str(exc)) from exc
        self.stdout.write(str(result))

    def _dry_run(self, selected, ids):
        counts = dict.fromkeys(["waiting", "blocked", "processing"], 0)
        for status in selected.filter(status__in=UNFINISHED).values_list("status", flat=True):
            counts[status] += 1
        at_once = counts["waiting"] + counts["blocked"]
        text = (
            f"dry run: would cancel {at_once} at once, ask {counts['processing']} running to stop"
        )
        if ids is not None:
            text += f", {len(set(ids)) - sum(counts.values())} finished, cancelled or unknown"
        self.stdout.write(text)
