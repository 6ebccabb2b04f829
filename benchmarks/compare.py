#!/usr/bin/env python
"""django-pgqueue side by side with a raw psycopg loop, pgqueuer, procrastinate
and Django's django.tasks (django-tasks-db backend), in one run.

    .venv/bin/python benchmarks/compare.py [--messages 20000] [--systems raw,pgqueue,...]

Every system gets a database of its own on the same server (bench_compare_<system>,
dropped and created again by every run), its own virtualenv under
benchmarks/.venvs/<system> (created with pinned versions unless --skip-install;
django-pgqueue and the raw loop run from the repo's .venv), and the same
measurements: enqueue rate (one message per transaction, and the system's bulk
API), drain throughput of a --messages backlog with 1 and 2 worker processes,
enqueue-commit-to-handler-start latency with an idle listening worker, the
statements per second of an idle worker, and the workers' peak RSS. The results
go to a JSON file and a Markdown table (also printed), with the ratios to the
raw loop and the PASS/FAIL list of django-pgqueue's targets. See
benchmarks/COMPARE.md for the methods.
"""

import argparse
import datetime
import json
import math
import os
import platform
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psycopg
from psycopg import sql

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import throughput  # noqa: E402
from throughput import busy_percent, cpu_times, git_commit, percentile  # noqa: E402

ROOT = BENCH.parent
TESTPROJECT = ROOT / "testproject"
PEERS = BENCH / "peers"
VENVS = BENCH / ".venvs"
RESULTS = BENCH / "results"
DEFAULT_SERVER = "postgres://postgres@127.0.0.1:5432"
APP_NAME = "bench_compare"  # this script's own connections, left out of every count

# --prefetch 200: a claim goes out while the previous batch still has work
# queued (README, Performance: tuning for short handlers). --subscriptions
# none: the testproject registers stream subscribers for the test suite; a
# project without any runs no stream thread, and the peers have no streams.
DEFAULT_PGQUEUE_WORKER_ARGS = "--concurrency 4 --batch-size 100 --prefetch 200 --subscriptions none"

# Targets of the issue for django-pgqueue, checked as ratios in the same run.
TARGET_NONATOMIC_VS_RAW = 0.5  # atomic=False, 1 process, vs raw batch-100, 1 process
TARGET_ATOMIC_JOBS = 5000.0  # atomic=True, 1 process
TARGET_ENQUEUE_VS_RAW = 0.7  # enqueue() one per transaction vs raw one per transaction
TARGET_ENQUEUE_MANY = 50000.0  # enqueue_many, messages/s
TARGET_P50_MS = 3.0
TARGET_P99_MS = 15.0
TARGET_NONATOMIC_VS_PGQUEUER = 2.0
TARGET_ATOMIC_VS_PGQUEUER = 1.0
TARGET_VS_SLOW_PEERS = 20.0  # procrastinate and django-tasks-db

# --repeat runs each drain configuration several times (the median counts),
# except one whose drain took longer than this: slow enough to be steady.
REPEAT_MAX_DRAIN_S = 20.0

_LIVE = set()  # processes not yet reaped: killed on any exit


class StepFailed(Exception):
    """One measurement of one system failed; the run goes on with the next."""


# --- processes --------------------------------------------------------------------------


class Proc:
    """A worker process in a session of its own (ctrl-c reaches only this
    script, which then kills it), output to a log file, peak RSS sampled from
    /proc/<pid>/status (VmHWM) while it runs."""

    def __init__(self, argv, env, cwd, log_path):
        self.argv = [str(a) for a in argv]
        self.log_path = Path(log_path)
        self._log = open(self.log_path, "wb")  # noqa: SIM115  (closed in wait)
        self.started = time.perf_counter()
        self.proc = subprocess.Popen(
            self.argv,
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        _LIVE.add(self)
        self.pid = self.proc.pid
        self.ended = None
        self.returncode = None
        self.hwm_kib = 0
        threading.Thread(target=self._sample_hwm, daemon=True).start()

    # VmHWM sampled while it runs, as throughput.py's workers do.
    _sample_hwm = throughput.WorkerProcess._sample_hwm

    def poll(self):
        if self.returncode is None and self.proc.poll() is not None:
            self._reaped()
        return self.returncode

    def _reaped(self):
        self.ended = time.perf_counter()
        self.returncode = self.proc.returncode
        self._log.close()
        _LIVE.discard(self)

    def wait(self, timeout):
        """Reap; on timeout kill the process group and return None."""
        if self.returncode is not None:
            return self.returncode
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return None
        self._reaped()
        return self.returncode

    def terminate(self, timeout=30.0):
        """SIGTERM, then SIGKILL after ``timeout``; returns the exit code (None if killed)."""
        if self.poll() is None:
            try:
                os.kill(self.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        return self.wait(timeout)

    def kill(self):
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
        if self.returncode is None:
            self._reaped()

    @property
    def peak_rss_mib(self):
        return self.hwm_kib / 1024.0

    def log_tail(self, lines=15):
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


def kill_all():
    for proc in list(_LIVE):
        proc.kill()


# --- database helpers -------------------------------------------------------------------


def url_for(server, dbname):
    return f"{server.rstrip('/')}/{dbname}"


def connect(url, autocommit=True):
    return psycopg.connect(url, autocommit=autocommit, application_name=APP_NAME)


def recreate_database(server, name):
    if "bench" not in name:
        raise SystemExit(f"refusing to drop {name!r}: not a bench database")
    with connect(url_for(server, "postgres")) as conn:
        conn.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))


class Stats:
    """A connection to the ``postgres`` database: reading the statistics views
    does not count as activity of a measured database."""

    def __init__(self, server):
        self.conn = connect(url_for(server, "postgres"))

    def value(self, query, params=None):
        return self.conn.execute(query, params).fetchone()[0]

    def transactions(self, dbname):
        return self.value(
            "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = %s", [dbname]
        )

    def backends(self, dbname):
        """[(pid, application_name, state, query_start, query)] of the clients of ``dbname``
        other than this script."""
        return self.conn.execute(
            "SELECT pid, application_name, state, query_start, query FROM pg_stat_activity"
            " WHERE datname = %s AND backend_type = 'client backend'"
            " AND application_name <> %s",
            [dbname, APP_NAME],
        ).fetchall()

    def wait_no_clients(self, dbname, timeout=15.0):
        """Wait until no client (this script's own included) is connected to
        ``dbname``: a backend reports its pending statistics as it exits."""
        query = (
            "SELECT count(*) FROM pg_stat_activity WHERE datname = %s"
            " AND backend_type = 'client backend'"
        )
        deadline = time.monotonic() + timeout
        while self.value(query, [dbname]) and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.1)

    def close(self):
        self.conn.close()


# --- the systems ------------------------------------------------------------------------


@dataclass
class Variant:
    key: str  # e.g. "atomic", "batch100"
    label: str  # the table's row label
    client: str = ""  # --variant for the client script (topic / handler)
    worker_args: list = field(default_factory=list)  # added to the system's worker args


