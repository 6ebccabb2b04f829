"""The history of finished messages (KEEP_FINISHED): what the worker's
acknowledgements, retries, dead-lettering and cancellations record, with
the right times and attempts, in the transaction that finishes the message;
and nothing at all, the statements unchanged, when it is off."""

import datetime
import time

import pytest
from django.db import connection, transaction
from django.test import override_settings
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from django_pgqueue import enqueue, lifecycle
from django_pgqueue.models import (
    DeadLetter,
    FinishedMessage,
    Message,
    Outcome,
    OutcomeCount,
    Status,
)
from django_pgqueue.sql import acks as acks_sql
from django_pgqueue.sql import history as history_sql
from django_pgqueue.worker import Worker

pytestmark = pytest.mark.django_db(transaction=True)


def counts():
    """{(queue, outcome): count} over every minute."""
    result = {}
    for queue, outcome, count in OutcomeCount.objects.values_list("queue", "outcome", "count"):
        result[(queue, outcome)] = result.get((queue, outcome), 0) + count
    return result


def run_until_empty(timeout=60.0):
    """Burst workers until no message is left (retries wait their backoff)."""
    deadline = time.monotonic() + timeout
    while Message.objects.exclude(status=Status.CANCELLED).exists():
        assert time.monotonic() < deadline, "messages left after the timeout"
        Worker(
            queues=["default", "mail"], concurrency=2, burst=True, worker_id="history-worker"
        ).run()
        time.sleep(0.05)


@pytest.mark.parametrize("topic", ["test.record", "test.record_nonatomic"])
def test_a_done_message_is_kept_with_its_times_and_worker(topic):
    before = timezone.now()
    message = enqueue(topic, {"user": 42}, headers={"h": "v"}, dedup_key="welcome-42")
    Worker(concurrency=2, burst=True, worker_id="history-worker").run()
    after = timezone.now()
    row = FinishedMessage.objects.get(message_id=message.pk)
    assert (row.topic, row.queue, row.outcome, row.attempts) == (topic, "default", "done", 1)
    assert (row.payload, row.headers["h"], row.dedup_key) == ({"user": 42}, "v", "welcome-42")
    assert row.worker == "history-worker"
    assert row.dead_letter_id is None
    assert row.enqueued_at == Message._meta.get_field("created_at").to_python(row.enqueued_at)
    assert before <= row.enqueued_at <= row.started_at <= row.finished_at <= after
    assert 0 <= row.duration < (after - before).total_seconds()
    assert counts() == {("default", "done"): 1}


def test_retried_then_done_counts_the_retry_and_keeps_one_row_with_both_attempts():
    # Retry(after=0.1): a fixed wait (the handler's backoff has full jitter,
    # which may draw next to nothing).
    message = enqueue("test.fail", {"times": 1, "after": 0.1})
    run_until_empty()
    rows = list(FinishedMessage.objects.filter(message_id=message.pk))
    assert len(rows) == 1
    row = rows[0]
    assert (row.outcome, row.attempts) == (Outcome.DONE, 2)
    # Started is the claim of the last run, after the first run's wait.
    assert row.started_at - row.enqueued_at >= datetime.timedelta(seconds=0.05)
    assert counts() == {("default", "retried"): 1, ("default", "done"): 1}


def test_a_dead_lettered_message_links_its_dead_letter():
    message = enqueue("test.fail", {"raise": "ConnectionError"}, max_attempts=2, queue="mail")
    run_until_empty()
    dead = DeadLetter.objects.get(message_id=message.pk)
    row = FinishedMessage.objects.get(message_id=message.pk)
    assert (row.outcome, row.attempts, row.queue) == (Outcome.DEAD_LETTERED, 2, "mail")
    assert row.dead_letter_id == dead.pk
    assert row.finished_at == dead.dead_lettered_at
    assert row.started_at is not None and row.started_at <= row.finished_at
    assert row.worker == "history-worker"
    assert counts() == {("mail", "retried"): 1, ("mail", "dead_lettered"): 1}


def test_cancelled_messages_are_kept_waiting_ones_without_a_start(make_message):
    waiting = enqueue("test.record", {"n": 1})
    started = timezone.now() - datetime.timedelta(seconds=30)
    running = make_message(status=Status.PROCESSING, updated_at=started)
    lifecycle.cancel([waiting.pk, running.pk])
    assert lifecycle.cancel_running(Message.objects.get(pk=running.pk), worker="w1")
    rows = {row.message_id: row for row in FinishedMessage.objects.all()}
    assert rows[waiting.pk].outcome == Outcome.CANCELLED
    assert rows[waiting.pk].started_at is None and rows[waiting.pk].duration is None
    assert rows[running.pk].outcome == Outcome.CANCELLED
    assert rows[running.pk].started_at == started
    assert rows[running.pk].worker == "w1"
    assert counts() == {("default", "cancelled"): 2}


def test_the_ack_records_the_claim_time_and_the_statement_time(make_message):
    claimed = timezone.now() - datetime.timedelta(seconds=5)
    message = make_message(status=Status.PROCESSING, updated_at=claimed, attempts=3)
    before = timezone.now()
    assert lifecycle.ack_leased([message]) == {message.pk}
    row = FinishedMessage.objects.get(message_id=message.pk)
    assert (row.started_at, row.attempts) == (claimed, 3)
    assert before <= row.finished_at <= timezone.now()
    assert row.duration == pytest.approx(5, abs=1)


