"""Behind a real PgBouncer in transaction pooling: poll-only workers drain a
workload with one maintainer at a time, and the admin and the enqueue paths
work. The test starts its own PgBouncer (Debian's package; ./runtests
installs it) between the workers and PostgreSQL, with fewer server
connections than clients, so that consecutive transactions of one client
run on different server sessions and any session state would break."""

import collections
import datetime
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import psycopg
import pytest
from demo.models import Handled
from django.db import connections, transaction
from django.urls import reverse
from django.utils import timezone

from django_pgqueue import checks as pgqueue_checks
from django_pgqueue import enqueue, enqueue_many
from django_pgqueue.models import DeadLetter, DeadLetterState, Message

from .conftest import InvariantChecker, database_url, raw_connection, wait_until

PGBOUNCER = shutil.which("pgbouncer", path=f"{os.environ.get('PATH', '')}:/usr/sbin:/sbin")
POOL_SIZE = 6  # server connections per database: fewer than the workers' clients


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Bouncer:
    def __init__(self, port, log_path):
        self.port = port
        self.log_path = log_path

    def url(self, alias):
        """``database_url(alias)`` through this PgBouncer."""
        params = connections[alias].settings_dict
        direct = f"@{params['HOST'] or 'localhost'}:{params['PORT'] or 5432}/"
        return database_url(alias).replace(direct, f"@127.0.0.1:{self.port}/")

    def worker_env(self):
        """What a worker process behind it needs (testproject/settings.py)."""
        return {
            "DATABASE_URL": self.url("default"),
            "OTHER_DATABASE_URL": self.url("other"),
            "DATABASE_PREPARE_THRESHOLD": "",  # 1.18 keeps no prepared statements
            "DATABASE_DISABLE_SERVER_SIDE_CURSORS": "1",
        }

    def show(self, what):
        """``SHOW <what>`` on PgBouncer's admin console, as dicts."""
        with psycopg.connect(
            host="127.0.0.1", port=self.port, dbname="pgbouncer", user="postgres", autocommit=True
        ) as conn:
            cursor = conn.execute(f"SHOW {what}")
            names = [column.name for column in cursor.description]
            return [dict(zip(names, row, strict=True)) for row in cursor]

    def log(self):
        return self.log_path.read_text()


@pytest.fixture(scope="module")
def pgbouncer():
    """A PgBouncer of this test module's own, in transaction pooling, in front
    of the test server; stopped at the end."""
    if PGBOUNCER is None:
        pytest.skip("PgBouncer is not installed (apt-get install pgbouncer; ./runtests does)")
    from django.conf import settings

    server = settings.DATABASES["default"]
    command = [PGBOUNCER]
    if os.geteuid() == 0:
        command += ["-u", "postgres"]  # PgBouncer will not run as root
    # tmp_path is private to root; PgBouncer, as postgres, must read its files.
    directory = Path(tempfile.mkdtemp(prefix="pgq-pgbouncer-"))
    directory.chmod(0o755)
    port = free_port()
    (directory / "userlist.txt").write_text('"postgres" ""\n')
    (directory / "pgbouncer.ini").write_text(
        f"""[databases]
* = host={server["HOST"] or "127.0.0.1"} port={server["PORT"] or 5432}

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {port}
unix_socket_dir =
auth_type = trust
auth_file = {directory / "userlist.txt"}
admin_users = postgres
pool_mode = transaction
default_pool_size = {POOL_SIZE}
max_client_conn = 200
"""
    )
    for name in ("userlist.txt", "pgbouncer.ini"):
        (directory / name).chmod(0o644)
    log_path = directory / "pgbouncer.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [*command, str(directory / "pgbouncer.ini")], stdout=log, stderr=subprocess.STDOUT
        )
    bouncer = Bouncer(port, log_path)
    try:
        deadline = time.monotonic() + 20
        while True:
            if process.poll() is not None:
                pytest.fail(f"PgBouncer exited with {process.returncode}:\n{bouncer.log()}")
            try:
                bouncer.show("VERSION")
                break
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    pytest.fail(f"PgBouncer did not accept connections:\n{bouncer.log()}")
                time.sleep(0.1)
        yield bouncer
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)
        shutil.rmtree(directory, ignore_errors=True)


def handled_counts():
    return collections.Counter(Handled.objects.values_list("message_id", flat=True))


ROUND = re.compile(r"Maintenance round in process (\d+) from ([\d.]+) to ([\d.]+)")


def maintenance_rounds(logs):
    """(start, end, pid) of every maintenance round the logs record."""
    return sorted(
        (float(start), float(end), int(pid))
        for log in logs
        for pid, start, end in ROUND.findall(log)
    )


