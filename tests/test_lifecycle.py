"""The state machine, one transition at a time: rows fabricated in the exact
state and time, one call, the rows read back, including rows on each side of
every threshold and rows that must stay untouched."""

import datetime
import re
import threading
import time
import uuid

import pytest
from django.db import connections, transaction
from django.db.models import Q
from django.db.models.functions import Now
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from django_pgqueue import lifecycle, liveness, maintenance
from django_pgqueue.models import Category, DeadLetter, Message, Status
from django_pgqueue.signals import dead_lettered, message_retried
from django_pgqueue.sql.acks import ack_statement, ids_by_token
from django_pgqueue.sql.claim import claim_statement

from .claiming import ack_and_claim, ack_many, claim
from .conftest import raw_connection

pytestmark = pytest.mark.django_db(transaction=True)

NOW = timezone.now()
SECOND = datetime.timedelta(seconds=1)


def reread(message):
    return Message.objects.filter(pk=message.pk).first()


# --- claim --------------------------------------------------------------------


def test_claim_takes_ready_messages_in_priority_then_run_at_then_id_order(make_message):
    low_old = make_message(priority=0, run_at=NOW - 10 * SECOND)
    high = make_message(priority=5, run_at=NOW - SECOND)
    low_new_a = make_message(priority=0, run_at=NOW - SECOND)
    low_new_b = make_message(priority=0, run_at=NOW - SECOND)
    make_message(priority=9, run_at=NOW + 60 * SECOND)  # delayed: not yet
    make_message(priority=9, queue="other")  # another queue
    make_message(priority=9, status=Status.PROCESSING)  # leased already
    make_message(priority=9, status=Status.DONE)

    claimed = claim(["default"], 10, "w1", 30, now=NOW)
    assert [m.pk for m in claimed] == [high.pk, low_old.pk, low_new_a.pk, low_new_b.pk]


def test_claim_serves_several_queues_in_the_order_given(make_message):
    a1 = make_message(queue="a", priority=0, run_at=NOW - SECOND)
    b1 = make_message(queue="b", priority=9, run_at=NOW - 9 * SECOND)
    a2 = make_message(queue="a", priority=1, run_at=NOW - SECOND)
    c1 = make_message(queue="c")
    assert [m.pk for m in claim(["a", "b"], 3, "w", 30, now=NOW)] == [a2.pk, a1.pk, b1.pk]
    assert claim(["a", "b"], 3, "w", 30, now=NOW) == []
    assert Message.objects.get(pk=c1.pk).status == Status.WAITING


def test_claim_sets_the_lease_counts_the_attempt_and_respects_the_limit(make_message):
    for _ in range(5):
        make_message(run_at=NOW - SECOND, attempts=2)
    claimed = claim(["default"], 3, "worker-7", 30, now=NOW)
    assert len(claimed) == 3
    tokens = {m.lease_token for m in claimed}
    assert len(tokens) == 1 and None not in tokens, "one fresh token for the batch"
    for message in claimed:
        row = reread(message)
        assert row.status == Status.PROCESSING
        assert row.attempts == 3 == message.attempts
        assert row.locked_by == "worker-7"
        assert row.lease_token == message.lease_token
        assert row.lease_expires_at == NOW + 30 * SECOND
    assert Message.objects.filter(status=Status.WAITING).count() == 2


def test_the_claim_is_one_prepared_statement_and_leaves_a_callers_commit_durable(make_message):
    for _ in range(9):
        make_message(run_at=NOW - SECOND)
    for _ in range(6):  # past psycopg's prepare_threshold (the testproject's 5)
        assert len(claim(["default"], 1, "w", 60)) == 1
    with connections["default"].cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_prepared_statements WHERE statement LIKE '%UPDATE%'"
        )
        assert cursor.fetchone()[0] >= 1
    # Inside a caller's transaction the claim does not make its commit asynchronous.
    with transaction.atomic(), connections["default"].cursor() as cursor:
        assert len(claim(["default"], 1, "w", 60)) == 1
        cursor.execute("SHOW synchronous_commit")
        assert cursor.fetchone()[0] == "on"
    # The worker's own (autocommit) claim sets it for its transaction alone.
    with CaptureQueriesContext(connections["default"]) as queries:
        assert len(claim(["default"], 1, "w", 60)) == 1
    assert "set_config('synchronous_commit', 'off', true)" in queries.captured_queries[-1]["sql"]
    sql, params = claim_statement("default", "default", 1, "w", async_commit=True)
    params[1] = uuid.uuid4()
    with transaction.atomic(), connections["default"].cursor() as cursor:
        cursor.execute(sql, params)
        assert len(cursor.fetchall()) == 1
        cursor.execute("SHOW synchronous_commit")
        assert cursor.fetchone()[0] == "off"
        transaction.set_rollback(True)


def test_claim_skips_rows_locked_by_another_transaction(make_message):
    locked = make_message(run_at=NOW - 2 * SECOND)
    free = make_message(run_at=NOW - SECOND)
    with raw_connection() as other:  # a claim in progress elsewhere
        other.execute("SELECT 1 FROM django_pgqueue_message WHERE id = %s FOR UPDATE", [locked.pk])
        claimed = claim(["default"], 10, "w", 30, now=NOW)
        assert [m.pk for m in claimed] == [free.pk], "did not skip the locked row"
    assert reread(locked).status == Status.WAITING


