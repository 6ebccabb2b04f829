"""The worker's database limits (PGQUEUE LOCK_TIMEOUT and STATEMENT_TIMEOUT)
and its behaviour at the database's limits: a row lock held by someone
else, and no connection slot left. Real PostgreSQL, real worker processes
where it matters."""

import collections
import logging
import os
import signal
import threading

import psycopg
import pytest
from demo.models import Handled
from django.db import OperationalError, connection
from django.test import override_settings

from django_pgqueue import checks as pgqueue_checks
from django_pgqueue import conf, enqueue, enqueue_many, lifecycle, liveness, registry
from django_pgqueue.models import DeadLetter, Message, Status
from django_pgqueue.sql import timeouts as timeouts_sql

from .conftest import database_url, raw_connection, running_worker, wait_until


def handled_counts():
    return collections.Counter(Handled.objects.values_list("message_id", flat=True))


# --- the settings ----------------------------------------------------------


@pytest.mark.parametrize("value", [None, 0.001, 0.5, 5, 60.0, 2_147_483])
def test_timeouts_accept_seconds_or_none(value):
    with override_settings(PGQUEUE={"LOCK_TIMEOUT": value, "STATEMENT_TIMEOUT": None}):
        assert pgqueue_checks.check_settings() == []
    with override_settings(PGQUEUE={"STATEMENT_TIMEOUT": value, "LOCK_TIMEOUT": None}):
        assert pgqueue_checks.check_settings() == []


@pytest.mark.parametrize("value", [0, -1, 0.0001, 2_147_484, True, "5s", float("nan")])
@pytest.mark.parametrize("key", ["LOCK_TIMEOUT", "STATEMENT_TIMEOUT"])
def test_timeouts_reject_what_postgresql_cannot_take(key, value):
    with override_settings(PGQUEUE={key: value}):
        [error] = pgqueue_checks.check_settings()
    assert error.id == "pgqueue.E003"
    assert f"PGQUEUE[{key!r}] must be a number of seconds from 0.001" in error.msg


def test_defaults_and_how_postgresql_gets_them():
    assert (conf.get("LOCK_TIMEOUT"), conf.get("STATEMENT_TIMEOUT")) == (5.0, 60.0)
    assert timeouts_sql.limits() == ["5000ms", "60000ms"]
    with override_settings(PGQUEUE={"LOCK_TIMEOUT": 0.0015, "STATEMENT_TIMEOUT": None}):
        assert timeouts_sql.limits() == ["2ms", None]
    with override_settings(PGQUEUE={"LOCK_TIMEOUT": None, "STATEMENT_TIMEOUT": None}):
        assert timeouts_sql.limits() is None


def test_a_lock_timeout_not_below_the_statement_timeout_is_a_warning():
    with override_settings(PGQUEUE={"LOCK_TIMEOUT": 30, "STATEMENT_TIMEOUT": 30}):
        [warning] = pgqueue_checks.check_settings()
    assert warning.id == "pgqueue.W101"
    assert "is not shorter than PGQUEUE['STATEMENT_TIMEOUT']" in warning.msg
    with override_settings(PGQUEUE={"LOCK_TIMEOUT": 30, "STATEMENT_TIMEOUT": None}):
        assert pgqueue_checks.check_settings() == []


# --- where the limits apply ------------------------------------------------

SEEN = []  # (handler kind, lock_timeout, statement_timeout) as a handler saw them


@pytest.fixture
def settings_recorders():
    """Handlers that record the timeouts their own queries run under."""

    def record(kind):
        def handle(message):
            with connection.cursor() as cursor:
                cursor.execute(
                    "SELECT current_setting('lock_timeout'), current_setting('statement_timeout')"
                )
                SEEN.append((kind, *cursor.fetchone()))

        return handle

    SEEN.clear()
    registry.handler("test.limits.atomic")(record("atomic"))
    registry.handler("test.limits.nonatomic", atomic=False)(record("nonatomic"))
    yield
    registry.unregister("test.limits.atomic")
    registry.unregister("test.limits.nonatomic")


