"""Cursors for django-pgqueue's own hot statements."""

from django.db.backends.postgresql.base import ServerBindingCursor


def prepared_cursor(connection):
    """A Django cursor (execute wrappers see its queries) over a psycopg
    cursor that binds parameters on the server; while the query log is on,
    Django's ordinary cursor (see below).

    Django's default cursor interpolates the parameters on the client, so the
    server parses and plans every statement again. With server-side binding,
    psycopg prepares a statement once the connection has run it
    ``prepare_threshold`` times (5 by default): enqueue() runs the same
    INSERT again and again, and each later run skips the planning (about a
    sixth of a one-message enqueue here).

    Django's default, ``"prepare_threshold": None`` in the database's
    ``OPTIONS``, is what PgBouncer in transaction mode needs unless it keeps
    prepared statements (1.21+ with ``max_prepared_statements``): psycopg
    then never prepares, and this stays a plain parameterised statement.
    """
    if connection.queries_logged:
        # DEBUG, or a test capturing queries: the query log wants the SQL as
        # sent, which Django reads from client-side binding cursors only.
        return connection.cursor()
    connection.ensure_connection()
    with connection.wrap_database_errors:
        cursor = ServerBindingCursor(connection.connection)
    connection.validate_thread_sharing()
    return connection.make_cursor(cursor)
