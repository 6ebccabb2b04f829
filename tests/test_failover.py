"""A primary failover survived: real worker processes on a multi-host
``DATABASE_URL`` (``target_session_attrs=read-write``) handle atomic
messages while the primary of a throwaway pair is killed (``kill -9`` of
the postmaster and every child) and its streaming standby promoted. The
workers reconnect to the new primary, hand back at once the messages whose
runs died with the old one (not after their 60 s lease), listen again, and
their stream delivery and scheduler go on.

With a synchronous standby, every commit the old primary acknowledged is on
the new one: nothing is lost and no atomic effect happens twice. With an
asynchronous one, the commits of the last moments may be gone (the docs'
window, docs/howto/failover.rst): the test reports what it lost and asserts
what the docs promise, that what the new primary holds is handled, once.

The pair is this module's own (benchmarks/harness/replication.py), made per
test; the suite's server is never touched. Also here: a worker's
connections terminated by the server on the suite's database
(``pg_terminate_backend``) while atomic handlers run."""

import collections
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from demo.models import Handled

from benchmarks.harness import replication, throwaway_pg
from django_pgqueue import enqueue_many
from django_pgqueue.models import DeadLetter, Message

from .conftest import MANAGE, raw_connection, shared_servers, wait_until

pytestmark = [pytest.mark.slow]

DATABASES = {"default": "pgqueue_failover", "other": "pgqueue_failover_other"}
LEASE = 60  # seconds: a message that waited for its lease would show
MESSAGES = 400


def pair_env(clusters):
    return {
        "DATABASE_URL": replication.multi_host_url(clusters, DATABASES["default"]),
        "OTHER_DATABASE_URL": replication.multi_host_url(clusters, DATABASES["other"]),
    }