@pytest.fixture
def statement_log(transactional_db):
    """A statement trigger on the message table that records, for each of the
    worker's writes, the timeouts it ran under: "claim" (an UPDATE that never
    waits: SKIP LOCKED), "ack, brief wait" (the batched acknowledgements of
    atomic=False handlers, under sql.acks.BRIEF_LOCK_WAIT_SQL), "ack, skip
    locked" (those that found a row locked past it), else the UPDATE or
    DELETE that may wait for a lock (an atomic handler's acknowledgement, a
    lease extension)."""
    with raw_connection(autocommit=True) as conn:
        conn.execute("CREATE TABLE test_limits_seen (op text, lock text, statement text)")
        conn.execute(
            """CREATE FUNCTION test_limits_seen() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
                INSERT INTO test_limits_seen VALUES (
                    CASE WHEN TG_OP = 'DELETE' AND current_query() LIKE '%pgqueue.lock_timeout%'
                             THEN 'ack, brief wait'
                         WHEN TG_OP = 'DELETE' AND current_query() LIKE '%SKIP LOCKED%'
                             THEN 'ack, skip locked'
                         WHEN current_query() LIKE '%AS m SET%' THEN 'claim'
                         ELSE TG_OP END,
                    current_setting('lock_timeout'), current_setting('statement_timeout'));
                RETURN NULL;
            END $$"""
        )
        conn.execute(
            "CREATE TRIGGER test_limits_seen AFTER UPDATE OR DELETE ON django_pgqueue_message"
            " FOR EACH STATEMENT EXECUTE FUNCTION test_limits_seen()"
        )
    yield
    with raw_connection(autocommit=True) as conn:
        conn.execute("DROP TRIGGER test_limits_seen ON django_pgqueue_message")
        conn.execute("DROP FUNCTION test_limits_seen()")
        conn.execute("DROP TABLE test_limits_seen")


@override_settings(PGQUEUE={"LOCK_TIMEOUT": 1.5, "STATEMENT_TIMEOUT": 7})
def test_the_limits_bound_the_workers_statements_and_not_its_handlers(
    statement_log, settings_recorders
):
    with raw_connection(autocommit=True) as conn:
        session = conn.execute(
            "SELECT current_setting('lock_timeout'), current_setting('statement_timeout')"
        ).fetchone()
    # Several atomic messages share a transaction (their acknowledgement is
    # sent in it, after the handlers); the others are acknowledged in batches.
    enqueue_many([{"topic": "test.limits.atomic"}] * 12 + [{"topic": "test.limits.nonatomic"}] * 12)
    with running_worker(concurrency=2, batch_size=6, poll_interval=0.2):
        wait_until(lambda: not Message.objects.exists(), timeout=60, message="all handled")
    assert len(SEEN) == 24
    assert {(lock, statement) for _, lock, statement in SEEN} == {session}, (
        "a handler ran under the worker's limits instead of its session's own settings"
    )
    assert {kind for kind, _, _ in SEEN} == {"atomic", "nonatomic"}
    with raw_connection(autocommit=True) as conn:
        seen = set(conn.execute("SELECT op, lock, statement FROM test_limits_seen"))
    # Those that may wait for a lock run under the limits; the batched
    # acknowledgements wait briefly, under that wait alone; the claim (sent
    # with them) and the skip-locked acknowledgements never wait, and carry
    # none (the hot path).
    waits = {(lock, statement) for op, lock, statement in seen if op in ("UPDATE", "DELETE")}
    brief = {(lock, statement) for op, lock, statement in seen if op == "ack, brief wait"}
    never_waits = {
        (lock, statement)
        for op, lock, statement in seen
        if op not in ("UPDATE", "DELETE", "ack, brief wait")
    }
    assert {op for op, _, _ in seen} >= {"claim", "ack, brief wait", "DELETE"}, seen
    assert waits == {("1500ms", "7s")}, f"the worker's acknowledgements ran with {seen}"
    assert brief == {("50ms", session[1])}, f"the batched acknowledgements ran with {seen}"
    assert never_waits == {session}, f"the claims ran with {seen}"
    assert session == ("0", "0"), "the test server has timeouts of its own"


@override_settings(PGQUEUE={"LOCK_TIMEOUT": None, "STATEMENT_TIMEOUT": None})
def test_none_leaves_the_sessions_settings(statement_log):
    enqueue_many([{"topic": "test.record_nonatomic"}] * 5)
    with running_worker(concurrency=1, poll_interval=0.2):
        wait_until(lambda: not Message.objects.exists(), timeout=60, message="all handled")
    with raw_connection(autocommit=True) as conn:
        seen = set(conn.execute("SELECT op, lock, statement FROM test_limits_seen"))
    brief = {(lock, statement) for op, lock, statement in seen if op == "ack, brief wait"}
    others = {(lock, statement) for op, lock, statement in seen if op != "ack, brief wait"}
    assert others == {("0", "0")}, seen
    assert brief == {("50ms", "0")}, seen  # its own brief wait, nothing else
    assert {"claim", "ack, brief wait"} <= {op for op, _, _ in seen}, seen


