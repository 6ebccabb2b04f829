"""The Worker in-process against the real database: the handlers of the demo
app (testproject/demo/handlers.py), real threads and connections."""

import collections
import logging
import threading
import time

import pytest
from demo.models import Handled
from django.db import connections
from django.db.backends import utils as backend_utils
from django.test import override_settings

from django_pgqueue import enqueue, enqueue_many, handler, registry
from django_pgqueue.models import DeadLetter, Message, Status
from django_pgqueue.worker import Worker

from .conftest import raw_connection, running_worker, wait_until

pytestmark = pytest.mark.django_db(transaction=True)


def handled_ids():
    return collections.Counter(Handled.objects.values_list("message_id", flat=True))


def test_a_worker_refuses_to_run_inside_a_transaction():
    from django.db import transaction

    with transaction.atomic(), pytest.raises(RuntimeError, match="inside a transaction"):
        Worker(burst=True).run()


def test_burst_handles_every_ready_message_once_and_exits():
    messages = enqueue_many([{"payload": {}}] * 30, topic="test.record")
    messages += enqueue_many([{"payload": {}}] * 10, topic="test.record_nonatomic")
    messages.append(enqueue("test.async", {}))
    messages.append(enqueue("test.record", {}, delay=3600))  # not ready: left alone
    processed = Worker(concurrency=4, burst=True).run()
    assert processed == 41
    assert handled_ids() == {m.pk: 1 for m in messages[:41]}
    assert list(Message.objects.values_list("pk", flat=True)) == [messages[-1].pk]


def test_a_burst_worker_exits_as_soon_as_its_acknowledgements_are_flushed():
    enqueue_many([{"payload": {}}] * 20, topic="test.record_nonatomic")
    started = time.monotonic()
    Worker(concurrency=4, burst=True, poll_interval=60).run()
    assert Handled.objects.count() == 20 and not Message.objects.exists()
    assert time.monotonic() - started < 30, "the worker waited for its poll to exit"


def test_a_burst_worker_does_not_exit_on_a_probe_older_than_a_retry(monkeypatch):
    """A probe that reads the queue while a handler still runs is stale once
    that handler has recorded a retry due at once: the burst worker must not
    exit on it. The probe here returns only after the handler's run has
    ended (its retry committed), which is the window a loaded machine opens
    by chance; the retried message is then run again, and the worker exits
    once it is done."""
    from django_pgqueue import Retry, liveness
    from django_pgqueue.worker.executor import Executor

    runs = []
    ended = threading.Event()

    @handler("test.retry_once_at_once", atomic=False)
    def retry_once_at_once(message):
        runs.append(message.attempts)
        if message.attempts == 1:
            started.set()
            assert probed.wait(10), "the worker's probe did not run during the handler"
            raise Retry("once more, at once", after=0)

    started, probed = threading.Event(), threading.Event()
    real_probe = liveness.probe

    def probe_that_reads_during_the_run(*args, **kwargs):
        found = real_probe(*args, **kwargs)
        if started.is_set() and not probed.is_set():
            probed.set()  # read while the handler runs: the message is processing
            # Return once the handler's run has ended (its retry committed).
            wait_until(ended.is_set, timeout=60, message="the first run to end")
        return found

    real_finished = Executor.finished

    def finished(self, job, outcome):
        real_finished(self, job, outcome)
        if job.message.attempts == 1:
            ended.set()

    monkeypatch.setattr(liveness, "probe", probe_that_reads_during_the_run)
    monkeypatch.setattr(Executor, "finished", finished)
    try:
        message = enqueue("test.retry_once_at_once", {})
        Worker(concurrency=2, burst=True, poll_interval=60).run()
    finally:
        registry.unregister("test.retry_once_at_once")
    assert probed.is_set(), "the probe never ran while the handler did: the test proves nothing"
    assert runs == [1, 2], f"the retry due at once was not run before the worker exited: {runs}"
    assert not Message.objects.filter(pk=message.pk).exists()


@pytest.fixture
def failing_acknowledgements():
    """The first ``count`` acknowledgements sent one way fail with a real
    database error (a trigger; its sequence survives the rollback): those
    carried by the claim's round trip (their query also holds the claim's
    UPDATE), or those sent alone (by a handler thread once a batch's worth
    is waiting, or by the main loop's timed flush)."""
    created = []

    def install(count, carried_by_claim):
        test = "> 0" if carried_by_claim else "= 0"
        with raw_connection(autocommit=True) as conn:
            conn.execute("CREATE SEQUENCE test_ack_failures")
            conn.execute(
                f"""CREATE FUNCTION test_fail_ack() RETURNS trigger LANGUAGE plpgsql AS $$
                BEGIN
                    IF position('AS m SET' IN current_query()) {test}
                            AND nextval('test_ack_failures') <= {int(count)} THEN
                        RAISE EXCEPTION 'injected acknowledgement failure';
                    END IF;
                    RETURN NULL;
                END $$"""
            )
            conn.execute(
                "CREATE TRIGGER test_fail_ack BEFORE DELETE ON django_pgqueue_message"
                " FOR EACH STATEMENT EXECUTE FUNCTION test_fail_ack()"
            )
        created.append(True)

    yield install
    if created:
        with raw_connection(autocommit=True) as conn:
            conn.execute("DROP TRIGGER test_fail_ack ON django_pgqueue_message")
            conn.execute("DROP FUNCTION test_fail_ack()")
            conn.execute("DROP SEQUENCE test_ack_failures")


