"""Wake-up notifications.

The insert trigger (created by migration 0002; its function as of 0007)
calls ``pg_notify(CHANNEL, queue)`` for each waiting row inserted, and
PostgreSQL folds identical notifications within a transaction: listeners get
one per transaction and queue, with the queue's name as the payload; a
grouped message's insert notifies GROUPS_CHANNEL instead.
PostgreSQL delivers it when the inserting transaction commits, whichever
client inserted. It is a hint that work is ready, never the delivery path:
workers also poll, because NOTIFY is at-most-once.

Poll-only mode (``PGQUEUE["NOTIFY"] = False``) disables the trigger; it is
synced with the setting each time ``migrate`` runs.
"""

import logging
import os

import psycopg
from django.db import connections

from django_pgqueue import conf

logger = logging.getLogger(__name__)

CHANNEL = "django_pgqueue"
# A grouped message's insert (it arrives blocked): workers promote the next
# message of released groups (migration 0009). Empty payload.
GROUPS_CHANNEL = "django_pgqueue_groups"
TRIGGER = "pgqueue_notify_insert"


def listen_connection(using):
    """A psycopg connection of its own to the database ``using``, in
    autocommit (notifications are only delivered between transactions),
    never one of Django's, named in pg_stat_activity."""
    params = connections[using].get_connection_params()
    params.pop("cursor_factory", None)
    params.pop("context", None)
    params["application_name"] = f"pgqueue_listener#{os.getpid()}"
    return psycopg.connect(**params, autocommit=True)


def trigger_enabled(using):
    """Whether the insert trigger fires on the database ``using``; None if it is absent."""
    from django_pgqueue.models import Message

    with connections[using].cursor() as cursor:
        cursor.execute(
            "SELECT tgenabled <> 'D' FROM pg_trigger"
            " WHERE tgname = %s AND tgrelid = to_regclass(%s)",
            [TRIGGER, Message._meta.db_table],
        )
        row = cursor.fetchone()
    return None if row is None else row[0]


def set_trigger_enabled(enabled, using):
    """Enable or disable the insert trigger. Returns True if its state changed."""
    from django_pgqueue.models import Message

    current = trigger_enabled(using)
    if current is None or current == enabled:
        return False
    connection = connections[using]
    table = connection.ops.quote_name(Message._meta.db_table)
    action = "ENABLE" if enabled else "DISABLE"
    with connection.cursor() as cursor:
        cursor.execute(f"ALTER TABLE {table} {action} TRIGGER {connection.ops.quote_name(TRIGGER)}")
    logger.info("NOTIFY trigger %sd on database %s", action.lower(), using)
    return True


def sync_trigger_after_migrate(sender, using, **kwargs):
    """post_migrate receiver: make the trigger follow PGQUEUE["NOTIFY"]."""
    if connections[using].vendor != "postgresql":
        return
    if trigger_enabled(using) is None:  # migrated backwards past the trigger
        return
    set_trigger_enabled(bool(conf.get("NOTIFY")), using)
