"""Fixtures shared by the test modules.

Everything runs against the real PostgreSQL of DATABASE_URL: pytest-django
creates the test databases (test_<name>) for both aliases and migrates them.
"""

import contextlib
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import psycopg
import pytest
from django.db import connections

from django_pgqueue.notify import CHANNEL


def raw_connection(alias="default", **kwargs):
    """A psycopg connection of its own (not Django's) to the test database of ``alias``."""
    params = connections[alias].settings_dict
    return psycopg.connect(
        dbname=params["NAME"],
        user=params["USER"] or None,
        password=params["PASSWORD"] or None,
        host=params["HOST"] or None,
        port=params["PORT"] or None,
        **kwargs,
    )


# Process-level modules: real worker processes, in-process workers with their
# threads, a browser, PgBouncer, a throwaway cluster. With every test that
# starts a worker process (the start_worker fixture), they are marked slow:
# one env of the tox matrix (py312-dj61) runs them, the others run the rest
# (-m "not slow"), which is where Python and Django versions differ.
PROCESS_LEVEL_MODULES = frozenset(
    {
        "tests.test_worker",
        "tests.test_worker_processes",
        "tests.test_browser",
        "tests.test_pgbouncer",
        "tests.test_db_limits",
        "tests.test_chaos",
    }
)


DOCS_IMAGES = Path(__file__).resolve().parent.parent / "docs" / "images"


def pytest_addoption(parser):
    parser.addoption(
        "--docs-images",
        action="store_true",
        help="write the screenshots that the documentation shows into docs/images/ "
        "(tests/test_tutorial_screens.py, tests/test_overview_browser.py); without it "
        "every screenshot goes to a temporary folder and the tree stays as it was",
    )


@pytest.fixture
def screenshots(request, tmp_path_factory):
    """The folder a browser test writes its screenshots to: a temporary one
    (pytest's, kept for the last few runs: the path is in the failure's
    report), or, for the documentation's own images and only when the run
    asks for them with --docs-images, ``docs/images/<docs_folder>``. So a
    run of the suite leaves the tree as it found it."""

    def folder(docs_folder=None):
        if docs_folder is not None and request.config.getoption("--docs-images"):
            path = DOCS_IMAGES / docs_folder
            path.mkdir(parents=True, exist_ok=True)
            return path
        return tmp_path_factory.mktemp("screenshots")

    return folder


def pytest_collection_modifyitems(items):
    for item in items:
        if item.module.__name__ in PROCESS_LEVEL_MODULES or "start_worker" in getattr(
            item, "fixturenames", ()
        ):
            item.add_marker(pytest.mark.slow)


class SharedServer:
    """A PostgreSQL server that ``DATABASES`` points at: the suite connects to
    it and never stops, restarts or reconfigures it (the tests that crash
    PostgreSQL run a throwaway cluster of their own: tests/test_chaos.py)."""

    def __init__(self, host, port, user, password):
        self.host, self.port, self.user, self.password = host, port, user, password

    def __repr__(self):
        return f"the PostgreSQL server at {self.host or 'localhost'}:{self.port or 5432}"

    def connect(self):
        # The maintenance database, as Django's own test-database setup uses.
        return psycopg.connect(
            dbname="postgres",
            user=self.user or None,
            password=self.password or None,
            host=self.host or None,
            port=self.port or None,
            connect_timeout=10,
            autocommit=True,
        )

    def state(self):
        """When its postmaster started and last (re)loaded its configuration."""
        with self.connect() as conn:
            return conn.execute("SELECT pg_postmaster_start_time(), pg_conf_load_time()").fetchone()

    def major(self):
        """Its major version (15), or None when it does not answer."""
        try:
            with self.connect() as conn:
                return conn.info.server_version // 10000
        except psycopg.OperationalError:
            return None


def shared_servers():
    """The distinct servers of ``settings.DATABASES``, the default alias's first."""
    from django.conf import settings

    servers = {}
    for params in settings.DATABASES.values():
        key = (params.get("HOST") or "", str(params.get("PORT") or ""))
        if key not in servers:
            servers[key] = SharedServer(
                params.get("HOST"), params.get("PORT"), params.get("USER"), params.get("PASSWORD")
            )
    return list(servers.values())


def shared_server_changes(before):
    """What became of each server of ``before`` ({server: its state()}) since:
    a list of problems, empty when none was restarted or reloaded."""
    problems = []
    for server, (started, loaded) in before.items():
        try:
            now_started, now_loaded = server.state()
        except psycopg.OperationalError as exc:
            problems.append(f"{server!r} no longer answers: {str(exc).strip()}")
            continue
        if now_started != started:
            problems.append(
                f"{server!r} was restarted: up since {started}, now since {now_started}"
            )
        elif now_loaded != loaded:
            problems.append(
                f"{server!r} reloaded its configuration: at {loaded}, now at {now_loaded}"
            )
    return problems


