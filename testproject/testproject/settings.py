"""Settings for the demo and test project, configured through the environment
(django-environ): DATABASE_URL, OTHER_DATABASE_URL, SECRET_KEY, DEBUG."""

from pathlib import Path

import environ

BASE_DIR = Path(__file__).resolve().parent.parent

env = environ.Env()

SECRET_KEY = env("SECRET_KEY", default="testproject-insecure-key-only-for-local-use")
DEBUG = env.bool("DEBUG", default=True)
ALLOWED_HOSTS = env.list("ALLOWED_HOSTS", default=["localhost", "127.0.0.1"])

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django_pgqueue",
    "demo",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "testproject.urls"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

WSGI_APPLICATION = "testproject.wsgi.application"

# "default" holds the business data and, unless PGQUEUE["DATABASE"] says
# otherwise, the queue. "other" is a second database, so that enqueueing
# across aliases is tested for real.
DATABASES = {
    "default": env.db("DATABASE_URL", default="postgres://postgres@127.0.0.1:5432/pgqueue"),
    "other": env.db_url(
        "OTHER_DATABASE_URL", default="postgres://postgres@127.0.0.1:5432/pgqueue_other"
    ),
}

# UNREACHABLE_DATABASE_URL: a third alias, "unreachable", pointed at a port
# where nothing listens (tests/test_worker_databases.py starts a worker with a
# queue there, to see it go on with the others). Absent when unset.
if env.str("UNREACHABLE_DATABASE_URL", default=""):
    DATABASES["unreachable"] = env.db_url("UNREACHABLE_DATABASE_URL")

# Django turns psycopg's prepared statements off (prepare_threshold None) for
# the sake of connection poolers; a project that talks to PostgreSQL directly
# (or through PgBouncer 1.21+) can let psycopg prepare the statements it runs
# often: django-pgqueue's one-message INSERT is one (docs/howto/sizing.rst).
# DATABASE_PREPARE_THRESHOLD="" turns it off, as behind an older PgBouncer.
_prepare_threshold = env.str("DATABASE_PREPARE_THRESHOLD", default="5")
# DATABASE_DISABLE_SERVER_SIDE_CURSORS=1: what Django needs behind PgBouncer
# in transaction pooling (tests/test_pgbouncer.py starts workers so).
_disable_server_side_cursors = env.bool("DATABASE_DISABLE_SERVER_SIDE_CURSORS", default=False)
for _database in DATABASES.values():
    _database.setdefault("OPTIONS", {})["prepare_threshold"] = (
        int(_prepare_threshold) if _prepare_threshold else None
    )
    if _disable_server_side_cursors:
        _database["DISABLE_SERVER_SIDE_CURSORS"] = True

# Test databases of their own names per test run that sets
# PGQUEUE_TEST_DATABASE_SUFFIX (tox sets it to the environment's name), so
# that the tox environments run side by side on one server: test_pgqueue_
# py311_dj52_gw0, ... (pytest-xdist adds the _gw0; PostgreSQL keeps names
# up to 63 characters).
_test_suffix = env.str("PGQUEUE_TEST_DATABASE_SUFFIX", default="")
if _test_suffix:
    _test_suffix = "".join(c if c.isalnum() else "_" for c in _test_suffix.lower())
    for _database in DATABASES.values():
        _database.setdefault("TEST", {})["NAME"] = f"test_{_database['NAME']}_{_test_suffix}"

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"

# The tutorial's handler sends e-mail (docs/tutorial/index.rst, run by
# tests/test_docs.py and tests/test_tutorial_screens.py). Django 6.1 wants
# the mailers named, and warns at each send when none is (an error under
# the suite's filterwarnings); its test environment swaps each for the
# in-memory backend (mail.outbox). Django before 6.1 ignores the setting.
MAILERS = {"default": {"BACKEND": "django.core.mail.backends.smtp.EmailBackend"}}

# pgqueue.W107 warns that autovacuum is off. The server the tests and
# benchmarks run on has autovacuum = off on purpose (benchmarks/README.md:
# the worst case, with no vacuum at a random moment), and tox runs "check
# --fail-level WARNING --database default" against it: only this warning is
# silenced, every other still fails that line. tests/test_checks.py calls
# the check itself (silencing only filters what the command shows).
SILENCED_SYSTEM_CHECKS = ["pgqueue.W107"]

# Tests start worker processes with settings of their own through this
# variable (a JSON object), e.g. PGQUEUE_JSON='{"HEARTBEAT_INTERVAL": 0.5}'.
PGQUEUE = env.json("PGQUEUE_JSON", default={})

# DATABASE_ROUTERS="django_pgqueue.routers.QueueRouter": the router that
# puts the app's tables on the queue databases only (tests/test_databases.py
# migrates fresh databases with it; the suite's own test databases hold
# every table).
DATABASE_ROUTERS = env.list("DATABASE_ROUTERS", default=[])

# OpenTelemetry: a process started with PGQUEUE_TRACE_FILE (the tests'
# worker processes, tests/test_tracing.py) exports its spans to that file, one
# JSON object a line, through the SDK's console exporter; the test reads them.
if env.str("PGQUEUE_TRACE_FILE", default=""):
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor

    _spans = open(env.str("PGQUEUE_TRACE_FILE"), "a", buffering=1)  # noqa: SIM115
    _provider = TracerProvider()
    _provider.add_span_processor(
        SimpleSpanProcessor(
            ConsoleSpanExporter(out=_spans, formatter=lambda span: span.to_json(indent=None) + "\n")
        )
    )
    trace.set_tracer_provider(_provider)

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "loggers": {
        "django_pgqueue": {
            "handlers": ["console"],
            "level": env("PGQUEUE_LOG_LEVEL", default="INFO"),
        }
    },
}

# Django's Tasks framework (Django 6.x; ignored by 5.2): django-pgqueue's
# backend by default; "retrying" shows retries set through OPTIONS (the way
# on Django 6.0, where @task takes no max_attempts); "immediate" is Django's
# own backend, which the tests compare ours with.
TASKS = {
    "default": {
        "BACKEND": "django_pgqueue.tasks.PgQueueBackend",
        "QUEUES": ["default", "tasks"],
    },
    "retrying": {
        "BACKEND": "django_pgqueue.tasks.PgQueueBackend",
        "QUEUES": ["default", "tasks"],
        "OPTIONS": {"MAX_ATTEMPTS": 3, "BACKOFF": "demo.tasks.no_wait"},
    },
    "immediate": {
        "BACKEND": "django.tasks.backends.immediate.ImmediateBackend",
        "QUEUES": ["default", "tasks"],
    },
}