class System:
    name = ""
    label = ""
    pins = []  # pip requirements of benchmarks/.venvs/<name>; none: the repo's .venv
    python_min = (3, 11)
    script = ""
    tables = []  # emptied before every measurement, VACUUM ANALYZEd before a drain
    poll_note = ""  # what the idle worker waits on
    bulk_note = ""
    single_note = ""
    worker_note = ""
    latency_from = "file"  # "file": the handler appends to BENCH_LATENCY_FILE; "sql"

    # SQL the monitor runs on the system's database
    first_key_sql = ""  # the job claimed first (min id)
    claimed_sql = ""  # %s = that key: true once it left the waiting state
    empty_sql = ""  # true when no job is waiting or running
    remaining_sql = ""  # jobs not finished (read on timeout only)
    verify_sql = ""  # (finished ok, failed) after a drain; None when not kept

    def __init__(self, opts):
        self.opts = opts
        self.dbname = f"bench_compare_{self.name.replace('-', '_')}"
        self.url = url_for(opts.server, self.dbname)
        self.worker_args = shlex.split(opts.worker_args.get(self.name, self.default_worker_args()))
        self.skip_reason = None
        self.info = {}
        self.freeze = None

    # -- environment --

    @property
    def venv(self):
        return VENVS / self.name

    @property
    def python(self):
        return Path(sys.executable) if not self.pins else self.venv / "bin" / "python"

    def bin(self, name):
        return self.venv / "bin" / name

    def env(self, **extra):
        env = dict(os.environ)
        for key in ("DJANGO_SETTINGS_MODULE", "PYTHONPATH", "VIRTUAL_ENV"):
            env.pop(key, None)
        env.update(BENCH_DSN=self.url, PYTHONPATH=str(PEERS), PYTHONUNBUFFERED="1")
        env.update(extra)
        return env

    def default_worker_args(self):
        return ""

    def variants(self):
        return [Variant("default", self.label)]

    def base_interpreter(self):
        return sys.executable

    def install(self, log_dir):
        """Create benchmarks/.venvs/<name> with the pins (kept when they already match)."""
        if not self.pins:
            return
        marker = self.venv / ".bench-pins"
        wanted = "\n".join(self.pins) + "\n"
        if self.python.exists() and marker.exists() and marker.read_text() == wanted:
            return
        if self.opts.skip_install:
            raise StepFailed(f"{self.venv} is missing or not at the pins, and --skip-install")
        interpreter = self.base_interpreter()
        print(f"  installing {', '.join(self.pins)} into {self.venv}", file=sys.stderr)
        shutil.rmtree(self.venv, ignore_errors=True)
        log = Path(log_dir) / f"install-{self.name}.log"
        with open(log, "wb") as out:
            steps = [
                [interpreter, "-m", "venv", str(self.venv)],
                [self.python, "-m", "pip", "install", "--disable-pip-version-check", "-q",
                 *self.pins],
            ]  # fmt: skip
            for step in steps:
                done = subprocess.run(step, stdout=out, stderr=subprocess.STDOUT, check=False)
                if done.returncode != 0:
                    text = log.read_text(errors="replace").splitlines()
                    errors = [ln for ln in text if "ERROR" in ln] or text[-5:]
                    errors = [e if len(e) < 160 else e[:100] + " ... " + e[-50:] for e in errors]
                    raise StepFailed(f"install failed ({log}): " + " | ".join(errors[-3:]))
        marker.write_text(wanted)

    def pip_freeze(self):
        done = subprocess.run(
            [self.python, "-m", "pip", "freeze", "--disable-pip-version-check"],
            capture_output=True,
            text=True,
            check=False,
        )
        return done.stdout.split() if done.returncode == 0 else None

    # -- database --

    def setup_database(self):
        recreate_database(self.opts.server, self.dbname)
        self.create_schema()

    def create_schema(self):
        self.client("setup")

    def reset(self):
        with connect(self.url) as conn:
            conn.execute(f"TRUNCATE {', '.join(self.tables)} RESTART IDENTITY CASCADE")

    def vacuum(self):
        with connect(self.url) as conn:
            for table in self.tables:
                conn.execute(f"VACUUM ANALYZE {table}")

    def run_checked(self, argv, what, cwd=None, env=None, timeout=600):
        try:
            done = subprocess.run(
                [str(a) for a in argv],
                cwd=cwd or ROOT,
                env=env or self.env(),
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            raise StepFailed(f"{what}: timed out after {timeout}s") from exc
        if done.returncode != 0:
            tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-8:])
            raise StepFailed(f"{what} exited {done.returncode}:\n{tail}")
        return done.stdout

    def client(self, op, *args, timeout=900):
        """Run one operation of the system's client script; returns its JSON answer."""
        out = self.run_checked(
            [self.python, PEERS / self.script, op, *args],
            f"{self.name} {op}",
            env=self.client_env(),
            timeout=timeout,
        )
        lines = [ln for ln in out.strip().splitlines() if ln.startswith("{")]
        if not lines:
            raise StepFailed(f"{self.name} {op}: no JSON answer in {out[-500:]!r}")
        return json.loads(lines[-1])

    def client_env(self):
        return self.env()

    # -- workers --

    def worker_argv(self, variant, burst):
        raise NotImplementedError

    def worker_env(self, latency_file=None):
        env = self.env()
        if latency_file:
            env["BENCH_LATENCY_FILE"] = str(latency_file)
        return env

    def worker_cwd(self):
        return PEERS

    def start_worker(self, variant, burst, log_name, latency_file=None):
        argv = self.worker_argv(variant, burst)
        return Proc(
            argv,
            self.worker_env(latency_file),
            self.worker_cwd(),
            self.opts.log_dir / f"{self.name}-{log_name}.log",
        )

    def command_text(self, variant, burst):
        argv = [str(a) for a in self.worker_argv(variant, burst)]
        for prefix in (str(self.venv / "bin") + "/", str(Path(sys.executable).parent) + "/"):
            argv = [a.replace(prefix, "") for a in argv]
        return " ".join(shlex.quote(str(a).replace(str(ROOT) + "/", "")) for a in argv)

    # -- latency --

    def latency_results(self, latency_file):
        """{key: handler start (epoch seconds)}, keys may repeat (then: list)."""
        found = {}
        try:
            text = Path(latency_file).read_text()
        except FileNotFoundError:
            return found
        for line in text.splitlines():
            parts = line.split()
            if len(parts) == 2:
                found.setdefault(parts[0], []).append(float(parts[1]))
        return found


class Raw(System):
    name = "raw"
    label = "raw psycopg loop"
    script = "bench_raw.py"
    tables = ["raw_jobs"]
    single_note = "autocommit `INSERT INTO raw_jobs (payload) VALUES (%s)`"
    bulk_note = "one `INSERT ... SELECT FROM unnest(%s::jsonb[])`"
    worker_note = (
        "`bench_raw.py worker --batch N`: per transaction `DELETE ... WHERE id IN (SELECT id"
        " ... ORDER BY id LIMIT N FOR UPDATE SKIP LOCKED) RETURNING`"
    )
    poll_note = "LISTEN, poll every 5 s"
    first_key_sql = "SELECT min(id) FROM raw_jobs"
    claimed_sql = "SELECT NOT EXISTS (SELECT 1 FROM raw_jobs WHERE id = %s)"
    empty_sql = "SELECT NOT EXISTS (SELECT 1 FROM raw_jobs)"
    remaining_sql = "SELECT count(*) FROM raw_jobs"

    def variants(self):
        return [
            Variant("batch1", "raw loop, batch 1", worker_args=["--batch", "1"]),
            Variant("batch100", "raw loop, batch 100", worker_args=["--batch", "100"]),
        ]

    def worker_argv(self, variant, burst):
        variant = variant or self.variants()[-1]
        argv = [self.python, PEERS / self.script, "worker", *self.worker_args, *variant.worker_args]
        return argv + (["--burst"] if burst else ["--latency"])


