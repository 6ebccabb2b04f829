"""Real `manage.py pgqueue_worker` processes: many workers, kill -9, SIGTERM,
connections terminated by the server, and the failure policy end to end."""

import collections
import signal
import time

import pytest
from demo.models import Handled

from django_pgqueue import enqueue, enqueue_many
from django_pgqueue.models import DeadLetter, Message, Status

from .conftest import InvariantChecker, raw_connection, wait_until

pytestmark = pytest.mark.slow


def handled_counts():
    return collections.Counter(Handled.objects.values_list("message_id", flat=True))


def test_three_workers_handle_2000_messages_exactly_once(start_worker):
    ids = [
        m.pk
        for m in enqueue_many([{"payload": {"n": n}} for n in range(2000)], topic="test.record")
    ]
    invariant = InvariantChecker(ids)
    workers = [
        start_worker(
            "--burst", "--concurrency", "4", "--batch-size", "20", "--log-level", "WARNING"
        )
        for _ in range(3)
    ]
    for worker in workers:
        assert worker.wait(timeout=120) == 0, worker.log()
    invariant.stop()
    counts = handled_counts()
    assert set(counts) == set(ids), f"{len(set(ids) - set(counts))} message(s) never handled"
    assert set(counts.values()) == {1}, "some message was handled twice"
    assert not Message.objects.exists() and not DeadLetter.objects.exists()
    pids = set(Handled.objects.values_list("pid", flat=True))
    assert len(pids) >= 2, "the workers did not share the work"


def test_kill_9_mid_handler_the_message_is_rescued_and_its_writes_appear_once(start_worker):
    # test.sleep writes its ledger row, then sleeps: the kill lands while that
    # write is uncommitted. With --lease 2 the message is rescued within seconds.
    message = enqueue("test.sleep", {"seconds": 60, "then": 0})
    victim = start_worker("--lease", "2", "--concurrency", "1")
    wait_until(
        lambda: Message.objects.filter(pk=message.pk, status=Status.PROCESSING).exists(),
        timeout=60,
        message="the first worker to take the message",
    )
    invariant = InvariantChecker([message.pk])
    victim.signal(signal.SIGKILL)
    victim.wait(timeout=10)
    row = Message.objects.get(pk=message.pk)
    assert (row.status, row.attempts) == (Status.PROCESSING, 1), "leased to the dead worker"
    assert not Handled.objects.exists(), "the killed handler's write was committed"

    rescuer = start_worker("--lease", "2", "--concurrency", "1", "--poll-interval", "0.5")
    wait_until(
        lambda: Handled.objects.filter(message_id=message.pk).exists(),
        timeout=60,
        message="the rescued message to be handled",
    )
    wait_until(lambda: not Message.objects.exists(), timeout=60)
    invariant.stop()
    assert list(Handled.objects.values_list("attempt", flat=True)) == [2], "exactly once"
    assert "rescued: worker lost" in rescuer.log()


def test_sigterm_lets_a_slow_handler_finish_and_exits_0(start_worker):
    message = enqueue("test.sleep", {"seconds": 2})
    worker = start_worker("--concurrency", "2", "--shutdown-timeout", "30")
    # The handler runs: its ledger row written in its transaction, it sleeps.
    # (PROCESSING alone is the claim: a SIGTERM before a thread starts the
    # message hands it back unstarted, which is another test's case.)
    with raw_connection(autocommit=True) as watcher:
        wait_until(
            lambda: watcher.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                " AND state = 'idle in transaction' AND query LIKE %s",
                [f'%INSERT INTO "{Handled._meta.db_table}"%'],
            ).fetchone()[0],
            timeout=60,
            message="the handler to be running",
        )
    worker.signal(signal.SIGTERM)
    assert worker.wait(timeout=60) == 0, worker.log()
    assert handled_counts() == {message.pk: 1}
    assert not Message.objects.exists(), "something was left leased or queued"
    assert "SIGTERM received, finishing in-flight messages" in worker.log()


