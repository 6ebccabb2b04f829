#!/usr/bin/env python
"""procrastinate's side of benchmarks/compare.py. Runs in benchmarks/.venvs/procrastinate.

The App (bench_procrastinate_app.py) is the worker's, started with procrastinate's own
CLI: ``procrastinate --app bench_procrastinate_app.app worker`` (this folder on
PYTHONPATH), psycopg 3 connector (PsycopgConnector, a psycopg_pool pool).
Tasks (async, as procrastinate recommends): ``noop`` does nothing, ``latency``
records its start. Enqueue: ``task.defer_async(...)`` per message (one
transaction each); bulk: ``task.batch_defer_async(*kwargs)``, one statement.
"""

import time

import _common
from bench_procrastinate_app import app, latency, noop


async def run(args):
    async with app.open_async():
        if args.op == "enqueue-single":
            await noop.defer_async(n=-1)  # warm up the pool, not timed
            async with app.connector.pool.connection() as conn:
                await conn.execute("DELETE FROM procrastinate_jobs")
            started = time.perf_counter()
            for i in range(args.n):
                await noop.defer_async(n=i)
            return {"seconds": time.perf_counter() - started, "n": args.n}
        if args.op == "enqueue-bulk":
            kwargs = [{"n": i} for i in range(args.n)]
            started = time.perf_counter()
            await noop.batch_defer_async(*kwargs)
            return {"seconds": time.perf_counter() - started, "n": args.n}
        if args.op == "latency-enqueue":
            await app.connector.execute_query_async("SELECT 1")

            async def one(key):
                await latency.defer_async(key=key)
                return key

            async def batch(keys):
                await latency.batch_defer_async(*({"key": key} for key in keys))
                return keys

            return await _common.async_latency_loop(one, args, batch)
    raise SystemExit(f"unknown op {args.op!r}")


def main(argv=None):
    names = ("procrastinate", "psycopg", "psycopg-pool")
    _common.async_main(__doc__, argv, names, run, "procrastinate schema --apply")


if __name__ == "__main__":
    main()