@pytest.mark.parametrize("carried_by_claim", [True, False])
def test_failed_acknowledgements_are_sent_again_and_nothing_runs_twice(
    failing_acknowledgements, caplog, carried_by_claim
):
    failing_acknowledgements(3, carried_by_claim)
    messages = enqueue_many([{"payload": {}}] * 60, topic="test.record_nonatomic")
    with running_worker(concurrency=2, batch_size=5, poll_interval=0.2):
        wait_until(
            lambda: not Message.objects.exists(), timeout=60, message="every acknowledgement"
        )
    assert handled_ids() == {m.pk: 1 for m in messages}
    # Each failure logged once: by the claim that carried it, or (sent alone)
    # by the handler thread or the main loop's timed flush, whichever sent it.
    assert caplog.text.count("injected acknowledgement failure") == 3, caplog.text


def test_a_failed_acknowledgement_of_workflow_steps_is_sent_again_with_their_bookkeeping(
    failing_acknowledgements, caplog
):
    # atomic=False steps: their acknowledgement and their steps' bookkeeping
    # are one transaction of their own; the first three fail (the injected
    # error in the DELETE) and roll back together, then are sent again.
    from django_pgqueue import Workflow

    failing_acknowledgements(3, carried_by_claim=False)
    wf = Workflow(name="acks")
    parts = [wf.add("wf.value_nonatomic", {"value": i}, name=f"part-{i}") for i in range(20)]
    wf.add("wf.sum", {}, name="join", after=parts)
    run = wf.enqueue()
    with running_worker(concurrency=2, batch_size=5, poll_interval=0.2):
        wait_until(lambda: run.status() == "done", message="the workflow done")
    assert caplog.text.count("injected acknowledgement failure") == 3, caplog.text
    assert Handled.objects.filter(topic="wf.sum").count() == 1
    assert run.result("join") == {
        "sum": sum(range(20)),
        "saw": sorted(f"part-{i}" for i in range(20)),
    }


def test_priority_decides_the_order():
    low = enqueue("test.record", {}, priority=-5)
    high = enqueue("test.record", {}, priority=5)
    mid = enqueue("test.record", {})
    Worker(concurrency=1, burst=True).run()
    order = list(Handled.objects.order_by("id").values_list("message_id", flat=True))
    assert order == [high.pk, mid.pk, low.pk]


@override_settings(PGQUEUE={"BACKOFF_JITTER": False})
def test_retry_timing_follows_the_policy():
    # test.fail: backoff_base 0.05 s, backoff_cap 0.2 s; DEPENDENCY backs off
    # 5x longer: 0.25 s, capped to 0.2 s.
    dependency = enqueue("test.fail", {"raise": "ConnectionError", "times": 5})
    asked = enqueue("test.fail", {"after": 30, "times": 5})
    Worker(concurrency=2, burst=True).run()  # one attempt each; the retries are not due yet
    row = Message.objects.get(pk=dependency.pk)
    assert (row.status, row.attempts, row.last_error_category) == ("waiting", 1, "dependency")
    assert (row.run_at - row.updated_at).total_seconds() == pytest.approx(0.2)
    assert row.last_error.startswith("ConnectionError: downstream is down")
    assert "Traceback" in row.last_error
    row = Message.objects.get(pk=asked.pk)
    assert (row.run_at - row.updated_at).total_seconds() == pytest.approx(30)
    assert row.last_error.startswith("Retry: asked to retry")


def test_a_transient_failure_is_retried_until_it_succeeds():
    message = enqueue("test.fail", {"raise": "TimeoutError", "times": 2})
    with running_worker(concurrency=1, poll_interval=0.2):
        wait_until(lambda: Handled.objects.filter(message_id=message.pk).exists(), timeout=60)
    assert list(Handled.objects.values_list("attempt", flat=True)) == [3]
    assert not Message.objects.exists() and not DeadLetter.objects.exists()


def broken_classifier(exc, message):
    raise RuntimeError("the classifier itself is broken")


@override_settings(PGQUEUE={"CLASSIFIER": broken_classifier})
def test_a_broken_classifier_loses_nothing_the_failure_counts_as_unknown():
    message = enqueue("test.fail", {"raise": "ValueError", "times": 5})
    # One attempt only: the retry is due within milliseconds (backoff 0.05s).
    Worker(concurrency=1, burst=True, max_messages=1).run()
    row = Message.objects.get(pk=message.pk)
    assert (row.status, row.attempts, row.last_error_category) == ("waiting", 1, "unknown")
    assert not DeadLetter.objects.exists()