def test_poll_only_workers_drain_through_pgbouncer_one_maintainer_at_a_time(
    pgbouncer, start_worker, make_message
):
    env = pgbouncer.worker_env()
    pgqueue = {"NOTIFY": False, "HEARTBEAT_INTERVAL": 1}
    options = ["--lease", "3", "--poll-interval", "0.2", "--log-level", "DEBUG"]
    # A worker that dies holding leases: maintenance has messages to rescue
    # while the others drain the workload.
    stuck = [
        m.pk
        for m in enqueue_many([{"payload": {"seconds": 60, "then": 0}}] * 4, topic="test.sleep")
    ]
    victim = start_worker("--concurrency", "4", *options, pgqueue=pgqueue, env=env)
    wait_until(
        lambda: Message.objects.filter(pk__in=stuck, status="processing").count() == 4,
        timeout=60,
        message="the victim to lease the four slow messages",
    )
    victim.signal(signal.SIGKILL)
    victim.wait(timeout=10)

    atomic = [m.pk for m in enqueue_many([{"payload": {}}] * 1500, topic="test.record")]
    nonatomic = [
        m.pk for m in enqueue_many([{"payload": {}}] * 1500, topic="test.record_nonatomic")
    ]
    invariant = InvariantChecker(atomic + stuck)
    workers = [
        start_worker("--concurrency", "3", "--batch-size", "20", *options, pgqueue=pgqueue, env=env)
        for _ in range(3)
    ]
    # Meanwhile more leases expire (messages of a worker that is gone): every
    # worker's poll sees them and tries maintenance at once.
    orphans = []
    for _ in range(30):
        for _ in range(2):
            orphans.append(
                make_message(
                    status="processing",
                    lease_expires_at=timezone.now() - datetime.timedelta(seconds=1),
                    locked_by="gone:1:ghost",
                ).pk
            )
        time.sleep(0.15)
    invariant.ids += orphans
    wait_until(lambda: not Message.objects.exists(), timeout=120, message="the queue to drain")
    invariant.stop()
    for worker in workers:
        worker.signal(signal.SIGTERM)
    for worker in workers:
        assert worker.wait(timeout=30) == 0, worker.log()[-3000:]
    logs = [worker.log() for worker in workers]

    counts = handled_counts()
    exactly_once = atomic + stuck + orphans
    assert {pk: counts[pk] for pk in exactly_once} == dict.fromkeys(exactly_once, 1), (
        "an atomic message was lost or its writes committed twice"
    )
    assert all(counts[pk] >= 1 for pk in nonatomic), "a message was lost"
    assert not DeadLetter.objects.exists()
    assert len({pid for pid in Handled.objects.values_list("pid", flat=True)}) >= 2
    assert sum(log.count("rescued: worker lost") for log in logs) >= 4 + len(orphans)
    assert "listener" not in "".join(logs), "a poll-only worker listened"
    assert not any("Traceback" in log for log in logs), "\n".join(logs)[-3000:]

    # Every worker tries maintenance every lease/4 while busy, and at once
    # when its poll sees an expired lease; the rounds it ran (logged with
    # their times before the commit releases the lock) never overlap.
    rounds = maintenance_rounds(logs)
    skipped = sum(log.count("skipped: another holds the lock") for log in logs)
    assert len(rounds) >= 3, f"too few maintenance rounds to show anything: {rounds}"
    overlaps = [(a, b) for a, b in zip(rounds, rounds[1:], strict=False) if a[1] > b[0]]
    assert not overlaps, (
        f"two maintenance rounds ran at once: {overlaps[:3]} ({skipped} attempts skipped)"
    )

    # It all went through PgBouncer, on fewer server connections than clients.
    name = connections["default"].settings_dict["NAME"]
    [pool] = [p for p in pgbouncer.show("POOLS") if p["database"] == name]
    [stats] = [s for s in pgbouncer.show("STATS") if s["database"] == name]
    assert stats["total_xact_count"] > 1000
    assert pool["sv_active"] + pool["sv_idle"] + pool["sv_used"] <= POOL_SIZE


@pytest.fixture
def through_pgbouncer(pgbouncer, transactional_db):
    """This process's "default" connection goes through PgBouncer (with the
    settings Django needs there) until the test ends."""
    connection = connections["default"]
    settings = connection.settings_dict
    saved = (settings["PORT"], settings["HOST"], settings.get("DISABLE_SERVER_SIDE_CURSORS"))
    threshold = settings["OPTIONS"].get("prepare_threshold")
    connection.close()
    settings.update(HOST="127.0.0.1", PORT=str(pgbouncer.port), DISABLE_SERVER_SIDE_CURSORS=True)
    settings["OPTIONS"]["prepare_threshold"] = None
    try:
        yield pgbouncer
    finally:
        connection.close()
        settings["PORT"], settings["HOST"], settings["DISABLE_SERVER_SIDE_CURSORS"] = saved
        settings["OPTIONS"]["prepare_threshold"] = threshold


