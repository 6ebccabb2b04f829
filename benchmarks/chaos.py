#!/usr/bin/env python
"""Chaos soak: many messages, several worker processes, faults on a schedule,
and a count of what was lost or handled twice.

    .venv/bin/python benchmarks/chaos.py --throwaway-cluster

runs on a PostgreSQL cluster of its own, created for the run and removed at
the end;

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/pgqueue_chaos \\
        .venv/bin/python benchmarks/chaos.py

against the database of DATABASE_URL (created and migrated if needed; its
queue tables must be empty, or pass --reset to empty them), without the
restart fault. In the testproject (testproject/demo/handlers.py, the
chaos.* topics):

- ``--messages`` (50,000) messages over four topics, two handled by
  ``atomic=True`` handlers and two by ``atomic=False`` ones, enqueued in
  ``--waves`` waves while the faults go on. Every handling that succeeds
  writes a ledger row (demo.Handled). A ``--fail-rate`` share of the
  messages fail on chosen attempts, with an exception of each category
  (transient, dependency, permanent, business, unknown, Retry); a
  handler sleeps ``--work-ms`` on average (a ``--slow-rate`` share 50 to 300
  ms), so that faults find messages in flight.
- ``--workers`` (4) ``pgqueue_worker`` processes. Every ``--fault-interval``
  seconds one fault, in shuffled rounds of the ``--faults`` kinds: ``kill9``
  (SIGKILL to a random worker, replaced at once), ``sigterm`` (graceful stop
  of another, replaced), ``terminate`` (``pg_terminate_backend`` of every
  connection of a worker), ``restart`` (PostgreSQL itself, with
  ``pg_ctl -D <datadir> restart -m immediate``: a crash and recovery). The
  restart fault only ever restarts the cluster it is told about: either
  ``--throwaway-cluster`` (the soak creates a cluster of its own in a
  temporary directory, with benchmarks/throwaway_pg.py, runs against it
  instead of DATABASE_URL and removes it at the end), or
  ``--restart-datadir`` naming the data directory of the server behind
  DATABASE_URL (checked against the server's ``data_directory``; as root,
  pg_ctl runs as the directory's owner). Without either, the default faults
  leave ``restart`` out.
- An invariant checked every ``--check-interval`` seconds during the run, in
  one snapshot per check: every message enqueued is in exactly one of the
  queue table, the dead letters, or done (absent from both, with a ledger
  row); a message of an atomic topic never has a ledger row while it is
  still in the queue or among the dead letters.

At the end it prints (and writes with ``--json``): enqueued, done,
dead-lettered, lost (must be 0), handled twice for atomic handlers (must be
0), extra handlings for non-atomic ones (must not exceed the messages that
were leased to a worker when a fault hit it: ``exposed``), invariant
violations (must be 0), worker exits nobody caused (must be 0), the faults
injected by kind, wall time and throughput. The exit status is 0 only if
every one of those holds.
"""

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import throwaway_pg

ROOT = Path(__file__).resolve().parents[1]
TESTPROJECT = ROOT / "testproject"
MANAGE = TESTPROJECT / "manage.py"

TOPICS = {  # topic: atomic?
    "chaos.orders": True,
    "chaos.invoices": True,
    "chaos.emails": False,
    "chaos.webhooks": False,
}
FAILURE_KINDS = ("transient", "dependency", "permanent", "business", "unknown", "retry")
FAULT_KINDS = ("kill9", "sigterm", "terminate", "restart")
MAX_ATTEMPTS = 4

# What the driver records of each message: its id, topic kind and wave.
EXPECTED_TABLE = "chaos_expected"
EXPECTED_DDL = f"""
CREATE TABLE IF NOT EXISTS {EXPECTED_TABLE} (
    message_id bigint PRIMARY KEY,
    atomic boolean NOT NULL,
    chunk integer NOT NULL
)"""

