#!/usr/bin/env python
"""pgqueuer's side of benchmarks/compare.py. Runs in benchmarks/.venvs/pgqueuer.

The worker is pgqueuer's own CLI, ``pgq run bench_pgqueuer:factory`` (this
folder on PYTHONPATH), with the PgQueuer application (queue manager and
scheduler) the README recommends and its asyncpg driver (BENCH_PGQUEUER_DRIVER
=psycopg for its psycopg 3 driver). Entrypoints: ``noop`` (does nothing) and
``latency`` (records its start). Enqueue: ``Queries.enqueue(entrypoint,
payload)`` per message on an autocommit connection (one transaction each);
bulk: ``Queries.enqueue([...], [...], [...])``, one statement.
"""

import asyncio
import contextlib
import os

import _common

DRIVER = os.environ.get("BENCH_PGQUEUER_DRIVER", "asyncpg")


async def connect():
    if DRIVER == "psycopg":
        import psycopg
        from pgqueuer.db import PsycopgDriver

        conn = await psycopg.AsyncConnection.connect(_common.DSN, autocommit=True)
        return conn, PsycopgDriver(conn)
    import asyncpg
    from pgqueuer.db import AsyncpgDriver

    conn = await asyncpg.connect(_common.DSN)
    return conn, AsyncpgDriver(conn)


@contextlib.asynccontextmanager
async def factory():
    from pgqueuer import PgQueuer
    from pgqueuer.models import Job

    conn, driver = await connect()
    pgq = PgQueuer(driver)

    @pgq.entrypoint("noop")
    async def noop(job: Job) -> None:
        pass

    @pgq.entrypoint("latency")
    async def latency(job: Job) -> None:
        _common.record_start(job.payload.decode())

    try:
        yield pgq
    finally:
        await conn.close()


async def run(args):
    from pgqueuer.queries import Queries

    conn, driver = await connect()
    queries = Queries(driver)
    out = {}
    try:
        if args.op == "enqueue-single":
            await queries.enqueue("noop", b"0")  # warm up (prepared statements), not timed
            await conn.execute("DELETE FROM pgqueuer")
            loop = asyncio.get_running_loop()
            started = loop.time()
            for i in range(args.n):
                await queries.enqueue("noop", str(i).encode())
            out = {"seconds": loop.time() - started, "n": args.n}
        elif args.op == "enqueue-bulk":
            entrypoints = ["noop"] * args.n
            payloads = [str(i).encode() for i in range(args.n)]
            priorities = [0] * args.n
            loop = asyncio.get_running_loop()
            started = loop.time()
            await queries.enqueue(entrypoints, payloads, priorities)
            out = {"seconds": loop.time() - started, "n": args.n}
        elif args.op == "latency-enqueue":

            async def one(key):
                await queries.enqueue("latency", key.encode())
                return key

            async def batch(keys):
                await queries.enqueue(
                    ["latency"] * len(keys), [k.encode() for k in keys], [0] * len(keys)
                )
                return keys

            out = await _common.async_latency_loop(one, args, batch)
        else:
            raise SystemExit(f"unknown op {args.op!r}")
    finally:
        await conn.close()
    return out


def main(argv=None):
    names = ["pgqueuer", "asyncpg" if DRIVER == "asyncpg" else "psycopg"]
    _common.async_main(__doc__, argv, names, run, "pgq install", driver=DRIVER)


if __name__ == "__main__":
    main()
