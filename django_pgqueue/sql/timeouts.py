"""The worker's limits (``PGQUEUE["LOCK_TIMEOUT"]`` and
``PGQUEUE["STATEMENT_TIMEOUT"]``) on a transaction: sent before a
statement, set on the current transaction, or a transaction that has them
(``worker_transaction``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

from django.db import connections, transaction

from django_pgqueue import conf

# The worker's limits (PGQUEUE LOCK_TIMEOUT and STATEMENT_TIMEOUT) for the
# current transaction only: set_config(..., true) is SET LOCAL. So they bound
# the worker's own statements and end with their transaction, never reaching
# a handler's queries (an atomic handler's transaction gets them with its
# acknowledgement, after the handler), and they hold behind PgBouncer in
# transaction pooling, where a session's SET would stay on the server
# connection and reach other clients. A setting of None keeps the value the
# session has (the server's, the role's, the project's OPTIONS). The claim
# and the skip-locked acknowledgements never wait for a lock and go without.
LIMITS_SQL = (
    "SELECT set_config('lock_timeout', COALESCE(%s, current_setting('lock_timeout')), true), "
    "set_config('statement_timeout', COALESCE(%s, current_setting('statement_timeout')), true)"
)


def limits() -> list[str | None] | None:
    """LIMITS_SQL's parameters from the settings; None when both are None."""
    values = [
        conf.milliseconds(conf.get("LOCK_TIMEOUT")),
        conf.milliseconds(conf.get("STATEMENT_TIMEOUT")),
    ]
    return None if values == [None, None] else values


def with_limits(sql: str, params: Sequence[Any]) -> tuple[str, list[Any], int]:
    """``sql`` after LIMITS_SQL, sent together (in autocommit, one implicit
    transaction: the limits hold for ``sql`` and end with it), and the number
    of results to skip before ``sql``'s. Client-side binding only (Django's
    default cursor): a server-bound statement is one statement."""
    extra = limits()
    if extra is None:
        return sql, list(params), 0
    return f"{LIMITS_SQL};{sql}", [*extra, *params], 1


# The worker's limits for one statement inside a transaction that goes on
# without them (a stream delivery's read of its events: the subscriber's
# queries follow in the same transaction). The session's values are kept in
# two settings of our own for the transaction, and put back right after the
# statement, all in one round trip.
KEEP_SETTINGS_SQL = (
    "SELECT set_config('pgqueue.lock_timeout', current_setting('lock_timeout'), true), "
    "set_config('pgqueue.statement_timeout', current_setting('statement_timeout'), true)"
)
PUT_BACK_SETTINGS_SQL = (
    "SELECT set_config('lock_timeout', current_setting('pgqueue.lock_timeout'), true), "
    "set_config('statement_timeout', current_setting('pgqueue.statement_timeout'), true)"
)


def with_limits_for_itself(query: str, params: Sequence[Any]) -> tuple[str, list[Any], int]:
    """``query`` under the worker's limits inside a transaction whose later
    statements run without them, and the number of results to skip before
    ``query``'s (one more, the settings put back, follows it). Client-side
    binding only, as ``with_limits``."""
    extra = limits()
    if extra is None:
        return query, list(params), 0
    statements = [KEEP_SETTINGS_SQL, LIMITS_SQL, query, PUT_BACK_SETTINGS_SQL]
    return ";".join(statements), [*extra, *params], 2


def set_limits(using: str | None = None) -> None:
    """Put the worker's limits on the current transaction of ``using``."""
    params = limits()
    if params is not None:
        with connections[using or conf.database_alias()].cursor() as cursor:
            cursor.execute(LIMITS_SQL, params)


@contextlib.contextmanager
def worker_transaction(using: str | None = None, savepoint: bool = True) -> Iterator[None]:
    """``transaction.atomic`` with the worker's limits, when it starts the
    transaction; inside a caller's transaction it is a savepoint (unless
    ``savepoint`` is False) and the caller's settings stay as they are."""
    using = using or conf.database_alias()
    outermost = not connections[using].in_atomic_block
    with transaction.atomic(using=using, savepoint=savepoint):
        if outermost:
            set_limits(using)
        yield
