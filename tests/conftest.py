"""Fixtures shared by the test modules.

Everything runs against the real PostgreSQL of DATABASE_URL: pytest-django
creates the test databases (test_<name>) for both aliases and migrates them.
"""

import time

import psycopg
import pytest
from django.db import connections

from django_pgqueue.notify import CHANNEL


def raw_connection(alias="default", **kwargs):
    """A psycopg connection of its own (not Django's) to the test database of ``alias``."""
    params = connections[alias].settings_dict
    return psycopg.connect(
        dbname=params["NAME"],
        user=params["USER"] or None,
        password=params["PASSWORD"] or None,
        host=params["HOST"] or None,
        port=params["PORT"] or None,
        **kwargs,
    )


@pytest.fixture
def other_connection(transactional_db):
    """A second, independent client: sees only what has been committed."""
    with raw_connection(autocommit=True) as conn:
        yield conn


class Listener:
    """A second real connection that LISTENs on the wake-up channel."""

    def __init__(self, conn):
        self.conn = conn
        conn.execute(f"LISTEN {CHANNEL}")

    def received(self, timeout):
        """Notifications that arrive within ``timeout`` seconds, as (channel, payload)."""
        return [(n.channel, n.payload) for n in self.conn.notifies(timeout=timeout)]

    def wait_for(self, count, timeout=5.0):
        """Collect notifications until ``count`` arrived or ``timeout`` passed."""
        got = []
        deadline = time.monotonic() + timeout
        while len(got) < count and time.monotonic() < deadline:
            got.extend(self.received(timeout=deadline - time.monotonic()))
        return got


@pytest.fixture
def listener(transactional_db):
    with raw_connection(autocommit=True) as conn:
        yield Listener(conn)


def wait_until(predicate, timeout=10.0, interval=0.02, message="condition"):
    """Poll ``predicate`` until it is true; fail with ``message`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {message}")
        time.sleep(interval)
