#!/usr/bin/env python
"""What one claim/acknowledge cycle costs, without threads or handlers.

The worker's main thread does, per cycle: claim up to min(free slots,
--batch-size) messages, hand them to the handler threads, and acknowledge
the finished ones (atomic=False). With no-op handlers that cycle is the
whole cost, so this loop, run in-process on the bench database, predicts
what one worker can do at a given claim size, and compares the current
claim and acknowledgement (as the worker sends them, through
benchmarks/harness/internals.py) with a one-statement
alternative (UPDATE ... WHERE id IN (SELECT ... FOR UPDATE SKIP LOCKED)
RETURNING, and a plain DELETE ... RETURNING): a prototype for discussion,
not a replacement.

    .venv/bin/python benchmarks/claim_cycle.py [--messages 8000] [--batch 4 32 100]

``--leased-by-others N``: first N messages are claimed by other (made-up)
workers and stay leased, as in a deployment where many workers hold many
messages, with the planner statistics taken before (nothing leased). The
acknowledgements must find this worker's rows without reading theirs:

    .venv/bin/python benchmarks/claim_cycle.py --batch 100 --leased-by-others 5000
"""

import argparse
import os
import sys
import time
import uuid

from harness import db
from harness.cli import require_bench_database
from harness.worker import TOPIC_NONATOMIC

DEFAULT_URL = "postgres://postgres@127.0.0.1:5432/pgqueue_bench"


def one_statement_sql(table, columns):
    cols = ", ".join(f"m.{c}" for c in columns)
    return f"""
UPDATE {table} m SET status = 'processing', attempts = m.attempts + 1, lease_token = %s,
    lease_expires_at = now() + make_interval(secs => %s), locked_by = %s, updated_at = now()
WHERE m.id IN (
    SELECT id FROM {table}
    WHERE status = 'waiting' AND queue = %s AND run_at <= now()
    ORDER BY priority DESC, run_at, id
    LIMIT %s
    FOR UPDATE SKIP LOCKED
)
RETURNING {cols}
"""


def make_alternative():
    from django.db import connection

    from django_pgqueue.models import Message

    table = Message._meta.db_table
    columns = [f.column for f in Message._meta.concrete_fields]
    claim_sql = one_statement_sql(table, columns)
    ack_sql = (
        f"DELETE FROM {table} WHERE id = ANY(%s) AND status = 'processing' AND lease_token = %s"
        " RETURNING id"
    )

    def claim(queues, limit, worker_id, lease_seconds):
        # One queue: "queue = %s" lets the claim index give the order.
        # (queue = ANY(array) would not: a sort of every waiting row.)
        with connection.cursor() as cursor:
            cursor.execute(claim_sql, [uuid.uuid4(), lease_seconds, worker_id, queues[0], limit])
            rows = cursor.fetchall()
        messages = [Message.from_db(connection.alias, columns, row) for row in rows]
        messages.sort(key=lambda m: (-m.priority, m.run_at, m.pk))  # RETURNING has no order
        return messages

    def ack_many(messages):
        by_token = {}
        for message in messages:
            by_token.setdefault(message.lease_token, []).append(message.pk)
        finished = set()
        with connection.cursor() as cursor:
            for token, ids in by_token.items():
                cursor.execute(ack_sql, [ids, token])
                finished.update(row[0] for row in cursor.fetchall())
        return finished

    return claim, ack_many


def fill(n, leased_by_others=0):
    from harness import internals

    from django_pgqueue import enqueue_many

    db.truncate()
    total = n + leased_by_others
    enqueue_many([{"payload": {"n": i}} for i in range(total)], topic=TOPIC_NONATOMIC)
    db.execute("VACUUM ANALYZE django_pgqueue_message")
    for start in range(0, leased_by_others, 100):
        size = min(100, leased_by_others - start)
        internals.claim(["default"], size, f"other-worker-{start // 100}", 3600)


def cycle(label, claim, ack_many, batch, n, leased_by_others=0):
    fill(n, leased_by_others)
    claim_s = ack_s = 0.0
    cycles = done = 0
    started = time.perf_counter()
    while True:
        t0 = time.perf_counter()
        messages = claim(["default"], batch, "claim-cycle", 60.0)
        t1 = time.perf_counter()
        if not messages:
            break
        finished = ack_many(messages)
        t2 = time.perf_counter()
        if len(finished) != len(messages):
            raise db.CheckFailed(f"{label}: {len(messages) - len(finished)} not acknowledged")
        claim_s += t1 - t0
        ack_s += t2 - t1
        cycles += 1
        done += len(messages)
    total = time.perf_counter() - started
    if done != n or db.count(db.MESSAGE_TABLE) != leased_by_others:
        raise db.CheckFailed(f"{label}: {done} of {n} messages went through the cycle")
    print(
        f"  {label:34} batch {batch:4}: {done / total:8,.0f} jobs/s   "
        f"claim {1000 * claim_s / cycles:6.2f} ms   ack {1000 * ack_s / cycles:6.2f} ms per cycle"
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=8000)
    parser.add_argument("--batch", type=int, nargs="+", default=[4, 32, 100])
    parser.add_argument(
        "--leased-by-others",
        type=int,
        default=0,
        help="messages other workers hold leased during the run (default 0)",
    )
    parser.add_argument("--database-url", default=os.environ.get("BENCH_DATABASE_URL", DEFAULT_URL))
    args = parser.parse_args(argv)
    if args.messages < 1 or args.leased_by_others < 0 or min(args.batch) < 1:
        parser.error("--messages and --batch must be at least 1, --leased-by-others at least 0")
    require_bench_database(parser, args.database_url)
    url = args.database_url
    env = db.pgqueue_env(url)
    try:
        db.prepare([url, db.other_url(url)], env)
        os.environ["PGQUEUE_LOG_LEVEL"] = "WARNING"  # the claim logs each message at INFO
        db.setup_django(env)
        from harness import internals

        alt_claim, alt_ack = make_alternative()
        print(
            f"claim + acknowledge, single thread, {args.messages} messages per line,"
            f" {args.leased_by_others} leased by other workers:"
        )
        for batch in args.batch:
            for label, claim, ack_many in (
                ("the worker's claim + ack_many", internals.claim, internals.ack_many),
                ("one-statement claim + DELETE", alt_claim, alt_ack),
            ):
                cycle(label, claim, ack_many, batch, args.messages, args.leased_by_others)
        db.truncate()
        return 0
    except db.CheckFailed as exc:
        print(f"CHECK FAILED: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
