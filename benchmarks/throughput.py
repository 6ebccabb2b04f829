#!/usr/bin/env python
"""Throughput, latency and idle-cost benchmark of one django-pgqueue worker.

Runs everything against a database of its own (default ``pgqueue_bench``,
created and migrated if missing), never the developer's. See
benchmarks/README.md for what is measured and how to read the output.

    .venv/bin/python benchmarks/throughput.py [--messages 20000] [--json out.json]
"""

import argparse
import datetime
import json
import math
import os
import platform
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import psycopg
from psycopg import sql

ROOT = Path(__file__).resolve().parent.parent
TESTPROJECT = ROOT / "testproject"
DEFAULT_URL = "postgres://postgres@127.0.0.1:5432/pgqueue_bench"

TOPIC_ATOMIC = "bench.noop"
TOPIC_NONATOMIC = "bench.noop_nonatomic"
TOPIC_LATENCY = "bench.latency"
TABLES = ("django_pgqueue_message", "django_pgqueue_deadletter", "demo_handled")

# The design goals of the issue, for this machine.
GOAL_JOBS_PER_S = 3000.0  # atomic=False, one worker process
GOAL_P50_MS = 10.0  # enqueue-to-start, idle worker
GOAL_QUERIES_PER_POLL = 1  # idle worker, statements per poll interval

# A --burst worker should exit within a few tenths of a second of the queue
# becoming empty (start-up and exit vary by about that much).
EXIT_LAG_NOTE_S = 0.5

# An error from a worker fails the benchmark; warnings are counted and reported.
ERROR_LINE = re.compile(r"^\S+ \S+ (ERROR|CRITICAL) |^Traceback", re.MULTILINE)
WARNING_LINE = re.compile(r"^\S+ \S+ WARNING (.*)$", re.MULTILINE)

# Every warning any worker logged, by kind (numbers and ids blanked out).
WARNINGS = {}

_LIVE = set()  # worker processes not yet reaped: killed on any exit


class CheckFailed(Exception):
    """A correctness check failed: the figures must not be trusted."""


# --- the database ---------------------------------------------------------------------


def database_name(url):
    return urlsplit(url).path.lstrip("/")


def with_database(url, name):
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path="/" + name))


def ensure_database(url):
    """Create the database of ``url`` if missing; True if it was created."""
    name = database_name(url)
    with psycopg.connect(with_database(url, "postgres"), autocommit=True) as conn:
        if conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name]).fetchone():
            return False
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        return True


def manage(env, *args, capture=True):
    return subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=TESTPROJECT,
        env=env,
        capture_output=capture,
        text=True,
        check=False,
    )


def migrate(env):
    for database in ("default", "other"):
        done = manage(env, "migrate", "--noinput", "-v", "0", "--database", database)
        if done.returncode != 0:
            raise CheckFailed(f"manage.py migrate --database {database} failed:\n{done.stderr}")


def setup_django(env):
    """Point this process's Django at the bench database (before any Django import)."""
    for key in ("DATABASE_URL", "OTHER_DATABASE_URL", "DEBUG", "DJANGO_SETTINGS_MODULE"):
        os.environ[key] = env[key]
    sys.path.insert(0, str(TESTPROJECT))
    import django

    django.setup()


def execute(statement, params=None):
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(statement, params)
        return cursor.fetchall() if cursor.description else None


def truncate():
    execute(f"TRUNCATE {', '.join(TABLES)} RESTART IDENTITY")


def count(table):
    return execute(f"SELECT count(*) FROM {table}")[0][0]


class Stats:
    """A connection of its own to the ``postgres`` database, so that reading
    statistics does not count as activity of the bench database."""

    def __init__(self, url):
        self.dbname = database_name(url)
        self.conn = psycopg.connect(with_database(url, "postgres"), autocommit=True)

    def transactions(self):
        """Committed plus rolled-back transactions of the bench database so far.

        Backends report to the statistics at most once a second while busy
        and when they exit, so read this after the worker exits, or expect a
        lag of about a second.
        """
        row = self.conn.execute(
            "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = %s",
            [self.dbname],
        ).fetchone()
        return row[0]

    def worker_backends(self, pid):
        """{backend pid: (application_name, state, query_start, query)} of worker ``pid``."""
        rows = self.conn.execute(
            "SELECT pid, application_name, state, query_start, query FROM pg_stat_activity"
            " WHERE datname = %s AND application_name IN (%s, %s)",
            [self.dbname, f"pgqueue_worker#{pid}", f"pgqueue_listener#{pid}"],
        ).fetchall()
        return {row[0]: row[1:] for row in rows}

    def wait_idle_database(self, timeout=10.0):
        """Wait until no client backend of this process is left on the bench database."""
        deadline = time.monotonic() + timeout
        query = (
            "SELECT count(*) FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()"
            " AND backend_type = 'client backend' AND application_name NOT LIKE 'pgqueue_%%'"
        )
        while time.monotonic() < deadline:
            if not self.conn.execute(query, [self.dbname]).fetchone()[0]:
                break
            time.sleep(0.02)
        time.sleep(0.1)

    def wait_gone(self, pid, timeout=10.0):
        """Wait until worker ``pid`` has no backend left (they have reported their counters)."""
        deadline = time.monotonic() + timeout
        while self.worker_backends(pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.1)

    def close(self):
        self.conn.close()


