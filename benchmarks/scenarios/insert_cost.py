#!/usr/bin/env python
"""Where a one-message enqueue's time goes in the server: the same
one-row INSERT, each in its own (autocommit) transaction, into

- ``raw``: the raw loop's table of the compare scenario (an id, a payload, one index,
  a statement-level NOTIFY trigger);
- ``ours``: django-pgqueue's message table as migrated;
- ``ours, no notify trigger``: the same with the insert trigger disabled;
- ``ours, no partial indexes``: without pgqueue_msg_claim_idx and
  pgqueue_msg_due_idx;
- ``ours, no group trigger and indexes``: without what message groups
  add to every insert (migration 0009): the row trigger that blocks grouped
  messages (its WHEN clause is all an ungrouped insert pays) and the two
  partial indexes of grouped rows;
- ``ours, no CHECK constraints``: without the table's five CHECK
  constraints (PostgreSQL reads and prepares each constraint's expression
  again for every INSERT statement, so a one-row insert pays for all of
  them);
- ``ours, enqueue()'s INSERT``: the statement ``enqueue()`` sends (every
  column bound, ``RETURNING`` the id and timestamps), where the others send
  a two-column INSERT;
- ``enqueue()``: the public call itself, on Django's connection (its
  checks, its cursor, the returned ``Message``): against ``raw``, the whole
  difference a one-message-per-transaction caller sees;

in turns (``--rounds`` times each, ``--n`` inserts per turn; the median
counts), with psycopg's prepared statements, and the WAL each writes per
insert, the CPU time its server process spent per insert (from
``/proc/<pid>/stat``; shown when the server runs on this machine) and this
client's (``time.process_time``): unlike the wall time, those do not wait
for the WAL flush, whose latency drifts.
The inserts must commit to be measured, and the variants change the table
for their turn, so it runs on a database of its own, ``--database``
(default ``postgres://postgres@127.0.0.1:5432/pgqueue_bench_insert``,
created and migrated through the testproject; its name must contain
"bench"), and puts every change back after each turn.

    .venv/bin/python -m benchmarks insert-cost                     # synchronous_commit on
    .venv/bin/python -m benchmarks insert-cost --synchronous-commit off
"""

import argparse
import os
import statistics
import sys
import time

from psycopg.types.json import Jsonb

from benchmarks.harness import db
from benchmarks.harness.machine import proc_cpu_seconds
from benchmarks.scenarios.compare import PEERS

sys.path.insert(0, str(PEERS))
from bench_raw import SCHEMA as RAW_SCHEMA  # noqa: E402  (the raw loop's table, as the compare scenario's)

INDEXES = {
    "pgqueue_msg_claim_idx": "CREATE INDEX pgqueue_msg_claim_idx ON django_pgqueue_message"
    " (queue, priority DESC, run_at, id) WHERE status = 'waiting'",
    "pgqueue_msg_due_idx": "CREATE INDEX pgqueue_msg_due_idx ON django_pgqueue_message"
    " (queue, run_at) WHERE status = 'waiting'",
}

GROUP_INDEXES = {
    "pgqueue_msg_group_head_uniq": "CREATE UNIQUE INDEX pgqueue_msg_group_head_uniq"
    " ON django_pgqueue_message (group_key)"
    " WHERE group_key IS NOT NULL AND status IN ('waiting', 'processing')",
    "pgqueue_msg_group_next_idx": "CREATE INDEX pgqueue_msg_group_next_idx"
    " ON django_pgqueue_message (group_key, id) WHERE status = 'blocked'",
}

RAW_INSERT_SQL = "INSERT INTO raw_jobs (payload) VALUES (%s)"


def payload_only(i):
    """The parameters of RAW_INSERT_SQL and OURS_INSERT_SQL."""
    return [Jsonb({"n": i})]


def enqueue_insert(database):
    """enqueue()'s one-message INSERT, captured as it runs, and its parameters
    (the same for every message: every option at its default)."""
    # DEBUG off, as in production and the compare scenario: with it on, Django logs
    # every query, and enqueue() then sends its INSERT unprepared through
    # Django's logging cursor (db.prepared_cursor).
    db.setup_django(
        dict(
            os.environ,
            DJANGO_SETTINGS_MODULE="testproject.settings",
            DATABASE_URL=database,
            DEBUG="False",
        )
    )
    from benchmarks.harness import internals

    sql, params = internals.enqueue_statement("bench.noop")
    return sql, lambda i: params


CONSTRAINTS_SQL = """
SELECT conname, pg_get_constraintdef(oid) FROM pg_constraint
WHERE conrelid = 'django_pgqueue_message'::regclass AND contype = 'c' ORDER BY conname
"""
OURS_INSERT_SQL = "INSERT INTO django_pgqueue_message (topic, payload) VALUES ('bench.noop', %s)"


