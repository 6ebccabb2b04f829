"""The procrastinate App of benchmarks/compare.py (a module of its own: procrastinate
warns when the App lives in the main module). See bench_procrastinate.py."""

import _common
import procrastinate

app = procrastinate.App(
    connector=procrastinate.PsycopgConnector(conninfo=_common.DSN),
)


@app.task(name="noop")
async def noop(n):
    pass


@app.task(name="latency")
async def latency(key):
    _common.record_start(key)