@pytest.fixture(scope="session", autouse=True)
def flush_only_tables_with_rows():
    """A transactional test's teardown empties the test databases with
    Django's flush: one TRUNCATE of every table, about 100 ms of the
    server's time for our 25 (each table gets new files), after every such
    test. TRUNCATE the tables that hold rows only (one query finds them):
    the same end state, a fraction of the cost."""
    from django.db.backends.postgresql.operations import DatabaseOperations

    flush = DatabaseOperations.sql_flush

    def sql_flush(self, style, tables, *, reset_sequences=False, allow_cascade=False):
        if tables and not reset_sequences:
            quote = self.quote_name
            probe = ", ".join(f"EXISTS (SELECT FROM {quote(table)})" for table in tables)
            with self.connection.cursor() as cursor:
                cursor.execute(f"SELECT {probe}")
                held = cursor.fetchone()
            tables = [table for table, has_rows in zip(tables, held, strict=True) if has_rows]
            # A table that an empty one references is truncated with it
            # (CASCADE): PostgreSQL refuses it alone, rows or not.
            allow_cascade = True
        return flush(
            self, style, tables, reset_sequences=reset_sequences, allow_cascade=allow_cascade
        )

    DatabaseOperations.sql_flush = sql_flush
    yield
    DatabaseOperations.sql_flush = flush


@pytest.fixture(scope="session", autouse=True)
def shared_servers_untouched():
    """Fails the run (an error at the last teardown) if a server of DATABASES
    was restarted, or its configuration reloaded, while the suite ran: its
    postmaster's start time and configuration load time must be those found at
    the start. Per pytest process, so under xdist each worker checks."""
    before = {}
    for server in shared_servers():
        try:
            before[server] = server.state()
        except psycopg.OperationalError:
            pass  # down from the start: the tests that need it fail on their own
    yield
    problems = shared_server_changes(before)
    if problems:
        pytest.fail(
            "the test suite must never stop, restart or reconfigure a server it did not start:\n"
            + "\n".join(problems),
            pytrace=False,
        )


@contextlib.contextmanager
def unreachable(alias):
    """The database ``alias`` does not answer inside the block: its connection
    is closed and pointed at port 1; both put back afterwards."""
    connection = connections[alias]
    port = connection.settings_dict["PORT"]
    connection.close()
    connection.settings_dict["PORT"] = 1
    try:
        yield
    finally:
        connection.close()
        connection.settings_dict["PORT"] = port


@pytest.fixture
def other_connection(transactional_db):
    """A second, independent client: sees only what has been committed."""
    with raw_connection(autocommit=True) as conn:
        yield conn


class Listener:
    """A second real connection that LISTENs on the wake-up channel."""

    def __init__(self, conn):
        self.conn = conn
        conn.execute(f"LISTEN {CHANNEL}")

    def received(self, timeout, stop_after=None):
        """Notifications that arrive within ``timeout`` seconds, as (channel, payload)."""
        return [
            (n.channel, n.payload)
            for n in self.conn.notifies(timeout=timeout, stop_after=stop_after)
        ]

    def wait_for(self, count, timeout=5.0):
        """Collect notifications until ``count`` arrived or ``timeout`` passed."""
        got = []
        deadline = time.monotonic() + timeout
        while len(got) < count and time.monotonic() < deadline:
            remaining = deadline - time.monotonic()
            got.extend(self.received(timeout=remaining, stop_after=count - len(got)))
        return got


@pytest.fixture
def listener(transactional_db):
    with raw_connection(autocommit=True) as conn:
        yield Listener(conn)


def wait_until(predicate, timeout=60.0, interval=0.02, message="condition"):
    """Poll ``predicate`` until it is true; fail with ``message`` after
    ``timeout``. The bound stops a broken test, nothing more: far above the
    normal case (a loaded machine runs a process-level step ten times
    slower), and only shorter where the test asserts that something comes
    before something else that is slower still (a poll of 120 s, say)."""
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {message}")
        time.sleep(interval)