def cpu_times():
    """(busy, total) jiffies of the whole machine, from /proc/stat."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


def busy_percent(before, after):
    if before is None or after is None or after[1] == before[1]:
        return None
    return 100.0 * (after[0] - before[0]) / (after[1] - before[1])


# --- worker processes -----------------------------------------------------------------


# --worker-args: options added to every worker's command line; always
# --subscriptions none (the testproject's stream subscribers are the test
# suite's; a project without any runs no stream thread).
EXTRA_WORKER_ARGS = ["--subscriptions", "none"]


class WorkerProcess:
    """``manage.py pgqueue_worker`` in a session of its own (ctrl-c reaches only
    this script, which then kills it), its output in a log file."""

    def __init__(self, env, log_dir, name, options):
        self.log_path = Path(log_dir) / f"{name}.log"
        self.args = [
            "manage.py", "pgqueue_worker", "--log-level", "WARNING", *options, *EXTRA_WORKER_ARGS
        ]  # fmt: skip
        self._log = open(self.log_path, "wb")  # noqa: SIM115  (closed in wait/kill)
        self.started = time.perf_counter()
        self.proc = subprocess.Popen(
            [sys.executable, *self.args],
            cwd=TESTPROJECT,
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
        self.rusage = None
        # Peak RSS: VmHWM of the process's own address space, sampled while it
        # runs. (getrusage's ru_maxrss is no good here: Linux carries the
        # forking parent's RSS over the exec, so it reports this script's size.)
        self.hwm_kib = 0
        self._sampler = threading.Thread(target=self._sample_hwm, daemon=True)
        self._sampler.start()

    def _sample_hwm(self):
        path = f"/proc/{self.pid}/status"
        while self.returncode is None:
            try:
                with open(path) as f:
                    for line in f:
                        if line.startswith("VmHWM:"):
                            self.hwm_kib = max(self.hwm_kib, int(line.split()[1]))
                            break
            except (OSError, ValueError):
                return
            time.sleep(0.02)

    def wait(self, timeout):
        """Reap the process (killing it after ``timeout`` seconds); returns its exit code."""
        timed_out = []

        def on_timeout():
            timed_out.append(True)
            self.kill_group()

        timer = threading.Timer(timeout, on_timeout)
        timer.daemon = True
        timer.start()
        try:
            _, status, self.rusage = os.wait4(self.pid, 0)
        finally:
            timer.cancel()
        self.ended = time.perf_counter()
        self.returncode = self.proc.returncode = os.waitstatus_to_exitcode(status)
        self._log.close()
        _LIVE.discard(self)
        if timed_out:
            raise CheckFailed(f"worker {self.pid} was killed after {timeout}s ({self.log_path})")
        return self.returncode

    def terminate(self, timeout=60.0):
        os.kill(self.pid, signal.SIGTERM)
        return self.wait(timeout)

    def kill_group(self):
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def kill(self):
        """Last resort on the way out: kill and reap."""
        if self.returncode is None:
            self.kill_group()
            try:
                self.wait(10)
            except (ChildProcessError, CheckFailed):
                pass

    @property
    def elapsed(self):
        return self.ended - self.started

    @property
    def peak_rss_mib(self):
        return self.hwm_kib / 1024.0

    @property
    def cpu_seconds(self):
        return self.rusage.ru_utime + self.rusage.ru_stime

    def log_text(self):
        return self.log_path.read_text(errors="replace")

    def check_clean(self, what):
        """Exit code 0 and no error in the log; returns the number of warnings."""
        text = self.log_text()
        if self.returncode != 0:
            raise CheckFailed(f"{what}: worker exited {self.returncode}\n{tail(text)}")
        if ERROR_LINE.search(text):
            raise CheckFailed(f"{what}: the worker logged errors\n{tail(text)}")
        warnings = WARNING_LINE.findall(text)
        for line in warnings:
            kind = re.sub(r"\b(id=\d+|attempt=\d+|[\w.-]+:\d+:[0-9a-f]+|\d+(\.\d+)?)", "N", line)
            WARNINGS[kind] = WARNINGS.get(kind, 0) + 1
        return len(warnings)

    def wait_listening(self, stats, timeout=60.0):
        """Wait until the worker's listener connection is idle in the database."""
        deadline = time.monotonic() + timeout
        name = f"pgqueue_listener#{self.pid}"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.returncode = self.proc.returncode
                _LIVE.discard(self)
                raise CheckFailed(f"worker exited {self.returncode} at start\n{self.log_text()}")
            backends = stats.worker_backends(self.pid).values()
            if any(app == name and state == "idle" for app, state, *_ in backends):
                return
            time.sleep(0.02)
        raise CheckFailed(f"worker {self.pid} did not start listening within {timeout}s")


