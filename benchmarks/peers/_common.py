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
        " --start-at and --stop-at (the senders start together, however long each took to"
        " start)",
    )
    p.add_argument(
        "--stop-at",
        type=float,
        default=0.0,
        help="with --rate: send nothing after this (epoch seconds): a sender far behind stops",
    )
    p.add_argument(
        "--senders", type=int, default=1, help="with --rate: this sender sends every SENDERS-th"
    )
    p.add_argument("--sender", type=int, default=0, help="with --rate: from message SENDER")
    p.add_argument(
        "--batch-late",
        action="store_true",
        help="with --rate: a late sender sends every message due by then in one transaction",
    )
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
    whole by a rename), which holds --start-at and --stop-at."""
    if not (args.rate and args.start_file):
        return
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    while not os.path.exists(args.start_file):
        time.sleep(0.001)
    with open(args.start_file) as f:
        args.start_at, args.stop_at = (float(x) for x in f.read().split())


def _turns(args, batching):
    """The sender's turns, as ("wait", seconds) and ("send", [(key, due), ...]:
    the messages of one transaction). A batch is formed when it is sent:
    every message due by then."""
    pending = schedule(args)
    i = 0
    while i < len(pending):
        due = pending[i][1]
        if due is not None:
            if args.stop_at and time.time() > args.stop_at:
                return  # far behind the schedule: the rest is not sent
            yield "wait", due - time.time()
        j = i + 1
        if batching and due is not None:
            now = time.time()
            while j < len(pending) and pending[j][1] <= now:
                j += 1
        yield "send", pending[i:j]
        if due is None:
            yield "wait", args.spacing
        i = j


def _record(result, sent, chunk):
    """The keys ``sent`` of one committed transaction, with their due times."""
    committed = time.time()
    result["transactions"] += 1
    for key, (_, due) in zip(sent, chunk, strict=True):
        result["sent"].append([str(key), committed] + ([due] if due is not None else []))


def latency_loop(enqueue_one, args, enqueue_batch=None):
    """Enqueue the messages of ``schedule(args)``: ``enqueue_one(key)`` must
    return when its transaction has committed, with the key the handler will
    write (``key`` or the message's id). Spaced: each --spacing after the
    previous one's commit; open loop (--rate): each when due, whatever the
    worker does, at once when the sender is late; with --batch-late, a late
    sender sends every message due by then in one transaction,
    ``enqueue_batch(keys)`` (returning their keys). Returns {"sent": [[key,
    commit time(, due)], ...], "ready_at": when the loop began, "transactions"}."""
    wait_start(args)
    result = {"sent": [], "ready_at": time.time(), "transactions": 0}
    for what, value in _turns(args, args.batch_late and enqueue_batch):
        if what == "wait":
            time.sleep(max(value, 0))
            continue
        keys = [key for key, _ in value]
        _record(result, enqueue_batch(keys) if len(keys) > 1 else [enqueue_one(keys[0])], value)
    return result


async def async_latency_loop(enqueue_one, args, enqueue_batch=None):
    """``latency_loop`` with coroutines ``enqueue_one`` and ``enqueue_batch``."""
    import asyncio

    wait_start(args)  # blocks the event loop: nothing else runs yet
    result = {"sent": [], "ready_at": time.time(), "transactions": 0}
    for what, value in _turns(args, args.batch_late and enqueue_batch):
        if what == "wait":
            await asyncio.sleep(max(value, 0))
            continue
        keys = [key for key, _ in value]
        if len(keys) > 1:
            sent = await enqueue_batch(keys)
        else:
            sent = [await enqueue_one(keys[0])]
        _record(result, sent, value)
    return result


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
