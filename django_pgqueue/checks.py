"""System checks: a wrong PGQUEUE setting or database is reported at start-up,
with a hint that says how to fix it, instead of failing at the first message."""

from django.core import checks
from django.core.exceptions import ImproperlyConfigured
from django.db import DatabaseError

from django_pgqueue import conf

POSTGRESQL_ENGINES = ("django.db.backends.postgresql",)


def register():
    checks.register(check_settings, checks.Tags.compatibility)
    checks.register(check_database, checks.Tags.compatibility)
    checks.register(check_schedules, checks.Tags.compatibility)
    # Tagged "database": it queries the server, so Django runs it only when
    # asked to (manage.py check --database, migrate).
    checks.register(check_vacuum, checks.Tags.database)
    # A deployment check: migrate runs the checks before it migrates, and
    # would warn of the very tables it is about to create.
    checks.register(check_queue_tables, checks.Tags.database, deploy=True)


def check_settings(app_configs=None, **kwargs):
    errors = [checks.Error(msg, hint=hint, id=id_) for id_, msg, hint in conf.validate()]
    return errors or _check_timeouts()


def _check_timeouts():
    lock, statement = conf.get("LOCK_TIMEOUT"), conf.get("STATEMENT_TIMEOUT")
    if lock is not None and statement is not None and lock >= statement:
        return [
            checks.Warning(
                f"PGQUEUE['LOCK_TIMEOUT'] ({lock}s) is not shorter than "
                f"PGQUEUE['STATEMENT_TIMEOUT'] ({statement}s): a worker statement that "
                "waits for a lock is cancelled by the statement timeout first.",
                hint="Make LOCK_TIMEOUT a few seconds and STATEMENT_TIMEOUT well above it.",
                id="pgqueue.W101",
            )
        ]
    return []


def check_schedules(app_configs=None, **kwargs):
    """pgqueue.E110: a bad entry of PGQUEUE["SCHEDULES"] (or schedule= of a
    handler), one error per field; pgqueue.E111: a schedule's task cannot be
    enqueued through PgQueueBackend. pgqueue_worker refuses to start on
    either (its system checks), so no worker runs a schedule half right."""
    from django_pgqueue.schedules import configured

    try:
        entries = conf.get("SCHEDULES")
    except ImproperlyConfigured:
        return []  # PGQUEUE itself is not a dict: check_settings reports it
    if not isinstance(entries, dict) or not all(isinstance(name, str) for name in entries):
        return []  # not a dict of names: check_settings reports it (pgqueue.E003)
    specs, found = configured.load()
    errors = [
        checks.Error(
            f"PGQUEUE['SCHEDULES'][{problem.name!r}]"
            + (f"[{problem.field!r}]" if problem.field else "")
            + f": {problem.problem}.",
            hint=problem.hint,
            id="pgqueue.E110",
        )
        for problem in found
    ]
    for spec in specs:
        if spec.task is not None:
            problem = _task_problem(spec.task)
            if problem:
                errors.append(
                    checks.Error(
                        f"PGQUEUE['SCHEDULES'][{spec.name!r}]['task']: {problem}.",
                        hint="Name a function decorated with django.tasks' @task, whose "
                        "backend (TASKS) is django_pgqueue.tasks.PgQueueBackend.",
                        id="pgqueue.E111",
                    )
                )
    return errors


def _task_problem(path):
    """Why the task ``path`` cannot be a schedule's, or None."""
    import django
    from django.utils.module_loading import import_string

    if django.VERSION < (6, 0):
        return f"{path!r} needs Django 6.0's Tasks framework (this is Django {django.__version__})"
    from django.tasks import Task
    from django.tasks.exceptions import InvalidTaskBackend

    from django_pgqueue.tasks import PgQueueBackend

    try:
        task = import_string(path)
    except ImportError as exc:
        return f"{path!r} cannot be imported ({exc})"
    if not isinstance(task, Task):
        return f"{path!r} is a {type(task).__name__}, not a Task (decorate it with @task)"
    try:
        backend = task.get_backend()
    except InvalidTaskBackend as exc:
        return f"{path!r} names the Tasks backend {task.backend!r}, which fails ({exc})"
    if not isinstance(backend, PgQueueBackend):
        return (
            f"{path!r} is enqueued through the Tasks backend {task.backend!r} "
            f"({type(backend).__name__}), not PgQueueBackend: its runs would have no result here"
        )
    return None