# One snapshot (one statement) per check.
CHECK_SQL = f"""
SELECT
    count(*) FILTER (WHERE in_queue AND dead),
    count(*) FILTER (WHERE NOT in_queue AND NOT dead AND NOT handled),
    count(*) FILTER (WHERE atomic AND handled AND (in_queue OR dead)),
    count(*) FILTER (WHERE in_queue),
    count(*)
FROM (
    SELECT e.atomic,
        EXISTS (SELECT 1 FROM django_pgqueue_message m WHERE m.id = e.message_id) AS in_queue,
        EXISTS (SELECT 1 FROM django_pgqueue_deadletter d
                WHERE d.message_id = e.message_id) AS dead,
        EXISTS (SELECT 1 FROM demo_handled h WHERE h.message_id = e.message_id) AS handled
    FROM {EXPECTED_TABLE} e
) AS state
"""

FINAL_SQL = f"""
SELECT
    count(*) FILTER (WHERE handled > 0 AND NOT dead AND NOT in_queue),
    count(*) FILTER (WHERE dead AND NOT in_queue),
    count(*) FILTER (WHERE handled = 0 AND NOT dead AND NOT in_queue),
    count(*) FILTER (WHERE atomic AND handled > 1),
    coalesce(sum(handled - 1) FILTER (WHERE NOT atomic AND handled > 1), 0),
    count(*) FILTER (WHERE in_queue)
FROM (
    SELECT e.atomic,
        EXISTS (SELECT 1 FROM django_pgqueue_message m WHERE m.id = e.message_id) AS in_queue,
        EXISTS (SELECT 1 FROM django_pgqueue_deadletter d
                WHERE d.message_id = e.message_id) AS dead,
        (SELECT count(*) FROM demo_handled h WHERE h.message_id = e.message_id) AS handled
    FROM {EXPECTED_TABLE} e
) AS state
"""


