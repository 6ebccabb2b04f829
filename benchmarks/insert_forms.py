#!/usr/bin/env python
"""One chunk of enqueue_many's INSERT in each form its rows could travel in.

``enqueue_many`` sends a large call as pipelined INSERTs of
``STREAM_CHUNK`` (1,000) rows; this times one such chunk of ``--rows``
no-op payloads (``{"n": i, "name": ..., "tags": [...]}``) in five forms,
``--rounds`` (40) rounds in a shuffled order, each chunk in a transaction
of its own into the emptied message table (or the raw loop's table), and
reports per form the median time of the statement as the client sees it
(its parameters built before), and the CPU time of the server process that
ran it (from ``/proc``: the server must be on this machine; the sum over
the rounds, so the 10 ms clock tick averages out), which a busy machine
disturbs far less than the wall clock:

- ``rows``: enqueue_many's array of rows (a JSON array of arrays, one per
  message, taken apart by ``jsonb_array_elements``), what it sends when the
  rows' options differ;
- ``shared``: enqueue_many's form for rows that share their options (the
  usual call): the options as parameters, the payloads as one JSON array;
- ``unnest``: ten typed arrays, one per column, through ``unnest``, bound on
  the server in binary (a candidate, not used);
- ``copy``: ``COPY`` of the rows into a temporary table, then ``INSERT ...
  SELECT`` from it (COPY itself can neither skip a dedup conflict nor return
  the ids; a candidate, not used);
- ``raw``: the raw loop's bulk insert (``peers/bench_raw.py``:
  ``INSERT ... SELECT FROM unnest(%s::jsonb[])`` into a table with a primary
  key and nothing else), the floor.

    .venv/bin/python benchmarks/insert_forms.py
    .venv/bin/python benchmarks/insert_forms.py --rows 1000 --rounds 80

It runs on a database of its own, ``--database-url`` (default
``postgres://postgres@127.0.0.1:5432/pgqueue_bench_insert_forms``, created
and migrated through the testproject if missing; its name must contain
"bench").
"""

import argparse
import os
import random
import statistics
import sys
import time

from harness import db
from harness.cli import require_bench_database
from harness.machine import git_commit

DEFAULT_URL = "postgres://postgres@127.0.0.1:5432/pgqueue_bench_insert_forms"
TABLE = f'"{db.MESSAGE_TABLE}"'
COLUMNS = "(queue, topic, payload, headers, priority, run_at, max_attempts, dedup_key, group_key)"
RETURNING = "RETURNING id, run_at::text, created_at::text"
UNNEST = f"""INSERT INTO {TABLE} {COLUMNS}
SELECT q, t, p::jsonb, h::jsonb, pr, COALESCE(ra, now() + make_interval(secs => d)), ma, dk, gk
FROM unnest(%b::text[], %b::text[], %b::text[], %b::text[], %b::int2[], %b::timestamptz[],
    %b::float8[], %b::int4[], %b::text[], %b::text[])
    WITH ORDINALITY AS input(q, t, p, h, pr, ra, d, ma, dk, gk, n)
ORDER BY n {RETURNING}"""
COPY_TABLE = """CREATE TEMPORARY TABLE IF NOT EXISTS bench_chunk (n serial, q text, t text,
    p jsonb, h jsonb, pr int2, ra timestamptz, d float8, ma int4, dk text, gk text)
    ON COMMIT DELETE ROWS"""
COPY_INSERT = f"""INSERT INTO {TABLE} {COLUMNS}
SELECT q, t, p, h, pr, COALESCE(ra, now() + make_interval(secs => d)), ma, dk, gk
FROM bench_chunk ORDER BY n {RETURNING}"""
RAW_TABLE = """CREATE TABLE IF NOT EXISTS raw_jobs (id bigserial PRIMARY KEY,
    payload jsonb NOT NULL, created_at timestamptz NOT NULL DEFAULT now())"""


def columns(payloads, topic):
    """The chunk as ten columns (no option given: defaults, no keys)."""
    import json

    n = len(payloads)
    texts = [json.dumps(p, separators=(",", ":")) for p in payloads]
    return [
        *(["default"] * n, [topic] * n, texts, ["{}"] * n, [0] * n),
        *([None] * n, [0.0] * n, [None] * n, [None] * n, [None] * n),
    ]