def test_a_rolled_back_ack_leaves_no_history(make_message):
    message = make_message(status=Status.PROCESSING)
    with pytest.raises(RuntimeError), transaction.atomic():
        assert lifecycle.ack(message)
        assert FinishedMessage.objects.filter(message_id=message.pk).exists()
        raise RuntimeError("the handler's transaction fails after the ack")
    assert not FinishedMessage.objects.exists() and not OutcomeCount.objects.exists()
    assert Message.objects.filter(pk=message.pk, status=Status.PROCESSING).exists()


def test_a_lost_lease_records_nothing(make_message):
    message = make_message(status=Status.PROCESSING)
    Message.objects.filter(pk=message.pk).update(lease_token=None, status=Status.WAITING)
    assert lifecycle.ack_leased([message]) == set()
    assert not FinishedMessage.objects.exists() and not OutcomeCount.objects.exists()


def test_the_ack_is_one_statement_with_the_history(make_message):
    messages = [make_message(status=Status.PROCESSING) for _ in range(3)]
    with CaptureQueriesContext(connection) as queries:
        finished, busy = lifecycle.ack_unlocked(messages)
    assert finished == {m.pk for m in messages} and busy == set()
    assert len(queries) == 1, [q["sql"] for q in queries]
    assert "INSERT INTO" in queries[0]["sql"] and "DELETE FROM" in queries[0]["sql"]
    assert FinishedMessage.objects.count() == 3
    assert counts() == {("default", "done"): 3}


@override_settings(PGQUEUE={"KEEP_FINISHED": 0})
def test_with_keep_finished_0_the_statements_are_the_old_ones_and_nothing_is_kept(
    make_message,
):
    ids = {None: [1, 2]}
    assert history_sql.ack_statement(connection, ids) == acks_sql.ack_statement(connection, ids)
    assert history_sql.ack_statement(connection, ids, True) == acks_sql.ack_statement(
        connection, ids, True
    )
    enqueue("test.record", {})
    enqueue("test.record_nonatomic", {})
    enqueue("test.fail", {"raise": "ValueError"}, max_attempts=1)
    lifecycle.cancel(enqueue("test.record", {}))
    Worker(concurrency=2, burst=True).run()
    assert DeadLetter.objects.count() == 1
    assert not FinishedMessage.objects.exists() and not OutcomeCount.objects.exists()


def test_counts_of_several_queues_in_one_batch_add_up(make_message):
    rows = [make_message(status=Status.PROCESSING, queue=q) for q in ["b", "a", "b", "a", "a"]]
    lifecycle.ack_leased(rows[:3])
    lifecycle.ack_leased(rows[3:])
    assert counts() == {("a", "done"): 3, ("b", "done"): 2}
    # One row per (minute, queue, outcome), whatever the number of batches.
    assert OutcomeCount.objects.count() <= 4


def test_two_connections_counting_the_same_minute_never_wait_for_each_other(
    make_message, other_connection
):
    """An atomic batch's acknowledgement holds its count row until its commit
    (after the WAL flush): another connection's acknowledgement of the same
    queue and minute must not wait for it (each connection has its row)."""
    first = make_message(status=Status.PROCESSING)
    second = make_message(status=Status.PROCESSING)
    statement, params = history_sql.ack_statement(connection, {first.lease_token: [first.pk]})
    with other_connection.transaction():
        assert len(other_connection.execute(statement, params).fetchall()) == 1
        # Not committed yet: its count row is locked until it does.
        with connection.cursor() as cursor:
            cursor.execute("SET lock_timeout = '2s'")
        try:
            started = time.monotonic()
            assert lifecycle.ack_leased([second]) == {second.pk}
            assert time.monotonic() - started < 1.5
        finally:
            with connection.cursor() as cursor:
                cursor.execute("RESET lock_timeout")
    assert counts() == {("default", "done"): 2}


def test_the_history_indexes_are_brin_without_django_contrib_postgres():
    """fields.BrinIndex: the history's summaries of page ranges, built as
    migration 0016 declares them, and a bad range size refused up front."""
    from django_pgqueue.fields import BrinIndex

    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT indexname, indexdef FROM pg_indexes WHERE tablename = %s AND indexname"
            " LIKE %s ORDER BY indexname",
            [FinishedMessage._meta.db_table, "%brin"],
        )
        found = cursor.fetchall()
    assert [name for name, _ in found] == [
        "pgqueue_hist_finished_brin",
        "pgqueue_hist_message_brin",
    ]
    assert all("USING brin" in sql and "pages_per_range='32'" in sql for _, sql in found), found
    for size in (0, -1):
        with pytest.raises(ValueError, match="pages_per_range must be a positive integer"):
            BrinIndex(fields=["finished_at"], name="x", pages_per_range=size)
    index = BrinIndex(fields=["finished_at"], name="x", pages_per_range=8)
    assert index.deconstruct()[2]["pages_per_range"] == 8