def log(text):
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def parse_args(argv):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--messages", type=int, default=50_000, help="messages enqueued in all")
    p.add_argument("--workers", type=int, default=4, help="worker processes at any time")
    p.add_argument("--concurrency", type=int, default=4, help="handler threads per worker")
    p.add_argument("--waves", type=int, default=10, help="the messages come in this many waves")
    p.add_argument("--wave-interval", type=float, default=2.0, help="seconds between waves")
    p.add_argument("--fault-interval", type=float, default=3.0, help="seconds between faults")
    p.add_argument(
        "--faults",
        default=None,
        help=f"comma-separated kinds to inject, of {','.join(FAULT_KINDS)} (default: all,"
        " restart only with --throwaway-cluster or --restart-datadir)",
    )
    p.add_argument(
        "--throwaway-cluster",
        action="store_true",
        help="create a PostgreSQL cluster of our own (initdb in a temporary directory, a free"
        " port), run against it instead of DATABASE_URL and restart it for the restart fault;"
        " removed at the end",
    )
    p.add_argument(
        "--restart-datadir",
        help="the restart fault restarts the cluster of this data directory, which must be the"
        " server behind DATABASE_URL (no other cluster is ever restarted)",
    )
    p.add_argument(
        "--pg-ctl",
        help="pg_ctl for --restart-datadir (default: that of the data directory's major version)",
    )
    p.add_argument(
        "--restart-log",
        default=os.devnull,
        help="the log file of the server that the restart fault starts again (pg_ctl -l)",
    )
    p.add_argument("--fail-rate", type=float, default=0.2, help="share of messages that fail")
    p.add_argument(
        "--work-ms",
        type=float,
        default=2.0,
        help="mean handler time, milliseconds (exponential), so that faults find work in flight",
    )
    p.add_argument("--slow-rate", type=float, default=0.02, help="share that sleep 50-300 ms")
    p.add_argument("--lease", type=float, default=3.0, help="the workers' --lease, seconds")
    p.add_argument("--check-interval", type=float, default=0.5, help="invariant check, seconds")
    p.add_argument("--timeout", type=float, default=1800.0, help="give up after, seconds")
    p.add_argument("--seed", type=int, default=None, help="random seed (default: random)")
    p.add_argument("--reset", action="store_true", help="empty the queue tables first")
    p.add_argument("--json", help="write the result to this file")
    p.add_argument("--log-dir", help="worker logs (default: a new temporary directory)")
    args = p.parse_args(argv)
    if args.throwaway_cluster and args.restart_datadir:
        p.error("--throwaway-cluster and --restart-datadir exclude each other")
    if args.pg_ctl and not args.restart_datadir:
        p.error("--pg-ctl goes with --restart-datadir")
    can_restart = args.throwaway_cluster or args.restart_datadir
    if args.faults is None:
        args.faults = ",".join(k for k in FAULT_KINDS if k != "restart" or can_restart)
    faults = [f.strip() for f in args.faults.split(",") if f.strip()]
    unknown = sorted(set(faults) - set(FAULT_KINDS))
    if unknown:
        p.error(f"--faults: unknown kind(s) {', '.join(unknown)}; choose from {FAULT_KINDS}")
    args.faults = faults
    for name in ("messages", "workers", "concurrency", "waves"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1")
    if args.waves > args.messages:
        p.error("--waves must not exceed --messages")
    for name in ("wave_interval", "fault_interval", "lease", "check_interval", "timeout"):
        if not getattr(args, name) > 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    if args.work_ms < 0:
        p.error("--work-ms must not be negative")
    for name in ("fail_rate", "slow_rate"):
        if not 0 <= getattr(args, name) <= 1:
            p.error(f"--{name.replace('_', '-')} must be between 0 and 1")
    if "restart" in faults and not can_restart:
        p.error(
            "--faults restart restarts only a cluster it is told about: pass"
            " --throwaway-cluster, or --restart-datadir with the data directory of"
            " DATABASE_URL's server; or leave restart out of --faults"
        )
    if args.restart_datadir:
        args.restart_datadir = os.path.realpath(args.restart_datadir)
        if not os.path.isfile(os.path.join(args.restart_datadir, "PG_VERSION")):
            p.error(f"--restart-datadir {args.restart_datadir}: not a PostgreSQL data directory")
        if args.pg_ctl is None:
            try:
                args.pg_ctl = os.path.join(
                    throwaway_pg.bindir_for_datadir(args.restart_datadir), "pg_ctl"
                )
            except throwaway_pg.ClusterError as exc:
                p.error(f"--restart-datadir: {exc}")
    return args


class Restarter:
    """Restarts the one cluster it was given, ``pg_ctl -D <datadir> restart -m
    immediate`` (as the data directory's owner when we are root)."""

    def __init__(self, datadir, pg_ctl, log_path):
        self.datadir = datadir
        self.pg_ctl = pg_ctl
        self.log_path = log_path

    def check_serves(self, connection):
        """Refuse to go on unless ``connection``'s server runs on our data directory."""
        with connection.cursor() as cursor:
            cursor.execute("SELECT current_setting('data_directory')")
            served = cursor.fetchone()[0]
        if os.path.realpath(served) != os.path.realpath(self.datadir):
            raise SystemExit(
                f"--restart-datadir {self.datadir} is not the data directory of the server"
                f" behind DATABASE_URL ({served}): refusing to restart it"
            )

    def restart(self):
        command = [
            self.pg_ctl,
            "-D",
            self.datadir,
            "restart",
            "-m",
            "immediate",
            "-w",
            "-t",
            "120",
            # The new postmaster writes there, not into our pipes.
            "-l",
            self.log_path,
        ]
        done = subprocess.run(
            throwaway_pg.as_owner(command, self.datadir),
            cwd=self.datadir,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            check=False,
            timeout=180,
        )
        if done.returncode:
            raise RuntimeError(
                f"{' '.join(command)} failed ({done.returncode}):\n{done.stdout}{done.stderr}"
            )


def setup_django():
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "testproject.settings")
    os.environ.setdefault("DEBUG", "False")
    sys.path.insert(0, str(TESTPROJECT))
    import django

    django.setup()


def with_retry(fn, what, attempts=60):
    """Run ``fn`` against the database, riding out a restart or a cut connection."""
    from django.db import InterfaceError, OperationalError, connection

    for attempt in range(attempts):
        try:
            return fn()
        except (OperationalError, InterfaceError) as exc:
            if attempt == attempts - 1:
                raise
            log(f"{what}: {str(exc).splitlines()[0]}; retrying")
            connection.close()
            time.sleep(0.5)
    raise AssertionError("unreachable")