def forms(conn, payloads, topic):
    """{name: (build the parameters, run the statement)}; runs in a transaction."""
    import psycopg
    from harness import internals
    from psycopg.types.json import Jsonb

    def package(shared):
        def run(params):
            with psycopg.ClientCursor(conn) as cur:  # Django's default cursor binds so
                cur.execute(sql, params)
                cur.fetchall()

        sql = internals.enqueue_many_chunk_insert(payloads[:2], topic, shared)[0]
        return lambda: internals.enqueue_many_chunk_insert(payloads, topic, shared)[1], run

    def unnest(params):
        with conn.cursor() as cur:
            cur.execute(UNNEST, params)
            cur.fetchall()

    def copy(params):
        with conn.cursor() as cur:
            cur.execute(COPY_TABLE)
            with cur.copy("COPY bench_chunk (q, t, p, h, pr, ra, d, ma, dk, gk) FROM STDIN") as cp:
                for record in zip(*params, strict=True):
                    cp.write_row(record)
            cur.execute(COPY_INSERT)
            cur.fetchall()

    def raw(params):
        conn.execute("INSERT INTO raw_jobs (payload) SELECT * FROM unnest(%s::jsonb[])", [params])

    def ten_columns():
        return columns(payloads, topic)

    return {
        "rows (enqueue_many, mixed options)": package(False),
        "shared (enqueue_many, shared options)": package(True),
        "unnest of ten typed arrays": (ten_columns, unnest),
        "copy into a temporary table": (ten_columns, copy),
        "raw loop (unnest of jsonb[])": (lambda: [Jsonb(p) for p in payloads], raw),
    }


def server_cpu(pid):
    """CPU seconds of the server process ``pid`` so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--rows", type=int, default=1000, help="rows per chunk")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument(
        "--database-url",
        default=os.environ.get("BENCH_INSERT_FORMS_DATABASE_URL", DEFAULT_URL),
        help="its name must contain 'bench' (created and migrated if missing, emptied)",
    )
    args = parser.parse_args(argv)
    require_bench_database(parser, args.database_url)
    if args.rows < 2 or args.rounds < 1:
        parser.error("--rows must be at least 2, --rounds at least 1")
    env = db.pgqueue_env(args.database_url)
    db.prepare([args.database_url, db.other_url(args.database_url)], env)
    db.setup_django(dict(env, DJANGO_SETTINGS_MODULE="testproject.settings"))
    payloads = [{"n": i, "name": f"item {i}", "tags": ["a", "b"]} for i in range(args.rows)]
    with db.connect(args.database_url) as conn:
        conn.execute(RAW_TABLE)
        pid = conn.info.backend_pid
        try:
            open(f"/proc/{pid}/stat").close()
        except OSError:
            parser.error("the server must run on this machine (its CPU is read from /proc)")
        chosen = forms(conn, payloads, "bench.noop")
        wall = {name: [] for name in chosen}
        cpu = dict.fromkeys(chosen, 0.0)
        for _ in range(args.rounds):
            order = list(chosen)
            random.shuffle(order)
            for name in order:
                build, run = chosen[name]
                conn.execute(f"TRUNCATE {TABLE}, raw_jobs")
                params = build()
                with conn.transaction():
                    before = server_cpu(pid)
                    started = time.perf_counter()
                    run(params)
                    wall[name].append(time.perf_counter() - started)
                    cpu[name] += server_cpu(pid) - before
        conn.execute(f"TRUNCATE {TABLE}, raw_jobs")
    print(
        f"one INSERT of {args.rows:,} rows, {args.rounds} rounds in shuffled order,"
        f" at {git_commit()}; load average {os.getloadavg()[0]:.1f}"
    )
    floor = cpu["raw loop (unnest of jsonb[])"]
    for name in chosen:
        ms = 1000 * cpu[name] / args.rounds
        print(
            f"  {name:40} statement median {1000 * statistics.median(wall[name]):7.2f} ms,"
            f" server CPU {ms:6.2f} ms ({cpu[name] / floor:4.2f}x the raw loop's)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