def tail(text, lines=30):
    return "\n".join(text.splitlines()[-lines:])


def worker_options(concurrency, batch_size, *extra):
    options = ["--concurrency", str(concurrency), *extra]
    if batch_size is not None:
        options += ["--batch-size", str(batch_size)]
    return options


# --- throughput -----------------------------------------------------------------------


@dataclass
class ThroughputRun:
    topic: str
    atomic: bool
    concurrency: int
    batch_size: int | None
    messages: int
    enqueue_s: float
    enqueue_per_s: float
    wall_s: float  # worker start to exit
    startup_s: float  # the same worker on an empty queue: start-up plus exit
    drain_s: float  # wall_s - startup_s
    jobs_per_s: float  # messages / drain_s
    jobs_per_s_wall: float  # messages / wall_s
    db_drain_s: float  # first claim seen in the database to the queue seen empty
    db_jobs_per_s: float | None  # messages / db_drain_s
    exit_lag_s: float  # drain_s - db_drain_s: how long the worker took to notice and exit
    worker_cpu_s: float
    worker_cpu_percent: float  # of one core, over the whole run
    machine_busy_percent: float | None  # all cores, during the run
    transactions_per_job: float  # in the bench database, during the run
    peak_rss_mib: float
    worker_warnings: int  # lines the worker logged at WARNING


class DrainMonitor:
    """Watches the queue from a connection of its own, every few milliseconds:
    when the first message (the lowest id, claimed first) is taken, and when
    no message is waiting or leased any more. Both are index look-ups."""

    FIRST = "SELECT status FROM django_pgqueue_message WHERE id = %s"
    LEFT = (
        "SELECT EXISTS (SELECT 1 FROM django_pgqueue_message WHERE status = 'processing')"
        " OR EXISTS (SELECT 1 FROM django_pgqueue_message WHERE status = 'waiting')"
    )

    def __init__(self, url, first_id, interval=0.005):
        self.conn = psycopg.connect(url, autocommit=True)
        self.first_id = first_id
        self.interval = interval
        self.first_claim = None  # time.perf_counter()
        self.empty = None
        self.queries = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="drain-monitor", daemon=True)

    def start(self):
        self._thread.start()

    def _run(self):
        while not self._stop.is_set() and self.empty is None:
            if self.first_claim is None:
                row = self.conn.execute(self.FIRST, [self.first_id]).fetchone()
                if row is None or row[0] != "waiting":
                    self.first_claim = time.perf_counter()
            else:
                if not self.conn.execute(self.LEFT).fetchone()[0]:
                    self.empty = time.perf_counter()
            self.queries += 1
            self._stop.wait(self.interval)

    def stop(self):
        self._stop.set()
        self._thread.join()
        self.conn.close()


def measure_startup(env, stats, log_dir, concurrency, batch_size, runs):
    """Median wall time of a --burst worker on an empty queue (start-up plus exit)."""
    truncate()
    times = []
    for i in range(runs):
        worker = WorkerProcess(
            env,
            log_dir,
            f"startup-c{concurrency}-b{batch_size}-{i}",
            worker_options(concurrency, batch_size, "--burst"),
        )
        worker.wait(120)
        worker.check_clean("empty-queue run")
        times.append(worker.elapsed)
    return statistics.median(times)