def manage(env, *args, timeout=300):
    done = subprocess.run(
        [sys.executable, str(MANAGE), *args],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.fixture
def make_pair():
    """make(synchronous): a throwaway primary, migrated, and its streaming
    standby; both removed at the end."""
    made = []

    def make(synchronous):
        try:
            primary = throwaway_pg.ThrowawayCluster.create(major=shared_servers()[0].major())
        except throwaway_pg.ClusterError as exc:
            pytest.fail(f"the failover test cannot run its own PostgreSQL: {exc}")
        made.append(primary)
        for name in DATABASES.values():
            primary.create_database(name)
        for alias in DATABASES:
            manage(pair_env([primary]), "migrate", "--database", alias, "--verbosity", "0")
        standby = replication.make_standby(primary, synchronous=synchronous)
        made.append(standby)
        return primary, standby

    yield make
    for cluster in reversed(made):
        cluster.close()


# Enqueues test.sleep messages (atomic: the ledger row is written first, then
# the handler sleeps, so a kill in the sleep leaves an uncommitted write),
# printing the ids of each committed batch, until its database fails.
ENQUEUER = """
import time
from django_pgqueue import enqueue_many

total, batch, pause = {total}, 10, 0.1
sent = 0
while sent < total:
    try:
        messages = enqueue_many(
            [{{"payload": {{"seconds": 0.1, "then": 0}}}}] * batch, topic="test.sleep"
        )
    except Exception as exc:
        print("stopped:", type(exc).__name__, flush=True)
        break
    print("committed:", *(m.pk for m in messages), flush=True)
    sent += batch
    time.sleep(pause)
"""

# After the failover: one message and one stream event, through the new primary.
AFTER = """
from django_pgqueue import enqueue, publish
from django.db import transaction

with transaction.atomic():
    message = enqueue("test.record", {"after": "failover"})
    event = publish("test.events", {"after": "failover"})
print("published:", message.pk, event.position, flush=True)
"""


def read(cluster, sql, params=()):
    with cluster.connect(DATABASES["default"], autocommit=True) as conn:
        return conn.execute(sql, params).fetchall()


def handled(cluster, topic="test.sleep"):
    """{message id: how many ledger rows} of ``topic`` on ``cluster``."""
    rows = read(cluster, "SELECT message_id FROM demo_handled WHERE topic = %s", [topic])
    return collections.Counter(row[0] for row in rows)


def still_held(cluster, leases):
    """Those of ``leases`` ({id: lease token}) still processing under that token."""
    return read(
        cluster,
        "SELECT id FROM django_pgqueue_message WHERE status = 'processing' AND "
        "(id, lease_token) IN (SELECT * FROM unnest(%s::bigint[], %s::uuid[]))",
        [list(leases), list(leases.values())],
    )


def run_failover(make_pair, start_worker, synchronous):
    """Workers at work, the primary killed, the standby promoted: the figures."""
    primary, standby = make_pair(synchronous)
    env = pair_env([primary, standby])
    enqueuer = subprocess.Popen(
        [sys.executable, str(MANAGE), "shell", "-c", ENQUEUER.format(total=MESSAGES)],
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    schedule = {"failover-tick": {"every": 1, "topic": "test.record"}}
    workers = [
        start_worker(
            *("--concurrency", "4", "--lease", str(LEASE), "--poll-interval", "10"),
            *("--subscriptions", "test.ledger"),
            pgqueue={"SCHEDULES": schedule},
            env=env,
        )
        for _ in range(2)
    ]
    try:
        wait_until(
            lambda: (
                sum(handled(primary).values()) >= 60
                and read(
                    primary,
                    "SELECT count(*) FROM django_pgqueue_message WHERE status = 'processing'",
                )[0][0]
                >= 4
            ),  # fmt: skip
            timeout=120,
            message="the workers to be busy on the primary",
        )
        handled_before = set(handled(primary))
        # Held under these leases when the primary died.
        in_flight = dict(
            read(
                primary,
                "SELECT id, lease_token FROM django_pgqueue_message WHERE status = 'processing' "
                "AND topic = 'test.sleep'",  # (not the scheduler's ticks)
            )
        )
        replication.kill9(primary)
        killed = time.monotonic()
        replication.promote(standby)
        promoted = time.monotonic()
        at_promotion = handled(standby)
        first_after = inflight_back = inflight_handled = None
        deadline = promoted + LEASE - 10
        committed = None  # the ids whose enqueue committed, once the enqueuer has stopped
        while True:
            now = time.monotonic()
            counts = handled(standby)
            if first_after is None and sum(counts.values()) > sum(at_promotion.values()):
                first_after = now - promoted
            if inflight_back is None and not still_held(standby, in_flight):
                inflight_back = now - promoted
            if inflight_handled is None and set(in_flight) <= set(counts):
                inflight_handled = now - promoted
            if committed is None and enqueuer.poll() is not None:
                output = enqueuer.stdout.read()
                committed = {
                    int(i)
                    for line in output.splitlines()
                    if line.startswith("committed:")
                    for i in line.split()[1:]
                }
                stopped = [line for line in output.splitlines() if line.startswith("stopped:")]
            queued = read(
                standby, "SELECT count(*) FROM django_pgqueue_message WHERE topic = 'test.sleep'"
            )[0][0]
            if committed is not None and inflight_handled is not None and not queued:
                break
            assert now < deadline, (
                f"not drained {now - promoted:.1f}s after the promotion (lease {LEASE}s): "
                f"{queued} queued, in flight at the kill and not handled: "
                f"{sorted(set(in_flight) - set(counts))[:10]}\n" + workers[0].log()[-3000:]
            )
            time.sleep(0.05)
        drained = time.monotonic() - promoted
        on_new = {row[0] for row in read(standby, "SELECT id FROM django_pgqueue_message")}
        dead = {row[0] for row in read(standby, "SELECT message_id FROM django_pgqueue_deadletter")}
        counts = handled(standby)
        figures = {
            "synchronous": synchronous,
            "enqueued_committed": len(committed),
            "enqueuer": stopped[0] if stopped else "done before the kill",
            "handled": len(counts),
            "in_flight_at_kill": len(in_flight),
            "kill_to_promoted_s": round(promoted - killed, 3),
            "promoted_to_first_handled_s": round(first_after or -1, 3),
            # Every message held at the kill is back in the queue (or done,
            # or claimed again): none waits for its old lease.
            "promoted_to_in_flight_back_s": round(inflight_back, 3),
            "promoted_to_in_flight_handled_s": round(inflight_handled, 3),
            "promoted_to_drained_s": round(drained, 3),
            "enqueues_lost": len(set(committed) - set(counts) - on_new - dead),
            "handlings_lost": len(handled_before - set(at_promotion)),
            "atomic_effects_twice": sum(1 for n in counts.values() if n > 1),
            "dead_lettered": len(dead),
            "handed_back_logged": sum("handed back" in w.log() for w in workers),
        }
        print("failover figures:", json.dumps(figures))
        return primary, standby, workers, figures, counts, committed
    finally:
        if enqueuer.poll() is None:
            enqueuer.kill()
        enqueuer.wait()
        enqueuer.stdout.close()


def check_everything_resumes(standby, env, workers):
    """On the new primary: a NOTIFY wakes a worker (poll interval 10 s, so a
    message handled in less means it listens again), the stream delivery
    delivers, the scheduler ticks."""
    ticks_before = sum(handled(standby, "test.record").values())
    shell = subprocess.Popen(
        [sys.executable, str(MANAGE), "shell", "-c", AFTER],
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        text=True,
    )
    with shell:
        for line in shell.stdout:  # (the shell may say more first)
            if line.startswith("published:"):  # it has committed
                committed = time.monotonic()
                break
        else:
            raise AssertionError("the shell published nothing")
        shell.stdout.read()
    message_id, position = map(int, line.split()[1:])
    wait_until(
        lambda: (
            message_id in handled(standby, "test.record")
            and position in handled(standby, "test.ledger")
        ),
        timeout=30,
        message="the message and the stream event published after the failover to be handled",
    )
    took = time.monotonic() - committed
    # A poll would take up to 10 s: a notification woke them.
    assert took < 5, f"handled {took:.1f}s after the commit: the listener did not listen again"
    wait_until(
        lambda: sum(handled(standby, "test.record").values()) >= ticks_before + 3,
        timeout=30,
        message="the scheduler to tick on the new primary",
    )
    logs = "".join(w.log() for w in workers)
    assert "listener" in logs and "reconnecting" in logs, "the listener was not cut off"
    for worker in workers:
        assert worker.popen.poll() is None, worker.log()[-3000:]
        worker.signal(signal.SIGTERM)
    for worker in workers:
        assert worker.wait(timeout=60) == 0, worker.log()[-3000:]


def test_a_failover_to_a_synchronous_standby_loses_nothing(make_pair, start_worker):
    primary, standby, workers, figures, counts, committed = run_failover(
        make_pair, start_worker, synchronous=True
    )
    report = json.dumps(figures) + "\n" + workers[0].log()[-4000:]
    assert figures["enqueues_lost"] == 0, report
    assert figures["handlings_lost"] == 0, report
    assert figures["atomic_effects_twice"] == 0, report
    assert figures["dead_lettered"] == 0, report
    assert figures["handled"] >= figures["enqueued_committed"], report
    assert set(counts) >= committed, report
    # Back within seconds of the promotion, not after the 60 s lease.
    assert figures["promoted_to_in_flight_back_s"] < 20, report
    assert figures["handed_back_logged"] >= 1, report
    check_everything_resumes(standby, pair_env([primary, standby]), workers)


def test_a_failover_to_an_asynchronous_standby_reports_its_window(make_pair, start_worker):
    primary, standby, workers, figures, counts, committed = run_failover(
        make_pair, start_worker, synchronous=False
    )
    report = json.dumps(figures) + "\n" + workers[0].log()[-4000:]
    # The window: commits acknowledged by the old primary and not yet
    # streamed are gone (figures["enqueues_lost"], ["handlings_lost"]: the
    # handlings run again). What the new primary holds is handled, once.
    assert figures["atomic_effects_twice"] == 0, report
    assert figures["promoted_to_in_flight_back_s"] < 20, report
    check_everything_resumes(standby, pair_env([primary, standby]), workers)


def test_runs_cut_off_by_terminated_connections_come_back_within_seconds(start_worker):
    """pg_terminate_backend of every connection of a worker while its atomic
    handlers run (their writes uncommitted): the messages come back at once
    (the worker hands them back, or records their retry), not after the
    60 s lease, and each effect commits once."""
    worker = start_worker("--concurrency", "4", "--lease", str(LEASE), "--poll-interval", "1")
    ids = [
        m.pk
        for m in enqueue_many([{"payload": {"seconds": 2, "then": 0}}] * 12, topic="test.sleep")
    ]

    def idle_in_transaction():
        with raw_connection(autocommit=True) as conn:
            return conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s "
                "AND state = 'idle in transaction'",
                [f"pgqueue_worker#{worker.pid}"],
            ).fetchone()[0]

    # Four handlers asleep after their write, in open transactions.
    wait_until(lambda: idle_in_transaction() >= 4, timeout=60, message="four handlers running")
    with raw_connection(autocommit=True) as admin:
        killed = admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name LIKE %s",
            [f"pgqueue_%#{worker.pid}"],
        ).fetchall()
    assert len(killed) >= 4
    cut = time.monotonic()
    wait_until(
        lambda: (
            set(Handled.objects.values_list("message_id", flat=True)) == set(ids)
            and not Message.objects.exists()
        ),
        timeout=LEASE - 10,
        message="every message to be handled (before the lease would have brought them back)",
    )
    took = time.monotonic() - cut
    counts = collections.Counter(Handled.objects.values_list("message_id", flat=True))
    assert set(counts.values()) == {1}, "an atomic effect committed twice"
    assert not DeadLetter.objects.exists()
    second = Handled.objects.filter(attempt=2).count()
    print(f"cut off: {second} run(s) came back, all handled {took:.1f}s after the cut")
    assert second >= 4, "the runs cut off did not run again"
    assert took < 20, f"{took:.1f}s: the cut-off runs waited for something like their lease"
    worker.signal(signal.SIGTERM)
    assert worker.wait(timeout=60) == 0, worker.log()
