"""The insert trigger: poll-only mode, and the migration that creates it."""

import pytest
from django.core.management import call_command
from django.test import override_settings

from django_pgqueue import enqueue
from django_pgqueue.notify import CHANNEL, trigger_enabled

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def restore_trigger():
    yield
    call_command("migrate", verbosity=0)  # back to the default, NOTIFY on
    assert trigger_enabled("default") is True


def test_poll_only_mode_disables_the_trigger_when_migrate_runs(listener, restore_trigger):
    with override_settings(PGQUEUE={"NOTIFY": False}):
        call_command("migrate", verbosity=0)
    assert trigger_enabled("default") is False
    enqueue("t", {})
    assert listener.received(timeout=0.3) == [], "poll-only mode still notified"

    call_command("migrate", verbosity=0)
    assert trigger_enabled("default") is True
    enqueue("t", {})
    assert listener.wait_for(1) == [(CHANNEL, "default")]


def test_trigger_migration_is_reversible(listener, restore_trigger):
    call_command("migrate", "django_pgqueue", "0001", verbosity=0)
    assert trigger_enabled("default") is None
    enqueue("t", {})
    assert listener.received(timeout=0.3) == []
    call_command("migrate", "django_pgqueue", verbosity=0)
    assert trigger_enabled("default") is True
