#!/usr/bin/env python
"""Where each byte of WAL goes when a worker drains the queue, per message:
by relation and record type, and by purpose (claim, acknowledgement,
history).

Per round and variant (``--handlers``, ``--keep-finished``), in turn: the
queue tables of the bench database emptied, ``--messages`` no-op messages
enqueued with ``enqueue_many()`` and the tables ``VACUUM ANALYZE``d (all
outside the measured window), a ``CHECKPOINT``, the WAL insert position
noted, one ``manage.py pgqueue_worker --burst --queues default
--subscriptions none --no-schedules`` drain (and ``--worker-args``), the
end position noted (and waited for until flushed:
``pg_get_wal_records_info`` refuses an end beyond the flushed WAL); a
temporary replication slot of the measuring connection keeps those WAL
segments until they are read (another client's ``CHECKPOINT`` would
recycle them: the server is shared). Every
record in between is read with pg_walinspect (``CREATE EXTENSION IF NOT
EXISTS pg_walinspect`` in the bench database) and attributed to the
relation of this database its first block reference names (``rel
spc/db/relfilenode``, mapped to a name with ``pg_relation_filenode()``).
The machine is shared: the records of other databases are counted apart
and left out, and so are records without a block reference (a COMMIT, a
RUNNING_XACTS) unless their transaction wrote to this database (the
drain's COMMITs, shown as "(transaction)").

Full-page images are split out. The drain starts right after a
checkpoint, so the first change to every page after it logs the whole
page (8 kB, less its hole): that is how PostgreSQL makes torn pages
repairable, and what it costs depends on when the last checkpoint was,
how many pages the drain touches (the backlog's size, the fillfactor) and
``checkpoint_timeout``, not on what the queue writes per message. A long
running queue pays it once per page per checkpoint, spread over every
message that page sees in that time. So the figure without the images is
the comparable one, from run to run and before and after a change; the
total with them is shown beside it.

Reported per variant: each line's bytes per message without full-page
images (median and range over ``--rounds``), the images' bytes and the
records per message; the purposes' totals; the grand total per message
with and without the images. Purposes: *claim*, the message table's
UPDATE (and its row LOCK) and every record of the message table's
indexes (the claim's new row versions are not HOT: their index entries);
*acknowledgement*, the message table's DELETE and the LOCK of a
transaction that deletes (the batched acknowledgement's ``FOR UPDATE
SKIP LOCKED``); *history*, the finished messages' table and the outcome
counts, with their indexes (none of it with ``KEEP_FINISHED`` 0);
*transaction*, the drain's COMMIT records; *other*, the rest (page
pruning, the workers table, the catalog, the visibility map).

    .venv/bin/python -m benchmarks wal                       # 20,000 messages, 3 rounds
    .venv/bin/python -m benchmarks wal --keep-finished both  # with the history off too
    .venv/bin/python -m benchmarks wal --messages 500 --rounds 1 --handlers nonatomic
"""

from __future__ import annotations

import json
import os
import re
import shlex
import sys
import time
from collections import Counter, defaultdict

from benchmarks.harness import cli, db
from benchmarks.harness.cli import run_with_logs
from benchmarks.harness.db import CheckFailed
from benchmarks.harness.machine import load_average
from benchmarks.harness.numbers import in_turn, median, spread
from benchmarks.harness.output import command_line, fmt, table, write_json
from benchmarks.harness.worker import TOPIC_ATOMIC, TOPIC_NONATOMIC, Bench

DEFAULT_URL = "postgres://postgres@127.0.0.1:5432/pgqueue_bench_wal"
MESSAGE = "django_pgqueue_message"
HISTORY_TABLES = ("django_pgqueue_finishedmessage", "django_pgqueue_outcomecount")
PURPOSES = ("claim", "acknowledgement", "history", "transaction", "other")
CHUNK = 1000  # messages per enqueue_many()