def throughput_run(env, stats, log_dir, topic, atomic, concurrency, batch_size, n, startup_s):
    from django_pgqueue import enqueue_many

    truncate()
    items = [{"payload": {"n": i}} for i in range(n)]
    started = time.perf_counter()
    enqueue_many(items, topic=topic)
    enqueue_s = time.perf_counter() - started
    execute("VACUUM ANALYZE django_pgqueue_message")
    if count("django_pgqueue_message") != n:
        raise CheckFailed(f"enqueue_many wrote {count('django_pgqueue_message')} rows, not {n}")

    name = f"{topic}-c{concurrency}-b{batch_size}"
    first_id = execute("SELECT min(id) FROM django_pgqueue_message")[0][0]
    from django.db import connection

    connection.close()  # its backend reports the enqueue's counters as it exits
    stats.wait_idle_database()
    xacts_before = stats.transactions()
    cpu_before = cpu_times()
    monitor = DrainMonitor(env["DATABASE_URL"], first_id)
    worker = WorkerProcess(env, log_dir, name, worker_options(concurrency, batch_size, "--burst"))
    monitor.start()
    try:
        worker.wait(max(600.0, n / 20))
    finally:
        monitor.stop()
    cpu_after = cpu_times()
    stats.wait_gone(worker.pid)
    stats.wait_idle_database()  # the monitor's backend too
    # The worker's backends reported their counters when exiting; the
    # monitor's own queries are one transaction each.
    xacts = stats.transactions() - xacts_before - monitor.queries
    warnings = worker.check_clean(name)
    left, dead = count("django_pgqueue_message"), count("django_pgqueue_deadletter")
    if left or dead:
        raise CheckFailed(
            f"{name}: after the worker exited, {left} message(s) are left and {dead} "
            f"dead letter(s) exist (expected 0 and 0)\n{tail(worker.log_text())}"
        )
    drain_s = worker.elapsed - startup_s
    if drain_s <= 0:
        raise CheckFailed(f"{name}: drained faster than start-up; use more --messages")
    if monitor.first_claim is None or monitor.empty is None:
        raise CheckFailed(f"{name}: the monitor did not see the queue start and end draining")
    db_drain_s = monitor.empty - monitor.first_claim
    return ThroughputRun(
        topic=topic,
        atomic=atomic,
        concurrency=concurrency,
        batch_size=batch_size,
        messages=n,
        enqueue_s=enqueue_s,
        enqueue_per_s=n / enqueue_s,
        wall_s=worker.elapsed,
        startup_s=startup_s,
        drain_s=drain_s,
        jobs_per_s=n / drain_s,
        jobs_per_s_wall=n / worker.elapsed,
        db_drain_s=db_drain_s,
        db_jobs_per_s=n / db_drain_s if db_drain_s > 0 else None,
        exit_lag_s=drain_s - db_drain_s,
        worker_cpu_s=worker.cpu_seconds,
        worker_cpu_percent=100.0 * worker.cpu_seconds / worker.elapsed,
        machine_busy_percent=busy_percent(cpu_before, cpu_after),
        transactions_per_job=xacts / n,
        peak_rss_mib=worker.peak_rss_mib,
        worker_warnings=warnings,
    )


# --- latency --------------------------------------------------------------------------


@dataclass
class LatencyResult:
    concurrency: int
    batch_size: int | None
    samples: int
    spacing_ms: float
    p50_ms: float
    p95_ms: float
    p99_ms: float
    min_ms: float
    max_ms: float
    mean_ms: float
    enqueue_call_p50_ms: float
    peak_rss_mib: float


def percentile(values, p):
    """Nearest-rank-interpolated percentile of ``values`` (0 <= p <= 100)."""
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    rank = (len(ordered) - 1) * p / 100.0
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def wait_for(predicate, timeout, what):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise CheckFailed(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)


def latency(env, stats, log_dir, concurrency, batch_size, samples, spacing):
    from demo.models import Handled
    from django.db import connection

    from django_pgqueue import enqueue

    truncate()
    worker = WorkerProcess(env, log_dir, "latency", worker_options(concurrency, batch_size))
    worker.wait_listening(stats)
    time.sleep(1.0)  # let the start-up claim and maintenance pass
    if connection.in_atomic_block:
        raise CheckFailed("the benchmark's own connection is inside a transaction")
    committed = {}
    call_ms = []
    for i in range(samples):
        started = time.time()
        message = enqueue(TOPIC_LATENCY, {"i": i})  # autocommit: committed on return
        done = time.time()
        committed[message.pk] = done
        call_ms.append(1000.0 * (done - started))
        time.sleep(spacing)
    wait_for(
        lambda: (
            Handled.objects.filter(topic=TOPIC_LATENCY).count() >= samples
            and count("django_pgqueue_message") == 0
        ),
        30,
        "the latency messages to be handled and acknowledged",
    )
    worker.terminate()
    worker.check_clean("latency worker (SIGTERM)")
    if count("django_pgqueue_deadletter"):
        raise CheckFailed("latency run: dead letters exist")

    handled = list(
        Handled.objects.filter(topic=TOPIC_LATENCY).values_list("message_id", "handled_at")
    )
    ids = [pk for pk, _ in handled]
    if sorted(ids) != sorted(committed):
        raise CheckFailed(
            f"latency run: {len(handled)} Handled rows for {len(committed)} messages "
            "(missing or duplicated handler runs)"
        )
    values = [1000.0 * (at.timestamp() - committed[pk]) for pk, at in handled]
    return LatencyResult(
        concurrency=concurrency,
        batch_size=batch_size,
        samples=samples,
        spacing_ms=1000.0 * spacing,
        p50_ms=percentile(values, 50),
        p95_ms=percentile(values, 95),
        p99_ms=percentile(values, 99),
        min_ms=min(values),
        max_ms=max(values),
        mean_ms=statistics.fmean(values),
        enqueue_call_p50_ms=percentile(call_ms, 50),
        peak_rss_mib=worker.peak_rss_mib,
    )


# --- idle cost ------------------------------------------------------------------------


@dataclass
class IdleResult:
    poll_interval_s: float
    window_s: float  # the idle window, after start-up and settling
    lifetime_s: float  # the worker process, start to exit
    lifetime_transactions: int  # pg_stat_database delta over the worker's whole life
    startup_statements: int  # sampled before the window: start-up and settling
    window_statements: dict = field(default_factory=dict)  # role -> {query: count}
    main_loop_statements: int = 0  # in the window
    main_loop_statements_per_poll: float = 0.0
    main_loop_mean_gap_s: float | None = None  # between consecutive main-loop statements
    allowed_statements: int = 0  # one per poll: window / shortest jittered interval, + 1
    other_statements: int = 0  # in the window, heartbeat and listener
    sample_every_ms: float = 0.0
    peak_rss_mib: float = 0.0


