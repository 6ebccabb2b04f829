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

``listen`` is the LISTEN loop of the worker's threads (the message loop's
listener, the stream delivery's): a dedicated connection, reconnected with
backoff, and a poll after each (re)connection for what was missed meanwhile.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Sequence

import psycopg
from django.db import connections

from django_pgqueue import conf
from django_pgqueue.db import Backoff

logger = logging.getLogger(__name__)

CHANNEL = "django_pgqueue"
# A grouped message's insert (it arrives blocked): workers promote the next
# message of released groups (migration 0009). Empty payload.
GROUPS_CHANNEL = "django_pgqueue_groups"
# Run-time control (controls, lifecycle.cancel): a queue's state changed
# ("queues"), cancellation was asked for running messages ("cancel:<ids>").
CONTROL_CHANNEL = "django_pgqueue_control"
TRIGGER = "pgqueue_notify_insert"


def listen_connection(using: str) -> psycopg.Connection:
    """A psycopg connection of its own to the database ``using``, in
    autocommit (notifications are only delivered between transactions),
    never one of Django's, named in pg_stat_activity."""
    params = connections[using].get_connection_params()
    params.pop("cursor_factory", None)
    params.pop("context", None)
    params["application_name"] = f"pgqueue_listener#{os.getpid()}"
    return psycopg.connect(**params, autocommit=True)


def listen(
    channels: Sequence[str],
    on_notify: Callable[[str, str], None],
    *,
    on_connect: Callable[[], None],
    stop: threading.Event,
    name: str,
    log: logging.Logger,
    reconnected: Callable[[], None] | None = None,
) -> None:
    """LISTEN to ``channels`` on a connection of its own (``listen_connection``)
    until ``stop`` is set, calling ``on_notify(channel, payload)`` for each
    notification. A hint only: the callers also poll, because NOTIFY is
    at-most-once.

    ``on_connect()`` runs after each (re)connection: the notifications sent
    while it was away are gone, so the caller polls once. A lost connection
    is logged (``log``, as ``name``, e.g. "Worker w1 listener"), counted
    (``reconnected()``) and opened again after a growing wait (Backoff).
    Blocks: the caller runs it on a thread of its own.
    """
    backoff = Backoff()
    while not stop.is_set():
        try:
            with listen_connection(conf.database_alias()) as conn:
                conn.execute("; ".join(f"LISTEN {channel}" for channel in channels))
                backoff.reset()
                on_connect()
                while not stop.is_set():
                    # Short slices: the thread notices ``stop`` quickly.
                    for notification in conn.notifies(timeout=0.25):
                        on_notify(notification.channel, notification.payload)
        except psycopg.Error as exc:
            if stop.is_set():
                break
            if reconnected is not None:
                reconnected()
            log.warning(
                "%s: %s; reconnecting in %.1fs",
                name,
                str(exc).strip() or type(exc).__name__,
                backoff.delay,
            )
            stop.wait(backoff.next())


def trigger_enabled(using: str) -> bool | None:
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


def set_trigger_enabled(enabled: bool, using: str) -> bool:
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


def sync_trigger_after_migrate(sender: object, using: str, **kwargs: object) -> None:
    """post_migrate receiver: make the trigger follow PGQUEUE["NOTIFY"]."""
    if connections[using].vendor != "postgresql":
        return
    if trigger_enabled(using) is None:  # migrated backwards past the trigger
        return
    set_trigger_enabled(bool(conf.get("NOTIFY")), using)