def variants(conn, database):
    """name -> ((insert, its parameters for message i), setup statements,
    teardown statements)."""
    checks = conn.execute(CONSTRAINTS_SQL).fetchall()
    table = "ALTER TABLE django_pgqueue_message "
    raw, ours = (RAW_INSERT_SQL, payload_only), (OURS_INSERT_SQL, payload_only)
    return {
        "raw": (raw, [], []),
        "ours": (ours, [], []),
        "ours, no notify trigger": (
            ours,
            ["ALTER TABLE django_pgqueue_message DISABLE TRIGGER pgqueue_notify_insert"],
            ["ALTER TABLE django_pgqueue_message ENABLE TRIGGER pgqueue_notify_insert"],
        ),
        "ours, no partial indexes": (
            ours,
            [f"DROP INDEX {name}" for name in INDEXES],
            list(INDEXES.values()),
        ),
        "ours, no group trigger and indexes": (
            ours,
            [
                "ALTER TABLE django_pgqueue_message DISABLE TRIGGER pgqueue_group_insert",
                *(f"DROP INDEX {name}" for name in GROUP_INDEXES),
            ],
            [
                "ALTER TABLE django_pgqueue_message ENABLE TRIGGER pgqueue_group_insert",
                *GROUP_INDEXES.values(),
            ],
        ),
        "ours, no CHECK constraints": (
            ours,
            [table + ", ".join(f"DROP CONSTRAINT {name}" for name, _ in checks)],
            [table + ", ".join(f"ADD CONSTRAINT {name} {text}" for name, text in checks)],
        ),
        "ours, enqueue()'s INSERT": (enqueue_insert(database), [], []),
        "enqueue()": (None, [], []),
    }


def turn(conn, insert, n, backend_cpu, synchronous_commit):
    """(wall us, server CPU us or None, WAL bytes, client CPU us), per insert.
    ``insert`` None: enqueue() on Django's connection (set up by
    enqueue_insert), in autocommit."""
    conn.execute("TRUNCATE django_pgqueue_message, raw_jobs")
    start_lsn = conn.execute("SELECT pg_current_wal_lsn()").fetchone()[0]
    if insert is None:
        from django.db import connection

        from django_pgqueue import enqueue

        with connection.cursor() as cursor:
            cursor.execute(f"SET synchronous_commit = {synchronous_commit}")
            cursor.execute("SELECT pg_backend_pid()")
            pid = cursor.fetchone()[0]
        enqueue("bench.noop", {"n": -1})  # the kept cursor, made before the turn
        server_cpu = backend_cpu_reader(conn, pid)

        def run():
            for i in range(n):
                enqueue("bench.noop", {"n": i})
    else:
        sql, params = insert
        server_cpu = backend_cpu

        def run():
            for i in range(n):
                conn.execute(sql, params(i), prepare=True)

    cpu, client = server_cpu(), time.process_time()
    started = time.perf_counter()
    run()
    seconds = time.perf_counter() - started
    client = time.process_time() - client
    cpu = None if cpu is None else server_cpu() - cpu
    wal = conn.execute("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), %s)", [start_lsn]).fetchone()[
        0
    ]
    per = 1e6 / n
    return seconds * per, None if cpu is None else cpu * per, float(wal) / n, client * per


def backend_cpu_reader(conn, pid=None):
    """A function returning the CPU seconds of ``conn``'s server process (or
    of the server process ``pid`` of the same server), or one returning
    None when that process is not on this machine."""
    if pid is None:
        pid = conn.execute("SELECT pg_backend_pid()").fetchone()[0]
    host = conn.info.host
    if host not in ("127.0.0.1", "localhost", "::1") and not host.startswith("/"):
        return lambda: None
    return lambda: proc_cpu_seconds(pid)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--database", default="postgres://postgres@127.0.0.1:5432/pgqueue_bench_insert")
    p.add_argument("--n", type=int, default=1500, help="inserts per turn")
    p.add_argument("--rounds", type=int, default=5, help="turns per variant")
    p.add_argument("--synchronous-commit", choices=["on", "off"], default="on")
    args = p.parse_args(argv)
    if "bench" not in db.database_name(args.database):
        p.error("--database: the name must contain 'bench' (its tables are emptied)")
    if args.n < 1 or args.rounds < 1:
        p.error("--n and --rounds must be at least 1")
    db.ensure_database(args.database)
    db.migrate(
        {**os.environ, "DATABASE_URL": args.database, "DEBUG": "False"}, databases=["default"]
    )
    with db.connect(args.database) as conn:
        conn.execute(RAW_SCHEMA)
        conn.execute(f"SET synchronous_commit = {args.synchronous_commit}")
        cases = variants(conn, args.database)
        backend_cpu = backend_cpu_reader(conn)
        times = {name: [] for name in cases}
        cpus = {name: [] for name in cases}
        clients = {name: [] for name in cases}
        wal = {}
        for _ in range(args.rounds):
            for name, (insert, setup, teardown) in cases.items():
                for statement in setup:
                    conn.execute(statement)
                try:
                    micros, cpu, wal[name], client = turn(
                        conn, insert, args.n, backend_cpu, args.synchronous_commit
                    )
                finally:
                    for statement in teardown:
                        conn.execute(statement)
                times[name].append(micros)
                if cpu is not None:
                    cpus[name].append(cpu)
                clients[name].append(client)
        conn.execute("TRUNCATE django_pgqueue_message, raw_jobs")
    print(
        f"{args.n:,} one-row INSERTs per turn, {args.rounds} turns each in rotation,"
        f" synchronous_commit={args.synchronous_commit}; per insert: the median wall time"
        " (all turns), the server process's median CPU time, the WAL, this client's median CPU"
    )
    for name, values in times.items():
        turns = " ".join(f"{v:.0f}" for v in values)
        cpu = f"cpu {statistics.median(cpus[name]):5.0f} us" if cpus[name] else "cpu     -"
        print(
            f"  {name:36} {statistics.median(values):6.0f} us  {cpu}  {wal[name]:4.0f} B"
            f"  client {statistics.median(clients[name]):4.0f} us  ({turns})"
        )