def check_database(app_configs=None, **kwargs):
    from django.conf import settings

    try:
        aliases = _queue_databases()
    except ImproperlyConfigured:
        return []  # check_settings reports it
    errors = []
    for alias in aliases:
        engine = settings.DATABASES[alias].get("ENGINE", "")
        if engine not in POSTGRESQL_ENGINES:
            errors.append(
                checks.Error(
                    f"The queue database {alias!r} uses {engine or 'no ENGINE'}; "
                    "django-pgqueue needs PostgreSQL.",
                    hint="Point PGQUEUE['DATABASE'] (and each queue's or stream's "
                    "'database') at an alias whose ENGINE is 'django.db.backends.postgresql'.",
                    id="pgqueue.E004",
                )
            )
        errors.extend(_check_pooling(alias, settings.DATABASES[alias]))
    if aliases:
        errors.extend(_check_psycopg())
    return errors


def _queue_databases():
    """The aliases of conf.databases() that check_settings finds no fault
    with (it reports the others)."""
    if conf.validate():
        return [alias for alias in [conf.get("DATABASE")] if not conf.alias_problem(alias)]
    return conf.databases()


def check_queue_tables(app_configs=None, databases=None, **kwargs):
    """pgqueue.W108: a database that holds a queue or a stream lacks the
    app's tables (``manage.py check --deploy --database <alias>``)."""
    from django.conf import settings
    from django.db import connections

    from django_pgqueue.models import Message

    try:
        aliases = _queue_databases()
    except ImproperlyConfigured:
        return []  # check_settings reports it
    warnings = []
    for alias in aliases:
        if databases is None or alias not in databases:
            continue
        if settings.DATABASES[alias].get("ENGINE", "") not in POSTGRESQL_ENGINES:
            continue  # check_database reports it
        try:
            tables = connections[alias].introspection.table_names()
        except DatabaseError:
            continue  # unreachable: whatever uses it next says so
        if Message._meta.db_table not in tables:
            warnings.append(
                checks.Warning(
                    f"The queue database {alias!r} has no django-pgqueue tables: its queues "
                    f"({', '.join(_held_by(alias)) or 'none'}) cannot be enqueued to or worked.",
                    hint=f"Run manage.py migrate --database {alias}, with "
                    "'django_pgqueue.routers.QueueRouter' in DATABASE_ROUTERS "
                    "(docs: Queues on several databases).",
                    id="pgqueue.W108",
                )
            )
    return warnings


def _held_by(alias):
    """The queues and streams the settings put on ``alias``."""
    names = [q for q in conf.queues() if conf.queue_database(q) == alias]
    names += [f"stream {s}" for s in conf.get("STREAMS") or {} if conf.stream_database(s) == alias]
    return names


def _check_pooling(alias, database):
    """Settings the worker cannot work with, and settings that cannot work
    together behind a transaction-pooling PgBouncer (which a project signals
    with DISABLE_SERVER_SIDE_CURSORS, as Django's documentation asks)."""
    problems: list[checks.CheckMessage] = []
    if database.get("OPTIONS", {}).get("server_side_binding"):
        problems.append(
            checks.Error(
                f"The queue database {alias!r} has OPTIONS server_side_binding=True: the "
                "worker sends an acknowledgement and a claim in one round "
                "trip, which needs Django's default client-side binding.",
                hint="Remove server_side_binding; django-pgqueue binds its hot statements on "
                "the server where that helps, and prepares them with prepare_threshold.",
                id="pgqueue.E105",
            )
        )
    isolation = database.get("OPTIONS", {}).get("isolation_level")
    if (
        isolation is not None and int(isolation) > 2
    ):  # psycopg's IsolationLevel: 2 is READ COMMITTED
        problems.append(
            checks.Error(
                f"The queue database {alias!r} has OPTIONS isolation_level="
                f"{getattr(isolation, 'name', isolation)}: the worker promotes the next "
                "message of a message group, and delivers stream events after a lock, with a "
                "snapshot per statement, which only READ COMMITTED gives; the promotion "
                "refuses to run otherwise.",
                hint="Remove isolation_level from the queue database's OPTIONS (PostgreSQL's "
                "default is READ COMMITTED), or give the queue an alias of its own "
                "(PGQUEUE['DATABASE']) without it.",
                id="pgqueue.E106",
            )
        )
    if database.get("DISABLE_SERVER_SIDE_CURSORS") and conf.get("NOTIFY"):
        problems.append(
            checks.Warning(
                f"The queue database {alias!r} has DISABLE_SERVER_SIDE_CURSORS (as behind "
                "PgBouncer in transaction pooling) but PGQUEUE['NOTIFY'] is True: a "
                "transaction pooler does not deliver LISTEN's notifications, so workers "
                "would wake only every POLL_INTERVAL and leave LISTENs on pooled server "
                "connections.",
                hint="Set PGQUEUE['NOTIFY'] = False (poll-only) and run manage.py migrate, or "
                "point the queue database at PostgreSQL or a session-pooling PgBouncer.",
                id="pgqueue.W102",
            )
        )
    return problems


