#!/usr/bin/env python
"""Django's ``django.tasks`` with the django-tasks-db backend, for
benchmarks/compare.py. Runs in benchmarks/.venvs/django-tasks-db (Django 6,
Python 3.12+).

Settings: bench_django_tasks_settings.py; tasks: bench_django_tasks_jobs.py
(``noop``, ``latency``). The worker is the backend's own command,
``python -m django db_worker``. Enqueue: ``task.enqueue(n=i)`` in autocommit
(one transaction each). django.tasks has no bulk API, so "bulk" is the same
call in a loop inside one ``transaction.atomic()``.
"""

import os

import _common

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "bench_django_tasks_settings")


def main(argv=None):
    args = _common.parser(__doc__.split("\n\n")[0]).parse_args(argv)
    import django

    django.setup()
    from bench_django_tasks_jobs import latency, noop
    from django.db import connection, transaction

    if args.op == "info":
        _common.answer_info(("django", "django-tasks-db", "psycopg"))
    elif args.op == "enqueue-single":
        noop.enqueue(n=-1)  # warm up, not timed
        with connection.cursor() as cursor:
            cursor.execute("DELETE FROM django_tasks_database_dbtaskresult")

        def run():
            for i in range(args.n):
                noop.enqueue(n=i)

        _common.emit({"seconds": _common.timed(run), "n": args.n})
    elif args.op == "enqueue-bulk":

        def run():
            with transaction.atomic():
                for i in range(args.n):
                    noop.enqueue(n=i)

        _common.emit({"seconds": _common.timed(run), "n": args.n})
    elif args.op == "latency-enqueue":
        connection.ensure_connection()

        def one(key):
            latency.enqueue(key=key)
            return key

        def batch(keys):
            with transaction.atomic():
                for key in keys:
                    latency.enqueue(key=key)
            return keys

        _common.emit(_common.latency_loop(one, args, batch))
    else:
        raise SystemExit(f"unknown op {args.op!r}")


if __name__ == "__main__":
    main()
