"""Bench databases: their URLs, creating and migrating them, and this
process's Django pointed at them.

A bench database's name must contain "bench": every run empties its queue
tables (``require_bench_name``). The testproject has two aliases, so each
bench database has an ``_other`` companion for the second one.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterable, Sequence
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
from psycopg import sql

from benchmarks.harness.tree import Tree

DEFAULT_SERVER = "postgres://postgres@127.0.0.1:5432"
# This harness's own connections (monitors, statistics), left out of every
# count of a measured database's clients. Not "pgqueue_...": that prefix
# names a worker's connections.
APP_NAME = "bench_harness"

MESSAGE_TABLE = "django_pgqueue_message"
DEADLETTER_TABLE = "django_pgqueue_deadletter"
# Emptied before a measurement: the queue, the dead letters, the demo's ledger.
TABLES = (MESSAGE_TABLE, DEADLETTER_TABLE, "demo_handled")


class CheckFailed(Exception):
    """A correctness check failed: the figures must not be trusted."""


# --- URLs ------------------------------------------------------------------------------


def database_name(url: str) -> str:
    return urlsplit(url).path.lstrip("/")


def with_database(url: str, name: str) -> str:
    return urlunsplit(urlsplit(url)._replace(path="/" + name))


def other_url(url: str) -> str:
    """The database of the testproject's second alias: the name + ``_other``."""
    return with_database(url, database_name(url) + "_other")


def bench_name_problem(url: str) -> str | None:
    """Why ``url`` may not be used as a bench database, or None."""
    name = database_name(url)
    if "bench" in name:
        return None
    return (
        f"the database {name!r} does not look like a bench database (its name must contain"
        " 'bench'): every run empties its queue tables"
    )


# --- connections and databases -----------------------------------------------------------


def connect(url: str, autocommit: bool = True, **kwargs: Any) -> psycopg.Connection[Any]:
    kwargs.setdefault("application_name", APP_NAME)
    return psycopg.connect(url, autocommit=autocommit, **kwargs)


def fetch_row(url: str, query: str, params: Sequence[Any] | None = None) -> tuple[Any, ...]:
    """The first row of ``query`` on the database of ``url`` (a connection of its own)."""
    with connect(url) as conn:
        row = conn.execute(query, params).fetchone()
    if row is None:
        raise CheckFailed(f"no row from {query!r}")
    return tuple(row)


def ensure_database(url: str) -> bool:
    """Create the database of ``url`` if missing; True if it was created."""
    name = database_name(url)
    with connect(with_database(url, "postgres")) as conn:
        if conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name]).fetchone():
            return False
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        return True


def recreate_database(url: str) -> None:
    """Drop the database of ``url`` (its clients too) and create it empty."""
    name = database_name(url)
    if "bench" not in name:
        raise SystemExit(f"refusing to drop {name!r}: not a bench database")
    with connect(with_database(url, "postgres")) as conn:
        conn.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))


def pgqueue_env(url: str, *, debug: bool = False) -> dict[str, str]:
    """The environment of the testproject's processes on the bench database
    ``url``: its workers log warnings and worse, and DEBUG is off unless
    asked (DEBUG=True keeps every query in memory)."""
    return dict(
        os.environ,
        DATABASE_URL=url,
        OTHER_DATABASE_URL=other_url(url),
        DEBUG="True" if debug else "False",
        DJANGO_SETTINGS_MODULE="testproject.settings",
        PGQUEUE_LOG_LEVEL="WARNING",
        PYTHONUNBUFFERED="1",
    )


def migrate(
    env: dict[str, str],
    tree: Tree | None = None,
    databases: Sequence[str] = ("default", "other"),
) -> None:
    """``manage.py migrate`` of ``tree``'s testproject, for each alias."""
    tree = tree or Tree.here()
    for database in databases:
        done = subprocess.run(
            tree.manage("migrate", "--noinput", "-v", "0", "--database", database),
            cwd=tree.testproject,
            env=tree.env(env),
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            raise CheckFailed(f"manage.py migrate --database {database} failed:\n{done.stderr}")


def prepare(urls: Iterable[str], env: dict[str, str], tree: Tree | None = None) -> None:
    """Create the databases of ``urls`` if missing (saying so) and migrate them."""
    for url in urls:
        if ensure_database(url):
            print(f"created database {database_name(url)}", file=sys.stderr)
    migrate(env, tree)


def fill_ready(url: str, topic: str, count: int) -> None:
    """``count`` ready messages of ``topic``, inserted as another client may."""
    with connect(url) as conn:
        conn.execute("TRUNCATE django_pgqueue_message, django_pgqueue_deadletter")
        conn.execute(
            "INSERT INTO django_pgqueue_message (topic, payload)"
            " SELECT %s, jsonb_build_object('n', n) FROM generate_series(1, %s) AS n",
            [topic, count],
        )
        conn.execute("ANALYZE django_pgqueue_message")


def setup_django(env: dict[str, str], tree: Tree | None = None) -> None:
    """Point this process's Django at the bench database (before any Django
    import): the settings of ``env`` that it has, the testproject of ``tree``."""
    tree = tree or Tree.here()
    for key in ("DATABASE_URL", "OTHER_DATABASE_URL", "DEBUG", "DJANGO_SETTINGS_MODULE"):
        if key in env:
            os.environ[key] = env[key]
    sys.path[:0] = [str(tree.testproject), str(tree.root)]
    import django

    django.setup()


# --- statements through this process's Django ----------------------------------------------


def execute(statement: str, params: Sequence[Any] | None = None) -> list[tuple[Any, ...]] | None:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(statement, params)
        return cursor.fetchall() if cursor.description else None


def rows(statement: str, params: Sequence[Any] | None = None) -> list[tuple[Any, ...]]:
    return execute(statement, params) or []


def scalar(statement: str, params: Sequence[Any] | None = None) -> Any:
    return rows(statement, params)[0][0]


def truncate(tables: Sequence[str] = TABLES) -> None:
    execute(f"TRUNCATE {', '.join(tables)} RESTART IDENTITY")


def count(table: str) -> int:
    return int(scalar(f"SELECT count(*) FROM {table}"))