# The server's switches without which autovacuum does nothing, and the
# tables of ours (their TOAST tables too) on which it is switched off.
VACUUM_SETTINGS_SQL = "SELECT current_setting('autovacuum'), current_setting('track_counts')"
VACUUM_DISABLED_SQL = """
SELECT c.relname, t.oid = c.reltoastrelid
FROM pg_class c
JOIN pg_class t ON t.oid = c.oid OR t.oid = c.reltoastrelid
CROSS JOIN LATERAL pg_options_to_table(t.reloptions) AS o
WHERE c.oid = ANY(ARRAY(SELECT to_regclass(name) FROM unnest(%s::text[]) AS name))
    AND o.option_name = 'autovacuum_enabled' AND NOT o.option_value::boolean
ORDER BY 1, 2
"""


def check_vacuum(app_configs=None, databases=None, **kwargs):
    """pgqueue.W107: autovacuum is off on the server or on our tables. Every
    message is a row inserted and deleted (and a worker's or a
    subscription's row is updated all the time): without vacuum the dead
    rows and index entries pile up, and claims, polls and lag counts slow
    down without bound."""
    from django.apps import apps
    from django.conf import settings
    from django.db import connections

    try:
        alias = conf.get("DATABASE")
    except ImproperlyConfigured:
        return []  # check_settings reports it
    if databases is None or alias not in databases or conf.alias_problem(alias):
        return []
    if settings.DATABASES[alias].get("ENGINE", "") not in POSTGRESQL_ENGINES:
        return []  # check_database reports it
    connection = connections[alias]
    tables = [model._meta.db_table for model in apps.get_app_config("django_pgqueue").get_models()]
    try:
        with connection.cursor() as cursor:
            cursor.execute(VACUUM_SETTINGS_SQL)
            autovacuum, track_counts = cursor.fetchone()
            cursor.execute(VACUUM_DISABLED_SQL, [[connection.ops.quote_name(t) for t in tables]])
            disabled = cursor.fetchall()
    except DatabaseError:
        # Unreachable, or not PostgreSQL enough to tell: whatever uses the
        # database next reports the connection problem itself.
        return []
    warnings = []
    if autovacuum != "on" or track_counts != "on":
        setting = "autovacuum = off" if autovacuum != "on" else "track_counts = off"
        vacuumdb_tables = " ".join(f"-t {table}" for table in tables)
        database = connection.settings_dict.get("NAME") or "<database>"
        warnings.append(
            checks.Warning(
                f"The queue database {alias!r} runs on a server with {setting}: autovacuum "
                "never cleans the queue tables, whose every message is a row inserted and "
                "deleted, so claims and polls slow down without bound.",
                hint="Set autovacuum = on and track_counts = on (PostgreSQL's defaults) in "
                "postgresql.conf, or run VACUUM on the queue tables every few minutes, e.g. "
                f"from cron: vacuumdb --dbname {database} {vacuumdb_tables}",
                id="pgqueue.W107",
            )
        )
    if disabled:
        names = sorted({table for table, _ in disabled})
        described = ", ".join(
            f"{table} (its TOAST table)" if toast else table for table, toast in disabled
        )
        warnings.append(
            checks.Warning(
                f"Autovacuum is switched off on queue table(s) of database {alias!r}: "
                f"{described}. Their dead rows are never cleaned, so claims and polls slow "
                "down without bound.",
                hint="Switch it back on: "
                + " ".join(
                    f"ALTER TABLE {table} RESET (autovacuum_enabled, toast.autovacuum_enabled);"
                    for table in names
                )
                + " (or VACUUM them every few minutes, e.g. with vacuumdb -t from cron).",
                id="pgqueue.W107",
            )
        )
    return warnings


def _check_psycopg():
    try:
        import psycopg
    except ImportError:
        return [
            checks.Error(
                "psycopg (version 3) is not installed.",
                hint="pip install 'psycopg>=3.2' (psycopg2 is not supported).",
                id="pgqueue.E005",
            )
        ]
    version = tuple(int(part) for part in psycopg.__version__.split(".")[:2])
    if version < (3, 2):
        return [
            checks.Error(
                f"psycopg {psycopg.__version__} is too old.",
                hint="pip install 'psycopg>=3.2': the worker needs Connection.notifies(timeout=).",
                id="pgqueue.E005",
            )
        ]
    return []
