"""The worker's own VACUUM of the queue table (django_pgqueue.vacuum), run
after a maintenance round when the table's dead rows pile up."""

import logging
import time
import uuid

import pytest
from django.db import connection, transaction
from django.test import override_settings

from django_pgqueue import enqueue, enqueue_many, maintenance, vacuum
from django_pgqueue.conf.problems import CHECKS
from django_pgqueue.models import Message

from .conftest import raw_connection, running_worker, wait_until

pytestmark = pytest.mark.django_db(transaction=True)

TABLE = Message._meta.db_table


def vacuum_count():
    """The queue table's manual vacuums so far, as the server counts them."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT vacuum_count FROM pg_stat_user_tables WHERE relid = %s::regclass", [TABLE]
        )
        return cursor.fetchone()[0]


def leave_dead_rows(n):
    """Insert ``n`` messages and delete them: ``n`` dead rows, none live; then
    flush this backend's statistics so pg_stat_user_tables shows them."""
    enqueue_many([{"payload": {"n": i}} for i in range(n)], topic="vacuum.test")
    Message.objects.all().delete()
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_stat_force_next_flush()")  # PostgreSQL 15
        cursor.execute("SELECT 1")  # the flush happens as the backend goes idle


@pytest.fixture(autouse=True)
def nothing_left_by_an_earlier_vacuum(monkeypatch):
    monkeypatch.setattr(vacuum, "_left_dead_rows", 0)


def other_backends():
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
        return cursor.fetchone()[0]


@pytest.fixture(autouse=True)
def statistics_from_zero():
    """The queue table's live and dead row counts start at zero: TRUNCATE
    resets them (the suite's flush after an earlier test truncates the
    tables that hold rows only: conftest.flush_only_tables_with_rows). First
    the earlier tests' connections end: a backend reports its last rows as
    it exits, which would count them again after the reset. The reset is
    flushed at once: PostgreSQL 15 forgets a truncation that a later
    transaction of the same backend reaches the statistics with."""
    wait_until(lambda: other_backends() == 0, message="the earlier tests' connections to end")
    with connection.cursor() as cursor:
        cursor.execute(f"TRUNCATE {TABLE} CASCADE")
        cursor.execute("SELECT pg_stat_force_next_flush()")
        cursor.execute("SELECT 1")  # the flush happens as the backend goes idle


@override_settings(PGQUEUE={"VACUUM_DEAD_ROWS": 100})
def test_the_round_vacuums_the_queue_table_when_dead_rows_pile_up(caplog):
    leave_dead_rows(300)
    before = vacuum_count()
    with caplog.at_level(logging.INFO, logger="django_pgqueue.vacuum"):
        result = maintenance.run_once()
    assert result is not None and result.vacuumed is not None
    assert result.vacuumed.dead_rows >= 300
    assert not result.vacuumed.skipped
    assert result.vacuumed.dead_rows_after < 300
    assert vacuum_count() == before + 1
    assert f"vacuumed {TABLE} (" in caplog.text


@override_settings(PGQUEUE={"VACUUM_DEAD_ROWS": 100, "HEARTBEAT_INTERVAL": 60.0})
def test_a_busy_worker_checks_every_second_not_only_at_its_rounds(caplog):
    """With these settings the heartbeat thread's rounds and lease
    extensions come every 15 s; the dead rows a busy worker leaves are
    checked every vacuum.CHECK_SECONDS between them."""
    # The worker stays busy meanwhile, with no transaction open (an atomic
    # handler's would hold back the xmin horizon of every database on the
    # server, and with it the ordered streams of tests running beside this).
    enqueue("test.started", {"seconds": 9})
    with caplog.at_level(logging.INFO, logger="django_pgqueue.vacuum"):
        with running_worker(concurrency=1, poll_interval=0.1):
            wait_until(
                lambda: Message.objects.filter(topic="test.started", status="processing").exists(),
                message="the sleeping handler started",
            )
            time.sleep(0.5)  # past the round the worker ran as it became busy
            before = vacuum_count()
            enqueue_many([{"payload": {"n": i}} for i in range(300)], topic="vacuum.test")
            Message.objects.filter(topic="vacuum.test").delete()
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_stat_force_next_flush()")
                cursor.execute("SELECT 1")
            wait_until(
                lambda: vacuum_count() > before,
                timeout=7,
                message="a vacuum before the next round (15 s)",
            )
    assert f"vacuumed {TABLE} (" in caplog.text


@override_settings(PGQUEUE={"VACUUM_DEAD_ROWS": 100})
def test_rows_the_last_vacuum_left_do_not_count(monkeypatch):
    # A long transaction's snapshot kept them: a vacuum at once would
    # remove none of them either.
    leave_dead_rows(300)
    monkeypatch.setattr(vacuum, "_left_dead_rows", 250)
    before = vacuum_count()
    assert vacuum.vacuum_if_due() is None
    assert vacuum_count() == before