@override_settings(PGQUEUE={"LOCK_TIMEOUT": 0.3})
def test_the_worker_transactions_of_lifecycle_carry_the_limits(make_message, transactional_db):
    message = make_message(status=Status.PROCESSING)
    with raw_connection() as locker:
        locker.execute(
            "SELECT 1 FROM django_pgqueue_message WHERE id = %s FOR UPDATE", [message.pk]
        )
        # A retry waits for the row, but only LOCK_TIMEOUT long.
        with pytest.raises(OperationalError) as raised:
            lifecycle.retry_later(message, 1, "transient", "boom")
        assert isinstance(raised.value.__cause__, psycopg.errors.LockNotAvailable)
        # Lease extension and batched acknowledgement skip the locked row: not lost, not done.
        assert liveness.extend_leases([message], 60) == set()
        assert lifecycle.ack_unlocked([message]) == (set(), {message.pk})
    assert lifecycle.ack_unlocked([message]) == ({message.pk}, set())


# --- the batched acknowledgements' brief lock wait ---------------------------


def claimed_message(worker_id="w"):
    """A message leased by the worker's own claim."""
    enqueue("test.limits.nonatomic", {})
    (row,) = lifecycle.ack_and_claim_rows((), ["default"], 1, worker_id, 60).rows
    return lifecycle.message_from_row(row)


def seen_acks():
    """The acknowledgements statement_log recorded, in order."""
    with raw_connection(autocommit=True) as conn:
        return [
            op for (op,) in conn.execute("SELECT op FROM test_limits_seen WHERE op LIKE 'ack%'")
        ]


def test_a_batched_acknowledgement_waits_for_a_row_lock_released_in_the_brief_wait(
    statement_log, monkeypatch
):
    """The plain DELETE waits for a row another transaction holds, and
    removes it once that transaction ends (not skipped, nothing logged as
    lost). The brief wait is made long here, so that the lock is released
    on a condition (the DELETE seen waiting), not a clock."""
    from django_pgqueue.sql import acks as acks_sql

    monkeypatch.setattr(
        acks_sql,
        "BRIEF_LOCK_WAIT_SQL",
        acks_sql.BRIEF_LOCK_WAIT_SQL.replace(acks_sql.BRIEF_LOCK_WAIT, "60s"),
    )
    message = claimed_message()
    locker = hold_row_lock(message.pk)
    result: dict[str, object] = {}

    def acknowledge():
        try:
            result["ack"] = lifecycle.ack_unlocked([message])
        finally:
            connection.close()  # this thread's connection

    thread = threading.Thread(target=acknowledge)
    thread.start()
    try:
        with raw_connection(autocommit=True) as watcher:
            wait_until(
                lambda: watcher.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                    " AND query LIKE '%%pgqueue.lock_timeout%%'"
                ).fetchone()[0],
                timeout=30,
                message="the acknowledgement to wait for the row lock",
            )
    finally:
        locker.close()  # its transaction ends: the row is free
        thread.join(timeout=60)
    assert result["ack"] == ({message.pk}, set())
    assert not Message.objects.filter(pk=message.pk).exists()
    assert seen_acks() == ["ack, brief wait"]


@pytest.fixture
def brief_waits_timed_out(monkeypatch):
    """The brief waits that ran out, counted where lifecycle tells them."""
    from django_pgqueue.db import lock_timed_out
    from django_pgqueue.lifecycle import acks as lifecycle_acks
    from django_pgqueue.lifecycle import claim as lifecycle_claim

    counted = []

    def counting(exc):
        counted.append(exc)
        return lock_timed_out(exc)

    monkeypatch.setattr(lifecycle_acks, "lock_timed_out", counting)
    monkeypatch.setattr(lifecycle_claim, "lock_timed_out", counting)
    return counted


