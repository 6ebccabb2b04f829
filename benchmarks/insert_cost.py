#!/usr/bin/env python
"""Where a one-message enqueue's time goes in the server: the same
one-row INSERT, each in its own (autocommit) transaction, into

- ``raw``: the raw loop's table of compare.py (an id, a payload, one index,
  a statement-level NOTIFY trigger);
- ``ours``: django-pgqueue's message table as migrated;
- ``ours, no notify trigger``: the same with the insert trigger disabled;
- ``ours, no partial indexes``: without pgqueue_msg_claim_idx and
  pgqueue_msg_due_idx;
- ``ours, no group trigger and indexes``: without what message groups
  add to every insert (migration 0009): the row trigger that blocks grouped
  messages (its WHEN clause is all an ungrouped insert pays) and the two
  partial indexes of grouped rows;

in turns (``--rounds`` times each, ``--n`` inserts per turn; the median
counts), with psycopg's prepared statements, and the WAL each writes per
insert. The inserts must commit to be measured, and the variants change the
table for their turn, so it runs on a database of its own, ``--database``
(default ``postgres://postgres@127.0.0.1:5432/pgqueue_bench_insert``,
created and migrated through the testproject; its name must contain
"bench"), and puts every change back after each turn.

    .venv/bin/python benchmarks/insert_cost.py                     # synchronous_commit on
    .venv/bin/python benchmarks/insert_cost.py --synchronous-commit off
"""

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psycopg
from psycopg.types.json import Jsonb

ROOT = Path(__file__).resolve().parents[1]

RAW_SCHEMA = """
DROP TABLE IF EXISTS raw_jobs;
CREATE TABLE raw_jobs (
    id bigserial PRIMARY KEY,
    payload jsonb NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);
CREATE OR REPLACE FUNCTION raw_jobs_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('raw_jobs', '');
    RETURN NULL;
END $$;
CREATE TRIGGER raw_jobs_notify AFTER INSERT ON raw_jobs
    FOR EACH STATEMENT EXECUTE FUNCTION raw_jobs_notify();
"""

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

RAW_INSERT = "INSERT INTO raw_jobs (payload) VALUES (%s)"
OURS_INSERT = "INSERT INTO django_pgqueue_message (topic, payload) VALUES ('bench.noop', %s)"


def variants(conn):
    """name -> (insert, setup statements, teardown statements)."""
    return {
        "raw": (RAW_INSERT, [], []),
        "ours": (OURS_INSERT, [], []),
        "ours, no notify trigger": (
            OURS_INSERT,
            ["ALTER TABLE django_pgqueue_message DISABLE TRIGGER pgqueue_notify_insert"],
            ["ALTER TABLE django_pgqueue_message ENABLE TRIGGER pgqueue_notify_insert"],
        ),
        "ours, no partial indexes": (
            OURS_INSERT,
            [f"DROP INDEX {name}" for name in INDEXES],
            list(INDEXES.values()),
        ),
        "ours, no group trigger and indexes": (
            OURS_INSERT,
            [
                "ALTER TABLE django_pgqueue_message DISABLE TRIGGER pgqueue_group_insert",
                *(f"DROP INDEX {name}" for name in GROUP_INDEXES),
            ],
            [
                "ALTER TABLE django_pgqueue_message ENABLE TRIGGER pgqueue_group_insert",
                *GROUP_INDEXES.values(),
            ],
        ),
    }


def turn(conn, insert, n):
    conn.execute("TRUNCATE django_pgqueue_message, raw_jobs")
    start_lsn = conn.execute("SELECT pg_current_wal_lsn()").fetchone()[0]
    started = time.perf_counter()
    for i in range(n):
        conn.execute(insert, [Jsonb({"n": i})], prepare=True)
    seconds = time.perf_counter() - started
    wal = conn.execute("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), %s)", [start_lsn]).fetchone()[
        0
    ]
    return seconds / n * 1e6, float(wal) / n


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--database", default="postgres://postgres@127.0.0.1:5432/pgqueue_bench_insert")
    p.add_argument("--n", type=int, default=1500, help="inserts per turn")
    p.add_argument("--rounds", type=int, default=5, help="turns per variant")
    p.add_argument("--synchronous-commit", choices=["on", "off"], default="on")
    args = p.parse_args(argv)
    if "bench" not in args.database.rsplit("/", 1)[-1]:
        p.error("--database: the name must contain 'bench' (its tables are emptied)")
    if args.n < 1 or args.rounds < 1:
        p.error("--n and --rounds must be at least 1")
    server, name = args.database.rsplit("/", 1)
    with psycopg.connect(f"{server}/postgres", autocommit=True) as admin:
        if not admin.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name]).fetchone():
            admin.execute(f'CREATE DATABASE "{name}"')
    subprocess.run(
        [sys.executable, str(ROOT / "testproject" / "manage.py"), "migrate", "-v0"],
        env={**os.environ, "DATABASE_URL": args.database, "DEBUG": "False"},
        check=True,
    )
    with psycopg.connect(args.database, autocommit=True) as conn:
        conn.execute(RAW_SCHEMA)
        conn.execute(f"SET synchronous_commit = {args.synchronous_commit}")
        cases = variants(conn)
        times = {name: [] for name in cases}
        wal = {}
        for _ in range(args.rounds):
            for name, (insert, setup, teardown) in cases.items():
                for statement in setup:
                    conn.execute(statement)
                try:
                    micros, wal[name] = turn(conn, insert, args.n)
                finally:
                    for statement in teardown:
                        conn.execute(statement)
                times[name].append(micros)
        conn.execute("TRUNCATE django_pgqueue_message, raw_jobs")
    print(
        f"{args.n:,} one-row INSERTs per turn, {args.rounds} turns each in rotation,"
        f" synchronous_commit={args.synchronous_commit}; median (all turns), WAL per insert"
    )
    for name, values in times.items():
        turns = " ".join(f"{v:.0f}" for v in values)
        print(f"  {name:34} {statistics.median(values):6.0f} us  ({turns})  {wal[name]:.0f} B")


if __name__ == "__main__":
    main()