def run_benchmark(scenario, *args, env=None, timeout=300):
    """``python -m benchmarks SCENARIO ARGS`` to its end, as a
    ``CompletedProcess`` (text). It and the workers it starts end with this
    process, even one killed outright (``start_scenario``), and its process
    group is killed on the way out, whatever happened."""
    from benchmarks.harness.processes import start_scenario

    run = start_scenario(
        scenario,
        [str(arg) for arg in args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        stdout, stderr = run.communicate(timeout=timeout)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(run.pid, signal.SIGKILL)
        run.wait()
    return subprocess.CompletedProcess(run.args, run.returncode, stdout, stderr)


@pytest.fixture
def make_message():
    """Fabricate a Message row in exactly the state a test needs."""
    import datetime
    import uuid

    from django.utils import timezone

    from django_pgqueue.models import Message, Status

    def make(topic="test.record", payload=None, **fields):
        now = timezone.now()
        if fields.get("status") == Status.PROCESSING:
            fields.setdefault("lease_token", uuid.uuid4())
            fields.setdefault("lease_expires_at", now + datetime.timedelta(seconds=60))
            fields.setdefault("locked_by", "test-worker")
            fields.setdefault("attempts", 1)
        fields.setdefault("run_at", now)
        return Message.objects.create(topic=topic, payload=payload or {}, **fields)

    return make


@pytest.fixture
def make_dead_letter():
    """Fabricate a DeadLetter row; every field can be given."""
    counter = iter(range(1_000_000, 2_000_000))

    from django_pgqueue.models import Category, DeadLetter

    def make(topic="test.record", **fields):
        fields.setdefault("message_id", next(counter))
        fields.setdefault("queue", "default")
        fields.setdefault("payload", {"n": 1})
        fields.setdefault("category", Category.TRANSIENT)
        fields.setdefault("reason", "ConnectionError: downstream is down\nmore lines")
        fields.setdefault("attempts", 5)
        return DeadLetter.objects.create(topic=topic, **fields)

    return make


MANAGE = __import__("pathlib").Path(__file__).resolve().parent.parent / "testproject" / "manage.py"


def database_url(alias):
    """A URL for the test database behind ``alias``, for child processes."""
    from urllib.parse import quote

    params = connections[alias].settings_dict
    auth = quote(params["USER"] or "")
    if params["PASSWORD"]:
        auth += ":" + quote(params["PASSWORD"])
    host = params["HOST"] or "localhost"
    port = params["PORT"] or 5432
    return f"postgres://{auth}@{host}:{port}/{params['NAME']}"


class WorkerProcess:
    """A real ``manage.py pgqueue_worker`` process on the test database."""

    def __init__(self, args, log_path, pgqueue=None, env=None):
        import json
        import os
        import subprocess
        import sys

        env = {
            **os.environ,
            "DATABASE_URL": database_url("default"),
            "OTHER_DATABASE_URL": database_url("other"),
            "PYTHONUNBUFFERED": "1",
            # The worker's PGQUEUE setting (testproject/settings.py reads it).
            "PGQUEUE_JSON": json.dumps(pgqueue or {}),
            # Last, so they win: DATABASE_URL through PgBouncer, another role...
            **(env or {}),
        }
        self.log_path = log_path
        self._log = open(log_path, "w")  # noqa: SIM115  (closed in stop())
        from benchmarks.harness.processes import die_with_parent

        # It ends with this test process, even one killed outright: a worker
        # left behind would hold the test database, and the next run could
        # not drop it.
        self.popen = subprocess.Popen(
            [sys.executable, str(MANAGE), "pgqueue_worker", *args],
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            preexec_fn=die_with_parent(),
        )
        self.pid = self.popen.pid

    def log(self):
        return self.log_path.read_text()

    def signal(self, signum):
        self.popen.send_signal(signum)

    def wait(self, timeout=60):
        return self.popen.wait(timeout=timeout)

    def kill(self):
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait(timeout=10)
        self._log.close()


@pytest.fixture
def start_worker(transactional_db, tmp_path):
    """Start worker processes (``env``: environment variables that override
    the test database's); every one still alive at teardown is killed."""
    started = []

    def start(*args, pgqueue=None, env=None):
        worker = WorkerProcess(
            args, tmp_path / f"worker-{len(started)}.log", pgqueue=pgqueue, env=env
        )
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.kill()


class InvariantChecker:
    """Checks, many times a second from its own connection and in one snapshot
    per check, that every message is in exactly one of: the queue, done (its
    atomic handler's ledger row), the dead letters."""

    SQL = """
        SELECT i FROM unnest(%s::bigint[]) AS i
        WHERE (EXISTS (SELECT 1 FROM django_pgqueue_message WHERE id = i))::int
            + (EXISTS (SELECT 1 FROM demo_handled WHERE message_id = i))::int
            + (EXISTS (SELECT 1 FROM django_pgqueue_deadletter WHERE message_id = i))::int
            <> 1
    """

    def __init__(self, ids):
        import threading

        self.ids = list(ids)
        self.checks = 0
        self.violations = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        with raw_connection(autocommit=True) as conn:
            while not self._stop.is_set():
                bad = [row[0] for row in conn.execute(self.SQL, [self.ids])]
                if bad:
                    self.violations.append(bad)
                self.checks += 1
                self._stop.wait(0.02)

    def stop(self):
        self._stop.set()
        self._thread.join(timeout=10)
        assert self.checks > 0, "the invariant was never checked"
        assert not self.violations, (
            f"messages in none or two of queue/done/dead-letter: {self.violations[:3]}"
        )


@contextlib.contextmanager
def running_worker(**options):
    """A Worker running in a thread of this process until the block ends."""
    from django_pgqueue.worker import Worker

    worker = Worker(**options)
    errors = []

    def run():
        try:
            worker.run()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    thread = threading.Thread(target=run, name="test-worker")
    thread.start()
    try:
        yield worker
    finally:
        worker.stop()
        thread.join(timeout=30)
        assert not thread.is_alive(), "the worker did not stop"
        assert not errors, f"the worker crashed: {errors!r}"


@pytest.fixture(autouse=True)
def restore_pgqueue_log_level():
    """pgqueue_worker run in-process (call_command) sets the django_pgqueue
    logger's level for the rest of the process: put it back after each test,
    so that the next one's caplog sees what it expects."""
    import logging

    logger = logging.getLogger("django_pgqueue")
    level = logger.level
    yield
    logger.setLevel(level)