NUMBERS = (  # (option, type, default, help)
    ("--messages", int, 20_000, "messages per drain"),
    ("--rounds", int, 3, "rounds; the variants take turns within each"),
    ("--lines", int, 20, "lines shown per variant, the largest first (the JSON has all)"),
    ("--timeout", float, 600.0, "seconds a worker may run"),
)  # fmt: skip

# pg_walinspect (PostgreSQL 15): one row per record between two positions.
RECORDS_SQL = """
SELECT xid::text::bigint, resource_manager || '/' || record_type, record_length, fpi_length,
       block_ref,
       CASE WHEN resource_manager = 'Heap' OR coalesce(block_ref, '') = '' THEN description END
FROM pg_get_wal_records_info(%s, %s)
"""
# Every relation of this database with a file: its file node, its name, the
# table it belongs to (an index's table, a TOAST table's owner).
RELATIONS_SQL = """
SELECT pg_relation_filenode(c.oid)::text, c.relname,
       coalesce(indexed.relname, owner.relname, c.relname)
FROM pg_class c
LEFT JOIN pg_index i ON i.indexrelid = c.oid
LEFT JOIN pg_class indexed ON indexed.oid = i.indrelid
LEFT JOIN pg_class owner ON owner.reltoastrelid = c.oid
WHERE pg_relation_filenode(c.oid) IS NOT NULL
"""
# A block reference (PostgreSQL 15: "blkref #0: rel 1663/16384/16385 fork main blk 3").
BLOCKS = re.compile(r"rel \d+/(\d+)/(\d+) fork (\w+) blk (\d+)")
OFFSET = re.compile(r"off (\d+)")  # the first words of a heap record's description
SUBXACTS = re.compile(r"subxacts:((?: \d+)+)")  # a COMMIT's or an ABORT's subtransactions
ROW_CHANGES = ("Heap/LOCK", "Heap/UPDATE", "Heap/HOT_UPDATE", "Heap/DELETE")


def parse_args(argv):
    parser = cli.parser(__doc__, NUMBERS)
    parser.add_argument(
        "--handlers",
        choices=("atomic", "nonatomic", "both"),
        default="both",
        help="the no-op handlers drained: bench.noop (atomic=True), bench.noop_nonatomic"
        " (atomic=False)",
    )
    parser.add_argument(
        "--keep-finished",
        choices=("default", "0", "both"),
        default="default",
        help="PGQUEUE['KEEP_FINISHED'] of the workers: the default (the history kept), 0 (no"
        " history), or both in turn (what the history costs)",
    )
    parser.add_argument(
        "--worker-args",
        default="",
        help="pgqueue_worker options added to --burst --queues default --subscriptions none"
        " --no-schedules ('': the command's defaults)",
    )
    cli.add_database_url(parser, "BENCH_WAL_DATABASE_URL", DEFAULT_URL)
    cli.add_results(parser, "also write every round's records, by line, as JSON")
    args = parser.parse_args(argv)
    if min(args.messages, args.rounds, args.lines) < 1:
        parser.error("--messages, --rounds and --lines must be at least 1")
    cli.require_bench_database(parser, args.database_url)
    return args


def variants(args):
    """name -> (topic, KEEP_FINISHED 0?), in the order of the first round."""
    handlers = {"nonatomic": [False], "atomic": [True], "both": [False, True]}[args.handlers]
    histories = {"default": [False], "0": [True], "both": [False, True]}[args.keep_finished]
    return {
        f"atomic={atomic}" + (", KEEP_FINISHED 0" if off else ""): (
            TOPIC_ATOMIC if atomic else TOPIC_NONATOMIC,
            off,
        )
        for atomic in handlers
        for off in histories
    }


# --- one drain ---------------------------------------------------------------------------


