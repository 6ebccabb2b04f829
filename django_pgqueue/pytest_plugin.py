"""The pytest plugin: the ``pgqueue`` fixture, which offers
``django_pgqueue.testing`` to a test.

Loaded by pytest through the ``pytest11`` entry point wherever
django-pgqueue is installed; the fixture is registered only when
pytest-django is in use too (it needs pytest-django's database set-up).
Nothing of Django is imported before a test asks for the fixture.

    @pytest.mark.django_db
    def test_order_confirmation(client, pgqueue):
        client.post("/orders/", {...})
        pgqueue.assert_enqueued("orders.confirm", payload={"order": 1})
        assert pgqueue.drain().done == 1
"""

from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest


def pytest_configure(config: pytest.Config) -> None:
    """Register the fixture if pytest-django is active ("django" is the name
    pytest-django's plugin registers under)."""
    if config.pluginmanager.hasplugin("django"):
        config.pluginmanager.register(_Fixtures(), "django_pgqueue.fixtures")


class _Fixtures:
    @pytest.fixture
    def pgqueue(self, db: Any) -> Iterator[ModuleType]:
        """``django_pgqueue.testing``: ``enqueued()``, ``assert_enqueued()``,
        ``assert_not_enqueued()``, ``drain()``. Asks for pytest-django's
        ``db``: in a test marked ``django_db(transaction=True)`` (or one that
        asks for ``transactional_db``) every step commits, else all of it is
        in the test's transaction."""
        from django_pgqueue import testing

        yield testing
