"""Django settings of benchmarks/compare.py's django.tasks + django-tasks-db side.

The database comes from BENCH_DSN (postgres://user@host:port/name). DEBUG is
off (it would keep every query in memory and turn on db_worker's reloader)."""

import os
from urllib.parse import urlsplit

_url = urlsplit(os.environ.get("BENCH_DSN", "postgres://postgres@127.0.0.1:5432/bench"))

SECRET_KEY = "benchmark-only"
DEBUG = False
USE_TZ = True
INSTALLED_APPS = ["django_tasks_db"]
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": _url.path.lstrip("/"),
        "USER": _url.username or "",
        "PASSWORD": _url.password or "",
        "HOST": _url.hostname or "",
        "PORT": str(_url.port or ""),
    }
}
TASKS = {
    "default": {
        "BACKEND": "django_tasks_db.DatabaseBackend",
        "QUEUES": ["default"],
    }
}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
# Persistent connections: db_worker calls close_old_connections() around every
# task, so with Django's default CONN_MAX_AGE = 0 it opens a new connection per
# task (about half the throughput). BENCH_DJANGO_CONN_MAX_AGE=0 measures that.
_age = os.environ.get("BENCH_DJANGO_CONN_MAX_AGE", "none").lower()
DATABASES["default"]["CONN_MAX_AGE"] = None if _age == "none" else int(_age)
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "loggers": {"django_tasks_db": {"handlers": ["console"], "level": "WARNING"}},
}