def fill(topic, count):
    """The queue tables emptied, ``count`` messages of ``topic`` enqueued."""
    from django_pgqueue import enqueue_many

    db.truncate((MESSAGE, "django_pgqueue_deadletter", *HISTORY_TABLES, "demo_handled"))
    for start in range(0, count, CHUNK):
        size = min(CHUNK, count - start)
        enqueue_many([{"payload": {"n": start + i}} for i in range(size)], topic=topic)


def wait_flushed(conn, lsn, timeout=60.0):
    deadline = time.monotonic() + timeout
    while conn.execute("SELECT pg_current_wal_flush_lsn() < %s::pg_lsn", [lsn]).fetchone()[0]:
        if time.monotonic() > deadline:
            raise CheckFailed(f"the WAL was not flushed up to {lsn} within {timeout}s")
        time.sleep(0.05)


def drain(bench, args, name, topic):
    """The WAL records of one burst drain of ``--messages`` messages of
    ``topic``: (records, this database's oid, its relations by file node)."""
    from django_pgqueue.models import DeadLetter, Message

    fill(topic, args.messages)
    with db.connect(bench.url) as conn:
        for table_name in (MESSAGE, *HISTORY_TABLES):
            conn.execute(f"VACUUM ANALYZE {table_name}")
        # The machine is shared: another client's CHECKPOINT during the drain
        # would recycle the WAL segments it wrote before they are read. A
        # temporary slot of this connection's holds them, until it closes.
        conn.execute(
            "SELECT pg_create_physical_replication_slot(%s, true, true)",
            [f"pgqueue_bench_wal_{os.getpid()}"],
        )
        conn.execute("CHECKPOINT")
        (start,) = conn.execute("SELECT pg_current_wal_insert_lsn()").fetchone()
        worker = bench.worker(
            name,
            ["--burst", "--queues", "default", "--subscriptions", "none", "--no-schedules"],
        )
        worker.finish(args.timeout)
        (end,) = conn.execute("SELECT pg_current_wal_insert_lsn()").fetchone()
        worker.check_clean(name)
        left, dead = Message.objects.count(), DeadLetter.objects.count()
        if left or dead:
            raise CheckFailed(f"{name}: {left} message(s) left, {dead} dead letter(s)")
        wait_flushed(conn, end)
        records = conn.execute(RECORDS_SQL, [start, end]).fetchall()
        (oid,) = conn.execute(
            "SELECT oid FROM pg_database WHERE datname = current_database()"
        ).fetchone()
        relations = {node: (rel, owner) for node, rel, owner in conn.execute(RELATIONS_SQL)}
    return records, oid, relations


def purpose(table_name, record):
    """What a record of ``table_name`` is for (a LOCK of the message table:
    what its row's next change is for, ``attribute``)."""
    if table_name in HISTORY_TABLES:
        return "history"
    if table_name != MESSAGE:
        return "other"
    kind = record.split("+")[0]  # UPDATE+INIT: an UPDATE onto a new page
    if kind in ("Heap/UPDATE", "Heap/HOT_UPDATE"):
        return "claim"
    if kind == "Heap/DELETE":
        return "acknowledgement"
    return "other" if kind.startswith(("Heap/", "Heap2/")) else "claim"  # Heap2: pruning


def row_address(blocks, description):
    """(block, offset) of the message row a LOCK, an UPDATE or a DELETE
    changes (an UPDATE to another page names the old page second)."""
    offset = OFFSET.match(description or "")
    return blocks[-1][3], offset.group(1) if offset else description


