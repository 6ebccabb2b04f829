"""manage.py pgqueue_schedules: look at and steer the periodic schedules from
the shell (the admin's Schedules page does the same).

    pgqueue_schedules list [--json] [--database ALIAS]
    pgqueue_schedules pause NAME [NAME ...]
    pgqueue_schedules resume NAME [NAME ...]
    pgqueue_schedules reset NAME [NAME ...]
    pgqueue_schedules run NAME

Pause and resume are kept in the database: they survive restarts and
deploys and win over the setting's ``enabled`` until ``reset``. ``run``
enqueues one message now, outside the ticks. ``list`` goes through every
database that holds the queues (``--database``: one): PGQUEUE["DATABASE"]
shows every configured schedule, another database those with a state row
there; a DATABASE column when there are several.
"""

import getpass
import json

from django.core.management.base import BaseCommand, CommandError

from django_pgqueue import conf
from django_pgqueue.management.options import add_database, databases, free_text
from django_pgqueue.management.output import Columns
from django_pgqueue.schedules import configured, overview, runs, state

COLUMNS = Columns(
    ["NAME", "SCHEDULE", "TIME ZONE", "STATE", "NEXT TICK", "LAST TICK", "LAST MESSAGE", "SKIPPED"],
    "<24 <30 <14 <6 <25 <25 <18 >7",
)
# pause/resume/reset: the run-time override each writes (None: the setting decides).
OVERRIDES = {"pause": False, "resume": True, "reset": None}


class Command(BaseCommand):
    help = "List, pause, resume, reset and run now the periodic schedules."

    def add_arguments(self, parser):
        actions = parser.add_subparsers(dest="action", required=True)
        listing = actions.add_parser(
            "list", help="every schedule: expression, time zone, next and last tick, state"
        )
        listing.add_argument("--json", action="store_true", help="print JSON, not a table")
        add_database(listing)
        for name, text in [
            ("pause", "no ticks until resumed (kept in the database, over the setting)"),
            ("resume", "tick again from the next tick on (kept, over the setting)"),
            ("reset", "forget pause/resume: the setting's 'enabled' decides again"),
        ]:
            action = actions.add_parser(name, help=text)
            action.add_argument("names", nargs="+", type=free_text, metavar="NAME")
        run = actions.add_parser("run", help="enqueue one message now, outside the ticks")
        run.add_argument("names", nargs=1, type=free_text, metavar="NAME")

    def handle(self, *args, action, **options):
        if action == "list":
            return self._list(databases(options["database"]), options["json"])
        names = options["names"]
        try:
            specs = [configured.get(name) for name in names]
        except KeyError as exc:
            raise CommandError(exc.args[0]) from None
        by = f"{getpass.getuser()} (pgqueue_schedules)"
        if action == "run":
            message = runs.run_now(specs[0], by=by)
            self.stdout.write(f"run: schedule {specs[0].name!r} enqueued message {message.pk}")
            return None
        for spec in specs:
            state.set_enabled(spec.name, OVERRIDES[action], by=by)
        self.stdout.write(f"{action}: {', '.join(names)}")
        return None

    def _list(self, aliases, as_json):
        rows = []
        for alias in aliases:
            with conf.on_database(alias):
                rows += [(alias, row) for row in overview.rows_here()]
        if as_json:
            found = [{"database": alias, **row.as_json()} for alias, row in rows]
            self.stdout.write(json.dumps(found, indent=2))
            return
        several = len(aliases) > 1
        columns = COLUMNS.led_by("DATABASE", "<12") if several else COLUMNS
        self.stdout.write(columns.header())
        for alias, row in rows:
            data = row.as_json()
            last = row.last_message_state or ""
            if row.last_message_id is not None:
                last = f"#{row.last_message_id} {last}"
            self.stdout.write(
                columns.row(
                    [
                        *([alias] if several else []),
                        row.name,
                        data["description"] or "(no longer configured)",
                        data["timezone"] or "",
                        "paused" if row.paused else "active",
                        data["next_tick"] or "-",
                        data["last_tick"] or "-",
                        last or "-",
                        row.skipped,
                    ]
                )
            )
