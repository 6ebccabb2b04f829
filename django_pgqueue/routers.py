"""The database router that puts django-pgqueue's tables on every database
that holds a queue or a stream, and nowhere else.

    DATABASE_ROUTERS = ["django_pgqueue.routers.QueueRouter"]

and then, as Django migrates one database at a time, ``manage.py migrate``
for the default database and ``manage.py migrate --database <alias>`` for
each other alias that ``PGQUEUE["QUEUES"]`` or ``PGQUEUE["STREAMS"]`` names
(``conf.databases()``; docs: *Queues on several databases*).

It has no opinion on reads and writes: every query of django-pgqueue names
its database (``.using(alias)``), and the router says nothing about the
project's other apps, which keep whatever routing they had.
"""

from __future__ import annotations

from typing import Any

from django_pgqueue import conf

APP_LABEL = "django_pgqueue"


class QueueRouter:
    """Migrates django-pgqueue's models on the aliases of ``conf.databases()``
    only; None (no opinion) for every other app and question."""

    def allow_migrate(
        self, db: str, app_label: str, model_name: str | None = None, **hints: Any
    ) -> bool | None:
        if app_label != APP_LABEL:
            return None
        return db in conf.databases()
