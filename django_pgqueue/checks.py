"""System checks: a wrong PGQUEUE setting or database is reported at start-up,
with a hint that says how to fix it, instead of failing at the first message."""

from django.core import checks
from django.core.exceptions import ImproperlyConfigured

from . import conf

POSTGRESQL_ENGINES = ("django.db.backends.postgresql",)


def register():
    checks.register(check_settings, checks.Tags.compatibility)
    checks.register(check_database, checks.Tags.compatibility)


def check_settings(app_configs=None, **kwargs):
    return [checks.Error(msg, hint=hint, id=id_) for id_, msg, hint in conf.validate()]


def check_database(app_configs=None, **kwargs):
    from django.conf import settings

    try:
        alias = conf.get("DATABASE")
    except ImproperlyConfigured:
        return []  # check_settings reports it
    if conf.alias_problem(alias):
        return []  # check_settings reports it
    engine = settings.DATABASES[alias].get("ENGINE", "")
    errors = []
    if engine not in POSTGRESQL_ENGINES:
        errors.append(
            checks.Error(
                f"The queue database {alias!r} uses {engine or 'no ENGINE'}; "
                "django-pgqueue needs PostgreSQL.",
                hint="Point PGQUEUE['DATABASE'] at an alias whose ENGINE is "
                "'django.db.backends.postgresql'.",
                id="pgqueue.E004",
            )
        )
    errors.extend(_check_psycopg())
    return errors


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