class PgQueue(System):
    name = "pgqueue"
    label = "django-pgqueue"
    script = "bench_pgqueue.py"
    tables = [
        "django_pgqueue_message",
        "django_pgqueue_deadletter",
        "django_pgqueue_workerheartbeat",
        "demo_handled",
    ]
    latency_from = "sql"
    single_note = "`enqueue(topic, payload)` in autocommit"
    bulk_note = "`enqueue_many(items, topic=...)`, one statement"
    first_key_sql = "SELECT min(id) FROM django_pgqueue_message"
    claimed_sql = (
        "SELECT coalesce((SELECT status <> 'waiting' FROM django_pgqueue_message WHERE id = %s),"
        " true)"
    )
    empty_sql = (
        "SELECT NOT (EXISTS (SELECT 1 FROM django_pgqueue_message WHERE status = 'processing')"
        " OR EXISTS (SELECT 1 FROM django_pgqueue_message WHERE status = 'waiting'))"
    )
    remaining_sql = (
        "SELECT count(*) FROM django_pgqueue_message WHERE status IN ('waiting', 'processing')"
    )
    verify_sql = (
        "SELECT (SELECT count(*) FROM django_pgqueue_message) = 0,"
        " (SELECT count(*) FROM django_pgqueue_deadletter)"
    )

    def __init__(self, opts):
        super().__init__(opts)
        self.worker_args = shlex.split(opts.pgqueue_worker_args)
        self.other_url = self.url + "_other"
        self.worker_note = (
            "`testproject/manage.py pgqueue_worker --log-level WARNING "
            + opts.pgqueue_worker_args
            + "` (`--burst` for the drains), DEBUG=False, OPTIONS prepare_threshold=5"
        )

    @property
    def poll_interval(self):
        for i, arg in enumerate(self.worker_args):
            if arg == "--poll-interval" and i + 1 < len(self.worker_args):
                return float(self.worker_args[i + 1])
            if arg.startswith("--poll-interval="):
                return float(arg.split("=", 1)[1])
        return float(self.info.get("poll_interval") or 5.0)

    @property
    def poll_note(self):
        return f"LISTEN, poll every {self.poll_interval:g} s"

    def variants(self):
        return [
            Variant("atomic", "django-pgqueue, atomic=True", client="atomic"),
            Variant("nonatomic", "django-pgqueue, atomic=False", client="nonatomic"),
        ]

    def env(self, **extra):
        env = super().env(**extra)
        env.update(
            DATABASE_URL=self.url,
            OTHER_DATABASE_URL=self.other_url,
            DEBUG="False",
            DJANGO_SETTINGS_MODULE="testproject.settings",
            PGQUEUE_LOG_LEVEL="WARNING",
        )
        return env

    def setup_database(self):
        recreate_database(self.opts.server, self.dbname)
        recreate_database(self.opts.server, self.dbname + "_other")
        for database in ("default", "other"):
            self.run_checked(
                [sys.executable, "manage.py", "migrate", "--noinput", "-v", "0",
                 "--database", database],
                f"manage.py migrate --database {database}",
                cwd=TESTPROJECT,
            )  # fmt: skip

    def worker_cwd(self):
        return TESTPROJECT

    def worker_argv(self, variant, burst):
        argv = [sys.executable, "manage.py", "pgqueue_worker", "--log-level", "WARNING"]
        return argv + self.worker_args + (["--burst"] if burst else [])

    def latency_results(self, latency_file):
        found = {}
        with connect(self.url) as conn:
            rows = conn.execute(
                "SELECT message_id, extract(epoch FROM handled_at)::float8 FROM demo_handled"
            ).fetchall()
        for pk, at in rows:
            found.setdefault(str(pk), []).append(at)
        return found


class PgQueuer(System):
    name = "pgqueuer"
    label = "pgqueuer"
    # typer 0.29 breaks pgqueuer 1.6's CLI (`--log-level` reaches it as a str).
    pins = [
        "pgqueuer[asyncpg,psycopg]==1.6.0",
        "asyncpg==0.32.0",
        "psycopg[binary]==3.3.9",
        "psycopg-pool==3.3.3",
        "typer==0.28.0",
    ]
    script = "bench_pgqueuer.py"
    tables = ["pgqueuer", "pgqueuer_log", "pgqueuer_statistics"]
    single_note = "`await queries.enqueue(entrypoint, payload)` (autocommit connection)"
    bulk_note = "`await queries.enqueue([...], [...], [...])`, one statement"
    poll_note = "LISTEN, dequeue timeout 30 s, health check every 10 s"
    first_key_sql = "SELECT min(id) FROM pgqueuer"
    claimed_sql = "SELECT coalesce((SELECT status <> 'queued' FROM pgqueuer WHERE id = %s), true)"
    empty_sql = "SELECT NOT EXISTS (SELECT 1 FROM pgqueuer)"
    remaining_sql = "SELECT count(*) FROM pgqueuer"
    verify_sql = (
        "SELECT NOT EXISTS (SELECT 1 FROM pgqueuer),"
        " (SELECT count(*) FROM pgqueuer_log WHERE status IN ('exception', 'failed'))"
    )

    def __init__(self, opts):
        super().__init__(opts)
        self.worker_note = (
            "`pgq run bench_pgqueuer:factory --log-level WARNING` (`--mode drain` for the"
            " drains), PgQueuer app, "
            + os.environ.get("BENCH_PGQUEUER_DRIVER", "asyncpg")
            + " driver"
            + (f", `{' '.join(self.worker_args)}`" if self.worker_args else "")
        )

    def variants(self):
        return [
            Variant("batch10", "pgqueuer, --batch-size 10 (default)", worker_args=[]),
            Variant("batch100", "pgqueuer, --batch-size 100", worker_args=["--batch-size", "100"]),
        ]

    def create_schema(self):
        self.run_checked([self.bin("pgq"), "--pg-dsn", self.url, "install"], "pgq install")

    def worker_argv(self, variant, burst):
        variant = variant or self.variants()[0]
        argv = [self.bin("pgq"), "run", "bench_pgqueuer:factory", "--log-level", "WARNING"]
        argv += self.worker_args + variant.worker_args
        return argv + (["--mode", "drain"] if burst else [])


class Procrastinate(System):
    name = "procrastinate"
    label = "procrastinate"
    pins = ["procrastinate==3.10.0", "psycopg[binary]==3.3.9", "psycopg-pool==3.3.3"]
    script = "bench_procrastinate.py"
    tables = [
        "procrastinate_jobs",
        "procrastinate_events",
        "procrastinate_periodic_defers",
        "procrastinate_workers",
    ]
    single_note = "`await task.defer_async(...)`"
    bulk_note = "`await task.batch_defer_async(*kwargs)`, one statement"
    poll_note = "LISTEN, poll every 5 s, heartbeat every 10 s"
    first_key_sql = "SELECT min(id) FROM procrastinate_jobs"
    claimed_sql = (
        "SELECT coalesce((SELECT status <> 'todo' FROM procrastinate_jobs WHERE id = %s), true)"
    )
    empty_sql = (
        "SELECT NOT EXISTS (SELECT 1 FROM procrastinate_jobs WHERE status IN ('todo', 'doing'))"
    )
    remaining_sql = "SELECT count(*) FROM procrastinate_jobs WHERE status IN ('todo', 'doing')"
    verify_sql = (
        "SELECT NOT EXISTS (SELECT 1 FROM procrastinate_jobs WHERE status <> 'succeeded'),"
        " (SELECT count(*) FROM procrastinate_jobs WHERE status = 'failed')"
    )

    def default_worker_args(self):
        return "--concurrency 4"

    def __init__(self, opts):
        super().__init__(opts)
        self.worker_note = (
            "`procrastinate --app bench_procrastinate_app.app worker "
            + " ".join(self.worker_args)
            + "` (`--one-shot` for the drains), PsycopgConnector, async tasks, jobs kept"
        )

    def create_schema(self):
        self.run_checked(
            [
                self.bin("procrastinate"),
                "--app",
                "bench_procrastinate_app.app",
                "schema",
                "--apply",
            ],
            "procrastinate schema --apply",
            cwd=PEERS,
        )

    def worker_argv(self, variant, burst):
        argv = [self.bin("procrastinate"), "--app", "bench_procrastinate_app.app", "worker"]
        return argv + self.worker_args + (["--one-shot"] if burst else [])


class DjangoTasks(System):
    name = "django-tasks-db"
    label = "django.tasks + django-tasks-db"
    pins = ["Django==6.1.3", "django-tasks-db==0.13.0", "psycopg[binary]==3.3.9"]
    python_min = (3, 12)
    script = "bench_django_tasks.py"
    tables = ["django_tasks_database_dbtaskresult"]
    single_note = "`task.enqueue(...)` in autocommit"
    bulk_note = "no bulk API: `task.enqueue()` in a loop inside one `transaction.atomic()`"
    poll_note = "polls every 1 s (`--interval`, no LISTEN)"
    first_key_sql = (
        "SELECT id FROM django_tasks_database_dbtaskresult"
        " ORDER BY priority DESC, run_after, enqueued_at LIMIT 1"
    )
    claimed_sql = (
        "SELECT coalesce((SELECT status <> 'READY' FROM django_tasks_database_dbtaskresult"
        " WHERE id = %s), true)"
    )
    empty_sql = (
        "SELECT NOT EXISTS (SELECT 1 FROM django_tasks_database_dbtaskresult"
        " WHERE status IN ('READY', 'RUNNING'))"
    )
    remaining_sql = (
        "SELECT count(*) FROM django_tasks_database_dbtaskresult"
        " WHERE status IN ('READY', 'RUNNING')"
    )
    verify_sql = (
        "SELECT NOT EXISTS (SELECT 1 FROM django_tasks_database_dbtaskresult"
        " WHERE status <> 'SUCCESSFUL'),"
        " (SELECT count(*) FROM django_tasks_database_dbtaskresult WHERE status = 'FAILED')"
    )

    def default_worker_args(self):
        return "--no-startup-delay"

    def __init__(self, opts):
        super().__init__(opts)
        self.worker_note = (
            "`python -m django db_worker "
            + " ".join(self.worker_args)
            + "` (`--batch` for the drains), DEBUG=False, CONN_MAX_AGE=None"
        )

    def env(self, **extra):
        env = super().env(**extra)
        env["DJANGO_SETTINGS_MODULE"] = "bench_django_tasks_settings"
        return env

    def base_interpreter(self):
        return find_python312()

    def create_schema(self):
        self.run_checked(
            [self.python, "-m", "django", "migrate", "--noinput", "-v", "0"],
            "django-tasks-db migrate",
            cwd=PEERS,
        )

    def worker_argv(self, variant, burst):
        argv = [self.python, "-m", "django", "db_worker", *self.worker_args]
        return argv + (["--batch"] if burst else [])


