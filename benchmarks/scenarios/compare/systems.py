"""The systems the compare scenario runs: the raw psycopg loop, django-pgqueue and
its peers. Each names its client script (benchmarks/peers/), its worker
command, the SQL that watches its queue, and what it pins."""

import os
import shlex

from benchmarks.harness import db
from benchmarks.harness.tree import Tree
from benchmarks.scenarios.compare import PEERS
from benchmarks.scenarios.compare.graphile import Graphile
from benchmarks.scenarios.compare.system import System, Variant, find_python312


class Raw(System):
    name = "raw"
    label = "raw psycopg loop"
    script = "bench_raw.py"
    tables = ["raw_jobs"]
    single_note = "autocommit `INSERT INTO raw_jobs (payload) VALUES (%s)`"
    bulk_note = "one `INSERT ... SELECT FROM unnest(%s::jsonb[])`"
    worker_note_format = (
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
    latency_from = "file"  # (and an older tree's demo.Handled rows: latency_results)
    worker_note_format = (
        "tuned: `testproject/manage.py pgqueue_worker --log-level WARNING {args}`; defaults:"
        " `testproject/manage.py pgqueue_worker --subscriptions none`, its INFO log level"
        " (`--subscriptions none` on both: the testproject's stream subscribers belong to its"
        " test suite); `--burst` for the drains, DEBUG=False, OPTIONS prepare_threshold=5"
    )
    single_note = "`enqueue(topic, payload)` in autocommit"
    bulk_note = "`enqueue_many(items, topic=...)`: pipelined INSERTs of 1,000 rows, one transaction"
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

    def __init__(self, opts, name=None, tree=None):
        """``tree``: the django-pgqueue checkout to run (default: this one)."""
        super().__init__(opts, name)
        self.tree = tree or Tree.here()
        self.worker_args = shlex.split(opts.pgqueue_worker_args)
        self.other_url = db.other_url(self.url)

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
        """The tuned workers (``--pgqueue-worker-args``; the keys "atomic" and
        "nonatomic", which the targets and the ab scenario name) and the worker as a
        user starts it first: no option but ``--subscriptions none`` (the
        testproject registers stream subscribers for its test suite; the
        peers have no streams), at its default INFO log level, which the
        testproject's log handler then passes (PGQUEUE_LOG_LEVEL)."""
        defaults = {
            "worker_defaults": True,
            "worker_args": ["--subscriptions", "none"],
            "env": {"PGQUEUE_LOG_LEVEL": "INFO"},
        }
        every = [
            Variant("atomic", "django-pgqueue, atomic=True, tuned", client="atomic"),
            Variant("nonatomic", "django-pgqueue, atomic=False, tuned", client="nonatomic"),
            Variant(
                "atomic-defaults", "django-pgqueue, atomic=True, defaults", "atomic", **defaults
            ),
            Variant(
                "nonatomic-defaults",
                "django-pgqueue, atomic=False, defaults",
                "nonatomic",
                **defaults,
            ),
        ]
        wanted = getattr(self.opts, "pgqueue_variants", None)  # compare's; ab: every one
        return [v for v in every if not wanted or v.key in wanted]

    @property
    def python(self):
        return self.tree.python

    def env(self, **extra):
        env = super().env(**extra)
        env.update(
            DATABASE_URL=self.url,
            OTHER_DATABASE_URL=self.other_url,
            DEBUG="False",
            DJANGO_SETTINGS_MODULE="testproject.settings",
            PGQUEUE_LOG_LEVEL="WARNING",
            BENCH_TESTPROJECT=str(self.tree.testproject),
        )
        return self.tree.env(env)

    def setup_database(self):
        db.recreate_database(self.url)
        db.recreate_database(self.other_url)
        for database in ("default", "other"):
            self.run_checked(
                self.tree.manage("migrate", "--noinput", "-v", "0", "--database", database),
                f"manage.py migrate --database {database}",
                cwd=self.tree.testproject,
            )

    def worker_cwd(self):
        return self.tree.testproject

    def worker_argv(self, variant, burst):
        if variant and variant.worker_defaults:
            argv = self.tree.manage("pgqueue_worker", *variant.worker_args)
        else:
            argv = self.tree.manage("pgqueue_worker", "--log-level", "WARNING") + self.worker_args
        return argv + (["--burst"] if burst else [])

    def latency_results(self, latency_file):
        """The lines the handler appends to the latency file (this tree's
        bench.latency, as the peers' handlers), and the demo.Handled rows of
        an older tree's, which wrote those instead."""
        found = super().latency_results(latency_file)
        with db.connect(self.url) as conn:
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

    @property
    def worker_note(self):
        return (
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
    default_args = "--concurrency 4"
    worker_note_format = (
        "`procrastinate --app bench_procrastinate_app.app worker {args}` (`--one-shot` for the"
        " drains), PsycopgConnector, async tasks, jobs kept"
    )
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
    default_args = "--no-startup-delay"
    worker_note_format = (
        "`python -m django db_worker {args}` (`--batch` for the drains), DEBUG=False,"
        " CONN_MAX_AGE=None"
    )
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


SYSTEMS = {cls.name: cls for cls in (Raw, PgQueue, PgQueuer, Graphile, Procrastinate, DjangoTasks)}
