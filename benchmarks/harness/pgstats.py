"""The server's statistics views, read from a connection of their own."""

from __future__ import annotations

import time
from typing import Any

from benchmarks.harness.db import APP_NAME, connect, with_database
from benchmarks.harness.servercost import ServerCost


class Stats:
    """A connection to the ``postgres`` database: reading pg_stat_database and
    pg_stat_activity does not count as activity of a measured database."""

    def __init__(self, url: str) -> None:
        """``url``: any database of the server (a server URL without one too)."""
        self.conn = connect(with_database(url, "postgres"))
        self._server: ServerCost | None = None

    @property
    def server(self) -> ServerCost:
        """The server's CPU and WAL position, read through this connection."""
        if self._server is None:
            self._server = ServerCost(self.conn)
        return self._server

    def value(self, query: str, params: list[Any] | None = None) -> Any:
        row = self.conn.execute(query, params).fetchone()
        return None if row is None else row[0]

    def transactions(self, dbname: str) -> int:
        """Committed plus rolled-back transactions of ``dbname`` so far.

        Backends report to the statistics at most once a second while busy
        and when they exit, so read this after the clients exit, or expect a
        lag (PostgreSQL 15: up to 10 s for an idle backend).
        """
        return int(
            self.value(
                "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = %s",
                [dbname],
            )
        )

    def backends(self, dbname: str) -> list[tuple[Any, ...]]:
        """[(pid, application_name, state, query_start, query)] of the clients
        of ``dbname``, this harness's own left out."""
        return self.conn.execute(
            "SELECT pid, application_name, state, query_start, query FROM pg_stat_activity"
            " WHERE datname = %s AND backend_type = 'client backend'"
            " AND application_name <> %s",
            [dbname, APP_NAME],
        ).fetchall()

    def worker_backends(self, dbname: str, pid: int) -> dict[int, tuple[Any, ...]]:
        """{backend pid: (application_name, state, query_start, query)} of the
        pgqueue worker process ``pid`` (its connections name themselves)."""
        rows = self.conn.execute(
            "SELECT pid, application_name, state, query_start, query FROM pg_stat_activity"
            " WHERE datname = %s AND application_name IN (%s, %s)",
            [dbname, f"pgqueue_worker#{pid}", f"pgqueue_listener#{pid}"],
        ).fetchall()
        return {row[0]: row[1:] for row in rows}

    def wait_no_clients(self, dbname: str, timeout: float = 15.0, workers: bool = True) -> None:
        """Wait until no client is connected to ``dbname`` (a backend reports
        its pending statistics as it exits); ``workers=False``: pgqueue
        workers' connections may stay."""
        query = (
            "SELECT count(*) FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()"
            " AND backend_type = 'client backend'"
        )
        if not workers:
            query += " AND application_name NOT LIKE 'pgqueue_%%'"
        deadline = time.monotonic() + timeout
        while self.value(query, [dbname]) and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.1)

    def wait_gone(self, dbname: str, pid: int, timeout: float = 10.0) -> None:
        """Wait until worker ``pid`` has no backend left (they have reported their counters)."""
        deadline = time.monotonic() + timeout
        while self.worker_backends(dbname, pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.1)

    def close(self) -> None:
        self.conn.close()

    def __enter__(self) -> Stats:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


Statements = dict[tuple[int, Any], tuple[str, str]]


def record_statements(seen: Statements, backends: list[tuple[Any, ...]]) -> None:
    """Add each backend's latest statement to ``seen``, keyed (backend pid,
    query_start) -> (application_name, query), from rows (pid,
    application_name, state, query_start, query). Sampled every few
    milliseconds, every new key is a statement: a lower bound, as two
    statements of one backend between two samples count once."""
    for pid, app, _state, start, query in backends:
        if start is not None:
            seen.setdefault((pid, start), (app, query))


def one_line(query: str, length: int) -> str:
    """A statement's text on one line, cut at ``length`` characters."""
    return " ".join(query.split())[:length]
