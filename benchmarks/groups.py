#!/usr/bin/env python
"""Message groups at scale: what the claim and a group's promotion cost with
no groups, a few large groups or very many small ones.

    .venv/bin/python benchmarks/groups.py                       # about a minute
    .venv/bin/python benchmarks/groups.py --blocked 1000000 --groups 10,100000

For each case the message table holds 1,000 ready ungrouped messages and
``--blocked`` grouped messages spread over G groups (``--groups``), each
group's oldest message promoted to waiting (its head) and the rest blocked,
as the triggers of migration 0009 leave them; G = 0 is the baseline, a
table of the same size without groups: as many ungrouped messages delayed
by a day. Then ``VACUUM ANALYZE``. Measured, each ``--repeat`` times in a
transaction that is rolled back (so every run sees the same table):

- **claim**: the worker's claim of 100 messages (the statement the worker
  sends, captured as it runs: benchmarks/harness/internals.py), under
  ``EXPLAIN (ANALYZE, BUFFERS)``: its execution time and the shared buffers
  it touched;
- **promote**: one group's head deleted (its release row written by the
  trigger, as an acknowledgement does), then ``pgqueue_promote_groups()``,
  which promotes that group's next message: execution time and buffers.

Buffers are the figure that says whether a cost grows with the table: the
time moves with the machine. The database is ``--database`` (default
``postgres://postgres@127.0.0.1:5432/pgqueue_bench_groups``, created and
migrated through the testproject; its name must contain "bench", its
message table is emptied).
"""

import argparse
import os
import statistics

from harness import db

READY = 1000

FILL_UNGROUPED = """
INSERT INTO django_pgqueue_message (topic, payload)
SELECT 'bench.noop', jsonb_build_object('n', n) FROM generate_series(1, %s) AS n
"""
FILL_DELAYED = """
INSERT INTO django_pgqueue_message (topic, payload, run_at)
SELECT 'bench.noop', jsonb_build_object('n', n), now() + interval '1 day'
FROM generate_series(1, %s) AS n
"""
# The grouped backlog as the triggers leave it, written with the insert
# trigger off (a million trigger calls would only slow the set-up): each
# group's first message waiting, the others blocked, in enqueue (id) order.
FILL_GROUPED = """
INSERT INTO django_pgqueue_message (topic, payload, group_key, status)
SELECT 'bench.noop', jsonb_build_object('n', n), 'g' || (n %% %(groups)s),
    CASE WHEN n <= %(groups)s THEN 'waiting' ELSE 'blocked' END
FROM generate_series(1, %(total)s) AS n
ORDER BY n
"""


def explain(conn, sql, params):
    """(execution ms, shared buffers hit + read) of ``sql`` run once."""
    plan = conn.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + sql, params).fetchone()[0][0]
    top = plan["Plan"]
    buffers = top.get("Shared Hit Blocks", 0) + top.get("Shared Read Blocks", 0)
    return plan["Execution Time"], buffers


def measure_claim(conn, claim_sql, claim_params, repeat):
    runs = []
    for _ in range(repeat):
        with conn.transaction(force_rollback=True):
            runs.append(explain(conn, claim_sql, claim_params))
    return runs


def measure_promote(conn, groups, repeat):
    runs = []
    for i in range(repeat):
        key = f"g{i % groups}"
        with conn.transaction(force_rollback=True):
            conn.execute(
                "DELETE FROM django_pgqueue_message WHERE group_key = %s"
                " AND status IN ('waiting', 'processing')",
                [key],
            )
            runs.append(explain(conn, "SELECT pgqueue_promote_groups(1000, false)", []))
            promoted = conn.execute(
                "SELECT count(*) FROM django_pgqueue_message WHERE group_key = %s"
                " AND status = 'waiting'",
                [key],
            ).fetchone()[0]
            if promoted != 1:
                raise SystemExit(f"group {key}: {promoted} head(s) after the promotion")
    return runs


def summary(runs):
    ms = statistics.median(r[0] for r in runs)
    buffers = statistics.median(r[1] for r in runs)
    return f"{ms:7.3f} ms {buffers:7.0f} buffers"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--database", default="postgres://postgres@127.0.0.1:5432/pgqueue_bench_groups")
    p.add_argument("--blocked", type=int, default=200_000, help="grouped messages per case")
    p.add_argument("--groups", default="0,10,1000,100000", help="group counts (0: no groups)")
    p.add_argument("--repeat", type=int, default=50, help="runs per measurement (median)")
    args = p.parse_args(argv)
    if "bench" not in db.database_name(args.database):
        p.error("--database: the name must contain 'bench' (its tables are emptied)")
    try:
        cases = [int(g) for g in args.groups.split(",")]
    except ValueError:
        p.error(f"--groups: a comma-separated list of numbers, not {args.groups!r}")
    if any(g < 0 or g > args.blocked for g in cases) or args.blocked < 1 or args.repeat < 1:
        p.error("--groups must be between 0 and --blocked; --blocked and --repeat at least 1")

    db.ensure_database(args.database)
    env = {**os.environ, "DATABASE_URL": args.database, "DEBUG": "False"}
    db.migrate(env, databases=["default"])
    env["DJANGO_SETTINGS_MODULE"] = os.environ.get("DJANGO_SETTINGS_MODULE", "testproject.settings")
    db.setup_django(env)
    from harness import internals

    # The claim statement as the worker sends it, from the code itself.
    [(claim_sql, claim_params)], _ = internals.claim_statements("default", 100, "bench", 60)

    print(
        f"{READY:,} ready ungrouped messages plus {args.blocked:,} grouped ones per case;"
        f" median of {args.repeat} runs, EXPLAIN (ANALYZE, BUFFERS)"
    )
    print(f"  {'groups':>8}  {'claim of 100':>28}  {'one group promoted':>28}")
    with db.connect(args.database) as conn:
        for groups in cases:
            conn.execute("TRUNCATE django_pgqueue_message, django_pgqueue_grouprelease")
            conn.execute(FILL_UNGROUPED, [READY])
            if groups:
                conn.execute(
                    "ALTER TABLE django_pgqueue_message DISABLE TRIGGER pgqueue_group_insert"
                )
                try:
                    conn.execute(FILL_GROUPED, {"groups": groups, "total": args.blocked})
                finally:
                    conn.execute(
                        "ALTER TABLE django_pgqueue_message ENABLE TRIGGER pgqueue_group_insert"
                    )
            conn.execute("VACUUM ANALYZE django_pgqueue_message")
            claim = summary(measure_claim(conn, claim_sql, claim_params, args.repeat))
            promote = summary(measure_promote(conn, groups, args.repeat)) if groups else "-"
            print(f"  {groups:>8,}  {claim:>28}  {promote:>28}", flush=True)
        conn.execute("TRUNCATE django_pgqueue_message, django_pgqueue_grouprelease")


if __name__ == "__main__":
    main()