def _short(query):
    return " ".join(query.split())[:70]


def idle_cost(env, stats, log_dir, concurrency, batch_size, poll_interval, window, settle):
    """Count what an idle listening worker asks the database.

    The worker's backends are sampled in pg_stat_activity every few
    milliseconds from its start: each shows its latest statement and when it
    started, so every new (backend, query_start) is a statement (a lower
    bound: two statements between two samples count once). Statements whose
    query_start falls in the window are the idle cost. As a cross-check, the
    bench database's transaction counter is read before the worker starts
    and after its backends exited: a backend may keep its counters for up to
    10 s while it lives, so only the whole life is exact.
    """
    from django.db import connection

    truncate()
    for table in TABLES:  # so that autovacuum has no reason to visit during the window
        execute(f"VACUUM ANALYZE {table}")
    connection.close()  # a backend reports its pending counters when it exits
    stats.wait_idle_database()
    xacts_before = stats.transactions()
    worker = WorkerProcess(
        env,
        log_dir,
        "idle",
        worker_options(concurrency, batch_size, "--poll-interval", str(poll_interval)),
    )
    listener = f"pgqueue_listener#{worker.pid}"
    seen = {}  # (backend pid, query_start) -> (application_name, query)
    window_start = window_end = None
    samples = 0
    deadline = time.monotonic() + 60
    while window_end is None or time.time() < window_end:
        backends = stats.worker_backends(worker.pid)
        for bpid, (app, _state, start, query) in backends.items():
            if start is not None:
                seen.setdefault((bpid, start), (app, query))
        if window_start is None:
            if any(app == listener and state == "idle" for app, state, *_ in backends.values()):
                window_start = time.time() + settle
                window_end = window_start + window
            elif worker.proc.poll() is not None or time.monotonic() > deadline:
                raise CheckFailed(f"idle worker did not start listening\n{worker.log_text()}")
        elif time.time() >= window_start:
            samples += 1
        time.sleep(0.005)
    worker.terminate()
    worker.check_clean("idle worker (SIGTERM)")
    stats.wait_gone(worker.pid)
    xacts = stats.transactions() - xacts_before

    # Name the connections by what they ran: the heartbeat's is the one that
    # takes the maintenance lock; the listener's has its own application_name.
    heartbeat = {
        bpid for (bpid, _), (_, query) in seen.items() if "pg_try_advisory_xact_lock" in query
    }
    lo = datetime.datetime.fromtimestamp(window_start, datetime.UTC)
    hi = datetime.datetime.fromtimestamp(window_end, datetime.UTC)
    by_role = {}
    main = other = before = 0
    main_starts = []
    for (bpid, start), (app, query) in seen.items():
        if start < lo:
            before += 1
            continue
        if start >= hi:
            continue
        if app == listener:
            role = "listener"
        elif bpid in heartbeat:
            role = "heartbeat"
        else:
            role = "main loop"
        if role == "main loop":
            main += 1
            main_starts.append(start)
        else:
            other += 1
        queries = by_role.setdefault(role, {})
        queries[_short(query)] = queries.get(_short(query), 0) + 1
    return IdleResult(
        poll_interval_s=poll_interval,
        window_s=window,
        lifetime_s=worker.elapsed,
        lifetime_transactions=xacts,
        startup_statements=before,
        window_statements=by_role,
        main_loop_statements=main,
        main_loop_statements_per_poll=main * poll_interval / window,
        main_loop_mean_gap_s=(
            (max(main_starts) - min(main_starts)).total_seconds() / (len(main_starts) - 1)
            if len(main_starts) > 1
            else None
        ),
        allowed_statements=GOAL_QUERIES_PER_POLL * math.floor(window / (0.9 * poll_interval)) + 1,
        other_statements=other,
        sample_every_ms=1000.0 * window / max(samples, 1),
        peak_rss_mib=worker.peak_rss_mib,
    )


# --- the report -----------------------------------------------------------------------


def parse_combo(text):
    match = re.fullmatch(r"(\d+)x(\d+|default)", text.strip())
    if not match:
        raise argparse.ArgumentTypeError(
            f"{text!r}: write CONCURRENCYxBATCH, e.g. 8x8 or 8xdefault"
        )
    concurrency = int(match.group(1))
    batch = None if match.group(2) == "default" else int(match.group(2))
    if concurrency < 1 or (batch is not None and batch < 1):
        raise argparse.ArgumentTypeError(f"{text!r}: both numbers must be at least 1")
    return concurrency, batch


def combo_list(text):
    if text.strip().lower() in ("", "none"):
        return []
    return [parse_combo(part) for part in text.split(",")]


