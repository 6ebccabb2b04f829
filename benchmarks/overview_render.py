#!/usr/bin/env python
"""Render time of the admin's queue overview (and the history's list) with a
big history: the pages must not read the history in full.

Fills the history (django_pgqueue_finishedmessage) of a database of its own
with ROWS finished messages spread over the last day (INSERT ... SELECT
generate_series), and the per-minute outcome counts those messages would
have left (one row per minute, queue and outcome), ANALYZEs both, then
requests each page through Django's test client as a logged-in superuser
and prints the median of REQUESTS requests (after one warm-up request).

    .venv/bin/python benchmarks/overview_render.py [--rows 1000000] [--requests 15]
        [--database-url postgres://postgres@127.0.0.1:5432/pgqueue_bench_overview]

The database name must contain "bench" (it is filled and emptied).
"""

import argparse
import statistics
import sys
import time

from harness import cli, db

DEFAULT_URL = "postgres://postgres@127.0.0.1:5432/pgqueue_bench_overview"
QUEUES = ["default", "mail", "reports"]

FILL_HISTORY = """
INSERT INTO django_pgqueue_finishedmessage (message_id, queue, topic, payload, headers,
    outcome, attempts, dedup_key, enqueued_at, started_at, finished_at, worker)
SELECT n, (ARRAY['default', 'mail', 'reports'])[1 + n %% 3],
    (ARRAY['orders.created', 'mail.send', 'reports.daily', 'users.welcome'])[1 + n %% 4],
    jsonb_build_object('user', n, 'email', 'user' || n || '@example.com'), '{}',
    CASE WHEN n %% 50 = 0 THEN 'dead_lettered' WHEN n %% 97 = 0 THEN 'cancelled' ELSE 'done' END,
    1 + (n %% 7 = 0)::int, CASE WHEN n %% 5 = 0 THEN 'key-' || n END,
    now() - make_interval(secs => 86400.0 * n / %(rows)s) - interval '2 seconds',
    now() - make_interval(secs => 86400.0 * n / %(rows)s) - interval '1 second',
    now() - make_interval(secs => 86400.0 * n / %(rows)s), 'host:1234:abcdef'
FROM generate_series(1, %(rows)s) AS n
"""
# What the acknowledgements would have counted for those rows.
FILL_COUNTS = """
INSERT INTO django_pgqueue_outcomecount (minute, queue, outcome, count)
SELECT date_trunc('minute', finished_at), queue, outcome, count(*)
FROM django_pgqueue_finishedmessage GROUP BY 1, 2, 3
UNION ALL
SELECT date_trunc('minute', finished_at), queue, 'retried', count(*)
FROM django_pgqueue_finishedmessage WHERE attempts > 1 GROUP BY 1, 2
"""


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000, help="history rows (1,000,000)")
    parser.add_argument("--requests", type=int, default=15, help="requests per page (15)")
    cli.add_database_url(parser, "BENCH_DATABASE_URL", DEFAULT_URL)
    args = parser.parse_args(argv)
    cli.require_bench_database(parser, args.database_url)
    if args.rows < 1 or args.requests < 1:
        parser.error("--rows and --requests must be at least 1")
    return args


def fill(rows):
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("TRUNCATE django_pgqueue_finishedmessage, django_pgqueue_outcomecount")
        started = time.monotonic()
        cursor.execute(FILL_HISTORY, {"rows": rows})
        cursor.execute(FILL_COUNTS)
        cursor.execute("VACUUM ANALYZE django_pgqueue_finishedmessage")
        cursor.execute("VACUUM ANALYZE django_pgqueue_outcomecount")
        cursor.execute("SELECT count(*) FROM django_pgqueue_outcomecount")
        counts = cursor.fetchone()[0]
    print(
        f"filled {rows:,} history rows and {counts:,} count rows "
        f"in {time.monotonic() - started:.1f} s",
        file=sys.stderr,
    )


def timed(client, url, requests):
    client.get(url)  # warm-up: templates, connections
    times = []
    for _ in range(requests):
        started = time.perf_counter()
        response = client.get(url)
        times.append((time.perf_counter() - started) * 1000)
        assert response.status_code == 200, (url, response.status_code)
    return times


def main(argv=None):
    args = parse_args(argv)
    env = db.pgqueue_env(args.database_url)
    db.prepare([args.database_url, db.other_url(args.database_url)], env)
    db.setup_django(env)
    from django.contrib.auth import get_user_model
    from django.test import Client
    from django.test.utils import setup_test_environment

    setup_test_environment()
    fill(args.rows)
    user_model = get_user_model()
    user = user_model.objects.filter(username="bench-admin").first()
    if user is None:
        user = user_model.objects.create_superuser("bench-admin", "bench@example.com", "x")
    client = Client()
    client.force_login(user)
    pages = {
        "overview": "/admin/django_pgqueue/finishedmessage/overview/",
        "history list": "/admin/django_pgqueue/finishedmessage/",
        "history list, outcome=done": "/admin/django_pgqueue/finishedmessage/?outcome__exact=done",
        "history list, search by id": "/admin/django_pgqueue/finishedmessage/?q=424242",
    }
    print(f"{'page':30} {'median ms':>10} {'min':>8} {'max':>8}  ({args.requests} requests)")
    for name, url in pages.items():
        times = timed(client, url, args.requests)
        print(f"{name:30} {statistics.median(times):10.1f} {min(times):8.1f} {max(times):8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