SYSTEMS = {cls.name: cls for cls in (Raw, PgQueue, PgQueuer, Procrastinate, DjangoTasks)}


def find_python312():
    """An interpreter >= 3.12 for Django 6: BENCH_PYTHON312, pyenv, or PATH."""
    candidates = []
    if os.environ.get("BENCH_PYTHON312"):
        candidates.append(os.environ["BENCH_PYTHON312"])
    if shutil.which("pyenv"):
        done = subprocess.run(["pyenv", "versions", "--bare"], capture_output=True, text=True)
        versions = []
        for line in done.stdout.split():
            parts = line.strip().split(".")
            if len(parts) >= 2 and parts[0] == "3" and parts[1].isdigit() and int(parts[1]) >= 12:
                if all(p.isdigit() for p in parts):
                    versions.append(tuple(int(p) for p in parts))
        for version in sorted(versions):  # the oldest >= 3.12 first: the best-tested
            text = ".".join(map(str, version))
            prefix = subprocess.run(["pyenv", "prefix", text], capture_output=True, text=True)
            if prefix.returncode == 0:
                candidates.append(str(Path(prefix.stdout.strip()) / "bin" / "python"))
    candidates += [shutil.which(n) for n in ("python3.12", "python3.13", "python3.14", "python3")]
    for candidate in candidates:
        if not candidate or not Path(candidate).exists():
            continue
        done = subprocess.run(
            [candidate, "-c", "import sys; print(sys.version_info >= (3, 12))"],
            capture_output=True,
            text=True,
            check=False,
        )
        if done.stdout.strip() == "True":
            return candidate
    raise StepFailed("no Python >= 3.12 found for Django 6 (set BENCH_PYTHON312)")


# --- measurements -----------------------------------------------------------------------


class DrainMonitor:
    """Watches one system's queue from a connection of its own: when the first
    job (the lowest key) leaves the waiting state, and when no job waits or
    runs any more. It polls every 5 ms at first, then every elapsed/200 (at
    most 100 ms), so the end is known to within 0.5%."""

    def __init__(self, system, first_key):
        self.system = system
        self.conn = connect(system.url)
        self.first_key = first_key
        self.first_claim = None
        self.empty = None
        self.queries = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.started = None

    def start(self):
        self.started = time.perf_counter()
        self._thread.start()

    def _run(self):
        while not self._stop.is_set() and self.empty is None:
            now = time.perf_counter()
            if self.first_claim is None:
                if self.conn.execute(self.system.claimed_sql, [self.first_key]).fetchone()[0]:
                    self.first_claim = now
            elif self.conn.execute(self.system.empty_sql).fetchone()[0]:
                self.empty = now
            self.queries += 1
            wait = (
                0.005
                if self.first_claim is None
                else min(0.1, max(0.005, (now - self.first_claim) / 200))
            )
            self._stop.wait(wait)

    def stop(self):
        self._stop.set()
        self._thread.join()
        self.conn.close()


def fill(system, variant, n):
    """Empty the tables, enqueue ``n`` messages with the bulk API, VACUUM ANALYZE."""
    system.reset()
    answer = system.client("enqueue-bulk", "--n", n, "--variant", variant.client)
    system.vacuum()
    return n / answer["seconds"]