def fmt_batch(batch):
    return "=conc" if batch is None else str(batch)


def table(headers, rows):
    widths = [max(len(str(x)) for x in column) for column in zip(headers, *rows, strict=True)]
    line = "  ".join(f"{{:>{w}}}" for w in widths)
    out = [line.format(*headers), line.format(*("-" * w for w in widths))]
    out += [line.format(*row) for row in rows]
    return "\n".join(out)


def fmt_seconds(value):
    return "-" if value is None else f"{value:.2f} s"


def goal(met):
    return "met" if met else "MISSED"


def print_report(result):
    runs = [ThroughputRun(**r) for r in result["throughput"]]
    if runs:
        print(f"\nThroughput: one worker --burst, {runs[0].messages} no-op messages per run")
        print(
            table(
                [
                    "topic",
                    "atomic",
                    "conc",
                    "batch",
                    "enqueue/s",
                    "wall s",
                    "startup s",
                    "drain s",
                    "jobs/s",
                    "db jobs/s",
                    "exit lag",
                    "xact/job",
                    "cpu%",
                    "box%",
                    "RSS MiB",
                    "warn",
                ],
                [
                    [
                        r.topic,
                        str(r.atomic),
                        r.concurrency,
                        fmt_batch(r.batch_size),
                        f"{r.enqueue_per_s:,.0f}",
                        f"{r.wall_s:.2f}",
                        f"{r.startup_s:.2f}",
                        f"{r.drain_s:.2f}",
                        f"{r.jobs_per_s:,.0f}",
                        "-" if r.db_jobs_per_s is None else f"{r.db_jobs_per_s:,.0f}",
                        f"{r.exit_lag_s:.2f}",
                        f"{r.transactions_per_job:.2f}",
                        f"{r.worker_cpu_percent:.0f}",
                        "-" if r.machine_busy_percent is None else f"{r.machine_busy_percent:.0f}",
                        f"{r.peak_rss_mib:.0f}",
                        r.worker_warnings,
                    ]
                    for r in runs
                ],
            )
        )
        print(
            "  jobs/s = messages / (wall - startup). db jobs/s = messages / (first claim to queue"
            " empty, watched in the\n  database); exit lag = (wall - startup) - that drain"
            " time: how late the worker exited. cpu% = worker CPU\n  time / wall (one core = 100);"
            " box% = all cores busy; xact/job = bench database transactions per message."
        )
        late = [r for r in runs if r.exit_lag_s > EXIT_LAG_NOTE_S]
        if late:
            print(
                f"  NOTE: {len(late)} run(s) exited more than {EXIT_LAG_NOTE_S:g} s after the queue"
                " was empty; their jobs/s understates the drain rate (see db jobs/s)."
            )
        for label, key in (("atomic=True", "atomic"), ("atomic=False", "nonatomic")):
            summary = result["summary"].get(key)
            if summary:
                print(
                    f"  {label:13} default ({summary['default_config']}): "
                    f"{summary['default_jobs_per_s']:,.0f} jobs/s; best ({summary['best_config']}):"
                    f" {summary['best_jobs_per_s']:,.0f} jobs/s"
                )
    lat = result.get("latency")
    if lat:
        print(
            f"\nLatency, enqueue commit to handler start, idle listening worker "
            f"(concurrency {lat['concurrency']}, {lat['samples']} messages "
            f"{lat['spacing_ms']:.0f} ms apart):"
        )
        print(
            f"  p50 {lat['p50_ms']:.2f} ms   p95 {lat['p95_ms']:.2f} ms   "
            f"p99 {lat['p99_ms']:.2f} ms   min {lat['min_ms']:.2f}   max {lat['max_ms']:.2f}   "
            f"(enqueue() call itself: p50 {lat['enqueue_call_p50_ms']:.2f} ms)"
        )
    idle = result.get("idle")
    if idle:
        print(
            f"\nIdle listening worker, --poll-interval {idle['poll_interval_s']:g}, "
            f"{idle['window_s']:g} s window (pg_stat_activity sampled every "
            f"{idle['sample_every_ms']:.1f} ms):"
        )
        for role, queries in sorted(idle["window_statements"].items()):
            for query, n in sorted(queries.items(), key=lambda item: -item[1]):
                print(f"  {role:10} {n:4}  {query}")
        if not idle["window_statements"]:
            print("  no statement at all")
        print(
            f"  main loop: {idle['main_loop_statements_per_poll']:.2f} statements per poll "
            f"interval (mean gap {fmt_seconds(idle['main_loop_mean_gap_s'])}); "
            f"heartbeat and listener: {idle['other_statements']}"
        )
        print(
            f"  cross-check: {idle['lifetime_transactions']} transactions in the bench database "
            f"over the worker's {idle['lifetime_s']:.1f} s life; "
            f"{idle['startup_statements']} statements sampled before the window"
        )
    if result.get("worker_warnings"):
        print("\nWarnings the workers logged (by kind; the figures stand, the checks passed):")
        for kind, n in sorted(result["worker_warnings"].items(), key=lambda item: -item[1]):
            print(f"  {n:5}  {kind}")
    if result.get("peak_rss_mib") is not None:
        print(f"\nPeak RSS of a worker process: {result['peak_rss_mib']:.0f} MiB")
    print("\nGoals:")
    for name, info in result["goals"].items():
        print(f"  {name:40} {info['value']:>10} (goal {info['goal']}): {goal(info['met'])}")