@override_settings(PGQUEUE={"VACUUM_DEAD_ROWS": 1000})
def test_few_dead_rows_are_left_to_autovacuum():
    leave_dead_rows(300)
    before = vacuum_count()
    result = maintenance.run_once()
    assert result is not None and result.vacuumed is None
    assert vacuum_count() == before


@override_settings(PGQUEUE={"VACUUM_DEAD_ROWS": 100})
def test_more_live_rows_than_dead_ones_wait():
    leave_dead_rows(300)
    enqueue_many([{"payload": {"n": i}} for i in range(400)], topic="vacuum.test")
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_stat_force_next_flush()")
        cursor.execute("SELECT 1")
    assert vacuum.vacuum_if_due() is None


@override_settings(PGQUEUE={"VACUUM_DEAD_ROWS": None})
def test_none_never_vacuums_from_the_worker():
    leave_dead_rows(300)
    before = vacuum_count()
    assert vacuum.vacuum_if_due() is None
    assert vacuum_count() == before


@override_settings(PGQUEUE={"VACUUM_DEAD_ROWS": 100})
def test_another_vacuum_holding_the_table_is_a_skip(caplog):
    """Another session holds the lock a VACUUM takes (as autovacuum or
    another worker's VACUUM would): SKIP_LOCKED skips it, and says so."""
    leave_dead_rows(300)
    before = vacuum_count()
    with raw_connection() as holder:  # a transaction of its own, open until the block ends
        holder.execute(f"LOCK TABLE {TABLE} IN SHARE UPDATE EXCLUSIVE MODE")
        with caplog.at_level(logging.INFO, logger="django_pgqueue.vacuum"):
            result = vacuum.vacuum_if_due()
    assert result is not None and result.skipped
    assert vacuum_count() == before
    assert "skipped: another vacuum holds it" in caplog.text


@override_settings(PGQUEUE={"VACUUM_DEAD_ROWS": 100})
def test_a_vacuum_the_server_cancels_is_logged_and_tried_again(caplog):
    """The VACUUM itself fails (here the server's statement_timeout cancels
    it partway): a warning, no result, and the next check vacuums."""
    leave_dead_rows(20_000)  # enough pages that 1 ms does not cover them
    before = vacuum_count()

    def cancel_soon(execute, sql, params, many, context):
        if sql.startswith("VACUUM"):
            execute("SET statement_timeout = '1ms'", None, False, context)
            try:
                return execute(sql, params, many, context)
            finally:
                execute("RESET statement_timeout", None, False, context)
        return execute(sql, params, many, context)

    with caplog.at_level(logging.WARNING, logger="django_pgqueue.vacuum"):
        with connection.execute_wrapper(cancel_soon):
            assert vacuum.vacuum_if_due() is None
    assert f"VACUUM of {TABLE} failed (" in caplog.text
    assert "statement timeout" in caplog.text
    assert vacuum_count() == before
    result = vacuum.vacuum_if_due()
    assert result is not None and not result.skipped
    assert vacuum_count() == before + 1


@override_settings(PGQUEUE={"VACUUM_DEAD_ROWS": 100})
def test_inside_a_transaction_it_does_nothing():
    leave_dead_rows(300)
    before = vacuum_count()
    with transaction.atomic():
        assert vacuum.vacuum_if_due() is None
    assert vacuum_count() == before


@override_settings(PGQUEUE={"VACUUM_DEAD_ROWS": 100})
def test_a_role_that_may_not_vacuum_says_so_once(caplog, monkeypatch):
    monkeypatch.setattr(vacuum, "_warned_permission", False)
    leave_dead_rows(300)
    before = vacuum_count()
    role = f"pgq_vac_{uuid.uuid4().hex[:12]}"  # roles are the whole server's
    with connection.cursor() as cursor:
        cursor.execute(f"CREATE ROLE {role}")
    try:
        with connection.cursor() as cursor:
            cursor.execute(f"SET ROLE {role}")
        with caplog.at_level(logging.INFO, logger="django_pgqueue.vacuum"):
            assert vacuum.vacuum_if_due() is None
            assert vacuum.vacuum_if_due() is None
    finally:
        with connection.cursor() as cursor:
            cursor.execute("RESET ROLE")
            cursor.execute(f"DROP ROLE {role}")
    assert vacuum_count() == before
    warnings = [r for r in caplog.records if r.name == "django_pgqueue.vacuum"]
    assert [r.levelno for r in warnings] == [logging.WARNING]
    assert "may not vacuum" in warnings[0].getMessage()


@pytest.mark.parametrize("value", [0, -1, 1.5, "50000", True])
def test_bad_thresholds_are_refused(value):
    assert "whole number of at least 1, or None" in CHECKS["VACUUM_DEAD_ROWS"](value)


@pytest.mark.parametrize("value", [1, 50_000, None])
def test_good_thresholds_pass(value):
    assert CHECKS["VACUUM_DEAD_ROWS"](value) is None