def attribute(records, oid, relations):
    """The records of one drain by line: {(relation, record type, purpose):
    [records, bytes, full-page image bytes]}, and the bytes left out, by why.

    A row LOCK of the message table goes with the row's next change in its
    transaction: the claim's ``FOR UPDATE SKIP LOCKED`` before its UPDATE
    (and the UPDATE's own lock while it finds the new version a page), the
    batched acknowledgement's before its DELETE; a batch of atomic=False
    acknowledgements and the next claim share one transaction."""
    lines, left_out = defaultdict(lambda: [0, 0, 0]), Counter()
    writers, locks, unattached = set(), defaultdict(list), []

    def add(key, length, fpi):
        line = lines[key]
        line[0], line[1], line[2] = line[0] + 1, line[1] + length, line[2] + fpi

    for xid, record, length, fpi, block_ref, description in records:
        blocks = BLOCKS.findall(block_ref or "")
        if not blocks:
            unattached.append((xid, record, length, fpi, description))
            continue
        dbnode, node, fork, _ = blocks[0]
        if int(dbnode) != oid:
            left_out["other databases"] += length
            continue
        writers.add(xid)
        relation, table_name = relations.get(node, (f"relfilenode {node}", ""))
        if fork != "main":
            relation, table_name = f"{relation} ({fork})", ""
        why = purpose(table_name, record)
        if table_name == MESSAGE and record.split("+")[0] in ROW_CHANGES:
            row = (xid, *row_address(blocks, description))
            if record == "Heap/LOCK":
                locks[row].append((length, fpi))
                continue
            for lock in locks.pop(row, []):
                add((relation, "Heap/LOCK", why), *lock)
        add((relation, record, why), length, fpi)
    for row_locks in locks.values():  # rows locked and left unchanged
        for lock in row_locks:
            add((MESSAGE, "Heap/LOCK", "other"), *lock)
    for xid, record, length, fpi, description in unattached:
        subxacts = SUBXACTS.search(description or "")
        xids = {xid, *(int(x) for x in subxacts.group(1).split())} if subxacts else {xid}
        if xid and xids & writers:
            add(("(transaction)", record, "transaction"), length, fpi)
        else:
            left_out["no relation, not this database's transaction"] += length
    return dict(lines), dict(left_out)


def measure(bench, args, name, topic):
    records, oid, relations = drain(bench, args, name, topic)
    lines, left_out = attribute(records, oid, relations)
    n = args.messages
    figures = [
        {"relation": relation, "record": record, "purpose": why, "records": count,
         "bytes": length, "fpi_bytes": fpi, "per_message": (length - fpi) / n,
         "fpi_per_message": fpi / n, "records_per_message": count / n}
        for (relation, record, why), (count, length, fpi) in lines.items()
    ]  # fmt: skip
    by_purpose = defaultdict(float)
    for line in figures:
        by_purpose[line["purpose"]] += line["per_message"]
    return {
        "lines": sorted(figures, key=lambda line: -line["per_message"]),
        "purposes": {why: by_purpose[why] for why in PURPOSES},
        "total": sum(line["per_message"] for line in figures),
        "total_with_fpi": sum(line["per_message"] + line["fpi_per_message"] for line in figures),
        "left_out_per_message": {why: b / n for why, b in left_out.items()},
    }


# --- the report ----------------------------------------------------------------------------


def median_range(values, spec=".1f"):
    low, high = spread(values) or (None, None)
    return [fmt(median(values), spec), f"{fmt(low, spec)}-{fmt(high, spec)}"]


def report_variant(args, name, runs):
    """One variant's lines, the largest first: bytes per message without
    full-page images (median, range), the images' and the records' medians."""
    per_round = defaultdict(lambda: [[0.0] * len(runs) for _ in range(3)])
    for index, figures in enumerate(runs):
        for line in figures["lines"]:
            values = per_round[(line["relation"], line["record"], line["purpose"])]
            for column, field in enumerate(
                ("per_message", "fpi_per_message", "records_per_message")
            ):
                values[column][index] = line[field]
    ordered = sorted(per_round.items(), key=lambda item: -(median(item[1][0]) or 0.0))
    rows = [
        [*key, *median_range(bytes_), fmt(median(fpi), ".1f"), fmt(median(count), ".2f")]
        for key, (bytes_, fpi, count) in ordered[: args.lines]
    ]
    rest = ordered[args.lines :]
    if rest:
        sums = [sum(values[0][i] for _, values in rest) for i in range(len(runs))]
        rows.append([f"({len(rest)} more lines)", "", "", *median_range(sums), "", ""])
    print(f"\n{name}: bytes of WAL per message, without full-page images (FPI)")
    headers = ["relation", "record", "purpose", "B/msg", "range", "FPI B/msg", "records/msg"]
    print(table(headers, rows))