def test_concurrent_claims_never_take_the_same_message(make_message):
    for _ in range(200):
        make_message(run_at=NOW - SECOND)
    results = []

    def claim_all():
        try:
            while batch := claim(["default"], 7, threading.current_thread().name, 30):
                results.extend(m.pk for m in batch)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=claim_all, name=f"w{i}") for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 200 and len(set(results)) == 200


def test_claims_racing_updates_of_waiting_rows_take_each_message_once(make_message):
    """The claim finds its picked rows again by address (ctid): rows that
    another transaction keeps updating while they wait (new row versions,
    new addresses) are still claimed exactly once, and none is left behind."""
    for _ in range(300):
        make_message(run_at=NOW - SECOND)
    claimed, errors = [], []
    claiming = threading.Event()
    claiming.set()

    def update_waiting_rows():
        try:
            with raw_connection(autocommit=True) as other:
                while claiming.is_set():
                    other.execute(
                        "UPDATE django_pgqueue_message SET headers = headers || '{}'"
                        " WHERE id IN (SELECT id FROM django_pgqueue_message"
                        " WHERE status = 'waiting' ORDER BY random() LIMIT 5)"
                        " AND status = 'waiting'"
                    )
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    def claim_and_ack():
        try:
            deadline = time.monotonic() + 60
            while Message.objects.exists() and time.monotonic() < deadline:
                batch = claim(["default"], 7, threading.current_thread().name, 30)
                claimed.extend(m.pk for m in batch)
                # (waits for a row the updater has locked for a moment)
                assert lifecycle.ack_leased(batch) == {m.pk for m in batch}
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)
        finally:
            connections.close_all()

    updater = threading.Thread(target=update_waiting_rows)
    updater.start()
    workers = [threading.Thread(target=claim_and_ack, name=f"w{i}") for i in range(3)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    claiming.clear()
    updater.join()
    assert not errors, errors
    assert len(claimed) == 300 and len(set(claimed)) == 300
    assert not Message.objects.exists()


def test_claim_finds_the_picked_rows_by_address_not_through_the_primary_key(make_message):
    """A join on id would look every claimed row up in the primary key again
    (a B-tree a level deeper with every hundredfold of rows in the table) or
    hash a sequential scan of the whole table (a mid-sized backlog): the
    cost of a claim would grow with rows it does not take."""
    with connections["default"].cursor() as cursor:
        cursor.execute(
            "INSERT INTO django_pgqueue_message (topic, payload, run_at)"
            " SELECT 'bulk', '{}', now() - interval '1 minute' FROM generate_series(1, 2000)"
        )
        cursor.execute("ANALYZE django_pgqueue_message")
    for limit, few_ready in ((100, False), (4, True)):
        sql, params = claim_statement("default", "default", limit, "w", few_ready=few_ready)
        params[1] = uuid.uuid4()
        with transaction.atomic(), connections["default"].cursor() as cursor:
            cursor.execute("EXPLAIN (ANALYZE, BUFFERS) " + sql, params)
            plan = "\n".join(row[0] for row in cursor.fetchall())
            transaction.set_rollback(True)
        assert "Tid Scan on django_pgqueue_message m" in plan, plan
        assert f"rows={limit} loops=1" in plan.splitlines()[0], plan
        assert "Seq Scan" not in plan and "_pkey" not in plan, plan


def test_claim_plan_does_not_read_finished_delayed_or_leased_rows(make_message):
    """The claim reads the head of a partial index: its cost is the same with
    20,000 rows that are not claimable as with none."""
    with connections["default"].cursor() as cursor:
        cursor.execute(
            """
            INSERT INTO django_pgqueue_message
                (topic, payload, status, run_at, lease_token, lease_expires_at)
            SELECT 'bulk', '{}', s, now() + interval '1 hour',
                CASE WHEN s = 'processing' THEN gen_random_uuid() END,
                CASE WHEN s = 'processing' THEN now() + interval '1 hour' END
            FROM unnest(ARRAY['done', 'waiting', 'processing']) s, generate_series(1, 7000)
            """
        )
        cursor.execute("ANALYZE django_pgqueue_message")
    for _ in range(20):
        make_message(run_at=NOW - SECOND)

    # The worker's own claim statement, run and rolled back.
    sql, params = claim_statement("default", "default", 10, "w")
    params[1] = uuid.uuid4()
    with transaction.atomic(), connections["default"].cursor() as cursor:
        cursor.execute("EXPLAIN (ANALYZE, BUFFERS) " + sql, params)
        plan = "\n".join(row[0] for row in cursor.fetchall())
        transaction.set_rollback(True)
    assert "Update on django_pgqueue_message" in plan, plan
    assert "Seq Scan" not in plan, plan
    assert "pgqueue_msg_claim_idx" in plan or "pgqueue_msg_due_idx" in plan, plan
    # The row picking (LockRows over the index scan) is what could grow with
    # the table; its Buffers line counts its whole subtree. (The UPDATE's own
    # buffers are the 10 rows it writes.)
    lines = plan.splitlines()
    lock_rows = next(i for i, line in enumerate(lines) if "LockRows" in line)
    top = next(line for line in lines[lock_rows:] if line.strip().startswith("Buffers:"))
    buffers = sum(int(part.split("=")[1]) for part in top.split() if "=" in part)
    assert buffers < 30, f"picking 10 rows touched {buffers} buffers:\n{plan}"


def _picking_buffers(sql, params):
    """EXPLAIN (ANALYZE, BUFFERS) of a claim, rolled back: (plan, buffers of
    the row picking: the LockRows subtree)."""
    params[1] = uuid.uuid4()
    with transaction.atomic(), connections["default"].cursor() as cursor:
        cursor.execute("EXPLAIN (ANALYZE, BUFFERS) " + sql, params)
        plan = "\n".join(row[0] for row in cursor.fetchall())
        transaction.set_rollback(True)
    lines = plan.splitlines()
    lock_rows = next(i for i, line in enumerate(lines) if "LockRows" in line)
    top = next(line for line in lines[lock_rows:] if line.strip().startswith("Buffers:"))
    return plan, sum(int(part.split("=")[1]) for part in top.split() if "=" in part)


def test_a_claim_expecting_few_reads_the_due_index_whatever_the_statistics_say(make_message):
    """Statistics taken with a backlog, the backlog gone, one message ready
    among 30,000 delayed ones: the few_ready claim (the worker's after a short
    claim) reads the head of the due index."""
    with connections["default"].cursor() as cursor:
        cursor.execute(
            """
            INSERT INTO django_pgqueue_message (topic, payload, run_at)
            SELECT 'bulk', '{}', now() + interval '1 hour' FROM generate_series(1, 30000);
            INSERT INTO django_pgqueue_message (topic, payload, run_at)
            SELECT 'backlog', '{}', now() - interval '1 minute' FROM generate_series(1, 20000);
            ANALYZE django_pgqueue_message;
            DELETE FROM django_pgqueue_message WHERE topic = 'backlog';
            """
        )
        cursor.execute("VACUUM django_pgqueue_message")  # the dead rows go, the statistics stay
    make_message(run_at=NOW - SECOND)
    sql, params = claim_statement("default", "default", 16, "w", few_ready=True)
    plan, buffers = _picking_buffers(sql, params)
    assert "pgqueue_msg_due_idx" in plan and "Seq Scan" not in plan, plan
    assert buffers < 30, f"picking 1 row touched {buffers} buffers:\n{plan}"


@pytest.mark.parametrize("few_ready", [False, True])
def test_the_prepared_claims_generic_plan_reads_a_partial_index(make_message, few_ready):
    """Once prepared, PostgreSQL may run the claim with a generic plan (no
    planning per call). That plan must still read the head of a partial
    index: the status is in the statement's text, never a parameter (the
    plan could not use the indexes' predicate), so with 30,000 delayed rows
    and one ready the claim stays a few buffers."""
    with connections["default"].cursor() as cursor:
        cursor.execute(
            "INSERT INTO django_pgqueue_message (topic, payload, run_at)"
            " SELECT 'bulk', '{}', now() + interval '1 hour' FROM generate_series(1, 30000);"
            " ANALYZE django_pgqueue_message"
        )
    make_message(run_at=NOW - SECOND)
    sql, params = claim_statement("default", "default", 16, "w", few_ready=few_ready)
    params[1] = uuid.uuid4()
    placeholders = iter(range(1, len(params) + 1))
    prepared = re.sub("%s", lambda _: f"${next(placeholders)}", sql)
    assert "'waiting'" in prepared and 'status" = $' not in prepared
    with transaction.atomic(), connections["default"].cursor() as cursor:
        cursor.execute("SET LOCAL plan_cache_mode = force_generic_plan")
        cursor.execute(f"PREPARE pgqueue_claim_test AS {prepared}")
        try:
            cursor.execute(
                "EXPLAIN (ANALYZE, BUFFERS) EXECUTE pgqueue_claim_test("
                + ", ".join(["%s"] * len(params))
                + ")",
                params,
            )
            plan = "\n".join(row[0] for row in cursor.fetchall())
        finally:
            cursor.execute("DEALLOCATE pgqueue_claim_test")
        transaction.set_rollback(True)
    assert "Seq Scan" not in plan, plan
    assert "pgqueue_msg_claim_idx" in plan or "pgqueue_msg_due_idx" in plan, plan
    assert "rows=1 " in plan.split("LockRows")[1], plan
    lines = plan.splitlines()
    lock_rows = next(i for i, line in enumerate(lines) if "LockRows" in line)
    top = next(line for line in lines[lock_rows:] if line.strip().startswith("Buffers:"))
    buffers = sum(int(part.split("=")[1]) for part in top.split() if "=" in part)
    assert buffers < 30, f"picking 1 row touched {buffers} buffers:\n{plan}"


def test_a_claim_expecting_few_keeps_its_generic_plan_while_statistics_describe_a_backlog(
    make_message,
):
    """Statistics taken with a backlog of 20,000 ready messages, the backlog
    gone: the worker's short claims (few_ready) run with PostgreSQL's generic
    plan instead of being planned again on every call. (With the limit bound
    as a parameter the planner estimated a tenth of the backlog for it and
    kept choosing custom plans.)"""
    with connections["default"].cursor() as cursor:
        cursor.execute(
            "INSERT INTO django_pgqueue_message (topic, payload)"
            " SELECT 'backlog', '{}' FROM generate_series(1, 20000);"
            " INSERT INTO django_pgqueue_message (topic, payload, run_at)"
            " SELECT 'later', '{}', now() + interval '1 day' FROM generate_series(1, 20000);"
            " ANALYZE django_pgqueue_message;"
            " DELETE FROM django_pgqueue_message WHERE topic = 'backlog'"
        )
        cursor.execute("VACUUM django_pgqueue_message")  # the dead rows go, the statistics stay
    for _ in range(12):  # psycopg prepares after 5, PostgreSQL decides after 5 more
        make_message(run_at=NOW - SECOND)
        assert len(claim(["default"], 16, "w", 60, few_ready=True)) == 1
    with connections["default"].cursor() as cursor:
        cursor.execute(
            "SELECT generic_plans, custom_plans FROM pg_prepared_statements"
            " WHERE statement LIKE '%%UPDATE%%' AND statement LIKE '%%LIMIT 16%%'"
        )
        ((generic, custom),) = cursor.fetchall()
    assert generic >= 1 and custom <= 5, (generic, custom)


def test_acknowledgements_and_lease_extensions_read_the_primary_key_not_every_lease():
    """5,000 messages leased by other workers, planner statistics taken while
    nothing was leased: acknowledging (and extending) this worker's 100 reads
    those 100 rows through the primary key. With the lease index's old
    condition (status = 'processing' only) the planner scanned the whole
    index, every worker's leases, for each acknowledgement. The rescue and
    the probe still read the lease index (by expiry)."""
    with connections["default"].cursor() as cursor:
        cursor.execute(
            "INSERT INTO django_pgqueue_message (topic, payload)"
            " SELECT 'bulk', '{}' FROM generate_series(1, 5100);"
            " ANALYZE django_pgqueue_message"
        )
    for n in range(50):
        claim(["default"], 100, f"other-{n}", 600)
    mine = claim(["default"], 100, "me", 60)
    assert len(mine) == 100

    def plan_of(sql, params):
        with transaction.atomic(), connections["default"].cursor() as cursor:
            cursor.execute("EXPLAIN (ANALYZE, BUFFERS) " + sql, params)
            plan = "\n".join(row[0] for row in cursor.fetchall())
            transaction.set_rollback(True)
        return plan

    for skip_locked in (True, False):
        ids = ids_by_token(mine)
        plan = plan_of(*ack_statement(connections["default"], ids, skip_locked))
        assert "pgqueue_msg_lease_idx" not in plan and "Seq Scan" not in plan, plan
        assert "django_pgqueue_message_pkey" in plan, plan
    token = mine[0].lease_token
    extend = (
        Message.objects.select_for_update(skip_locked=True)
        .filter(pk__in=[m.pk for m in mine], status=Status.PROCESSING, lease_token=token)
        .values("pk")
    )
    with transaction.atomic():
        plan = extend.explain()
    assert "pgqueue_msg_lease_idx" not in plan and "pkey" in plan, plan
    rescue = Message.objects.filter(status=Status.PROCESSING, lease_expires_at__lt=Now()).order_by(
        "lease_expires_at"
    )[:1000]
    assert "pgqueue_msg_lease_idx" in rescue.explain()
    assert ack_many(mine) == {m.pk for m in mine}
    assert liveness.extend_leases(mine, 60) == set()  # acknowledged: gone, not lost


def test_a_claim_expecting_few_takes_them_all_in_claim_order_or_the_oldest(make_message):
    low_old = make_message(run_at=NOW - 3 * SECOND, priority=0)
    high_new = make_message(run_at=NOW - SECOND, priority=5)
    middle = make_message(run_at=NOW - 2 * SECOND, priority=0)
    claimed = claim(["default"], 10, "w", 60, few_ready=True)
    assert [m.pk for m in claimed] == [high_new.pk, low_old.pk, middle.pk]
    Message.objects.all().delete()
    oldest = [make_message(run_at=NOW - (10 - n) * SECOND) for n in range(3)]
    make_message(run_at=NOW - SECOND, priority=9)
    # More ready than asked: this one claim takes the oldest, not the most urgent.
    claimed = claim(["default"], 3, "w", 60, few_ready=True)
    assert [m.pk for m in claimed] == [m.pk for m in oldest]


# --- ack ----------------------------------------------------------------------


def test_ack_deletes_only_with_the_current_lease(make_message):
    held = make_message(status=Status.PROCESSING)
    assert lifecycle.ack(held) is True
    assert reread(held) is None

    stolen = make_message(status=Status.PROCESSING)
    late = Message.objects.get(pk=stolen.pk)
    late.lease_token = uuid.uuid4()  # a rescued-and-reclaimed message has another token
    assert lifecycle.ack(late) is False, "a late ack must not finish a rescued message"
    assert reread(stolen).status == Status.PROCESSING

    rescued = make_message(status=Status.PROCESSING)
    Message.objects.filter(pk=rescued.pk).update(status=Status.WAITING, lease_token=None)
    assert lifecycle.ack(rescued) is False
    assert reread(rescued).status == Status.WAITING


def test_ack_many_reports_which_were_still_held(make_message):
    a = make_message(status=Status.PROCESSING)
    b = make_message(status=Status.PROCESSING, lease_token=a.lease_token)
    lost = make_message(status=Status.PROCESSING, lease_token=a.lease_token)
    Message.objects.filter(pk=lost.pk).update(lease_token=uuid.uuid4())
    assert ack_many([a, b, lost]) == {a.pk, b.pk}
    assert list(Message.objects.values_list("pk", flat=True)) == [lost.pk]


def test_acknowledging_nothing_sends_nothing():
    with CaptureQueriesContext(connections["default"]) as queries:
        assert ack_many([]) == set()
        assert lifecycle.ack_unlocked([]) == (set(), set())
        assert lifecycle.ack_leased([]) == set()
    assert len(queries) == 0


def test_acknowledgements_of_several_claims_each_check_their_own_token(make_message):
    for _ in range(6):
        make_message(run_at=NOW - SECOND)
    first = claim(["default"], 3, "w", 60)
    second = claim(["default"], 3, "w", 60)
    assert first[0].lease_token != second[0].lease_token
    # One of each claim's messages with the other claim's token: not acknowledged.
    swapped = [
        *first[:2],
        *second[:2],
        Message(pk=first[2].pk, lease_token=second[0].lease_token),
        Message(pk=second[2].pk, lease_token=first[0].lease_token),
    ]
    held = {m.pk for m in first[:2] + second[:2]}
    acked, claimed = ack_and_claim(swapped, ["default"], 1, "w", 60)
    assert acked == held and claimed == []
    assert set(Message.objects.values_list("pk", flat=True)) == {first[2].pk, second[2].pk}
    assert ack_many([first[2], second[2]]) == {first[2].pk, second[2].pk}


# --- retry, release, extend ---------------------------------------------------


def test_retry_later_records_the_failure_and_schedules_the_next_attempt(make_message):
    message = make_message(status=Status.PROCESSING, attempts=2)
    assert lifecycle.retry_later(message, 90, Category.DEPENDENCY, "ConnectionError: down", NOW)
    row = reread(message)
    assert row.status == Status.WAITING
    assert row.run_at == NOW + 90 * SECOND
    assert row.attempts == 2, "the attempt stays counted"
    assert (row.last_error, row.last_error_category) == ("ConnectionError: down", "dependency")
    assert row.first_failed_at == NOW
    assert row.lease_token is None and row.locked_by == "" and row.lease_expires_at is None

    message2 = make_message(status=Status.PROCESSING, first_failed_at=NOW - 60 * SECOND)
    lifecycle.retry_later(message2, 1, Category.TRANSIENT, "x", NOW)
    assert reread(message2).first_failed_at == NOW - 60 * SECOND, "first failure is kept"

    other = make_message(status=Status.PROCESSING)
    other.lease_token = uuid.uuid4()
    assert lifecycle.retry_later(other, 1, Category.TRANSIENT, "x") is False
    assert reread(other).status == Status.PROCESSING


def test_release_hands_back_without_counting_the_attempt(make_message):
    message = make_message(status=Status.PROCESSING, attempts=3)
    lost = make_message(status=Status.PROCESSING, attempts=1)
    lost.lease_token = uuid.uuid4()
    assert lifecycle.release([message, lost]) == 1
    row = reread(message)
    assert (row.status, row.attempts, row.lease_token) == (Status.WAITING, 2, None)
    assert reread(lost).status == Status.PROCESSING


def test_extend_leases_reports_the_lost_ones(make_message):
    held = make_message(status=Status.PROCESSING, lease_expires_at=NOW + SECOND)
    rescued = make_message(status=Status.PROCESSING, lease_token=held.lease_token)
    Message.objects.filter(pk=rescued.pk).update(status=Status.WAITING, lease_token=None)
    taken = make_message(status=Status.PROCESSING, lease_token=held.lease_token)
    Message.objects.filter(pk=taken.pk).update(lease_token=uuid.uuid4())
    acked = make_message(status=Status.PROCESSING, lease_token=held.lease_token)
    Message.objects.filter(pk=acked.pk).delete()  # finished meanwhile: not lost
    lost = liveness.extend_leases([held, rescued, taken, acked], 60, now=NOW)
    assert lost == {rescued.pk, taken.pk}
    assert reread(held).lease_expires_at == NOW + 60 * SECOND
    assert reread(rescued).lease_expires_at == rescued.lease_expires_at


# --- dead letters -------------------------------------------------------------


def test_dead_letter_moves_the_message_in_one_transaction(make_message):
    sent = []
    receiver = lambda sender, dead_letter, message_id, **kw: sent.append(message_id)  # noqa: E731
    dead_lettered.connect(receiver)
    try:
        message = make_message(
            payload={"sku": None},
            status=Status.PROCESSING,
            attempts=4,
            priority=3,
            headers={"trace": "abc"},
            first_failed_at=NOW - 60 * SECOND,
            group_key="g",
        )
        with transaction.atomic():
            dead = lifecycle.dead_letter(
                message,
                Category.PERMANENT,
                "KeyError: 'sku'",
                "Traceback ...",
                worker="w9",
                now=NOW,
            )
            assert sent == [], "signal before commit"
        assert sent == [message.pk]
    finally:
        dead_lettered.disconnect(receiver)
    assert reread(message) is None
    row = DeadLetter.objects.get()
    assert row.pk == dead.pk and row.message_id == message.pk
    assert (row.topic, row.queue, row.payload, row.headers) == (
        "test.record",
        "default",
        {"sku": None},
        {"trace": "abc"},
    )
    assert (row.category, row.reason, row.traceback) == (
        "permanent",
        "KeyError: 'sku'",
        "Traceback ...",
    )
    assert (row.attempts, row.priority, row.group_key, row.worker) == (4, 3, "g", "w9")
    assert row.first_failed_at == NOW - 60 * SECOND and row.last_failed_at == NOW
    assert row.state == "new"


def test_dead_letter_is_a_no_op_for_a_message_no_longer_held(make_message):
    message = make_message(status=Status.PROCESSING)
    message.lease_token = uuid.uuid4()
    assert lifecycle.dead_letter(message, Category.PERMANENT, "x") is None
    assert reread(message) is not None and not DeadLetter.objects.exists()


def test_dead_letter_failure_midway_leaves_the_message_in_the_queue(make_message, monkeypatch):
    message = make_message(status=Status.PROCESSING)

    def broken_delete(*args, **kwargs):
        raise RuntimeError("crash between the insert and the delete")

    monkeypatch.setattr("django.db.models.query.QuerySet.delete", broken_delete)
    with pytest.raises(RuntimeError):
        lifecycle.dead_letter(message, Category.PERMANENT, "x")
    monkeypatch.undo()
    assert reread(message).status == Status.PROCESSING, "never in neither table"
    assert not DeadLetter.objects.exists(), "never in both tables"


# --- rescue -------------------------------------------------------------------


def test_rescue_returns_expired_leases_and_leaves_live_ones(make_message):
    expired = make_message(
        status=Status.PROCESSING, lease_expires_at=NOW - SECOND, attempts=1, locked_by="dead-worker"
    )
    live = make_message(status=Status.PROCESSING, lease_expires_at=NOW + SECOND)
    on_the_edge = make_message(status=Status.PROCESSING, lease_expires_at=NOW)
    waiting = make_message(run_at=NOW - 60 * SECOND)
    result = maintenance.rescue_expired(now=NOW)
    assert result == maintenance.RescueResult(requeued=1, dead_lettered=0)
    row = reread(expired)
    assert (row.status, row.attempts, row.lease_token) == (Status.WAITING, 1, None)
    assert row.last_error == "worker lost: the lease of dead-worker expired"
    assert row.last_error_category == Category.TRANSIENT
    assert row.first_failed_at == NOW and row.run_at == NOW
    assert reread(live).status == Status.PROCESSING
    assert reread(on_the_edge).status == Status.PROCESSING, "expiry is strict"
    assert reread(waiting).run_at == NOW - 60 * SECOND


def test_rescue_dead_letters_a_message_that_used_its_last_attempt(make_message):
    last = make_message(
        status=Status.PROCESSING,
        lease_expires_at=NOW - SECOND,
        attempts=3,
        max_attempts=3,
        locked_by="w",
    )
    assert maintenance.rescue_expired(now=NOW) == maintenance.RescueResult(0, 1)
    assert reread(last) is None
    dead = DeadLetter.objects.get(message_id=last.pk)
    assert dead.category == "transient"
    assert "worker lost" in dead.reason and "last of 3 attempts" in dead.reason


def test_rescue_leaves_alone_a_message_that_is_being_acknowledged(make_message):
    message = make_message(status=Status.PROCESSING, lease_expires_at=NOW - SECOND)
    with raw_connection() as acking:  # the late worker's ack holds the row
        acking.execute("DELETE FROM django_pgqueue_message WHERE id = %s", [message.pk])
        assert maintenance.rescue_expired(now=NOW) == maintenance.RescueResult(0, 0)
        acking.commit()
    assert reread(message) is None, "the ack won; the rescue did not resurrect the message"


def test_a_rescued_run_sends_message_retried_after_the_commit(make_message):
    lost = make_message(
        status=Status.PROCESSING, lease_expires_at=NOW - SECOND, attempts=2, locked_by="gone"
    )
    got = []

    def receive(sender, message, **kwargs):
        # Sent after the commit: another connection sees the rescued row.
        with raw_connection() as other:
            status = other.execute(
                "SELECT status FROM django_pgqueue_message WHERE id = %s", [message.pk]
            ).fetchone()[0]
        got.append((sender, message.pk, message.attempts, status, kwargs))

    message_retried.connect(receive, weak=False)
    try:
        assert maintenance.run_once(now=NOW).rescued == 1
    finally:
        message_retried.disconnect(receive)
    [(sender, pk, attempts, status, kwargs)] = got
    assert (sender, pk, attempts, status) == (Message, lost.pk, 2, Status.WAITING)
    assert kwargs["lost"] is True and kwargs["worker"] == "gone"
    assert kwargs["category"] == Category.TRANSIENT and kwargs["delay"] == 0
    assert kwargs["reason"] == "worker lost: the lease of gone expired"


def test_a_processing_row_without_a_lease_is_refused_by_the_database(make_message):
    from django.db import IntegrityError

    leased = make_message(status=Status.PROCESSING)
    for column in ("lease_token", "lease_expires_at"):
        with pytest.raises(IntegrityError, match="pgqueue_msg_processing_has_lease"):
            with transaction.atomic():
                Message.objects.filter(pk=leased.pk).update(**{column: None})
    with pytest.raises(IntegrityError, match="pgqueue_msg_processing_has_lease"):
        with transaction.atomic():
            make_message(status=Status.PROCESSING, lease_token=None)
    waiting = make_message()
    assert (waiting.lease_token, waiting.lease_expires_at) == (None, None), "only leased rows"


@pytest.mark.parametrize("missing", ["lease_expires_at", "lease_token", "both"])
def test_rescue_treats_a_processing_row_without_a_lease_as_expired(make_message, missing):
    # Such a row predates the constraint (or was written with it dropped):
    # the table is made to hold one, in this test's transaction only.
    with transaction.atomic():
        with connections["default"].cursor() as cursor:
            cursor.execute(
                "ALTER TABLE django_pgqueue_message "
                "DROP CONSTRAINT pgqueue_msg_processing_has_lease"
            )
        orphan = make_message(status=Status.PROCESSING, attempts=1, locked_by="restored")
        cleared = ["lease_expires_at", "lease_token"] if missing == "both" else [missing]
        Message.objects.filter(pk=orphan.pk).update(**dict.fromkeys(cleared))
        live = make_message(status=Status.PROCESSING, lease_expires_at=NOW + 60 * SECOND)
        assert maintenance.rescue_expired(now=NOW) == maintenance.RescueResult(1, 0)
        row = reread(orphan)
        assert (row.status, row.attempts, row.lease_token) == (Status.WAITING, 1, None)
        assert row.last_error.startswith("lease missing: processing without a lease")
        assert reread(live).status == Status.PROCESSING
        transaction.set_rollback(True)  # the constraint comes back


def test_migration_0013_gives_leaseless_rows_an_expired_lease_for_the_rescue():
    from django.db.migrations.executor import MigrationExecutor

    connection = connections["default"]
    executor = MigrationExecutor(connection)
    latest = executor.loader.graph.leaf_nodes("django_pgqueue")
    executor.migrate([("django_pgqueue", "0012_queue_index_cleanup")])
    try:
        with connection.cursor() as cursor:
            cursor.execute(
                "INSERT INTO django_pgqueue_message (topic, payload, status, attempts, locked_by)"
                " VALUES ('t', '{}', 'processing', 1, 'old-version') RETURNING id"
            )
            orphan = cursor.fetchone()[0]
    finally:
        executor = MigrationExecutor(connection)
        executor.loader.build_graph()
        executor.migrate(latest)
    row = Message.objects.get(pk=orphan)
    assert row.lease_token is not None and row.lease_expires_at <= timezone.now()
    assert maintenance.rescue_expired().requeued == 1
    row = reread(row)
    assert (row.status, row.attempts) == (Status.WAITING, 1)


@pytest.mark.parametrize("never", ["infinity", "10000-01-01 00:00:00+00"])
def test_a_processing_row_whose_lease_never_expires_is_refused_by_the_database(make_message, never):
    # The rescue finds a dead worker's rows by their lease's expiry: a lease
    # past any date Python can read ('infinity', year 10000) never expires.
    from django.db import IntegrityError

    leased = make_message(status=Status.PROCESSING)
    table = Message._meta.db_table
    with pytest.raises(IntegrityError, match="pgqueue_msg_processing_lease_finite"):
        with transaction.atomic(), connections["default"].cursor() as cursor:
            cursor.execute(
                f"UPDATE {table} SET lease_expires_at = %s::timestamptz WHERE id = %s",
                [never, leased.pk],
            )
    with pytest.raises(IntegrityError, match="pgqueue_msg_processing_lease_finite"):
        with transaction.atomic(), connections["default"].cursor() as cursor:
            cursor.execute(
                f"INSERT INTO {table} (topic, payload, status, lease_token, lease_expires_at)"
                " VALUES ('t', '{}', 'processing', gen_random_uuid(), %s::timestamptz)",
                [never],
            )
    latest = datetime.datetime(9999, 12, 30, tzinfo=datetime.UTC)
    Message.objects.filter(pk=leased.pk).update(lease_expires_at=latest)  # a date, however far
    assert reread(leased).lease_expires_at == latest


def test_migration_0017_expires_a_lease_that_never_would_for_the_rescue():
    from django.db.migrations.executor import MigrationExecutor

    connection = connections["default"]
    executor = MigrationExecutor(connection)
    latest = executor.loader.graph.leaf_nodes("django_pgqueue")
    executor.migrate([("django_pgqueue", "0016_history")])
    try:
        with connection.cursor() as cursor:
            cursor.execute(
                "INSERT INTO django_pgqueue_message"
                " (topic, payload, status, attempts, locked_by, lease_token, lease_expires_at)"
                " VALUES ('t', '{}', 'processing', 1, 'old-client', gen_random_uuid(), 'infinity'),"
                " ('t', '{}', 'processing', 1, 'alive', gen_random_uuid(), now() + '1 hour')"
                " RETURNING id"
            )
            forever, alive = (row[0] for row in cursor.fetchall())
    finally:
        executor = MigrationExecutor(connection)
        executor.loader.build_graph()
        executor.migrate(latest)
    row = Message.objects.get(pk=forever)
    assert row.status == Status.PROCESSING and row.lease_expires_at <= timezone.now()
    assert reread(Message(pk=alive)).lease_expires_at > timezone.now(), "a real lease is kept"
    assert maintenance.rescue_expired().requeued == 1
    row = reread(row)
    assert (row.status, row.attempts) == (Status.WAITING, 1)
    assert row.last_error == "worker lost: the lease of old-client expired"
    assert reread(Message(pk=alive)).status == Status.PROCESSING


def test_rescue_says_when_the_lease_expired_under_a_worker_that_is_alive(make_message):
    from django_pgqueue.models import WorkerHeartbeat

    def beat(worker_id, at):
        WorkerHeartbeat.objects.create(
            worker_id=worker_id,
            hostname="h",
            pid=1,
            queues=["default"],
            concurrency=1,
            heartbeat_at=at,
            expires_at=at + 30 * SECOND,
        )

    # "busy" beat after its lease ran out: alive, the row was locked;
    # "dead" last beat before its lease expired: the worker was lost.
    beat("busy", NOW - SECOND)
    beat("dead", NOW - 20 * SECOND)
    locked = make_message(
        status=Status.PROCESSING, lease_expires_at=NOW - 5 * SECOND, locked_by="busy"
    )
    lost = make_message(
        status=Status.PROCESSING, lease_expires_at=NOW - 5 * SECOND, locked_by="dead"
    )
    assert maintenance.rescue_expired(now=NOW).requeued == 2
    assert reread(locked).last_error.startswith(
        "lease expired: the lease of busy expired while that worker was still alive"
    )
    assert "worker lost" not in reread(locked).last_error
    assert reread(lost).last_error == "worker lost: the lease of dead expired"


def test_maintenance_runs_in_one_worker_at_a_time(make_message):
    make_message(status=Status.PROCESSING, lease_expires_at=NOW - SECOND)
    with raw_connection() as leader:
        leader.execute("SELECT pg_advisory_xact_lock(%s)", [maintenance.MAINTENANCE_LOCK_KEY])
        assert maintenance.run_once(now=NOW) is None, "ran while another worker held the lock"
        assert Message.objects.filter(status=Status.PROCESSING).count() == 1
    assert maintenance.run_once(now=NOW) == maintenance.MaintenanceResult(1, 0)


# --- run now ------------------------------------------------------------------


def test_run_now_clears_the_delay_of_waiting_messages_only(make_message, listener):
    delayed = make_message(run_at=NOW + 3600 * SECOND, queue="mail")
    due = make_message(run_at=NOW - 60 * SECOND)
    leased = make_message(status=Status.PROCESSING, run_at=NOW + 3600 * SECOND)
    listener.wait_for(2)  # the two waiting rows' own notifications
    assert lifecycle.run_now([delayed.pk, due.pk, leased.pk], now=NOW) == 1
    assert reread(delayed).run_at == NOW
    assert reread(due).run_at == NOW - 60 * SECOND, "an already due message keeps its place"
    assert reread(leased).run_at == NOW + 3600 * SECOND
    assert listener.wait_for(1) == [("django_pgqueue", "mail")], "the workers were not woken"


# --- probe --------------------------------------------------------------------


def test_probe_reports_the_next_due_message_and_expired_leases(make_message):
    assert not liveness.probe(["default"]).ready
    make_message(run_at=timezone.now() + 30 * SECOND)
    make_message(run_at=timezone.now() + 10 * SECOND, queue="other")
    found = liveness.probe(["default"])
    assert not found.ready and 29 < found.seconds_until_due() <= 30
    assert 9 < liveness.probe(["default", "other"]).seconds_until_due() <= 10
    assert not found.lease_expired
    make_message(status=Status.PROCESSING, lease_expires_at=timezone.now() - SECOND)
    make_message(run_at=timezone.now() - SECOND)
    found = liveness.probe(["default"])
    assert found.ready and found.lease_expired
    assert Message.objects.filter(~Q(status=Status.WAITING)).count() == 1


def test_the_queue_tables_carry_their_autovacuum_settings():
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT relname, reloptions FROM pg_class "
            "WHERE relname IN ('django_pgqueue_message', 'django_pgqueue_deadletter')"
        )
        options = {name: set(opts or ()) for name, opts in cursor.fetchall()}
    assert {
        "autovacuum_vacuum_scale_factor=0",
        "autovacuum_vacuum_threshold=5000",
        "autovacuum_vacuum_cost_delay=0",
        "fillfactor=50",  # migration 0021
        "vacuum_index_cleanup=on",  # migration 0012
    } <= options["django_pgqueue_message"]
    assert "autovacuum_vacuum_insert_threshold=50000" in options["django_pgqueue_deadletter"]


