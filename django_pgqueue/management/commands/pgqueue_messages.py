"""manage.py pgqueue_messages: act on messages in the queue from the shell
(the same operations as the Python API).

    pgqueue_messages cancel --ids 12,13 [--by WHO] [--dry-run]
    pgqueue_messages cancel --topic orders.sync [--queue default] [--by WHO] [--dry-run]

``cancel``: waiting, delayed and blocked messages are cancelled at once;
running ones are asked to stop (their handler's ``cancel_requested()``),
and end cancelled unless their handler finishes first. Prints the counts
by outcome. It goes through every database that holds the queues
(``--database``: one; --queue: that queue's), each line led by its database
when there are several; --ids (numbered per database) needs --database then.
"""

from django.core.management.base import BaseCommand, CommandError

from django_pgqueue import conf, lifecycle
from django_pgqueue.exceptions import QueueControlError
from django_pgqueue.management.options import (
    add_database,
    databases,
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
        add_database(cancelling, "act on")

    def handle(self, *args, action, ids=None, topic=None, queue=None, **options):
        if queue is not None and topic is None:
            raise CommandError("--queue goes with --topic")
        aliases = databases(options["database"])
        if queue is not None:
            aliases = [alias for alias in aliases if alias == conf.queue_database(queue)]
        if ids is not None and len(aliases) > 1:
            raise CommandError(
                "--ids names messages of one database (each numbers its own): "
                f"give --database (one of {', '.join(aliases)})"
            )
        for alias in aliases:
            with conf.on_database(alias):
                lead = f"{alias}: " if len(aliases) > 1 else ""
                self._cancel(lead, ids, topic, queue, options)

    def _cancel(self, lead, ids, topic, queue, options):
        """Cancel the messages selected in the database the code works on."""
        selected = Message.objects.using(conf.database_alias()).filter(status__in=UNFINISHED)
        if ids is not None:
            selected = Message.objects.using(conf.database_alias()).filter(pk__in=ids)
        else:
            selected = selected.filter(topic__in=topic)
            if queue is not None:
                selected = selected.filter(queue=queue)
        if options["dry_run"]:
            self._dry_run(lead, selected, ids)
            return
        by = options["by"] if options["by"] is not None else default_actor()
        try:
            result = lifecycle.cancel(ids if ids is not None else selected, by=by)
        except QueueControlError as exc:
            raise CommandError(str(exc)) from exc
        self.stdout.write(f"{lead}{result}")

    def _dry_run(self, lead, selected, ids):
        counts = dict.fromkeys(["waiting", "blocked", "processing"], 0)
        for status in selected.filter(status__in=UNFINISHED).values_list("status", flat=True):
            counts[status] += 1
        at_once = counts["waiting"] + counts["blocked"]
        running = counts["processing"]
        text = f"{lead}dry run: would cancel {at_once} at once, ask {running} running to stop"
        if ids is not None:
            text += f", {len(set(ids)) - sum(counts.values())} finished, cancelled or unknown"
        self.stdout.write(text)