def representative(repeats):
    """The median run of the repeats of one configuration (by jobs/s; the
    upper median of an even count), with every repeat's figures added."""
    measured = sorted((r for r in repeats if r.get("jobs_per_s")), key=lambda r: r["jobs_per_s"])
    run = dict(measured[len(measured) // 2] if measured else repeats[0])
    run["repeats"] = [r.get("jobs_per_s") for r in repeats]
    run["bulk_enqueue_all"] = [r["bulk_enqueue_per_s"] for r in repeats]
    run["peak_rss_mib"] = [max(x) for x in zip(*(r["peak_rss_mib"] for r in repeats), strict=True)]
    run["problems"] = [p for r in repeats for p in r["problems"]]
    run["timed_out"] = any(r["timed_out"] for r in repeats)
    run["all"] = repeats
    return run


def drain_run(system, stats, variant, processes, n, tag="r0"):
    """Fill the queue, start ``processes`` burst workers at once, and time the
    drain as the database sees it."""
    bulk_rate = fill(system, variant, n)
    with connect(system.url) as conn:
        first_key = conn.execute(system.first_key_sql).fetchone()[0]
    stats.wait_no_clients(system.dbname)
    xacts_before = stats.transactions(system.dbname)
    cpu_before = cpu_times()
    load_before = os.getloadavg()[0]
    monitor = DrainMonitor(system, first_key)
    monitor.start()
    started = time.perf_counter()
    workers = [
        system.start_worker(variant, True, f"drain-{variant.key}-{processes}p-{tag}-{i}")
        for i in range(processes)
    ]
    timeout = system.opts.run_timeout
    deadline = started + timeout
    timed_out = False
    try:
        while any(w.poll() is None for w in workers):
            if time.perf_counter() > deadline:
                timed_out = True
                break
            time.sleep(0.02)
        if not timed_out and monitor.empty is None:
            # Every worker exited: give the monitor a moment to see the end.
            end_wait = time.perf_counter() + 2.0
            while monitor.empty is None and time.perf_counter() < end_wait:
                time.sleep(0.01)
    finally:
        stop_at = time.perf_counter()
        monitor.stop()
        for w in workers:
            if w.poll() is None:
                w.kill()
    cpu_after = cpu_times()
    ended = max((w.ended or stop_at) for w in workers)
    run = {
        "variant": variant.key,
        "processes": processes,
        "messages": n,
        "bulk_enqueue_per_s": bulk_rate,
        "wall_s": ended - started,
        "exit_codes": [w.returncode for w in workers],
        "peak_rss_mib": [round(w.peak_rss_mib, 1) for w in workers],
        "machine_busy_percent": busy_percent(cpu_before, cpu_after),
        "load_average_1min_before": load_before,
        "monitor_queries": monitor.queries,
        "timed_out": timed_out,
        "problems": [],
    }
    if monitor.first_claim is None:
        run["problems"].append("the monitor never saw the first job claimed")
        run["jobs_per_s"] = None
    elif timed_out or monitor.empty is None:
        with connect(system.url) as conn:
            left = conn.execute(system.remaining_sql).fetchone()[0]
        done = n - left
        elapsed = stop_at - monitor.first_claim
        run["processed"] = done
        run["drain_s"] = elapsed
        run["jobs_per_s"] = done / elapsed if elapsed > 0 else None
        run["problems"].append(
            f"timeout after {timeout:g} s: {done} of {n} done"
            if timed_out
            else f"the workers exited with {left} job(s) left"
        )
    else:
        run["drain_s"] = monitor.empty - monitor.first_claim
        run["jobs_per_s"] = n / run["drain_s"]
        run["startup_s"] = monitor.first_claim - started  # start to the first claim
    if not timed_out:
        stats.wait_no_clients(system.dbname)
        xacts = stats.transactions(system.dbname) - xacts_before - monitor.queries
        run["transactions_per_job"] = xacts / n
        if system.verify_sql:
            with connect(system.url) as conn:
                ok, failed = conn.execute(system.verify_sql).fetchone()
            if not ok or failed:
                run["problems"].append(f"after the drain: finished ok={ok}, failed={failed}")
        bad = [w for w in workers if w.returncode not in (0, None)]
        for w in bad:
            run["problems"].append(f"worker exited {w.returncode}: {w.log_tail(5)}")
    return run


def wait_until(predicate, timeout, poll=0.02):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(poll)
    return predicate()


def start_listening_worker(system, name, latency_file):
    """Start a (non-burst) worker, send one warm-up message and wait until it
    is handled: then the worker has started and listens (or polls)."""
    system.reset()
    worker = system.start_worker(None, False, name, latency_file)
    warm = system.client("latency-enqueue", "--n", "1", "--spacing", "0", "--prefix", "warm")[
        "sent"
    ]
    keys = {k for k, _ in warm}

    def handled():
        if worker.poll() is not None:
            raise StepFailed(f"{name} worker exited {worker.returncode}:\n{worker.log_tail()}")
        return keys <= set(system.latency_results(latency_file))

    if not wait_until(handled, 60, poll=0.05):
        worker.kill()
        raise StepFailed(f"{name}: the warm-up message was not handled within 60 s")
    return worker, keys


def measure_latency(system, samples, spacing):
    latency_file = system.opts.log_dir / f"{system.name}-latency.txt"
    latency_file.unlink(missing_ok=True)
    worker, warm_keys = start_listening_worker(system, "latency", latency_file)
    try:
        time.sleep(1.0)  # let it go idle
        sent = system.client(
            "latency-enqueue", "--n", samples, "--spacing", spacing, timeout=samples * 5 + 60
        )["sent"]
        committed = {k: t for k, t in sent}

        def all_handled():
            return set(committed) <= set(system.latency_results(latency_file))

        complete = wait_until(all_handled, 30 + (5 if system.name == "django-tasks-db" else 0), 0.1)
    finally:
        code = worker.terminate()
    found = system.latency_results(latency_file)
    values, missing, dupes = [], 0, 0
    for key, at in committed.items():
        starts = found.get(key)
        if not starts:
            missing += 1
            continue
        if len(starts) > 1:
            dupes += 1
        values.append(1000.0 * (min(starts) - at))
    result = {
        "samples": samples,
        "spacing_ms": 1000.0 * spacing,
        "handled": len(values),
        "missing": missing,
        "duplicated": dupes,
        "complete": complete,
        "worker_exit": code,
        "peak_rss_mib": round(worker.peak_rss_mib, 1),
    }
    if values:
        result.update(
            p50_ms=percentile(values, 50),
            p95_ms=percentile(values, 95),
            p99_ms=percentile(values, 99),
            min_ms=min(values),
            max_ms=max(values),
            mean_ms=statistics.fmean(values),
        )
    return result


def measure_idle(system, stats, settle, window):
    """What an idle listening worker asks the database, two ways, both lower
    bounds of the statements it sends:

    - transactions: the system database's xact_commit + xact_rollback
      (pg_stat_database) over the window. Exact, but a transaction of several
      statements counts once, and a backend may hold its counters back for up
      to 10 s (PostgreSQL 15), hence the long settle before the window;
    - statements: every new (backend, query_start) in pg_stat_activity,
      sampled every ~5 ms (two statements of one backend between two samples
      count once, e.g. BEGIN; SELECT; COMMIT).

    This script's own connections are to the ``postgres`` database, so they
    count in neither. queries = the larger of the two."""
    latency_file = system.opts.log_dir / f"{system.name}-idle.txt"
    latency_file.unlink(missing_ok=True)
    system.vacuum()
    worker, _ = start_listening_worker(system, "idle", latency_file)
    seen = {}
    samples = 0

    def sample():
        for pid, app, _state, start, query in stats.backends(system.dbname):
            if start is not None:
                seen.setdefault((pid, start), (app, query))

    try:
        window_start = time.time() + settle
        while time.time() < window_start:
            sample()
            time.sleep(0.005)
        before = set(seen)
        xacts_before = stats.transactions(system.dbname)
        window_end = time.time() + window
        while time.time() < window_end:
            sample()
            samples += 1
            time.sleep(0.005)
        xacts = stats.transactions(system.dbname) - xacts_before
    finally:
        code = worker.terminate()
    lo = datetime.datetime.fromtimestamp(window_start, datetime.UTC)
    statements = {}
    count = 0
    for key, (_app, query) in seen.items():
        if key in before or key[1] < lo:
            continue
        count += 1
        text = " ".join(query.split())[:80]
        statements[text] = statements.get(text, 0) + 1
    queries = max(count, xacts)
    return {
        "window_s": window,
        "settle_s": settle,
        "queries": queries,
        "queries_per_s": queries / window,
        "statements": count,
        "statements_per_s": count / window,
        "by_query": dict(sorted(statements.items(), key=lambda kv: -kv[1])),
        "transactions": xacts,
        "transactions_per_s": xacts / window,
        "sample_every_ms": 1000.0 * window / max(samples, 1),
        "worker_exit": code,
        "peak_rss_mib": round(worker.peak_rss_mib, 1),
    }


def run_system(system, stats):
    opts = system.opts
    result = {"name": system.name, "label": system.label, "status": "ok", "errors": []}
    print(f"\n== {system.label}", file=sys.stderr)
    try:
        system.install(opts.log_dir)
        system.info = system.client("info")
        system.setup_database()
    except Exception as exc:  # cannot be installed or set up: not run, the others go on
        result["status"] = "not run"
        result["reason"] = (
            str(exc) if isinstance(exc, StepFailed) else f"{type(exc).__name__}: {exc}"
        )
        print(f"  NOT RUN: {exc}", file=sys.stderr)
        return result
    result["versions"] = system.info.get("versions")
    result["python"] = system.info.get("python")
    result["database"] = system.dbname
    result["worker_args"] = system.worker_args
    result["notes"] = {
        "worker": system.worker_note,
        "enqueue_single": system.single_note,
        "enqueue_bulk": system.bulk_note,
        "idle": system.poll_note,
    }
    if system.pins:
        result["pins"] = system.pins
        result["pip_freeze"] = system.pip_freeze()
    variants = system.variants()

    def step(what, fn):
        try:
            return fn()
        except Exception as exc:  # one measurement failed: record it, go on with the next
            text = str(exc) if isinstance(exc, StepFailed) else f"{type(exc).__name__}: {exc}"
            result["errors"].append(f"{what}: {text}")
            print(f"  {what} FAILED: {text}", file=sys.stderr)
            return None

    # Enqueue, one message per transaction: --repeat runs, the median counts
    # (a run is short, about a second, and commit latency here drifts).
    def single():
        rates = []
        for _ in range(opts.repeat):
            system.reset()
            answer = system.client(
                "enqueue-single", "--n", opts.enqueue_messages, "--variant", variants[0].client
            )
            rates.append(opts.enqueue_messages / answer["seconds"])
        return rates

    rates = step("enqueue one per transaction", single)
    rate = statistics.median(rates) if rates else None
    result["enqueue_single_per_s"] = rate
    result["enqueue_single_all"] = rates
    if rate:
        shown = ", ".join(f"{r:,.0f}" for r in rates)
        print(f"  enqueue, one per transaction: {rate:,.0f}/s (runs: {shown})", file=sys.stderr)

    # Drain throughput, 1 and 2 worker processes, per variant (each fills the queue
    # with the bulk API first: that is the bulk enqueue figure).
    result["variants"] = {}
    for variant in variants:
        runs = {}
        for processes in opts.processes:
            repeats = []
            for i in range(opts.repeat):
                run = step(
                    f"{variant.label}, {processes} process(es)",
                    lambda v=variant, p=processes, i=i: drain_run(
                        system, stats, v, p, opts.messages, f"r{i}"
                    ),
                )
                if run is None:
                    break
                repeats.append(run)
                jobs = run.get("jobs_per_s")
                note = f"; {'; '.join(run['problems'])}" if run["problems"] else ""
                print(
                    f"  {variant.label:38} {processes}p: "
                    + (f"{jobs:9,.0f} jobs/s" if jobs else "        -")
                    + f" (bulk enqueue {run['bulk_enqueue_per_s']:,.0f}/s){note}",
                    file=sys.stderr,
                )
                if run["timed_out"] or (run.get("drain_s") or 0) > REPEAT_MAX_DRAIN_S:
                    break  # slow enough to be steady: not repeated
            if repeats:
                runs[str(processes)] = representative(repeats)
        result["variants"][variant.key] = {
            "label": variant.label,
            "worker": system.command_text(variant, True),
            "runs": runs,
        }
    bulk = [
        rate
        for v in result["variants"].values()
        for r in v["runs"].values()
        for rate in r["bulk_enqueue_all"]
    ]
    result["enqueue_bulk_per_s"] = statistics.median(bulk) if bulk else None
    result["enqueue_bulk_all"] = bulk

    if opts.latency_samples:
        lat = step(
            "latency",
            lambda: measure_latency(system, opts.latency_samples, opts.latency_spacing_ms / 1000),
        )
        result["latency"] = lat
        if lat and "p50_ms" in lat:
            print(
                f"  latency p50 {lat['p50_ms']:.2f} ms, p95 {lat['p95_ms']:.2f} ms, "
                f"p99 {lat['p99_ms']:.2f} ms ({lat['handled']}/{lat['samples']})",
                file=sys.stderr,
            )
    if opts.idle_seconds:
        idle = step(
            "idle", lambda: measure_idle(system, stats, opts.idle_settle, opts.idle_seconds)
        )
        result["idle"] = idle
        if idle:
            print(
                f"  idle: {idle['queries']} queries in {idle['window_s']:g} s"
                f" ({idle['transactions']} transactions, {idle['statements']} statements seen)",
                file=sys.stderr,
            )
    if isinstance(system, PgQueue):
        result["poll_interval_s"] = system.poll_interval
    rss = [
        x
        for v in result["variants"].values()
        for r in v["runs"].values()
        for x in r["peak_rss_mib"]
    ]
    rss += [m["peak_rss_mib"] for m in (result.get("latency"), result.get("idle")) if m]
    result["peak_rss_mib"] = max(rss) if rss else None
    try:
        system.reset()
    except psycopg.Error:
        pass
    return result


# --- report -----------------------------------------------------------------------------


def jobs(result, variant, processes):
    try:
        run = result["variants"][variant]["runs"][str(processes)]
    except (KeyError, TypeError):
        return None, None
    return run.get("jobs_per_s"), run


def fmt_rate(value, run=None):
    if value is None:
        return "-"
    text = f"{value:,.0f}"
    if run and run.get("timed_out"):
        text += " (timeout)"
    elif run and run.get("problems"):
        text += " (!)"
    return text


def fmt_ratio(value, base):
    if value is None or not base:
        return "-"
    ratio = value / base
    return f"{ratio:.2f}" if ratio < 10 else f"{ratio:.1f}"


def build_targets(results, opts, drains_in_turn=None):
    """django-pgqueue's targets, each {target, value, required, met, note};
    met is None when a figure it needs was not measured. Drain ratios come
    from ``drains_in_turn`` (paired_drains) when it has them."""
    by = {r["name"]: r for r in results if r.get("status") == "ok"}
    raw, pgq = by.get("raw"), by.get("pgqueue")
    targets = []

    def add(name, required, value=None, met=None, note=""):
        targets.append(
            {"target": name, "value": value or "-", "required": required, "met": met,
             "note": note}
        )  # fmt: skip

    if not pgq:
        add("django-pgqueue targets", "-", note="django-pgqueue was not run")
        return targets
    atomic = jobs(pgq, "atomic", 1)[0]
    nonatomic = jobs(pgq, "nonatomic", 1)[0]
    raw100 = jobs(raw, "batch100", 1)[0] if raw else None

    name = "atomic=False throughput, 1 process"
    required = f">= {TARGET_NONATOMIC_VS_RAW:.0%} of raw batch-100"
    in_turn = paired_ratio(drains_in_turn, "pgqueue/nonatomic", "raw/batch100")
    if in_turn:
        ratio, pairs = in_turn
        value = (
            f"{ratio:.0%}, the median of {len(pairs)} rounds run in turn ("
            + ", ".join(f"{m:,.0f}/{o:,.0f}" for m, o in pairs)
            + ")"
        )
        add(name, required, value, ratio >= TARGET_NONATOMIC_VS_RAW)
    elif nonatomic and raw100:
        ratio = nonatomic / raw100
        value = f"{nonatomic:,.0f}/s = {ratio:.0%} of {raw100:,.0f}/s"
        add(name, required, value, ratio >= TARGET_NONATOMIC_VS_RAW)
    else:
        add(name, required, note="not measured")

    name = "atomic=True throughput, 1 process"
    required = f">= {TARGET_ATOMIC_JOBS:,.0f}/s"
    if atomic:
        add(name, required, f"{atomic:,.0f}/s", atomic >= TARGET_ATOMIC_JOBS)
    else:
        add(name, required, note="not measured")

    name = "enqueue(), one per transaction"
    required = f">= {TARGET_ENQUEUE_VS_RAW:.0%} of raw one-per-transaction"
    single, raw_single = pgq.get("enqueue_single_per_s"), (raw or {}).get("enqueue_single_per_s")
    paired = pgq.get("enqueue_single_paired")
    if paired:
        ratio = paired["ratio"]
        value = (
            f"{ratio:.0%}, the median of {len(paired['pairs'])} pairs run in turn ("
            + ", ".join(f"{q:,.0f}/{r:,.0f}" for r, q in paired["pairs"])
            + ")"
        )
        add(name, required, value, ratio >= TARGET_ENQUEUE_VS_RAW)
    elif single and raw_single:
        ratio = single / raw_single
        value = f"{single:,.0f}/s = {ratio:.0%} of {raw_single:,.0f}/s"
        add(name, required, value, ratio >= TARGET_ENQUEUE_VS_RAW)
    else:
        add(name, required, note="not measured")

    name = "enqueue_many()"
    required = f">= {TARGET_ENQUEUE_MANY:,.0f}/s"
    bulk = pgq.get("enqueue_bulk_per_s")
    if bulk:
        add(name, required, f"{bulk:,.0f}/s", bulk >= TARGET_ENQUEUE_MANY)
    else:
        add(name, required, note="not measured")

    lat = pgq.get("latency") or {}
    for key, limit in (("p50", TARGET_P50_MS), ("p99", TARGET_P99_MS)):
        name = f"latency {key}, commit to handler start"
        required = f"< {limit:g} ms"
        if f"{key}_ms" in lat:
            complete = lat["missing"] == 0 and lat["duplicated"] == 0
            note = "" if complete else f"{lat['missing']} missing, {lat['duplicated']} duplicated"
            value = lat[f"{key}_ms"]
            add(name, required, f"{value:.2f} ms", value < limit and complete, note)
        else:
            add(name, required, note="not measured")

    name = "idle worker: statements per poll interval"
    idle = pgq.get("idle")
    if idle:
        poll = pgq.get("poll_interval_s") or 5.0
        allowed = math.floor(idle["window_s"] / (0.9 * poll)) + 1
        value = f"{idle['queries']} in {idle['window_s']:g} s (poll {poll:g} s)"
        required = f"<= {allowed} (one per poll, +-10% jitter)"
        add(name, required, value, idle["queries"] <= allowed)
    else:
        add(name, "one per poll interval", note="not measured")

    for name, mine, peer, factor in (
        ("atomic=False vs pgqueuer", nonatomic, "pgqueuer", TARGET_NONATOMIC_VS_PGQUEUER),
        ("atomic=True vs pgqueuer", atomic, "pgqueuer", TARGET_ATOMIC_VS_PGQUEUER),
        ("atomic=True vs procrastinate", atomic, "procrastinate", TARGET_VS_SLOW_PEERS),
        ("atomic=True vs django-tasks-db", atomic, "django-tasks-db", TARGET_VS_SLOW_PEERS),
    ):
        required = f">= {factor:g}x (1 process, the peer's best variant)"
        if peer not in by:
            add(name, required, note=f"{peer} not run")
            continue
        # The peer's best one-process run over its variants.
        candidates = [
            (run.get("jobs_per_s"), variant["label"], run)
            for variant in by[peer]["variants"].values()
            if (run := variant["runs"].get("1")) and run.get("jobs_per_s")
        ]
        if not mine or not candidates:
            add(name, required, note="not measured")
            continue
        value, label, run = max(candidates, key=lambda c: c[0])
        note = "the peer hit the timeout: its rate is over the part drained" if run.get(
            "timed_out") else ""  # fmt: skip
        best = best_variant(by[peer])
        variant = "nonatomic" if name.startswith("atomic=False") else "atomic"
        in_turn = best and paired_ratio(drains_in_turn, f"pgqueue/{variant}", f"{peer}/{best[0]}")
        if in_turn:
            ratio, pairs = in_turn
            text = f"{ratio:.1f}x, the median of {len(pairs)} rounds run in turn ({label}: " + (
                ", ".join(f"{m:,.0f}/{o:,.0f}" for m, o in pairs) + ")"
            )
            add(name, required, text, ratio >= factor, note)
            continue
        text = f"{mine / value:.1f}x ({mine:,.0f} vs {value:,.0f}/s, {label})"
        add(name, required, text, mine / value >= factor, note)
    return targets


def markdown(report):
    results = report["systems"]
    by = {r["name"]: r for r in results if r.get("status") == "ok"}
    raw = by.get("raw", {})
    raw100 = jobs(raw, "batch100", 1)[0] if raw else None
    raw100_2 = jobs(raw, "batch100", 2)[0] if raw else None
    raw_single = raw.get("enqueue_single_per_s")
    raw_bulk = raw.get("enqueue_bulk_per_s")
    opts = report["options"]
    env = report["environment"]
    out = []
    out.append(
        f"{opts['messages']:,} no-op messages per drain, {opts['enqueue_messages']:,} for the "
        f"one-per-transaction enqueue; {env['cpus']} CPUs, PostgreSQL {env['postgres']} "
        f"(synchronous_commit={env['synchronous_commit']}), Python {env['python']}, "
        f"commit {env['commit']}, {report['started_at']}; load average (1 min) at start"
        f" {env['load_average_at_start'][0]:.1f}, at end {env['load_average_at_end'][0]:.1f}."
    )
    out.append("")
    header = [
        "system / variant",
        "drain 1 proc /s",
        "x raw b100",
        "drain 2 procs /s",
        "x raw b100 (2)",
        "enqueue 1/txn /s",
        "x raw",
        "bulk enqueue /s",
        "x raw",
        "latency p50 / p95 / p99 ms",
        "idle queries/s",
        "peak RSS MiB",
    ]
    out.append("| " + " | ".join(header) + " |")
    out.append("|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|")
    for r in results:
        if r.get("status") != "ok":
            out.append(
                f"| {r['label']} | not run: {r.get('reason', '?').splitlines()[0][:120]} |"
                + " |" * (len(header) - 2)
            )
            continue
        lat = r.get("latency") or {}
        lat_text = (
            f"{lat['p50_ms']:.1f} / {lat['p95_ms']:.1f} / {lat['p99_ms']:.1f}"
            if "p50_ms" in lat
            else "-"
        )
        if lat.get("missing") or lat.get("duplicated"):
            lat_text += f" ({lat['missing']} lost, {lat['duplicated']} dup)"
        idle = r.get("idle")
        idle_text = f"{idle['queries_per_s']:.2f}" if idle else "-"
        for key, variant in r["variants"].items():
            j1, run1 = jobs(r, key, 1)
            j2, run2 = jobs(r, key, 2)
            rss = [x for run in variant["runs"].values() for x in run["peak_rss_mib"]]
            out.append(
                "| "
                + " | ".join(
                    [
                        variant["label"],
                        fmt_rate(j1, run1),
                        fmt_ratio(j1, raw100),
                        fmt_rate(j2, run2),
                        fmt_ratio(j2, raw100_2),
                        fmt_rate(r.get("enqueue_single_per_s")),
                        fmt_ratio(r.get("enqueue_single_per_s"), raw_single),
                        fmt_rate(r.get("enqueue_bulk_per_s")),
                        fmt_ratio(r.get("enqueue_bulk_per_s"), raw_bulk),
                        lat_text,
                        idle_text,
                        f"{max(rss):.0f}" if rss else "-",
                    ]
                )
                + " |"
            )
    out.append("")
    out.append(
        "Drain: messages / (first job claimed to queue empty, watched in the database),"
        " burst workers, backlog VACUUM ANALYZEd first, median of up to"
        f" {opts['repeat']} runs (a drain longer than {REPEAT_MAX_DRAIN_S:g} s runs once);"
        " (timeout): the run hit --run-timeout, the rate is over the part drained;"
        " (!): see the JSON's problems. Enqueue one per transaction: median of"
        f" {opts['repeat']} runs. Enqueue and latency are per system (the same on"
        " each of its rows); x raw b100 (2) compares with the raw loop with 2 processes."
        " Latency: an idle listening worker, messages enqueued one at a time"
        f" {opts['latency_spacing_ms']:g} ms apart, commit to handler start. Idle: queries"
        f" per second over {opts['idle_seconds']:g} s, the larger of the database's"
        " transactions (pg_stat_database) and the statements seen in pg_stat_activity,"
        " each system's default polling. Peak RSS: VmHWM of one worker process."
    )
    out.append("")
    out.append("| system | worker | enqueue 1/txn | bulk enqueue | idle worker waits on |")
    out.append("|---|---|---|---|---|")
    for r in results:
        if r.get("status") != "ok":
            continue
        notes = r["notes"]
        versions = ", ".join(f"{k} {v}" for k, v in (r.get("versions") or {}).items())
        out.append(
            f"| {r['label']} ({versions}; Python {r.get('python')}) | {notes['worker']} | "
            f"{notes['enqueue_single']} | {notes['enqueue_bulk']} | {notes['idle']} |"
        )
    out.append("")
    out.append("Targets (django-pgqueue):")
    out.append("")
    out.append("| target | measured | required | result |")
    out.append("|---|---|---|---|")
    for t in report["targets"]:
        verdict = "n/a" if t["met"] is None else ("PASS" if t["met"] else "FAIL")
        note = f" ({t['note']})" if t["note"] else ""
        out.append(f"| {t['target']} | {t['value']} | {t['required']} | {verdict}{note} |")
    errors = [(r["label"], e) for r in results for e in r.get("errors", [])]
    problems = [
        (r["label"], v["label"], p, run["processes"])
        for r in results
        if r.get("status") == "ok"
        for v in r["variants"].values()
        for run in v["runs"].values()
        for p in run["problems"]
    ]
    if errors or problems:
        out.append("")
        out.append("Problems:")
        out.append("")
        for label, e in errors:
            out.append(f"- {label}: {e.splitlines()[0]}")
        for _label, variant, p, processes in problems:
            out.append(f"- {variant}, {processes} process(es): {p.splitlines()[0]}")
    return "\n".join(out) + "\n"


# --- main -------------------------------------------------------------------------------


def parse_worker_args(values):
    out = {}
    for value in values:
        name, sep, args = value.partition("=")
        if not sep or name not in SYSTEMS:
            raise argparse.ArgumentTypeError(
                f"--worker-args {value!r}: write SYSTEM=ARGS, SYSTEM one of {', '.join(SYSTEMS)}"
            )
        out[name] = args
    return out


def parse_args(argv):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--messages", type=int, default=20000, help="backlog of every drain run")
    p.add_argument(
        "--systems",
        default=",".join(SYSTEMS),
        help=f"comma-separated subset of {','.join(SYSTEMS)}",
    )
    p.add_argument("--json", type=Path, default=RESULTS / "compare.json", help="results file")
    p.add_argument("--markdown", type=Path, default=RESULTS / "compare.md", help="table file")
    p.add_argument(
        "--skip-install",
        action="store_true",
        help="use benchmarks/.venvs as they are (a missing one: that system is not run)",
    )
    p.add_argument(
        "--pgqueue-worker-args",
        default=DEFAULT_PGQUEUE_WORKER_ARGS,
        help="pgqueue_worker options for every django-pgqueue worker",
    )
    p.add_argument(
        "--worker-args",
        action="append",
        default=[],
        metavar="SYSTEM=ARGS",
        help="worker options of a peer instead of the default, e.g."
        " 'procrastinate=--concurrency 16' (repeatable; defaults: procrastinate"
        " '--concurrency 4', django-tasks-db '--no-startup-delay')",
    )
    p.add_argument(
        "--enqueue-messages", type=int, default=2000, help="one-per-transaction enqueue run"
    )
    p.add_argument("--processes", default="1,2", help="worker processes of the drain runs")
    p.add_argument(
        "--repeat",
        type=int,
        default=3,
        help="runs of each drain configuration, the median counts (a drain longer than"
        f" {REPEAT_MAX_DRAIN_S:g} s is not repeated)",
    )
    p.add_argument(
        "--run-timeout",
        type=float,
        default=180.0,
        help="seconds a drain run may take; then the rate over the part drained is reported",
    )
    p.add_argument("--latency-samples", type=int, default=200, help="0: no latency run")
    p.add_argument("--latency-spacing-ms", type=float, default=20.0)
    p.add_argument("--idle-seconds", type=float, default=10.0, help="0: no idle run")
    p.add_argument(
        "--idle-settle",
        type=float,
        default=11.0,
        help="idle seconds before the window (PostgreSQL 15 backends may hold their statistics"
        " back for up to 10 s)",
    )
    p.add_argument(
        "--server",
        default=os.environ.get("BENCH_SERVER_URL", DEFAULT_SERVER),
        help="PostgreSQL server URL without a database; env BENCH_SERVER_URL",
    )
    args = p.parse_args(argv)
    try:
        args.worker_args = parse_worker_args(args.worker_args)
    except argparse.ArgumentTypeError as exc:
        p.error(str(exc))
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in args.systems if s not in SYSTEMS]
    if unknown:
        p.error(f"unknown system(s) {', '.join(unknown)}; choose from {', '.join(SYSTEMS)}")
    args.processes = [int(x) for x in args.processes.split(",")]
    if min(args.messages, args.enqueue_messages, args.repeat, *args.processes) < 1:
        p.error("--messages, --enqueue-messages, --processes and --repeat must be at least 1")
    return args


def paired_enqueue(raw, pgqueue, opts):
    """The one-per-transaction enqueue of the raw loop and of django-pgqueue
    again, in alternation, --repeat pairs: each is bound by the commit's WAL
    flush, whose latency on a shared machine drifts by a third within
    minutes, so the target compares runs made side by side (the median of
    the pairs' ratios), not runs made minutes apart."""
    pairs = []
    print(
        "\n== enqueue one per transaction, the raw loop and django-pgqueue in turn", file=sys.stderr
    )
    for _ in range(opts.repeat):
        pair = []
        for system, result in (raw, pgqueue):
            if result.get("status") != "ok":
                return
            system.reset()
            answer = system.client(
                "enqueue-single",
                "--n",
                opts.enqueue_messages,
                "--variant",
                system.variants()[0].client,
            )
            pair.append(opts.enqueue_messages / answer["seconds"])
        pairs.append(pair)
        print(
            f"  raw {pair[0]:,.0f}/s, django-pgqueue {pair[1]:,.0f}/s: {pair[1] / pair[0]:.0%}",
            file=sys.stderr,
        )
    pgqueue[1]["enqueue_single_paired"] = {
        "pairs": pairs,
        "ratio": statistics.median(q / r for r, q in pairs),
    }


def best_variant(result):
    """The key of a system's fastest one-process drain variant (its label), or None."""
    ranked = [
        (run["jobs_per_s"], key, variant["label"])
        for key, variant in (result.get("variants") or {}).items()
        if (run := variant["runs"].get("1")) and run.get("jobs_per_s")
    ]
    return max(ranked)[1:] if ranked else None


def paired_drains(ran, stats, opts):
    """The one-process drains that the targets compare, run again in turn,
    --repeat rounds: the raw loop with batch 100, django-pgqueue (both
    variants) and pgqueuer's fastest variant. Drains of different systems
    otherwise run minutes apart, and this machine's speed moves by a third
    within minutes (the raw loop's batch-100 drain: 30,000 to 40,000/s in
    two runs an hour apart), so a ratio of two such runs measures the
    moment as much as the systems. The targets take the median of the
    rounds' ratios; the table keeps the main runs."""
    entries = []
    for name, keys in (("raw", ["batch100"]), ("pgqueue", ["atomic", "nonatomic"])):
        if name in ran and ran[name][1].get("status") == "ok":
            entries += [(name, key) for key in keys]
    if "pgqueuer" in ran and ran["pgqueuer"][1].get("status") == "ok":
        best = best_variant(ran["pgqueuer"][1])
        if best:
            entries.append(("pgqueuer", best[0]))
    if not any(name == "pgqueue" for name, _ in entries) or len(entries) < 3:
        return None
    print("\n== one-process drains again, in turn (for the targets' ratios)", file=sys.stderr)
    rounds = []
    for i in range(opts.repeat):
        rates = {}
        for name, key in entries:
            system = ran[name][0]
            variant = next(v for v in system.variants() if v.key == key)
            try:
                run = drain_run(system, stats, variant, 1, opts.messages, f"pair{i}")
            except Exception as exc:  # noqa: BLE001  (a failed drain: the round is incomplete)
                print(f"  {name}/{key} FAILED: {exc}", file=sys.stderr)
                return None
            if run["problems"] or run["timed_out"] or not run.get("jobs_per_s"):
                print(f"  {name}/{key}: {'; '.join(run['problems']) or 'no rate'}", file=sys.stderr)
                return None
            rates[f"{name}/{key}"] = run["jobs_per_s"]
        rounds.append(rates)
        print("  " + ", ".join(f"{k} {v:,.0f}/s" for k, v in rates.items()), file=sys.stderr)
    return {"entries": [f"{n}/{k}" for n, k in entries], "rounds": rounds}


def paired_ratio(paired, mine, other):
    """(median of the rounds' mine/other ratios, the rounds' (mine, other)) or None."""
    if not paired or not all(mine in r and other in r for r in paired["rounds"]):
        return None
    pairs = [(r[mine], r[other]) for r in paired["rounds"]]
    return statistics.median(m / o for m, o in pairs), pairs


def main(argv=None):
    opts = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even if started in background
    started = time.monotonic()
    RESULTS.mkdir(parents=True, exist_ok=True)
    opts.log_dir = RESULTS / "logs"
    shutil.rmtree(opts.log_dir, ignore_errors=True)
    opts.log_dir.mkdir(parents=True)
    stats = None
    try:
        try:
            stats = Stats(opts.server)
        except psycopg.OperationalError as exc:
            print(f"cannot connect to {opts.server}/postgres: {exc}", file=sys.stderr)
            return 2
        with connect(url_for(opts.server, "postgres")) as conn:
            postgres = conn.execute("SHOW server_version").fetchone()[0]
            sync_commit = conn.execute("SHOW synchronous_commit").fetchone()[0]
        report = {
            "started_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "command": " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv]),
            "environment": {
                "commit": git_commit(),
                "cpus": os.cpu_count(),
                "python": platform.python_version(),
                "platform": platform.platform(),
                "postgres": postgres,
                "synchronous_commit": sync_commit,
                "load_average_at_start": os.getloadavg(),
            },
            "options": {
                k: (str(v) if isinstance(v, Path) else v)
                for k, v in vars(opts).items()
                if k != "log_dir"
            },
            "systems": [],
        }
        load = os.getloadavg()[0]
        if load > 0.5:
            print(
                f"note: the load average is {load:.1f} before the run: something else is busy,"
                " the figures will be noisy",
                file=sys.stderr,
            )
        ran = {}
        for name in opts.systems:
            system = SYSTEMS[name](opts)
            report["systems"].append(run_system(system, stats))
            ran[name] = (system, report["systems"][-1])
        if {"raw", "pgqueue"} <= ran.keys():
            paired_enqueue(ran["raw"], ran["pgqueue"], opts)
        report["paired_drains"] = paired_drains(ran, stats, opts)
        report["targets"] = build_targets(report["systems"], opts, report["paired_drains"])
        report["environment"]["load_average_at_end"] = os.getloadavg()
        report["elapsed_s"] = time.monotonic() - started
        text = markdown(report)
        opts.json.parent.mkdir(parents=True, exist_ok=True)
        opts.json.write_text(json.dumps(report, indent=2, default=str) + "\n")
        opts.markdown.parent.mkdir(parents=True, exist_ok=True)
        opts.markdown.write_text(text)
        print()
        print(text)
        print(
            f"wrote {opts.json} and {opts.markdown} in {report['elapsed_s'] / 60:.1f} min"
            f" (worker logs in {opts.log_dir})"
        )
        return 0
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    finally:
        kill_all()
        if stats is not None:
            stats.close()


if __name__ == "__main__":
    sys.exit(main())