def test_permanent_and_business_failures_go_straight_to_the_dead_letters():
    permanent = enqueue("test.fail", {"raise": "Permanent"})
    business = enqueue("test.fail", {"raise": "ValidationError"})
    malformed = enqueue("test.fail", {"raise": "ValueError"})
    nobody = enqueue("nobody.handles", {"x": 1})
    Worker(concurrency=2, burst=True).run()
    dead = {d.message_id: d for d in DeadLetter.objects.all()}
    assert (dead[permanent.pk].category, dead[permanent.pk].attempts) == ("permanent", 1)
    assert dead[permanent.pk].reason == "Permanent: cannot ever work"
    assert (dead[business.pk].category, dead[business.pk].attempts) == ("business", 1)
    assert dead[malformed.pk].category == "permanent"
    assert dead[nobody.pk].category == "permanent"
    assert "no handler for topic 'nobody.handles'" in dead[nobody.pk].reason
    assert dead[nobody.pk].payload == {"x": 1}
    assert 'raise FAILURES[message.payload.get("raise"' in dead[permanent.pk].traceback
    assert not Message.objects.exists()


@override_settings(PGQUEUE={"MAX_ATTEMPTS": 3})
def test_exhausted_attempts_land_in_the_dead_letters_with_the_last_category():
    message = enqueue("test.fail", {"raise": "RuntimeError"})
    with running_worker(concurrency=1, poll_interval=0.2):
        wait_until(lambda: DeadLetter.objects.exists(), timeout=60)
    dead = DeadLetter.objects.get()
    assert (dead.message_id, dead.category, dead.attempts) == (message.pk, "unknown", 3)
    assert dead.reason == "RuntimeError: something odd"
    assert dead.first_failed_at < dead.last_failed_at
    assert not Message.objects.exists() and not Handled.objects.exists()


def test_a_handler_past_its_timeout_is_retried_and_does_not_block_capacity():
    # test.timeout: timeout 1 s, max_attempts 2, sleeps 5 s then records.
    slow = enqueue("test.timeout", {"seconds": 5})
    with running_worker(concurrency=1, poll_interval=0.2):
        # The retry is due within 0.1 s: wait for the recorded failure, which
        # the next claim keeps, not for the short "waiting" window.
        timed_out = Message.objects.filter(pk=slow.pk, last_error__startswith="HandlerTimeout")
        row = wait_until(timed_out.first, timeout=5, message="the first timeout to be recorded")
        assert row.last_error.startswith("HandlerTimeout: timeout: the handler ran past 1.0s")
        assert row.last_error_category == "transient"
        # The one slot is given to a fresh thread while the first handler
        # still sleeps in its own.
        quick = enqueue("test.record", {})
        wait_until(lambda: Handled.objects.filter(message_id=quick.pk).exists(), timeout=5)
        assert len(handler_threads()) == 2, "the timed-out handler held the capacity"
        wait_until(lambda: DeadLetter.objects.filter(message_id=slow.pk).exists(), timeout=60)
    wait_until(lambda: not handler_threads(), timeout=60, message="the late handlers to return")
    dead = DeadLetter.objects.get(message_id=slow.pk)
    assert (dead.category, dead.attempts) == ("transient", 2)
    assert not Handled.objects.filter(message_id=slow.pk).exists()


def test_a_timeout_is_noticed_when_it_passes_not_at_the_next_poll():
    """The main loop reckons when to wake before a handler starts; the
    handler's thread wakes it to reckon again with the new deadline."""
    # test.timeout: timeout 1 s, sleeps the payload's seconds.
    slow = enqueue("test.timeout", {"seconds": 3})
    with running_worker(concurrency=1, poll_interval=120):
        timed_out = Message.objects.filter(pk=slow.pk, last_error__startswith="HandlerTimeout")
        # Due 1 s after the start; the next poll would be 120 s after it.
        wait_until(
            timed_out.exists, timeout=60, message="the timeout to be noticed before the poll"
        )
    wait_until(lambda: not handler_threads(), timeout=60, message="the late handler to return")


@pytest.fixture
def lease_thief():
    """A handler that loses its lease mid-run, as when it is rescued and taken
    by another worker: another connection changes the lease token."""

    @handler("test.lose_lease")
    def lose_lease(message):
        Handled.objects.create(
            message_id=message.pk, topic=message.topic, attempt=message.attempts, pid=0
        )
        with raw_connection(autocommit=True) as other:
            other.execute(
                "UPDATE django_pgqueue_message SET lease_token = gen_random_uuid() WHERE id = %s",
                [message.pk],
            )

    yield
    registry.unregister("test.lose_lease")