def queued_topics():
    """The waiting messages' topics, read directly from PostgreSQL."""
    with raw_connection(autocommit=True) as conn:
        rows = conn.execute("SELECT topic, count(*) FROM django_pgqueue_message GROUP BY topic")
        return dict(rows)


def test_enqueue_paths_work_through_pgbouncer(through_pgbouncer):
    enqueue("pool.one", {"n": 1})
    with transaction.atomic():
        enqueue("pool.atomic", {"n": 1})
        enqueue_many([{"payload": {"n": n}} for n in range(2500)], topic="pool.many_atomic")
        transaction.on_commit(lambda: enqueue("pool.on_commit", {}))
    enqueue_many([{"payload": {"n": n}} for n in range(2500)], topic="pool.many")
    with pytest.raises(ZeroDivisionError), transaction.atomic():
        enqueue("pool.rolled_back", {})
        enqueue_many([{"payload": {}}] * 3, topic="pool.rolled_back")
        1 / 0  # noqa: B018
    assert queued_topics() == {
        "pool.one": 1,
        "pool.atomic": 1,
        "pool.many_atomic": 2500,
        "pool.on_commit": 1,
        "pool.many": 2500,
    }
    name = connections["default"].settings_dict["NAME"]
    assert any(c["database"] == name for c in through_pgbouncer.show("CLIENTS")), (
        "this process's connection did not go through PgBouncer"
    )


def test_the_admin_works_through_pgbouncer(admin_client, make_dead_letter, through_pgbouncer):
    waiting = enqueue("pool.admin", {"n": 1})
    page = admin_client.get(reverse("admin:django_pgqueue_message_changelist"))
    assert page.status_code == 200
    assert waiting.pk in {m.pk for m in page.context["cl"].result_list}
    dead = make_dead_letter(payload={"order": 7}, queue="mail")
    response = admin_client.post(
        reverse("admin:django_pgqueue_deadletter_changelist"),
        {"action": "revive", "index": 0, "_selected_action": [dead.pk]},
        follow=True,
    )
    assert [str(m) for m in response.context["messages"]] == ["Revived 1, skipped 0."]
    assert DeadLetter.objects.get(pk=dead.pk).state == DeadLetterState.REVIVED
    assert queued_topics() == {"pool.admin": 1, dead.topic: 1}
    page = admin_client.get(reverse("admin:django_pgqueue_deadletter_changelist"))
    assert page.status_code == 200 and dead.pk in {d.pk for d in page.context["cl"].result_list}


# --- settings that cannot work behind a pooler ---------------------------------


def test_listening_behind_a_transaction_pooler_is_a_warning(monkeypatch, settings):
    database = settings.DATABASES["default"]
    monkeypatch.setitem(database, "DISABLE_SERVER_SIDE_CURSORS", True)
    [warning] = pgqueue_checks.check_database()
    assert warning.id == "pgqueue.W102"
    assert "PGQUEUE['NOTIFY'] is True" in warning.msg and "NOTIFY'] = False" in warning.hint
    settings.PGQUEUE = {"NOTIFY": False}
    assert pgqueue_checks.check_database() == []


def test_server_side_binding_is_an_error(monkeypatch, settings):
    options = {**settings.DATABASES["default"]["OPTIONS"], "server_side_binding": True}
    monkeypatch.setitem(settings.DATABASES["default"], "OPTIONS", options)
    [error] = pgqueue_checks.check_database()
    assert error.id == "pgqueue.E105"


@pytest.mark.parametrize("level", ["REPEATABLE_READ", "SERIALIZABLE"])
def test_an_isolation_level_above_read_committed_is_an_error(monkeypatch, settings, level):
    import psycopg

    isolation = getattr(psycopg.IsolationLevel, level)
    options = {**settings.DATABASES["default"]["OPTIONS"], "isolation_level": isolation}
    monkeypatch.setitem(settings.DATABASES["default"], "OPTIONS", options)
    [error] = pgqueue_checks.check_database()
    assert error.id == "pgqueue.E106" and level in error.msg
    options["isolation_level"] = psycopg.IsolationLevel.READ_COMMITTED
    assert pgqueue_checks.check_database() == []