def summarize(args, names, results):
    """The purposes and the totals, a column pair (median, range) per variant."""

    def cells(figure):
        return [cell for n in names for cell in median_range([figure(r) for r in results[n]])]

    rows = [[why, *cells(lambda r, why=why: r["purposes"][why])] for why in PURPOSES]
    rows.append(["total, without full-page images", *cells(lambda r: r["total"])])
    rows.append(["total, with full-page images", *cells(lambda r: r["total_with_fpi"])])
    for why in sorted({w for n in names for r in results[n] for w in r["left_out_per_message"]}):
        rows.append(
            [f"left out: {why}", *cells(lambda r, w=why: r["left_out_per_message"].get(w, 0.0))]
        )
    print(
        f"\n{args.messages:,} messages per drain, {args.rounds} round(s) in turn; bytes of WAL per"
        " message without full-page images unless said, median and range over the rounds;"
        f" worker: --burst {args.worker_args or '(defaults)'}"
    )
    print(table(["", *(cell for n in names for cell in (n, "range"))], rows))
    summary = {
        n: {
            "total": median([r["total"] for r in results[n]]),
            "total_with_fpi": median([r["total_with_fpi"] for r in results[n]]),
            "purposes": {w: median([r["purposes"][w] for r in results[n]]) for w in PURPOSES},
        }
        for n in names
    }
    load = load_average()
    if load:
        print(f"load average at the end: {' '.join(f'{x:.2f}' for x in load)} (a shared machine:"
              " other databases' WAL is left out, not their effect on checkpoints)")  # fmt: skip
    return summary


def run(args, logs):
    url = args.database_url
    env = db.pgqueue_env(url)
    db.recreate_database(url)
    db.recreate_database(db.other_url(url))
    db.migrate(env)
    db.setup_django(env)
    with db.connect(url) as conn:
        conn.execute("CREATE EXTENSION IF NOT EXISTS pg_walinspect")
    worker_args = shlex.split(args.worker_args)
    settings = json.loads(env.get("PGQUEUE_JSON") or "{}")
    benches = {
        False: Bench(url, env, logs.path, worker_args=worker_args),
        True: Bench(url, dict(env, PGQUEUE_JSON=json.dumps({**settings, "KEEP_FINISHED": 0})),
                    logs.path, worker_args=worker_args),
    }  # fmt: skip
    cases = variants(args)
    results = {name: [] for name in cases}
    for index in range(args.rounds):
        for name in in_turn(index, list(cases)):
            topic, history_off = cases[name]
            label = f"r{index + 1}-" + re.sub(r"\W+", "-", name)
            figures = measure(benches[history_off], args, label, topic)
            results[name].append(figures)
            print(
                f"  round {index + 1} {name:28}: {figures['total']:6.1f} B/msg without full-page"
                f" images, {figures['total_with_fpi']:7.1f} with",
                file=sys.stderr,
            )
    db.truncate((MESSAGE, "django_pgqueue_deadletter", *HISTORY_TABLES, "demo_handled"))
    for name in cases:
        report_variant(args, name, results[name])
    summary = summarize(args, list(cases), results)
    if args.json:
        write_json(args.json, {"command": command_line(), "options": vars(args),
                               "rounds": results, "summary": summary})  # fmt: skip
        print(f"wrote {args.json}")
    return 0


def main(argv=None):
    args = parse_args(argv)
    return run_with_logs("pgqueue-bench-wal-", args.keep_logs, lambda logs: run(args, logs))
