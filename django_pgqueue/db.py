"""Database connections as django-pgqueue's threads use them: the cursor of
the hot statements, the state of a connection's transaction, what an error
left behind, and the wait before trying again."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
from django.db import InterfaceError, connections
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.backends.postgresql.base import ServerBindingCursor
from django.db.backends.utils import CursorWrapper

from django_pgqueue import text

# After a database error: wait this long, doubling up to the cap (Backoff).
RECONNECT_DELAY = 0.5
RECONNECT_DELAY_CAP = 30.0

# The attribute of a DatabaseWrapper that keeps its prepared_cursor: (the
# psycopg connection it was opened on, whether the query log was on, it).
_CACHED = "_pgqueue_prepared_cursor"


def prepared_cursor(connection: BaseDatabaseWrapper) -> CursorWrapper:
    """A Django cursor (execute wrappers see its queries) over a psycopg
    cursor that binds parameters on the server; while the query log is on,
    Django's ordinary cursor (see below). Callers use it and leave it open:
    it is the connection's own, kept for the next statement.

    Django's default cursor interpolates the parameters on the client, so the
    server parses and plans every statement again. With server-side binding,
    psycopg prepares a statement once the connection has run it
    ``prepare_threshold`` times (5 by default): enqueue() and the claim run
    the same statement again and again, and each later run skips the
    planning.

    The cursor is kept on the DatabaseWrapper (one per thread, as Django's
    connections are) until its psycopg connection changes: building a new
    psycopg cursor and Django wrapper for every statement is a measurable
    share of a one-message enqueue (benchmarks/insert_cost.py).

    Django's default, ``"prepare_threshold": None`` in the database's
    ``OPTIONS``, is what PgBouncer in transaction mode needs unless it keeps
    prepared statements (1.21+ with ``max_prepared_statements``): psycopg
    then never prepares, and this stays a plain parameterised statement.
    """
    logged = connection.queries_logged
    connection.ensure_connection()
    cached = getattr(connection, _CACHED, None)
    if cached is not None:
        pg_connection, was_logged, wrapper = cached
        if pg_connection is connection.connection and was_logged == logged:
            if not wrapper.cursor.closed:
                return wrapper
        else:
            wrapper.close()
    if logged:
        # DEBUG, or a test capturing queries: the query log wants the SQL as
        # sent, which Django reads from client-side binding cursors only.
        wrapper = connection.cursor()
    else:
        with connection.wrap_database_errors:
            cursor = ServerBindingCursor(connection.connection)  # type: ignore[call-arg]
        connection.validate_thread_sharing()
        wrapper = connection.make_cursor(cursor)  # type: ignore[arg-type]
    setattr(connection, _CACHED, (connection.connection, logged, wrapper))
    return wrapper


_INERROR = psycopg.pq.TransactionStatus.INERROR
_IDLE = psycopg.pq.TransactionStatus.IDLE


@contextmanager
def autocommit_if_unused(connection: BaseDatabaseWrapper) -> Iterator[bool]:
    """Inside ``transaction.atomic``: when nothing has run on the connection
    since the block began (the driver has not sent BEGIN yet), run the
    statements of the ``with`` block in autocommit, each its own transaction,
    and yield True; else yield False and change nothing.

    A handler's acknowledgement is the only statement of its transaction
    when the handler ran no query (it called an API, sent an email): alone,
    it is one round trip instead of three (BEGIN, the statement, COMMIT),
    and the atomic block's COMMIT then has nothing to send. Its on_commit
    callbacks still run after the block, once the acknowledgement is
    committed."""
    raw = connection.connection
    if raw is None or raw.autocommit or raw.pgconn.transaction_status != _IDLE:
        yield False
        return
    raw.autocommit = True
    try:
        yield True
    finally:
        if not raw.closed:
            raw.autocommit = False


def transaction_failed(connection: BaseDatabaseWrapper) -> bool:
    """Whether the server reported the connection's transaction as aborted
    (read from the driver's state: no round trip). A handler or subscriber
    that caught a database error and returned leaves it so: its transaction
    cannot commit."""
    raw = connection.connection
    # pgconn's status, not raw.info's: that builds an object and an enum per
    # read, and the atomic batches ask once per message.
    return raw is not None and raw.pgconn.transaction_status == _INERROR


def drop_broken_connections() -> None:
    """Close this thread's connections that an error left unusable; keep the rest."""
    for connection in connections.all(initialized_only=True):
        if connection.connection is None or not connection.errors_occurred:
            continue
        if connection.in_atomic_block or not connection.is_usable():
            connection.close()
        else:
            connection.errors_occurred = False


# SQLSTATEs of a connection that is gone: class 08 (connection exception),
# and the server ending the session (pg_terminate_backend, a shutdown or a
# crash, a server that takes no sessions yet).
_CONNECTION_GONE = ("57P01", "57P02", "57P03")


def connection_lost(exc: BaseException) -> bool:
    """Whether ``exc`` (a Django DatabaseError, or anything that wraps one)
    says the connection died: a reset, the server or its backend gone, a
    server that refuses the session (a standby when the database asks for
    a read-write one), or the error of a connection already closed. Not a
    statement's failure on a live connection (a lock or statement timeout,
    a constraint)."""
    seen: set[int] = set()
    error: BaseException | None = exc
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, (psycopg.InterfaceError, InterfaceError)):
            return True  # "the connection is closed"
        if isinstance(error, psycopg.OperationalError):
            state = error.sqlstate
            return state is None or state.startswith("08") or state in _CONNECTION_GONE
        error = error.__cause__ or error.__context__
    return False