def test_a_second_signal_exits_at_once_and_the_lease_brings_the_message_back(start_worker):
    message = enqueue("test.sleep", {"seconds": 60, "then": 0})
    worker = start_worker("--lease", "2", "--concurrency", "1")
    wait_until(
        lambda: Message.objects.filter(pk=message.pk, status=Status.PROCESSING).exists(), timeout=60
    )
    worker.signal(signal.SIGTERM)
    wait_until(lambda: "SIGTERM received" in worker.log(), timeout=60)
    worker.signal(signal.SIGINT)
    assert worker.wait(timeout=60) != 0
    assert Message.objects.get(pk=message.pk).status == Status.PROCESSING
    start_worker("--lease", "2", "--poll-interval", "0.5")
    wait_until(lambda: not Message.objects.exists(), timeout=60)
    assert list(Handled.objects.values_list("attempt", flat=True)) == [2]


def test_terminated_database_connections_are_survived_and_nothing_is_lost(start_worker):
    worker = start_worker("--concurrency", "4", "--poll-interval", "0.5", "--lease", "5")
    wait_until(lambda: backends_of(worker), timeout=60, message="the worker to connect")
    ids = []
    for batch in range(20):
        ids += [m.pk for m in enqueue_many([{"payload": {"b": batch}}] * 10, topic="test.record")]
        if batch == 8:
            invariant = InvariantChecker(ids)
        if batch in (10, 15):
            # The second cut waits for the worker to have reconnected.
            wait_until(lambda: backends_of(worker), timeout=60, message="the worker to reconnect")
            with raw_connection(autocommit=True) as admin:
                killed = [
                    row[0]
                    for row in admin.execute(
                        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                        "WHERE application_name LIKE %s",
                        [f"pgqueue_%#{worker.pid}"],
                    )
                ]
            assert killed, "no worker connection was found to terminate"
        time.sleep(0.05)
    invariant.ids = ids
    wait_until(
        lambda: len(handled_counts()) == len(ids), timeout=60, message="every message to be handled"
    )
    invariant.stop()
    assert set(handled_counts().values()) == {1}
    assert not Message.objects.exists() and not DeadLetter.objects.exists()
    assert worker.popen.poll() is None, "the worker died"
    log = worker.log()
    assert "listener: " in log and "reconnecting" in log, "the listener was not cut off"
    worker.signal(signal.SIGTERM)
    assert worker.wait(timeout=30) == 0


def backends_of(worker):
    with raw_connection(autocommit=True) as conn:
        return [
            row[0]
            for row in conn.execute(
                "SELECT application_name FROM pg_stat_activity WHERE application_name LIKE %s",
                [f"pgqueue_%#{worker.pid}"],
            )
        ]


def test_the_worker_names_its_connections(start_worker):
    worker = start_worker("--concurrency", "2")
    expected = {f"pgqueue_worker#{worker.pid}", f"pgqueue_listener#{worker.pid}"}
    wait_until(
        lambda: set(backends_of(worker)) == expected,
        timeout=60,
        message=f"connections named {expected} in pg_stat_activity",
    )


def test_failure_policy_end_to_end(start_worker):
    retried = enqueue("test.fail", {"raise": "TimeoutError", "times": 1})
    asked = enqueue("test.fail", {"after": 1, "times": 1})
    permanent = enqueue("test.fail", {"raise": "Permanent"})
    business = enqueue("test.fail", {"raise": "ValidationError"})
    exhausted = enqueue("test.fail", {"raise": "RuntimeError"}, max_attempts=3)
    start_worker("--poll-interval", "0.2", "--concurrency", "4")
    wait_until(
        lambda: DeadLetter.objects.count() == 3 and handled_counts().total() == 2,
        timeout=60,
        message="three dead letters and two handled retries",
    )
    dead = {d.message_id: d for d in DeadLetter.objects.all()}
    assert (dead[permanent.pk].category, dead[permanent.pk].attempts) == ("permanent", 1)
    assert (dead[business.pk].category, dead[business.pk].attempts) == ("business", 1)
    assert (dead[exhausted.pk].category, dead[exhausted.pk].attempts) == ("unknown", 3)
    handled = {h.message_id: h for h in Handled.objects.all()}
    assert handled[retried.pk].attempt == 2 and handled[asked.pk].attempt == 2
    # Retry(after=1): the second attempt started at least a second after the
    # message was created (the first attempt came after that).
    assert (handled[asked.pk].handled_at - asked.created_at).total_seconds() >= 1.0
    assert not Message.objects.exists()
