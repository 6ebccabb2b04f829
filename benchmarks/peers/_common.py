"""Helpers shared by the per-system scripts of benchmarks/compare.py.

Standard library only: every script in this folder runs in the virtualenv of
its own system (benchmarks/.venvs/<system>, or the repo's .venv), imports this
module from its own folder, and answers one operation per call, as one JSON
object on the last line of stdout.
"""

import argparse
import json
import os
import sys
import time

DSN = os.environ.get("BENCH_DSN", "")


def record_start(key):
    """A latency handler's first act: append "<key> <time.time()>" to the
    file named by BENCH_LATENCY_FILE (the worker and the enqueuer share one
    clock: the same machine). One write(2) of a short line with O_APPEND, so
    lines of concurrent handlers never mix."""
    now = time.time()
    path = os.environ.get("BENCH_LATENCY_FILE")
    if not path:
        return
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, f"{key} {now:.6f}\n".encode())
    finally:
        os.close(fd)


def emit(obj):
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def parser(description):
    p = argparse.ArgumentParser(description=description)
    p.add_argument("op", help="info, setup, enqueue-single, enqueue-bulk or latency-enqueue")
    p.add_argument("--n", type=int, default=0, help="messages")
    p.add_argument("--variant", default="", help="which handler/topic the messages go to")
    p.add_argument("--spacing", type=float, default=0.02, help="latency-enqueue: seconds apart")
    p.add_argument("--prefix", default="", help="latency-enqueue: prefix of the message keys")
    return p


def latency_loop(enqueue_one, n, spacing, prefix=""):
    """Enqueue ``n`` messages one at a time, ``spacing`` apart; ``enqueue_one(key)``
    must return when its transaction has committed, with the key the handler
    will write. Returns [[key, commit time], ...]."""
    out = []
    for i in range(n):
        key = enqueue_one(f"{prefix}{i}")
        out.append([str(key), time.time()])
        time.sleep(spacing)
    return out


def timed(fn):
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def answer_info(packages, **extra):
    """The ``info`` operation: the versions of ``packages``, the Python, ``extra``."""
    from importlib.metadata import version

    emit(
        {
            "versions": {name: version(name) for name in packages},
            "python": sys.version.split()[0],
            **extra,
        }
    )


def async_main(doc, argv, packages, run, setup_command, **info):
    """The main of a client whose operations are coroutines, ``run(args)``:
    ``info`` lists ``packages`` (and ``info``); the schema is set up by
    compare.py with ``setup_command``."""
    import asyncio

    args = parser(doc.split("\n\n")[0]).parse_args(argv)
    if args.op == "info":
        answer_info(packages, **info)
    elif args.op == "setup":
        raise SystemExit(f"setup: run `{setup_command}` (compare.py does)")
    else:
        emit(asyncio.run(run(args)))