def config_text(concurrency, batch_size):
    return f"--concurrency {concurrency}" + (
        "" if batch_size is None else f" --batch-size {batch_size}"
    )


def summarize(runs, default_combo):
    summary = {}
    for key, atomic in (("atomic", True), ("nonatomic", False)):
        mine = [r for r in runs if r.atomic == atomic]
        if not mine:
            continue
        best = max(mine, key=lambda r: r.jobs_per_s)
        default = [r for r in mine if (r.concurrency, r.batch_size) == default_combo]
        summary[key] = {
            "best_config": config_text(best.concurrency, best.batch_size),
            "best_jobs_per_s": best.jobs_per_s,
            "default_config": config_text(*default_combo),
            "default_jobs_per_s": statistics.median(r.jobs_per_s for r in default)
            if default
            else None,
        }
    return summary


def goals(result):
    out = {}
    nonatomic = result["summary"].get("nonatomic")
    if nonatomic:
        out["jobs/s, atomic=False, best configuration"] = {
            "value": f"{nonatomic['best_jobs_per_s']:,.0f}",
            "goal": f">= {GOAL_JOBS_PER_S:,.0f}",
            "met": nonatomic["best_jobs_per_s"] >= GOAL_JOBS_PER_S,
        }
        if nonatomic["default_jobs_per_s"] is not None:
            out["jobs/s, atomic=False, default options"] = {
                "value": f"{nonatomic['default_jobs_per_s']:,.0f}",
                "goal": f">= {GOAL_JOBS_PER_S:,.0f}",
                "met": nonatomic["default_jobs_per_s"] >= GOAL_JOBS_PER_S,
            }
    if result.get("latency"):
        p50 = result["latency"]["p50_ms"]
        out["p50 enqueue-to-start latency, idle (ms)"] = {
            "value": f"{p50:.2f}",
            "goal": f"< {GOAL_P50_MS:g}",
            "met": p50 < GOAL_P50_MS,
        }
    if result.get("idle"):
        idle = result["idle"]
        total = idle["main_loop_statements"] + idle["other_statements"]
        out["idle worker statements in the window"] = {
            # the poll interval is jittered by +-10%: allow one per shortest interval
            "value": str(total),
            "goal": f"<= {idle['allowed_statements']} ({GOAL_QUERIES_PER_POLL} per poll)",
            "met": total <= idle["allowed_statements"],
        }
    return out


# --- main -----------------------------------------------------------------------------