def test_a_row_held_past_the_brief_wait_is_skipped_and_the_claim_goes_on(
    statement_log, brief_waits_timed_out
):
    """With the claim's round trip: the acknowledgements wait briefly for a
    locked row, then go again skipping it, with the claim; the session's
    lock_timeout is what it was."""
    held = claimed_message()
    free = claimed_message()
    enqueue("test.limits.nonatomic", {})
    locker = hold_row_lock(held.pk)
    try:
        result = lifecycle.ack_and_claim_rows([held, free], ["default"], 5, "w", 60)
    finally:
        locker.close()
    assert (result.acked, result.busy) == ({free.pk}, {held.pk})
    assert len(result.rows) == 1, "the claim sent with the acknowledgements did not run"
    assert Message.objects.get(pk=held.pk).status == Status.PROCESSING
    # The brief try failed whole (one implicit transaction, its trace
    # rolled back with it); the second went.
    assert len(brief_waits_timed_out) == 1
    assert seen_acks() == ["ack, skip locked"]
    with connection.cursor() as cursor:
        cursor.execute("SHOW lock_timeout")
        assert cursor.fetchone()[0] == "0"
    # An acknowledgement that found its row locked skips it at once.
    locker = hold_row_lock(held.pk)
    try:
        result = lifecycle.ack_and_claim_rows([held], ["default"], 5, "w", 60, wait_briefly=False)
        assert lifecycle.ack_unlocked([held], wait_briefly=False) == (set(), {held.pk})
    finally:
        locker.close()
    assert (result.acked, result.busy) == (set(), {held.pk})
    assert len(brief_waits_timed_out) == 1, "a retry waited for the lock again"
    assert seen_acks() == ["ack, skip locked"] * 3
    assert lifecycle.ack_unlocked([held]) == ({held.pk}, set())
    assert seen_acks()[-1] == "ack, brief wait"


def test_inside_a_transaction_the_batched_acknowledgement_skips_locked_rows(statement_log):
    """A failed statement would break the caller's transaction: no brief
    wait there, the rows another transaction holds are skipped."""
    from django.db import transaction

    held = claimed_message()
    locker = hold_row_lock(held.pk)
    try:
        with transaction.atomic():
            assert lifecycle.ack_unlocked([held]) == (set(), {held.pk})
    finally:
        locker.close()
    assert seen_acks() == ["ack, skip locked"]


# --- a row lock held by someone else ----------------------------------------


def hold_row_lock(message_id):
    """Another client's transaction holding ``message_id``'s row FOR UPDATE."""
    conn = raw_connection()
    conn.execute("SELECT 1 FROM django_pgqueue_message WHERE id = %s FOR UPDATE", [message_id])
    return conn


def test_a_row_locked_under_a_running_atomic_handler_stalls_nothing(start_worker):
    """The handler of a leased message finishes while another client holds
    its row: the acknowledgement waits LOCK_TIMEOUT, fails, and the worker
    goes on with the others. Once the lock is gone the message runs again
    and its writes commit once (the first run's were rolled back)."""
    slow = enqueue("test.sleep", {"seconds": 1.0, "then": 0})
    worker = start_worker(
        "--concurrency", "2", "--lease", "2", "--poll-interval", "0.2",
        pgqueue={"LOCK_TIMEOUT": 0.5, "HEARTBEAT_INTERVAL": 1},
    )  # fmt: skip
    wait_until(
        lambda: Message.objects.filter(pk=slow.pk, status=Status.PROCESSING).exists(),
        timeout=60,
        message="the worker to lease the slow message",
    )
    locker = hold_row_lock(slow.pk)
    try:
        others = [
            m.pk
            for m in enqueue_many(
                [{"topic": "test.record"}] * 30 + [{"topic": "test.record_nonatomic"}] * 30
            )
        ]
        wait_until(
            lambda: set(others) <= set(handled_counts()),
            timeout=60,
            message="the other messages to be handled while the row is locked",
        )
        wait_until(
            lambda: "canceling statement due to lock timeout" in worker.log(),
            timeout=60,
            message="the blocked acknowledgement to fail with lock_timeout",
        )
        assert Message.objects.filter(pk=slow.pk).exists(), "acknowledged through the lock"
        assert not Handled.objects.filter(message_id=slow.pk).exists(), "committed twice?"
    finally:
        locker.close()  # rolls back: the lock is gone
    wait_until(lambda: not Message.objects.exists(), timeout=60, message="the slow message done")
    counts = handled_counts()
    assert set(counts) == {*others, slow.pk} and set(counts.values()) == {1}
    assert Handled.objects.get(message_id=slow.pk).attempt == 2
    assert not DeadLetter.objects.exists()
    assert worker.popen.poll() is None, "the worker died"


FINISHED = threading.Event()
LOCKED = threading.Event()


