"""Cursors for django-pgqueue's own hot statements."""

from django.db.backends.postgresql.base import ServerBindingCursor

# The attribute of a DatabaseWrapper that keeps its prepared_cursor: (the
# psycopg connection it was opened on, whether the query log was on, it).
_CACHED = "_pgqueue_prepared_cursor"


def prepared_cursor(connection):
    """A Django cursor (execute wrappers see its queries) over a psycopg
    cursor that binds parameters on the server; while the query log is on,
    Django's ordinary cursor (see below). Callers use it and leave it open:
    it is the connection's own, kept for the next statement.

    Django's default cursor interpolates the parameters on the client, so the
    server parses and plans every statement again. With server-side binding,
    psycopg prepares a statement once the connection has run it
    ``prepare_threshold`` times (5 by default): enqueue() runs the same
    INSERT again and again, and each later run skips the planning (about a
    sixth of a one-message enqueue here).

    The cursor is kept on the DatabaseWrapper (one per thread, as Django's
    connections are) until its psycopg connection changes: a new psycopg
    cursor and Django wrapper for every statement cost about 30 us, a tenth
    of a one-message enqueue (benchmarks/insert_cost.py measures the rest).

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
            cursor = ServerBindingCursor(connection.connection)
        connection.validate_thread_sharing()
        wrapper = connection.make_cursor(cursor)
    setattr(connection, _CACHED, (connection.connection, logged, wrapper))
    return wrapper