def test_a_claimed_message_equals_its_row_as_the_orm_reads_it(make_message):
    make_message(payload={"a": [1, "x"]}, headers={"h": "v"}, run_at=NOW - SECOND)
    [claimed] = claim(["default"], 1, "w", 30)
    stored = Message.objects.get(pk=claimed.pk)
    for field in Message._meta.concrete_fields:
        assert getattr(claimed, field.attname) == getattr(stored, field.attname), field.name
    assert claimed.run_at.tzinfo is not None and claimed._state.db == "default"
    assert not claimed._state.adding


def test_a_claimed_message_is_built_through_the_orms_public_path(make_message):
    """message_from_row builds the Message with Model.from_db, as a queryset
    does: __init__ runs, so receivers of post_init see claimed messages too."""
    from django.db.models.signals import post_init

    make_message(run_at=NOW - SECOND)
    seen = []

    def receiver(sender, instance, **kwargs):
        seen.append(instance)

    post_init.connect(receiver, sender=Message)
    try:
        [claimed] = claim(["default"], 1, "w", 30)
    finally:
        post_init.disconnect(receiver, sender=Message)
    assert seen == [claimed] and seen[0] is claimed


def test_message_from_db_shortcut_holds_what_django_builds(make_message):
    """Message.from_db skips __init__ only where that cannot differ: no field
    of Message is a relation (a foreign key's attname has a setter __init__
    would run), a partial row (only()) takes Django's path and defers the
    rest, and the full row gives the same values and state as __init__."""
    assert not any(field.is_relation for field in Message._meta.concrete_fields)
    made = make_message(run_at=NOW - SECOND)
    partial = Message.objects.only("topic").get(pk=made.pk)
    assert partial.get_deferred_fields() >= {"payload", "status"}
    assert partial.status == made.status  # loaded on access, as Django does

    row = [getattr(made, field.attname) for field in Message._meta.concrete_fields]
    attnames = [field.attname for field in Message._meta.concrete_fields]
    fast = Message.from_db("default", attnames, row)
    slow = Message(*row)
    assert {name: getattr(fast, name) for name in attnames} == {
        name: getattr(slow, name) for name in attnames
    }
    assert (fast._state.db, fast._state.adding) == ("default", False)
    assert fast.get_deferred_fields() == set()
    assert fast == slow and hash(fast) == hash(slow)