@pytest.fixture
def handler_that_waits_for_a_lock():
    """A non-atomic handler that returns only once the test has locked its
    row: its acknowledgement then finds the row locked."""

    def handle(message):
        FINISHED.set()
        LOCKED.wait(timeout=20)

    FINISHED.clear()
    LOCKED.clear()
    registry.handler("test.limits.waits", atomic=False)(handle)
    yield
    registry.unregister("test.limits.waits")


@override_settings(PGQUEUE={"LOCK_TIMEOUT": 30})
def test_a_locked_row_defers_its_acknowledgement_not_the_others(
    handler_that_waits_for_a_lock, caplog, transactional_db
):
    """Batched acknowledgements (atomic=False) skip a locked row and try it
    again later; claims and the other acknowledgements go on meanwhile, with
    no wait for the lock (LOCK_TIMEOUT is long here)."""
    # A pgqueue_worker run by an earlier test may have left the logger's level higher.
    caplog.set_level(logging.WARNING, logger="django_pgqueue")
    waiting = enqueue("test.limits.waits", {})
    with running_worker(concurrency=2, batch_size=4, poll_interval=0.2, lease_seconds=10):
        assert FINISHED.wait(timeout=20), "the handler never ran"
        locker = hold_row_lock(waiting.pk)
        try:
            LOCKED.set()
            wait_until(
                lambda: "acknowledgement deferred" in caplog.text,
                timeout=60,
                message="the acknowledgement to skip the locked row",
            )
            others = [m.pk for m in enqueue_many([{"topic": "test.record_nonatomic"}] * 40)]
            wait_until(
                lambda: not Message.objects.filter(pk__in=others).exists(),
                timeout=60,
                message="the others to be handled and acknowledged",
            )
            assert Message.objects.filter(pk=waiting.pk, status=Status.PROCESSING).exists()
        finally:
            locker.close()
        wait_until(lambda: not Message.objects.exists(), timeout=60, message="the last ack")
    assert handled_counts() == {pk: 1 for pk in others}
    assert "lease lost" not in caplog.text
    assert not DeadLetter.objects.exists()


# --- no connection slot left ---------------------------------------------------


@pytest.fixture
def limited_role(transactional_db):
    """A login role of its own with CONNECTION LIMIT 3 (superusers have no
    limit) and the rights a worker needs on the test database."""
    role = f"pgq_limited_{os.getpid()}"
    with raw_connection(autocommit=True) as conn:
        conn.execute(f"DROP ROLE IF EXISTS {role}")
        conn.execute(f"CREATE ROLE {role} LOGIN CONNECTION LIMIT 3")
        conn.execute(f"GRANT USAGE ON SCHEMA public TO {role}")
        conn.execute(
            f"GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO {role}"
        )
        conn.execute(f"GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA public TO {role}")
    yield role
    with raw_connection(autocommit=True) as conn:
        conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s", [role]
        )
        conn.execute(f"DROP OWNED BY {role}")
        conn.execute(f"DROP ROLE {role}")


def test_no_connection_slot_left_the_worker_waits_then_drains(limited_role, start_worker):
    params = connection.settings_dict
    as_role = dict(
        dbname=params["NAME"], user=limited_role, host=params["HOST"], port=params["PORT"]
    )
    hogs = [psycopg.connect(**as_role) for _ in range(3)]  # every slot the role has
    try:
        url = database_url("default").replace(f"//{params['USER']}@", f"//{limited_role}@")
        ids = [m.pk for m in enqueue_many([{"topic": "test.record"}] * 20)]
        worker = start_worker(
            "--concurrency", "1", "--poll-interval", "0.2",
            pgqueue={"NOTIFY": False}, env={"DATABASE_URL": url},
        )  # fmt: skip
        wait_until(
            lambda: worker.log().count("the database takes no more connections") >= 2,
            timeout=60,
            message="the worker to log the refused connections, twice",
        )
        assert "too many connections for role" in worker.log()
        assert worker.popen.poll() is None, f"the worker exited:\n{worker.log()}"
        assert not Handled.objects.exists()
    finally:
        for hog in hogs:
            hog.close()
    wait_until(lambda: not Message.objects.exists(), timeout=60, message="the queue to drain")
    assert handled_counts() == {pk: 1 for pk in ids}
    worker.signal(signal.SIGTERM)
    assert worker.wait(timeout=60) == 0, worker.log()
    assert "Traceback" not in worker.log()