def git_commit():
    """The checked-out commit (with '+dirty' for local changes), or None."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+dirty" if dirty else "")


def parse_args(argv):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--messages", type=int, default=20000, help="messages per throughput run")
    parser.add_argument(
        "--concurrency",
        type=int,
        default=4,
        help="worker --concurrency of the default configuration (the command's default is 4),"
        " also used for the latency and idle measurements",
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="worker --batch-size of the default configuration (default: the command's own)",
    )
    parser.add_argument(
        "--sweep",
        type=combo_list,
        default="8xdefault,16xdefault,32xdefault,16x100",
        help="more CONCURRENCYxBATCH configurations for the throughput runs "
        "('default' = the command's own batch size), or 'none'",
    )
    parser.add_argument("--repeat", type=int, default=1, help="throughput runs per configuration")
    parser.add_argument("--startup-runs", type=int, default=3, help="empty-queue runs, median")
    parser.add_argument("--latency-samples", type=int, default=200)
    parser.add_argument("--latency-spacing-ms", type=float, default=20.0)
    parser.add_argument("--idle-seconds", type=float, default=10.0)
    parser.add_argument("--idle-poll-interval", type=float, default=1.0)
    parser.add_argument(
        "--skip",
        action="append",
        default=[],
        choices=["atomic", "nonatomic", "latency", "idle"],
        help="leave out a part (repeatable)",
    )
    parser.add_argument(
        "--database-url",
        default=os.environ.get("BENCH_DATABASE_URL", DEFAULT_URL),
        help="the bench database (its name must contain 'bench'; created and migrated if missing,"
        " emptied by every run); env BENCH_DATABASE_URL",
    )
    parser.add_argument(
        "--django-debug",
        action="store_true",
        help="run the worker with DEBUG=True (the testproject's default, which logs every query"
        " in memory); the benchmark uses DEBUG=False unless this is given",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the results here as JSON")
    parser.add_argument(
        "--enforce-goals",
        action="store_true",
        help="exit 3 when a design goal is missed (checks always exit 1 on failure)",
    )
    parser.add_argument("--keep-logs", action="store_true", help="keep the worker logs")
    parser.add_argument(
        "--worker-args",
        default="",
        help="more pgqueue_worker options for every worker, e.g. '--metrics-port 0'",
    )
    args = parser.parse_args(argv)
    EXTRA_WORKER_ARGS.extend(shlex.split(args.worker_args))
    if args.messages < 1 or args.repeat < 1 or args.startup_runs < 1:
        parser.error("--messages, --repeat and --startup-runs must be at least 1")
    if "bench" not in database_name(args.database_url):
        parser.error(
            f"the database {database_name(args.database_url)!r} does not look like a bench "
            "database (its name must contain 'bench'): every run empties its queue tables"
        )
    return args


def main(argv=None):
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    signal.signal(signal.SIGINT, signal.default_int_handler)
    url = args.database_url
    other = with_database(url, database_name(url) + "_other")
    env = dict(
        os.environ,
        DATABASE_URL=url,
        OTHER_DATABASE_URL=other,
        DEBUG="True" if args.django_debug else "False",
        DJANGO_SETTINGS_MODULE="testproject.settings",
        PGQUEUE_LOG_LEVEL="WARNING",
        PYTHONUNBUFFERED="1",
    )
    log_dir = tempfile.mkdtemp(prefix="pgqueue-bench-")
    stats = None
    try:
        for db in (url, other):
            if ensure_database(db):
                print(f"created database {database_name(db)}", file=sys.stderr)
        migrate(env)
        setup_django(env)
        stats = Stats(url)
        default_combo = (args.concurrency, args.batch_size)
        combos = [default_combo] + [c for c in args.sweep if c != default_combo]
        result = {
            "started_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "commit": git_commit(),
            "machine": {
                "cpus": os.cpu_count(),
                "python": platform.python_version(),
                "postgres": execute("SHOW server_version")[0][0],
                "synchronous_commit": execute("SHOW synchronous_commit")[0][0],
                "platform": platform.platform(),
            },
            "options": {k: v for k, v in vars(args).items() if k not in ("json",)},
            "throughput": [],
        }
        startup = {}
        topics = [
            (topic, atomic)
            for topic, atomic, part in (
                (TOPIC_ATOMIC, True, "atomic"),
                (TOPIC_NONATOMIC, False, "nonatomic"),
            )
            if part not in args.skip
        ]
        runs = []
        for concurrency, batch in combos:
            if topics:
                startup[(concurrency, batch)] = measure_startup(
                    env, stats, log_dir, concurrency, batch, args.startup_runs
                )
            for topic, atomic in topics:
                for _ in range(args.repeat):
                    run = throughput_run(
                        env,
                        stats,
                        log_dir,
                        topic,
                        atomic,
                        concurrency,
                        batch,
                        args.messages,
                        startup[(concurrency, batch)],
                    )
                    runs.append(run)
                    print(
                        f"  {topic:22} conc {concurrency:3} batch {fmt_batch(batch):>5}: "
                        f"{run.jobs_per_s:8,.0f} jobs/s (drain {run.drain_s:.2f} s, "
                        f"start-up {run.startup_s:.2f} s, exit lag {run.exit_lag_s:.2f} s)",
                        file=sys.stderr,
                    )
        result["throughput"] = [asdict(r) for r in runs]
        result["summary"] = summarize(runs, default_combo)
        rss = [r.peak_rss_mib for r in runs]
        if "latency" not in args.skip:
            lat = latency(
                env,
                stats,
                log_dir,
                args.concurrency,
                args.batch_size,
                args.latency_samples,
                args.latency_spacing_ms / 1000.0,
            )
            result["latency"] = asdict(lat)
            rss.append(lat.peak_rss_mib)
            print(f"  latency p50 {lat.p50_ms:.2f} ms", file=sys.stderr)
        if "idle" not in args.skip:
            idle = idle_cost(
                env,
                stats,
                log_dir,
                args.concurrency,
                args.batch_size,
                args.idle_poll_interval,
                args.idle_seconds,
                settle=2.0,
            )
            result["idle"] = asdict(idle)
            rss.append(idle.peak_rss_mib)
        result["peak_rss_mib"] = max(rss) if rss else None
        result["worker_warnings"] = dict(WARNINGS)
        result["goals"] = goals(result)
        truncate()
        print_report(result)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
            print(f"\nwrote {args.json}")
        if args.enforce_goals and not all(g["met"] for g in result["goals"].values()):
            return 3
        return 0
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except CheckFailed as exc:
        print(f"\nCHECK FAILED: {exc}", file=sys.stderr)
        args.keep_logs = True
        return 1
    finally:
        for worker in list(_LIVE):
            worker.kill()
        if stats is not None:
            stats.close()
        if not args.keep_logs:
            for path in Path(log_dir).glob("*.log"):
                path.unlink()
            os.rmdir(log_dir)
        elif log_dir:
            print(f"worker logs kept in {log_dir}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
