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
    p.add_argument(
        "--rate",
        type=float,
        default=0.0,
        help="latency-enqueue, open loop: message i is due at --start-at + i / RATE (epoch"
        " seconds) and sent then, or at once when late (no --spacing)",
    )
    p.add_argument("--start-at", type=float, default=0.0, help="with --rate: when message 0 is due")
    p.add_argument(
        "--start-file",
        default="",
        help="with --rate: once connected, print 'ready' and wait for this file, which holds"
        " --start-at (the senders start together, however long each took to start)",
    )
    p.add_argument(
        "--senders", type=int, default=1, help="with --rate: this sender sends every SENDERS-th"
    )
    p.add_argument("--sender", type=int, default=0, help="with --rate: from message SENDER")
    return p


def schedule(args):
    """[(key, due)] of the messages this client sends: due (epoch seconds) on
    the open-loop schedule of --rate (this sender's share: every --senders-th
    message from --sender), or None without --rate (then --spacing apart)."""
    if not args.rate:
        return [(f"{args.prefix}{i}", None) for i in range(args.n)]
    return [
        (f"{args.prefix}{i}", args.start_at + i / args.rate)
        for i in range(args.sender, args.n, args.senders)
    ]


def wait_start(args):
    """With --start-file: say "ready" on stdout and wait for the file (written
    whole by a rename), whose content becomes --start-at."""
    if not (args.rate and args.start_file):
        return
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    while not os.path.exists(args.start_file):
        time.sleep(0.001)
    with open(args.start_file) as f:
        args.start_at = float(f.read())


def latency_loop(enqueue_one, args):
    """Enqueue the messages of ``schedule(args)`` one per transaction:
    ``enqueue_one(key)`` must return when its transaction has committed, with
    the key the handler will write (``key`` or the message's id). Spaced: each
    --spacing after the previous one's commit; open loop (--rate): each when
    due, whatever the worker does, at once when the sender is late. Returns
    {"sent": [[key, commit time(, due)], ...], "ready_at": when the loop began}."""
    wait_start(args)
    out = []
    ready_at = time.time()
    for key, due in schedule(args):
        if due is not None and (delay := due - time.time()) > 0:
            time.sleep(delay)
        sent = enqueue_one(key)
        out.append([str(sent), time.time()] + ([due] if due is not None else []))
        if due is None:
            time.sleep(args.spacing)
    return {"sent": out, "ready_at": ready_at}


async def async_latency_loop(enqueue_one, args):
    """``latency_loop`` with a coroutine ``enqueue_one``."""
    import asyncio

    wait_start(args)  # blocks the event loop: nothing else runs yet
    out = []
    ready_at = time.time()
    for key, due in schedule(args):
        if due is not None and (delay := due - time.time()) > 0:
            await asyncio.sleep(delay)
        sent = await enqueue_one(key)
        out.append([str(sent), time.time()] + ([due] if due is not None else []))
        if due is None:
            await asyncio.sleep(args.spacing)
    return {"sent": out, "ready_at": ready_at}


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