class Workers:
    """The worker processes: started, signalled, replaced, reaped."""

    def __init__(self, args, log_dir, pgqueue):
        self.args = args
        self.log_dir = log_dir
        self.env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "PGQUEUE_JSON": json.dumps(pgqueue),
            "PGQUEUE_LOG_LEVEL": "WARNING",
        }
        self.live = []  # Popen
        self.signalled = {}  # pid -> signal sent by us
        self.started = 0
        self.unexpected_exits = []  # (pid, returncode)

    def start(self):
        self.started += 1
        path = self.log_dir / f"worker-{self.started}.log"
        with open(path, "w") as out:
            popen = subprocess.Popen(
                [
                    sys.executable,
                    str(MANAGE),
                    "pgqueue_worker",
                    "--concurrency",
                    str(self.args.concurrency),
                    "--lease",
                    str(self.args.lease),
                    "--poll-interval",
                    "1",
                    "--shutdown-timeout",
                    "10",
                ],
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        popen.log_path = path
        self.live.append(popen)
        return popen

    def reap(self):
        """Forget exited workers; note any exit that we did not cause."""
        for popen in list(self.live):
            code = popen.poll()
            if code is None:
                continue
            self.live.remove(popen)
            sent = self.signalled.get(popen.pid)
            # SIGTERM: exit 0 after a graceful stop, or -15 when it came before
            # the worker had installed its handler (it was still starting).
            if sent == signal.SIGKILL or (sent == signal.SIGTERM and code in (0, -signal.SIGTERM)):
                continue
            self.unexpected_exits.append((popen.pid, code, str(popen.log_path)))
            log(f"worker {popen.pid} exited with {code} unasked: see {popen.log_path}")

    def victim(self):
        running = [p for p in self.live if p.pid not in self.signalled]
        return random.choice(running) if running else None

    def signal(self, popen, signum):
        self.signalled[popen.pid] = signum
        popen.send_signal(signum)

    def stop_all(self, timeout=60):
        for popen in self.live:
            if popen.poll() is None and popen.pid not in self.signalled:
                self.signal(popen, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for popen in self.live:
            try:
                popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.signal(popen, signal.SIGKILL)
                popen.wait()
        self.reap()


class InvariantChecker(threading.Thread):
    """CHECK_SQL every interval from a connection of its own (reconnecting
    after a restart); records every check that found a violation."""

    def __init__(self, dsn, interval):
        super().__init__(name="chaos-invariant", daemon=True)
        self.dsn = dsn
        self.interval = interval
        self.checks = 0
        self.violations = []
        self.pending = None  # messages still in the queue at the last check
        self.stop_event = threading.Event()

    def run(self):
        import psycopg

        conn = None
        while not self.stop_event.is_set():
            try:
                if conn is None or conn.closed:
                    conn = psycopg.connect(self.dsn, autocommit=True, connect_timeout=5)
                both, lost, atomic_twice, pending, total = conn.execute(CHECK_SQL).fetchone()
            except psycopg.Error:
                if conn is not None:
                    conn.close()
                conn = None
                self.stop_event.wait(0.5)
                continue
            self.checks += 1
            self.pending = pending
            if both or lost or atomic_twice:
                found = {"in_queue_and_dead": both, "lost": lost, "atomic_done_twice": atomic_twice}
                self.violations.append({"at": time.time(), "of": total, **found})
                log(f"INVARIANT VIOLATED: {found}")
            self.stop_event.wait(self.interval)
        if conn is not None:
            conn.close()

    def stop(self):
        self.stop_event.set()
        self.join(timeout=30)


class Faults:
    """One fault per call, in shuffled rounds of the chosen kinds."""

    def __init__(self, kinds, workers, restarter=None):
        self.kinds = list(kinds)
        self.workers = workers
        self.round = []
        self.counts = dict.fromkeys(kinds, 0)
        # Messages leased to a worker when a fault hit it: the most that a
        # non-atomic handler may have handled again afterwards.
        self.exposed = 0
        self.restarter = restarter
        assert restarter is not None or "restart" not in kinds

    def inject(self):
        if not self.kinds:
            return
        if not self.round:
            self.round = random.sample(self.kinds, len(self.kinds))
        kind = self.round.pop()
        getattr(self, kind)()
        self.counts[kind] += 1

    def leased(self, pid=None):
        from django.db import connection

        def count():
            with connection.cursor() as cursor:
                if pid is None:
                    cursor.execute(
                        "SELECT count(*) FROM django_pgqueue_message WHERE status = 'processing'"
                    )
                else:
                    cursor.execute(
                        "SELECT count(*) FROM django_pgqueue_message"
                        " WHERE status = 'processing' AND locked_by LIKE %s",
                        [f"%:{pid}:%"],
                    )
                return cursor.fetchone()[0]

        return with_retry(count, "counting leased messages")

    def kill9(self):
        self._signal_and_replace(signal.SIGKILL, "kill -9")

    def sigterm(self):
        # A graceful stop finishes or hands back what it holds; counted as
        # exposed all the same, so the bound never relies on that.
        self._signal_and_replace(signal.SIGTERM, "SIGTERM")

    def _signal_and_replace(self, signum, label):
        victim = self.workers.victim()
        if victim is None:
            return
        exposed = self.leased(victim.pid)
        self.workers.signal(victim, signum)
        self.exposed += exposed
        self.workers.start()
        log(f"fault: {label} worker {victim.pid} ({exposed} leased); replaced")

    def terminate(self):
        from django.db import connection

        victim = self.workers.victim()
        if victim is None:
            return
        exposed = self.leased(victim.pid)

        def cut():
            with connection.cursor() as cursor:
                cursor.execute(
                    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
                    " WHERE application_name LIKE %s",
                    [f"pgqueue_%#{victim.pid}"],
                )
                return cursor.fetchone()[0]

        cut_count = with_retry(cut, "terminating backends")
        self.exposed += exposed
        log(f"fault: pg_terminate_backend x{cut_count} of worker {victim.pid} ({exposed} leased)")

    def restart(self):
        from django.db import connection

        exposed = self.leased()
        started = time.monotonic()
        self.restarter.restart()
        connection.close()
        self.exposed += exposed
        log(
            f"fault: PostgreSQL of {self.restarter.datadir} restarted (immediate) in"
            f" {time.monotonic() - started:.1f}s ({exposed} leased)"
        )


def make_payloads(count, args, rng):
    payloads = []
    for _ in range(count):
        payload = {}
        if rng.random() < args.fail_rate:
            attempts = rng.sample(range(1, MAX_ATTEMPTS + 1), rng.randint(1, 3))
            payload["fail"] = {str(a): rng.choice(FAILURE_KINDS) for a in attempts}
        if rng.random() < args.slow_rate:
            payload["sleep"] = round(rng.uniform(0.05, 0.3), 3)
        elif args.work_ms:
            payload["sleep"] = round(min(rng.expovariate(1000 / args.work_ms), 0.05), 4)
        payloads.append(payload)
    return payloads


def enqueue_wave(wave, size, args, rng):
    """Enqueue one wave in chunks, each chunk recorded in EXPECTED_TABLE in the
    same transaction: after an error the chunk's fate is read, not guessed."""
    from django.db import connection, transaction

    from django_pgqueue import enqueue_many

    chunk_size = 1000
    enqueued = 0
    for start in range(0, size, chunk_size):
        chunk = wave * 1_000_000 + start
        n = min(chunk_size, size - start)
        topic = rng.choice(list(TOPICS))
        payloads = make_payloads(n, args, rng)
        items = [{"payload": payload} for payload in payloads]

        def insert(topic=topic, items=items, chunk=chunk):
            with connection.cursor() as cursor:
                cursor.execute(f"SELECT 1 FROM {EXPECTED_TABLE} WHERE chunk = %s LIMIT 1", [chunk])
                if cursor.fetchone():
                    return 0  # committed before the error that brought us here
            with transaction.atomic():
                messages = enqueue_many(items, topic=topic)
                with connection.cursor() as cursor:
                    cursor.execute(
                        f"INSERT INTO {EXPECTED_TABLE} (message_id, atomic, chunk)"
                        " SELECT unnest(%s::bigint[]), %s, %s",
                        [[m.pk for m in messages], TOPICS[topic], chunk],
                    )
            return len(messages)

        with_retry(insert, f"enqueueing wave {wave}")
        enqueued += n
    return enqueued


def empty_tables(reset):
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(EXPECTED_DDL)
        cursor.execute(
            "SELECT (SELECT count(*) FROM django_pgqueue_message)"
            " + (SELECT count(*) FROM django_pgqueue_deadletter)"
            " + (SELECT count(*) FROM demo_handled)"
            f" + (SELECT count(*) FROM {EXPECTED_TABLE})"
        )
        rows = cursor.fetchone()[0]
        if rows and not reset:
            raise SystemExit(
                f"the database {connection.settings_dict['NAME']!r} holds {rows} queue,"
                " dead-letter or ledger row(s): pass --reset to empty the tables first"
            )
        cursor.execute(
            "TRUNCATE django_pgqueue_message, django_pgqueue_deadletter, demo_handled,"
            f" {EXPECTED_TABLE}"
        )


def dsn():
    from django.db import connection

    params = connection.settings_dict
    parts = {
        "dbname": params["NAME"],
        "user": params["USER"],
        "password": params["PASSWORD"],
        "host": params["HOST"],
        "port": params["PORT"],
    }
    return " ".join(f"{k}='{v}'" for k, v in parts.items() if v)


def run(args):
    from django.core.management import call_command
    from django.db import connection

    seed = args.seed if args.seed is not None else random.randrange(2**32)
    random.seed(seed)
    rng = random.Random(seed)
    restarter = None
    if args.restart_datadir:
        restarter = Restarter(args.restart_datadir, args.pg_ctl, args.restart_log)
        restarter.check_serves(connection)
    call_command("migrate", verbosity=0)
    if args.throwaway_cluster:
        call_command("migrate", database="other", verbosity=0)
    empty_tables(args.reset)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="pgqueue-chaos-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    log(
        f"chaos soak on {connection.settings_dict['NAME']!r}: {args.messages:,} messages,"
        f" {args.workers} workers, faults {','.join(args.faults) or 'none'}, seed {seed},"
        f" worker logs in {log_dir}"
    )
    pgqueue = {
        "MAX_ATTEMPTS": MAX_ATTEMPTS,
        "HEARTBEAT_INTERVAL": 1.0,
        "POLL_INTERVAL": 1.0,
        "BACKOFF_BASE": 0.05,
        "BACKOFF_CAP": 0.5,
    }
    workers = Workers(args, log_dir, pgqueue)
    faults = Faults(args.faults, workers, restarter)
    checker = InvariantChecker(dsn(), args.check_interval)
    checker.start()
    started = time.monotonic()
    deadline = started + args.timeout
    for _ in range(args.workers):
        workers.start()

    wave_sizes = [args.messages // args.waves] * args.waves
    wave_sizes[-1] += args.messages - sum(wave_sizes)
    enqueued = 0
    next_wave = started
    next_fault = started + args.fault_interval
    wave = 0
    timed_out = False
    while True:
        now = time.monotonic()
        if now > deadline:
            timed_out = True
            log("timed out")
            break
        workers.reap()
        if wave < args.waves and now >= next_wave:
            enqueued += enqueue_wave(wave, wave_sizes[wave], args, rng)
            log(f"wave {wave + 1}/{args.waves}: {enqueued:,} enqueued")
            wave += 1
            next_wave = now + args.wave_interval
        enqueuing = wave < args.waves
        pending = checker.pending
        # Faults go on while there is work; a round that has begun finishes.
        busy = enqueuing or pending is None or pending > 0
        if now >= next_fault and (busy or faults.round):
            faults.inject()
            next_fault = time.monotonic() + args.fault_interval * random.uniform(0.7, 1.3)
        if not enqueuing and not faults.round and pending == 0 and checker.checks:
            if with_retry(queue_is_empty, "checking the queue"):
                break
        time.sleep(0.05)
    drained = time.monotonic()
    workers.stop_all()
    checker.stop()
    result = final_counts(args, seed, enqueued, drained - started, workers, faults, checker)
    result["timed_out"] = timed_out
    result["log_dir"] = str(log_dir)
    result["ok"] = ok(result)
    return result


def queue_is_empty():
    from django_pgqueue.models import Message

    return not Message.objects.exists()


def final_counts(args, seed, enqueued, seconds, workers, faults, checker):
    from django.db import connection

    def read():
        with connection.cursor() as cursor:
            cursor.execute(FINAL_SQL)
            return cursor.fetchone()

    done, dead, lost, atomic_twice, nonatomic_extra, still_queued = with_retry(read, "counting")
    categories = dict(with_retry(dead_letter_categories, "counting dead letters"))
    return {
        "messages": args.messages,
        "enqueued": enqueued,
        "done": done,
        "dead_lettered": dead,
        "dead_letter_categories": categories,
        "still_queued": still_queued,
        "lost": lost,
        "handled_twice_atomic": atomic_twice,
        "extra_handlings_nonatomic": int(nonatomic_extra),
        "exposed_in_flight": faults.exposed,
        "invariant_checks": checker.checks,
        "invariant_violations": checker.violations,
        "unexpected_worker_exits": workers.unexpected_exits,
        "workers_started": workers.started,
        "faults": faults.counts,
        "seconds": round(seconds, 2),
        "messages_per_s": round(enqueued / seconds, 1) if seconds else None,
        "workers": args.workers,
        "concurrency": args.concurrency,
        "seed": seed,
    }


def dead_letter_categories():
    from django.db.models import Count

    from django_pgqueue.models import DeadLetter

    return list(DeadLetter.objects.values_list("category").annotate(n=Count("id")).order_by())


def ok(result):
    return (
        not result["timed_out"]
        and result["enqueued"] == result["messages"]
        and result["lost"] == 0
        and result["still_queued"] == 0
        and result["handled_twice_atomic"] == 0
        and result["extra_handlings_nonatomic"] <= result["exposed_in_flight"]
        and result["invariant_checks"] > 0
        and not result["invariant_violations"]
        and not result["unexpected_worker_exits"]
    )


def report(result):
    faults = ", ".join(f"{kind} {n}" for kind, n in result["faults"].items()) or "none"
    categories = ", ".join(f"{c} {n}" for c, n in result["dead_letter_categories"].items())
    lines = [
        f"enqueued                    {result['enqueued']:,}",
        f"done                        {result['done']:,}",
        f"dead-lettered               {result['dead_lettered']:,} ({categories or '-'})",
        f"lost                        {result['lost']:,}  (must be 0)",
        f"still queued                {result['still_queued']:,}  (must be 0)",
        f"handled twice, atomic       {result['handled_twice_atomic']:,}  (must be 0)",
        f"extra handlings, non-atomic {result['extra_handlings_nonatomic']:,}"
        f"  (at most {result['exposed_in_flight']:,}: leased to workers when faults hit)",
        f"invariant checks            {result['invariant_checks']:,},"
        f" {len(result['invariant_violations'])} violation(s)",
        f"unexpected worker exits     {len(result['unexpected_worker_exits'])}",
        f"faults                      {faults} ({result['workers_started']} workers started)",
        f"wall time                   {result['seconds']:.1f} s,"
        f" {result['messages_per_s']:,.0f} messages/s",
        f"result                      {'PASS' if result['ok'] else 'FAIL'}",
    ]
    print("\n".join(lines), flush=True)


def main(argv=None):
    args = parse_args(argv)
    cluster = None
    if args.throwaway_cluster:
        cluster = throwaway_pg.ThrowawayCluster.create(prefix="pgqueue-chaos-pg-")
        for name in ("pgqueue_chaos", "pgqueue_chaos_other"):
            cluster.create_database(name)
        # Ours and the workers' (they inherit the environment).
        os.environ["DATABASE_URL"] = cluster.url("pgqueue_chaos")
        os.environ["OTHER_DATABASE_URL"] = cluster.url("pgqueue_chaos_other")
        args.restart_datadir = str(cluster.datadir)
        args.pg_ctl = cluster.pg_ctl_path
        if args.restart_log == os.devnull:
            args.restart_log = str(cluster.log_path)
        log(f"throwaway cluster in {cluster.datadir}, port {cluster.port}")
    try:
        setup_django()
        result = run(args)
    finally:
        if cluster is not None:
            from django.db import connections

            connections.close_all()
            cluster.close()
    report(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