def lock_timed_out(exc: BaseException) -> bool:
    """Whether ``exc`` (a Django DatabaseError) is PostgreSQL's lock_timeout:
    the transaction failed, its connection is fine."""
    return isinstance(exc.__cause__, psycopg.errors.LockNotAvailable)


def first_line(exc: BaseException) -> str:
    """The first line of an error's text (its type's name if it has none),
    for a log line or a health check's details."""
    return text.first_line(str(exc)) or type(exc).__name__


class Backoff:
    """The wait after a database error: RECONNECT_DELAY, doubling up to
    RECONNECT_DELAY_CAP, each wait jittered by a fifth (threads that lost the
    server together do not come back together); ``reset()`` after a success."""

    def __init__(self) -> None:
        self.delay = RECONNECT_DELAY  # the next wait, before its jitter

    def reset(self) -> None:
        self.delay = RECONNECT_DELAY

    def next(self) -> float:
        """Seconds to wait now; the wait after it doubles."""
        wait = self.delay * random.uniform(0.8, 1.2)
        self.delay = min(self.delay * 2, RECONNECT_DELAY_CAP)
        return wait


class LazySavepoint:
    """An execute wrapper on the queue's connection while a batch of units
    (atomic handlers, stream events) shares one transaction: just before the
    running unit's first query it opens the unit's savepoint ``name``
    (releasing the previous unit's in the same round trip). A unit that
    runs no query through Django (it calls an API, sends an email, does
    nothing) costs no round trip, and has nothing to undo.

    Queries sent around Django (the driver's connection, ``callproc``,
    ``copy``) open no savepoint: a unit must not fail after writing that
    way. A failure that left the transaction broken with no savepoint to
    return to raises ``cannot_undo()``: the caller rolls the whole batch
    back."""

    def __init__(
        self,
        connection: BaseDatabaseWrapper,
        name: str,
        cannot_undo: Callable[[], BaseException],
    ) -> None:
        self.connection = connection
        self._open_sql = f"SAVEPOINT {name}"
        self._next_sql = f"RELEASE SAVEPOINT {name}; SAVEPOINT {name}"
        self._rollback_sql = f"ROLLBACK TO SAVEPOINT {name}"
        self._cannot_undo = cannot_undo
        self.armed = False  # a unit is running
        self.placed = False  # the running unit's savepoint is open
        self.exists = False  # some savepoint is open in this transaction
        self.opened = 0  # savepoints opened in this transaction

    def __call__(
        self, execute: Callable[..., Any], sql: str, params: Any, many: bool, context: Any
    ) -> Any:
        if self.armed and not self.placed:
            self._open()
        return execute(sql, params, many, context)

    def arm(self) -> None:
        """A unit starts: its first query opens its savepoint."""
        self.armed, self.placed = True, False

    def disarm(self) -> None:
        """The unit succeeded: its savepoint (if any) is released with the next one's."""
        self.armed = False

    def _open(self) -> None:
        self.armed = False  # if the savepoint fails, the batch rolls back
        self._execute_raw(self._next_sql if self.exists else self._open_sql)
        self.exists = self.placed = self.armed = True
        self.opened += 1

    def rollback(self) -> None:
        """Undo the running unit's writes; without its savepoint there is
        nothing to undo unless the transaction broke (``cannot_undo``)."""
        was_armed, self.armed = self.armed, False
        if self.placed:
            self._execute_raw(self._rollback_sql)
        elif not was_armed or transaction_failed(self.connection):
            # Not armed: opening the savepoint failed, the previous one is
            # not this unit's to return to.
            raise self._cannot_undo()

    def _execute_raw(self, sql: str) -> None:
        """The bookkeeping statement on the driver's connection, past
        Django's cursor wrapper (and its execute wrappers: this one)."""
        with self.connection.wrap_database_errors:
            psycopg.ClientCursor(self.connection.connection).execute(sql)
