#!/usr/bin/env python
"""The raw psycopg 3 loop of benchmarks/compare.py: the floor the queue
libraries are measured against. Runs in the repo's .venv.

Table ``raw_jobs (id bigserial, payload jsonb, created_at)`` with an AFTER
INSERT ... FOR EACH STATEMENT trigger that sends one NOTIFY (as the queue
libraries do). Enqueue: one autocommit INSERT per message, or one
``INSERT ... SELECT FROM unnest(%s::jsonb[])`` for many. Worker: one
transaction per claim, ``DELETE FROM raw_jobs WHERE id IN (SELECT id ...
ORDER BY id LIMIT n FOR UPDATE SKIP LOCKED) RETURNING id, payload``, the
handler runs on each row, then COMMIT; when a claim comes back empty it
exits (``--burst``) or waits for a NOTIFY on a second connection
(LISTEN raw_jobs) or the poll interval.
"""

import os
import sys

import _common
import psycopg
from psycopg.types.json import Jsonb

SCHEMA = """
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

CLAIM = (
    "DELETE FROM raw_jobs WHERE id IN (SELECT id FROM raw_jobs ORDER BY id LIMIT %s"
    " FOR UPDATE SKIP LOCKED) RETURNING id, payload"
)


def handle(row, latency):
    if latency:
        _common.record_start(row[1]["key"])


def worker(batch, burst, poll_interval, latency):
    conn = psycopg.connect(_common.DSN, application_name=f"raw_worker#{os.getpid()}")
    listener = None
    if not burst:
        listener = psycopg.connect(
            _common.DSN, autocommit=True, application_name=f"raw_listener#{os.getpid()}"
        )
        listener.execute("LISTEN raw_jobs")
    handled = 0
    try:
        while True:
            with conn.transaction():
                rows = conn.execute(CLAIM, [batch], prepare=True).fetchall()
                for row in rows:
                    handle(row, latency)
            handled += len(rows)
            if rows:
                continue
            if burst:
                break
            # Empty: sleep until a NOTIFY (or the poll interval), then drain the
            # other notifications that arrived meanwhile and claim again.
            for _ in listener.notifies(timeout=poll_interval, stop_after=1):
                pass
            for _ in listener.notifies(timeout=0):
                pass
    except KeyboardInterrupt:
        pass
    finally:
        conn.close()
        if listener is not None:
            listener.close()
    return handled


def main(argv=None):
    p = _common.parser(__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=100, help="worker: rows claimed per transaction")
    p.add_argument("--burst", action="store_true", help="worker: exit when a claim is empty")
    p.add_argument("--poll-interval", type=float, default=5.0, help="worker: seconds")
    p.add_argument("--latency", action="store_true", help="worker: handlers record their start")
    args = p.parse_args(argv)
    import signal

    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    if args.op == "worker":
        worker(args.batch, args.burst, args.poll_interval, args.latency)
        return
    if args.op == "info":
        _common.emit(
            {"versions": {"psycopg": psycopg.__version__}, "python": sys.version.split()[0]}
        )
        return
    with psycopg.connect(_common.DSN, autocommit=True) as conn:
        if args.op == "setup":
            conn.execute(SCHEMA)
            _common.emit({"ok": True})
        elif args.op == "enqueue-single":
            conn.execute("SELECT 1")
            insert = "INSERT INTO raw_jobs (payload) VALUES (%s)"

            def run():
                for i in range(args.n):
                    conn.execute(insert, [Jsonb({"n": i})], prepare=True)

            _common.emit({"seconds": _common.timed(run), "n": args.n})
        elif args.op == "enqueue-bulk":
            payloads = [Jsonb({"n": i}) for i in range(args.n)]
            seconds = _common.timed(
                lambda: conn.execute(
                    "INSERT INTO raw_jobs (payload) SELECT * FROM unnest(%s::jsonb[])", [payloads]
                )
            )
            _common.emit({"seconds": seconds, "n": args.n})
        elif args.op == "latency-enqueue":
            conn.execute("SELECT 1")

            def one(key):
                conn.execute(
                    "INSERT INTO raw_jobs (payload) VALUES (%s)",
                    [Jsonb({"key": key})],
                    prepare=True,
                )
                return key

            def batch(keys):
                with conn.transaction():
                    conn.cursor().executemany(
                        "INSERT INTO raw_jobs (payload) VALUES (%s)",
                        [[Jsonb({"key": key})] for key in keys],
                    )
                return keys

            _common.emit(_common.latency_loop(one, args, batch))
        else:
            p.error(f"unknown op {args.op!r}")


if __name__ == "__main__":
    main()