def test_an_atomic_handler_that_lost_its_lease_rolls_back_its_writes(lease_thief):
    message = enqueue("test.lose_lease", {})
    Worker(concurrency=1, burst=True).run()
    assert not Handled.objects.exists(), "the handler's write was committed without the lease"
    row = Message.objects.get(pk=message.pk)
    assert row.status == Status.PROCESSING, "the new lease holder's message was not touched"


@override_settings(PGQUEUE={"NOTIFY": False})
def test_poll_only_mode_works_without_notifications():
    with running_worker(concurrency=2, poll_interval=0.2):
        assert not any(t.name == "pgqueue-listener" for t in threading.enumerate())
        message = enqueue("test.record", {})
        wait_until(lambda: Handled.objects.filter(message_id=message.pk).exists(), timeout=60)


def test_a_notification_wakes_an_idle_worker_long_before_its_poll():
    with running_worker(concurrency=1, poll_interval=600):
        wait_until(lambda: listener_pids(), message="the listener to connect")
        message = enqueue("test.record", {})
        wait_until(lambda: Handled.objects.filter(message_id=message.pk).exists(), timeout=60)


def test_the_listener_reconnects_and_listens_again_after_its_connection_is_killed():
    with running_worker(concurrency=1, poll_interval=600):
        [pid] = wait_until(listener_pids, message="the listener to connect")
        with raw_connection(autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(%s)", [pid])
        wait_until(
            lambda: listener_pids() not in ([], [pid]),
            timeout=60,
            message="a new listener connection",
        )
        message = enqueue("test.record", {})
        wait_until(lambda: Handled.objects.filter(message_id=message.pk).exists(), timeout=60)


def listener_pids():
    import os

    with raw_connection(autocommit=True) as conn:
        return [
            row[0]
            for row in conn.execute(
                "SELECT pid FROM pg_stat_activity WHERE application_name = %s",
                [f"pgqueue_listener#{os.getpid()}"],
            )
        ]


def test_an_idle_worker_issues_at_most_one_query_per_poll_interval(monkeypatch):
    queries = collections.Counter()
    original = backend_utils.CursorWrapper._execute

    def counting(self, sql, params, *ignore):
        queries[threading.current_thread().name] += 1
        return original(self, sql, params, *ignore)

    with running_worker(concurrency=2, poll_interval=0.25):
        time.sleep(0.5)  # let start-up settle, then count
        monkeypatch.setattr(backend_utils.CursorWrapper, "_execute", counting)
        time.sleep(2.5)
        monkeypatch.undo()
    polls = 2.5 / (0.25 * 0.9)
    assert sum(queries.values()) <= polls + 1, f"idle worker queries: {dict(queries)}"
    assert set(queries) <= {"test-worker"}, f"only the loop's poll may query: {dict(queries)}"


def test_stop_lets_the_running_handler_finish():
    message = enqueue("test.sleep", {"seconds": 0.5})
    with running_worker(concurrency=1, shutdown_timeout=10) as worker:
        # Started, not only claimed: a claimed message not yet started is
        # handed back at the stop, without running (the next test).
        wait_until(
            lambda: any(job.started is not None for job in worker._ledger.leased()),
            message="the handler to start",
        )
    assert handled_ids() == {message.pk: 1}
    assert not Message.objects.exists()


def test_stop_hands_back_what_does_not_finish_in_time_without_counting_the_attempt():
    message = enqueue("test.sleep", {"seconds": 3})
    with running_worker(concurrency=1, shutdown_timeout=0.2):
        wait_until(lambda: Message.objects.filter(status="processing").exists())
    row = Message.objects.get(pk=message.pk)
    assert (row.status, row.attempts, row.lease_token) == ("waiting", 0, None)
    # The abandoned handler's transaction finds the lease gone and rolls back.
    wait_until(lambda: not handler_threads(), timeout=60, message="the handler to return")
    assert not Handled.objects.exists(), "the handed-back handler committed its writes"


def handler_threads():
    return [t for t in threading.enumerate() if t.name.startswith("pgqueue-handler")]


def test_a_raising_signal_receiver_is_logged_and_stops_nothing(caplog):
    from django_pgqueue.signals import dead_lettered, message_done, message_retried

    def broken(**kwargs):
        raise RuntimeError("receiver bug")

    for signal in (message_done, message_retried, dead_lettered):
        signal.connect(broken, dispatch_uid="test-broken")
    try:
        done = enqueue_many([{"payload": {}}] * 5, topic="test.record")
        retried = enqueue("test.fail", {"raise": "ConnectionError", "times": 1})
        dead = enqueue("test.fail", {"raise": "Permanent"})
        with running_worker(concurrency=2, poll_interval=0.1):
            wait_until(
                lambda: (
                    handled_ids().keys() >= {m.pk for m in done} | {retried.pk}
                    and DeadLetter.objects.filter(message_id=dead.pk).exists()
                ),
                timeout=60,
                message="every message finished despite the broken receiver",
            )
    finally:
        for signal in (message_done, message_retried, dead_lettered):
            signal.disconnect(dispatch_uid="test-broken")
    assert not Message.objects.exists()
    assert "Signal receiver" in caplog.text and "receiver bug" in caplog.text


# --- atomic handlers sharing a transaction ------------------------------------


@pytest.fixture
def committed():
    from demo import handlers

    handlers.COMMITTED.clear()
    yield handlers.COMMITTED
    handlers.COMMITTED.clear()


@pytest.fixture
def ack_calls(monkeypatch):
    """How many shared transactions acknowledged their messages."""
    from django_pgqueue import lifecycle

    calls = []
    real = lifecycle.ack_leased

    def counting(messages):
        calls.append(len(messages))
        return real(messages)

    monkeypatch.setattr(lifecycle, "ack_leased", counting)
    return calls


@pytest.fixture
def unhurried_batches(monkeypatch):
    """A shared transaction takes the jobs queued behind its first for 5 s,
    not 50 ms: on a loaded machine the short window can close before they
    are taken, and the tests using this are about what a batch does with
    them, not about its time limit."""
    from django_pgqueue.worker import atomic

    monkeypatch.setattr(atomic, "ATOMIC_BATCH_SECONDS", 5.0)


def test_atomic_handlers_share_a_commit_and_a_failure_rolls_back_only_its_own_work(
    committed, ack_calls, unhurried_batches
):
    messages = enqueue_many([{"payload": {}}] * 9, topic="test.batch")
    failing = enqueue("test.batch", {"do": "fail"})
    with running_worker(concurrency=1, batch_size=20, prefetch=20, poll_interval=0.1):
        wait_until(lambda: not Message.objects.exists(), message="every message, one retried")
    assert not DeadLetter.objects.exists()
    rows = list(Handled.objects.values_list("message_id", "attempt"))
    assert sorted(rows) == sorted([(m.pk, 1) for m in messages] + [(failing.pk, 2)])
    # The failed attempt's on_commit callback was discarded with its savepoint.
    assert sorted(committed) == sorted([m.pk for m in messages] + [failing.pk])
    assert ack_calls[0] == 9, f"one shared transaction for the first 10: {ack_calls}"


def test_handlers_that_run_no_query_share_the_batch_and_fail_alone(
    committed, ack_calls, unhurried_batches
):
    """Savepoints open lazily: a handler with no query has none, and its
    failure still discards only its own on_commit callbacks."""
    plain = enqueue_many([{"payload": {}}] * 3, topic="test.batch")
    nodb = enqueue_many([{"payload": {"do": "nodb"}}] * 3, topic="test.batch")
    early = enqueue("test.batch", {"do": "fail_early"})
    late = enqueue("test.batch", {"do": "fail"})
    more = enqueue_many([{"payload": {}}, {"payload": {"do": "nodb"}}], topic="test.batch")
    with running_worker(concurrency=1, batch_size=20, prefetch=20, poll_interval=0.1):
        wait_until(lambda: not Message.objects.exists(), message="every message, two retried")
    assert not DeadLetter.objects.exists()
    writers = [*plain, more[0]]
    rows = sorted(Handled.objects.values_list("message_id", "attempt"))
    assert rows == sorted([(m.pk, 1) for m in writers] + [(late.pk, 2)])
    everyone = [*plain, *nodb, early, late, *more]
    assert sorted(committed) == sorted(m.pk for m in everyone), "each callback once"
    assert ack_calls[0] == 8, f"one shared transaction for the first ten: {ack_calls}"


@pytest.fixture
def ack_modes(monkeypatch):
    """Per acknowledgement of a shared transaction: (its messages, whether
    it was sent in autocommit, alone)."""
    from django_pgqueue import conf, lifecycle

    calls = []
    real = lifecycle.ack_leased

    def recording(messages):
        raw = connections[conf.database_alias()].connection
        calls.append((len(messages), raw.autocommit))
        return real(messages)

    monkeypatch.setattr(lifecycle, "ack_leased", recording)
    return calls


def test_handlers_that_run_no_query_are_acknowledged_alone_in_batches_past_fifty(
    committed, ack_modes, unhurried_batches
):
    """No savepoint was opened, so ATOMIC_BATCH_MAX does not end the batch
    (the batch size does), and the acknowledgement is the transaction's
    only statement: sent in autocommit, one round trip. The handlers'
    on_commit callbacks run once it has committed."""
    messages = enqueue_many([{"payload": {"do": "nodb"}}] * 120, topic="test.batch")
    with running_worker(concurrency=1, batch_size=200, prefetch=200, poll_interval=0.1):
        wait_until(lambda: not Message.objects.exists(), message="every message")
    assert ack_modes[0] == (120, True), ack_modes
    assert sorted(committed) == sorted(m.pk for m in messages), "each callback once"
    assert not DeadLetter.objects.exists()


def test_a_lone_handler_that_runs_no_query_is_acknowledged_alone(committed, ack_modes, caplog):
    """A message run on its own (batch size 1): its acknowledgement is sent
    in autocommit, its on_commit callback runs after it; when the lease was
    lost the callback is dropped and the row stays with the lease's holder."""
    from django_pgqueue import lifecycle

    modes = []
    real = lifecycle.ack

    def recording(message):
        modes.append(connections["default"].connection.autocommit)
        return real(message)

    done = enqueue("test.batch", {"do": "nodb"})
    stolen = enqueue("test.batch", {"do": "nodb_steal"})
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(lifecycle, "ack", recording)
        Worker(concurrency=1, batch_size=1, prefetch=0, max_messages=2, burst=True).run()
    assert modes == [True, True]
    assert committed == [done.pk]
    assert list(Message.objects.values_list("pk", "status")) == [(stolen.pk, Status.PROCESSING)]
    assert "lease lost before the commit" in caplog.text


@override_settings(PGQUEUE={"LOCK_TIMEOUT": 0.3})
def test_a_locked_row_under_an_acknowledgement_sent_alone_commits_none_of_it(
    committed, ack_modes, caplog, unhurried_batches
):
    """The batch's acknowledgement, sent in autocommit, waits LOCK_TIMEOUT
    for a row another client holds and fails: nothing of it committed. The
    others run again one by one and are acknowledged; the locked one is
    left to its lease, and runs and is acknowledged once the lock is gone."""
    from demo import handlers

    before = enqueue_many([{"payload": {"do": "nodb"}}] * 2, topic="test.batch")
    locked = enqueue("test.batch", {"do": "nodb_lock"})
    after = enqueue_many([{"payload": {"do": "nodb"}}] * 2, topic="test.batch")
    others = sorted(m.pk for m in before + after)
    try:
        with running_worker(
            concurrency=1, batch_size=20, prefetch=20, poll_interval=0.1, lease_seconds=2
        ):
            wait_until(
                lambda: list(Message.objects.values_list("pk", flat=True)) == [locked.pk],
                message="the others acknowledged, the locked one left",
            )
            assert ack_modes[0] == (5, True), ack_modes
            assert sorted(committed) == others, "the others' callbacks once, after their acks"
            handlers.ROW_LOCKS.pop(locked.pk).close()  # rolls back: the lock is gone
            wait_until(lambda: not Message.objects.exists(), message="the locked one, later")
    finally:
        for other in handlers.ROW_LOCKS.values():
            other.close()
        handlers.ROW_LOCKS.clear()
    assert "waited too long for a row lock" in caplog.text
    assert sorted(committed) == sorted([*others, locked.pk])
    assert not DeadLetter.objects.exists()


def test_a_connection_lost_under_an_acknowledgement_sent_alone_loses_nothing(
    committed, caplog, monkeypatch, unhurried_batches
):
    """The server ends the worker's connection as the batch's acknowledgement
    (in autocommit) is sent: nothing of it committed, the connection is
    replaced, and the messages come back with their expired leases and are
    acknowledged, each on_commit callback once."""
    from demo import handlers

    from django_pgqueue import lifecycle

    real = lifecycle.ack_leased
    cut = []

    def cut_first(messages):
        if not cut:
            cut.append(len(messages))
            pid = connections["default"].connection.info.backend_pid
            with handlers.other_client(autocommit=True) as other:
                other.execute("SELECT pg_terminate_backend(%s)", [pid])
        return real(messages)

    monkeypatch.setattr(lifecycle, "ack_leased", cut_first)
    messages = enqueue_many([{"payload": {"do": "nodb"}}] * 5, topic="test.batch")
    with running_worker(
        concurrency=1, batch_size=20, prefetch=20, poll_interval=0.1, lease_seconds=2
    ) as worker:
        wait_until(lambda: not Message.objects.exists(), message="every message, later")
        assert worker  # still running: the stop below must be clean
    assert cut == [5]
    assert "could not commit" in caplog.text
    assert sorted(committed) == sorted(m.pk for m in messages), "each callback once"
    assert not DeadLetter.objects.exists()


def test_a_shared_transaction_opens_at_most_fifty_savepoints(
    committed, ack_modes, unhurried_batches
):
    """Handlers that query each open a savepoint (a subtransaction when they
    write): ATOMIC_BATCH_MAX of them end the batch, committed in the
    transaction with its acknowledgement."""
    messages = enqueue_many([{"payload": {}}] * 60, topic="test.batch")
    with running_worker(concurrency=1, batch_size=200, prefetch=200, poll_interval=0.1):
        wait_until(lambda: not Message.objects.exists(), message="every message")
    assert ack_modes[0] == (50, False), ack_modes
    assert handled_ids() == {m.pk: 1 for m in messages}
    assert sorted(committed) == sorted(m.pk for m in messages)


def test_a_lease_lost_in_a_batch_acknowledged_alone_loses_only_that_message(
    committed, ack_modes, caplog, unhurried_batches
):
    """The acknowledgement committed alone, with no write to undo: the others
    are done (run once, callbacks once), the one that lost its lease keeps
    its row for the lease's holder, and its on_commit callback is dropped."""
    before = enqueue_many([{"payload": {"do": "nodb"}}] * 3, topic="test.batch")
    stolen = enqueue("test.batch", {"do": "nodb_steal"})
    after = enqueue_many([{"payload": {"do": "nodb"}}] * 3, topic="test.batch")
    Worker(concurrency=1, batch_size=20, prefetch=20, max_messages=7, burst=True).run()
    others = sorted(m.pk for m in before + after)
    assert ack_modes == [(7, True)], ack_modes
    assert sorted(committed) == others, "each other callback once, none of the stolen one"
    assert list(Message.objects.values_list("pk", "status")) == [(stolen.pk, Status.PROCESSING)]
    assert f"Message id={stolen.pk} " in caplog.text
    assert "lease lost before the commit" in caplog.text


@pytest.mark.parametrize("action", ["raw_swallow", "raw_swallow_then_write"])
def test_a_transaction_broken_around_django_rolls_the_batch_back_and_loses_nothing(
    committed, caplog, action
):
    """No savepoint to return to: the whole batch rolls back and the others
    run again one by one, their writes once."""
    before = enqueue_many([{"payload": {}}] * 3, topic="test.batch")
    broken = enqueue("test.batch", {"do": action})
    after = enqueue_many([{"payload": {}}, {"payload": {"do": "nodb"}}], topic="test.batch")
    with running_worker(concurrency=1, batch_size=20, prefetch=20, poll_interval=0.1):
        wait_until(lambda: not Message.objects.exists(), message="every message, one retried")
    assert not DeadLetter.objects.exists()
    writers = [*before, after[0], broken]
    assert handled_ids() == {m.pk: 1 for m in writers}
    assert Handled.objects.get(message_id=broken.pk).attempt == 2
    assert sorted(committed) == sorted(m.pk for m in [*before, broken, *after])
    assert "could not be undone on its own" in caplog.text


def test_an_async_handler_in_a_shared_transaction_rolls_back_alone():
    """Its ORM calls (sync_to_async, in the handler thread) open its savepoint."""
    messages = enqueue_many([{"payload": {}}] * 3, topic="test.async_batch")
    failing = enqueue("test.async_batch", {"fail": True})
    later = enqueue_many([{"payload": {}}] * 3, topic="test.async_batch")
    with running_worker(concurrency=1, batch_size=20, prefetch=20, poll_interval=0.1):
        wait_until(lambda: not Message.objects.exists(), message="every message, one retried")
    rows = sorted(Handled.objects.values_list("message_id", "attempt"))
    assert rows == sorted([(m.pk, 1) for m in messages + later] + [(failing.pk, 2)])


def test_a_handler_that_breaks_the_transaction_and_swallows_the_error_fails_alone(committed):
    messages = enqueue_many([{"payload": {}}] * 4, topic="test.batch")
    broken = enqueue("test.batch", {"do": "swallow"})
    later = enqueue_many([{"payload": {}}] * 4, topic="test.batch")
    with running_worker(concurrency=1, batch_size=20, prefetch=20, poll_interval=0.1):
        wait_until(lambda: not Message.objects.exists(), message="every message, one retried")
    counts = handled_ids()
    assert set(counts.values()) == {1}
    assert set(counts) == {m.pk for m in messages + later} | {broken.pk}
    assert Handled.objects.get(message_id=broken.pk).attempt == 2


def test_a_lost_lease_rolls_the_batch_back_and_the_others_run_again_alone(committed):
    before = enqueue_many([{"payload": {}}] * 3, topic="test.batch")
    stolen = enqueue("test.batch", {"do": "steal"})
    after = enqueue_many([{"payload": {}}] * 3, topic="test.batch")
    Worker(concurrency=1, batch_size=20, max_messages=7, burst=True).run()
    others = {m.pk for m in before + after}
    assert handled_ids() == dict.fromkeys(others, 1), "each other message's writes once"
    assert sorted(committed) == sorted(others)
    # The stolen message's writes rolled back; it stays leased to "someone else".
    row = Message.objects.get(pk=stolen.pk)
    assert row.status == Status.PROCESSING and stolen.pk not in handled_ids()


def test_a_timed_out_handler_does_not_hold_the_batch_it_shares_hostage():
    done_first = enqueue_many([{"payload": {}}] * 2, topic="test.batch_timeout")
    sleeper = enqueue("test.batch_timeout", {"sleep": 5})
    with running_worker(concurrency=1, batch_size=20, prefetch=20, poll_interval=0.1):
        wait_until(
            lambda: len(handled_ids()) == 3 and not Message.objects.exists(),
            timeout=60,
            message="the batch's other messages and the retried sleeper",
        )
    assert handled_ids() == dict.fromkeys([m.pk for m in done_first] + [sleeper.pk], 1)
    assert Handled.objects.get(message_id=sleeper.pk).attempt == 2


def test_prefetched_messages_are_handed_back_at_once_on_stop():
    first = enqueue("test.sleep", {"seconds": 0.6})
    rest = enqueue_many([{"payload": {"seconds": 0.6}}] * 6, topic="test.sleep")
    with running_worker(
        concurrency=1, batch_size=7, prefetch=6, poll_interval=0.1, shutdown_timeout=10
    ):
        wait_until(lambda: Handled.objects.filter(message_id=first.pk).exists())
    handled = set(handled_ids())
    waiting = Message.objects.filter(status=Status.WAITING)
    assert waiting.count() == 7 - len(handled) >= 4, "the prefetched ones were not run"
    assert set(waiting.values_list("attempts", flat=True)) == {0}
    assert {m.pk for m in waiting} == {m.pk for m in [first, *rest]} - handled


def test_prefetched_messages_that_cannot_be_handed_back_wait_for_their_lease():
    """The hand-back at shutdown fails (a real database error): the messages
    stay leased, and the rescue returns them once the lease expires; each
    then runs once."""
    from django.utils import timezone

    from django_pgqueue import maintenance

    first = enqueue("test.sleep", {"seconds": 0.6})
    rest = enqueue_many([{"payload": {"seconds": 0.6}}] * 6, topic="test.sleep")
    with raw_connection(autocommit=True) as conn:
        # The hand-back is the one UPDATE that lowers the attempt count
        # (GREATEST("attempts" - 1, 0): the claim has GREATEST() too).
        conn.execute(
            """CREATE FUNCTION test_fail_release() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
                IF position('"ATTEMPTS" - 1' IN upper(current_query())) > 0 THEN
                    RAISE EXCEPTION 'injected hand-back failure';
                END IF;
                RETURN NULL;
            END $$"""
        )
        conn.execute(
            "CREATE TRIGGER test_fail_release BEFORE UPDATE ON django_pgqueue_message"
            " FOR EACH STATEMENT EXECUTE FUNCTION test_fail_release()"
        )
    try:
        with running_worker(
            concurrency=1,
            batch_size=7,
            prefetch=6,
            poll_interval=0.1,
            shutdown_timeout=10,
            lease_seconds=2,
        ):
            wait_until(lambda: Handled.objects.filter(message_id=first.pk).exists())
    finally:
        with raw_connection(autocommit=True) as conn:
            conn.execute("DROP TRIGGER test_fail_release ON django_pgqueue_message")
            conn.execute("DROP FUNCTION test_fail_release()")
    handled = set(handled_ids())
    leased = Message.objects.filter(status=Status.PROCESSING).count()
    assert leased == 7 - len(handled) >= 4, "still leased: the hand-back failed"
    time.sleep(2.1)  # past the lease
    assert maintenance.rescue_expired(now=timezone.now()).requeued == leased
    with running_worker(concurrency=2, poll_interval=0.1):
        wait_until(lambda: not Message.objects.exists(), message="the rescued messages")
    assert handled_ids() == dict.fromkeys([m.pk for m in [first, *rest]], 1)


# --- what the worker logs ------------------------------------------------------------


def test_at_info_a_worker_logs_a_summary_with_the_rate_not_a_line_per_message(caplog):
    caplog.set_level(logging.INFO, logger="django_pgqueue")
    enqueue_many([{"payload": {}}] * 30, topic="test.record")
    enqueue_many([{"payload": {}}] * 20, topic="test.record_nonatomic")
    enqueue("test.fail", {"times": 1, "after": 3600})  # retried in an hour
    with override_settings(PGQUEUE={"LOG_SUMMARY_INTERVAL": 3600}):
        Worker(concurrency=4, burst=True).run()
    per_message = [r for r in caplog.records if getattr(r, "state", None) in ("claimed", "done")]
    assert per_message == []
    summaries = [r for r in caplog.records if getattr(r, "state", None) == "summary"]
    # The interval is an hour: the one line is the part logged when it stops.
    assert len(summaries) == 1, caplog.text
    summary = summaries[0]
    assert (summary.done, summary.retried, summary.dead_lettered) == (50, 1, 0)
    assert summary.finished == 51 and summary.rate > 0
    assert " 50 done (" in summary.getMessage() and "/s), 1 retried" in summary.getMessage()


def test_at_debug_a_worker_logs_each_claim_and_each_done_message(caplog):
    caplog.set_level(logging.DEBUG, logger="django_pgqueue")
    messages = enqueue_many([{"payload": {}}] * 5, topic="test.record_nonatomic")
    Worker(concurrency=2, burst=True).run()
    for state in ("claimed", "done"):
        logged = {r.message_id for r in caplog.records if getattr(r, "state", None) == state}
        assert logged == {m.pk for m in messages}, state


def test_no_summary_for_an_interval_in_which_nothing_finished(caplog):
    caplog.set_level(logging.INFO, logger="django_pgqueue")
    Worker(concurrency=2, burst=True).run()
    assert not [r for r in caplog.records if getattr(r, "state", None) == "summary"]
