#!/usr/bin/env python
"""Soak benchmark: a million messages through a worker on a server with
autovacuum on; the queue table's size, its indexes' sizes, its dead rows and
the claim's cost at the start and at the end.

Runs in a PostgreSQL cluster of its own (benchmarks/harness/throwaway_pg.py: initdb
in a temporary directory, autovacuum on as PostgreSQL ships it, removed at
the end); the shared server, whose autovacuum may be off, is never touched.
See benchmarks/README.md ("soak").

    .venv/bin/python -m benchmarks soak [--messages 1000000] [--json out.json]

Each of ``--table-settings`` (default: product, postgres) is one run in a
fresh database: ``product`` keeps the queue table's storage parameters of
migrations 0005 and 0012, ``postgres`` resets them to PostgreSQL's defaults.
"""

import importlib
import json
import statistics
import sys
import time

from benchmarks.harness import cli, db, throwaway_pg
from benchmarks.harness.cli import run_with_logs
from benchmarks.harness.machine import description, git_commit, load_average
from benchmarks.harness.output import command_line, now_iso, write_checked
from benchmarks.harness.worker import EMPTY_SQL, TOPIC_NONATOMIC, Bench
from benchmarks.scenarios.scale.fill import insert_messages
from benchmarks.scenarios.soak import HISTORY_TABLE
from benchmarks.scenarios.soak.probe import claim_probe
from benchmarks.scenarios.soak.report import checks, print_report
from benchmarks.scenarios.soak.sizes import snapshot, storage_options

DEFAULT_WORKER_ARGS = "--concurrency 4 --batch-size 100 --subscriptions none"
NUMBERS = (
    ("--messages", int, 1_000_000, "messages through the worker in all"),
    ("--rounds", int, 10, "the messages come in this many rounds, each drained to the end"),
    ("--chunk", int, 10_000, "messages enqueued at a time, when fewer than this are waiting"),
    ("--claim-calls", int, 200, "claims of the probe"),
    ("--claim-batch", int, 100, "what each claim of the probe asks for"),
    ("--settle", float, 90.0, "at the end, wait up to this long for an autovacuum, s"),
    ("--naptime", int, 60, "the cluster's autovacuum_naptime, s (PostgreSQL's default: 60)"),
    ("--tolerance", float, 0.10, "allowed end/start difference"),
    ("--probe-pairs", int, 5, "claim probes of the soaked and the reference database, in turn"),
    ("--rate-pairs", int, 3, "rounds through a fresh worker on each, in turn, at the end"),
)
SETTINGS = ("product", "postgres")
LISTENING_SQL = (
    "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s AND state = 'idle'"
)


def reset_statements():
    """ALTER TABLEs that give the queue table PostgreSQL's own storage
    parameters back (the reverse of migrations 0005 and 0012)."""
    statements = []
    for name in ("0005_queue_autovacuum", "0012_queue_index_cleanup"):
        migration = importlib.import_module(f"django_pgqueue.migrations.{name}").Migration
        for operation in migration.operations:
            if "django_pgqueue_message " in operation.reverse_sql:
                statements.append(operation.reverse_sql)
    return statements


def parse_args(argv):
    parser = cli.parser(__doc__, NUMBERS)
    parser.add_argument(
        "--table-settings",
        default=",".join(SETTINGS),
        help="comma-separated runs, each in a fresh database: product (migrations 0005 and"
        " 0012's storage parameters) or postgres (reset to PostgreSQL's defaults)",
    )
    parser.add_argument(
        "--worker-args",
        default=DEFAULT_WORKER_ARGS,
        help="pgqueue_worker options (the script adds --log-level WARNING)",
    )
    parser.add_argument(
        "--reindex-probe",
        action="store_true",
        help="after the end's probe, REINDEX the queue table and probe once more: whether"
        " what the end's claim costs more is its indexes' bloat",
    )
    cli.add_results(parser, "also write the results here as JSON")
    parser.add_argument(
        "--report",
        metavar="PATH",
        help="print the report and checks of an earlier run's JSON, and run nothing",
    )
    args = parser.parse_args(argv)
    args.table_settings = [s.strip() for s in args.table_settings.split(",") if s.strip()]
    unknown = set(args.table_settings) - set(SETTINGS)
    if unknown or not args.table_settings:
        parser.error(f"--table-settings: choose from {', '.join(SETTINGS)}")
    sizes = (args.messages, args.rounds, args.chunk, args.claim_calls, args.claim_batch)
    if min(*sizes, args.probe_pairs, args.rate_pairs) < 1:
        parser.error("the sizes must be at least 1")
    if not 1 <= args.naptime <= 2147483:
        parser.error("--naptime must be 1 to 2147483 seconds")
    if args.rounds > args.messages:
        parser.error("--rounds must not exceed --messages")
    return args


def use_database(bench, url):
    """Point the workers and this process's Django at the database of ``url``
    (on the same cluster)."""
    from django.db import connections

    bench.use_database(url)
    for alias, target in (("default", url), ("other", db.other_url(url))):
        connections[alias].close()
        connections[alias].settings_dict["NAME"] = db.database_name(target)


def remaining():
    """Messages not finished yet (waiting or leased)."""
    return db.scalar(f"SELECT count(*) FROM {db.MESSAGE_TABLE}")


def feed_round(first, last, chunk, worker):
    """Enqueue messages first..last in chunks, a chunk whenever fewer than
    ``chunk`` wait, then wait until the worker has drained them all."""
    n = first
    while n <= last or db.scalar(EMPTY_SQL) is False:
        if worker.poll() is not None:
            raise db.CheckFailed(f"the worker exited early\n{worker.log_tail()}")
        if n <= last and remaining() < chunk:
            upto = min(last, n + chunk - 1)
            insert_messages(n, upto, TOPIC_NONATOMIC)
            n = upto + 1
        else:
            time.sleep(0.05)


def wait_for_autovacuum(count_before, timeout):
    """Wait until the queue table has been autovacuumed since ``count_before``;
    the seconds waited, None if it was not within ``timeout``."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if snapshot()[db.MESSAGE_TABLE]["autovacuum_count"] > count_before:
            return time.monotonic() - started
        time.sleep(1.0)
    return None


def in_turn(bench, i, soaked_url, reference_url):
    """ "soaked" and "reference" in pair ``i``'s order (alternating from one
    pair to the next), each yielded once the bench points at its database."""
    order = [("soaked", soaked_url), ("reference", reference_url)]
    for name, url in order if i % 2 == 0 else order[::-1]:
        use_database(bench, url)
        yield name


def paired_probes(bench, args, soaked_url, reference_url):
    """The claim probe on the soaked database and on the reference (a
    database of the same cluster that no worker ever used), in turn,
    ``--probe-pairs`` times, the order alternating; each probe after a quiesce (no autovacuum
    running, a CHECKPOINT) and followed by a VACUUM of its table. The
    machine's speed drifts by far more than 10% over minutes: only a ratio
    to a reference measured in the same minutes tells what the churn left
    in the soaked table and its indexes."""
    pairs = []
    for i in range(args.probe_pairs):
        pair = {}
        for name in in_turn(bench, i, soaked_url, reference_url):
            pair[name] = claim_probe(args.claim_calls, args.claim_batch, quiet=True)
            db.execute(f"VACUUM {db.MESSAGE_TABLE}")
        pairs.append(pair)
    use_database(bench, soaked_url)

    def ratio(key):
        return statistics.median(p["soaked"][key] / p["reference"][key] for p in pairs)

    return {
        "pairs": pairs,
        "server_cpu_ratio": ratio("server_cpu_mean_ms"),
        "p50_ratio": ratio("p50_ms"),
    }


def start_worker(bench, name):
    """A worker on the bench's database, once its listener waits (the rounds
    time the worker's work, not its start-up)."""
    worker = bench.worker(name, [])
    deadline = time.monotonic() + 60
    while not db.scalar(LISTENING_SQL, [f"pgqueue_listener#{worker.pid}"]):
        if worker.poll() is not None or time.monotonic() > deadline:
            raise db.CheckFailed(f"the worker did not start\n{worker.log_tail()}")
        time.sleep(0.05)
    return worker


def paired_rounds(bench, args, soaked_url, reference_url, messages):
    """A round of ``messages`` through a fresh worker on the soaked database
    and on the reference, in turn, ``--rate-pairs`` times (the order alternating):
    the worker's rate at the end beside a table no worker churned, measured
    in the same minutes."""
    pairs = []
    for i in range(args.rate_pairs):
        pair = {}
        for name in in_turn(bench, i, soaked_url, reference_url):
            worker = start_worker(bench, f"soak-rate-{name}-{i}")
            started = time.perf_counter()
            feed_round(1, messages, args.chunk, worker)
            pair[name] = messages / (time.perf_counter() - started)
            worker.stop()
            worker.check_clean(f"soak round {name} {i + 1} (SIGTERM)")
        pairs.append(pair)
    use_database(bench, soaked_url)
    ratio = statistics.median(p["soaked"] / p["reference"] for p in pairs)
    return {"messages": messages, "pairs": pairs, "ratio": ratio}


def soak_run(bench, args, settings, reference_url):
    """One run: the probe, the rounds through one worker, the probe again;
    the probes beside the reference's at the start and the end."""
    if settings == "postgres":
        for statement in reset_statements():
            db.execute(statement)
    soaked_url = bench.url
    run = {
        "table_settings": settings,
        "storage_options": storage_options(db.MESSAGE_TABLE),
        "start": snapshot(),
    }
    run["probe_start"] = claim_probe(args.claim_calls, args.claim_batch)
    run["after_probe_start"] = snapshot()
    db.execute(f"VACUUM {db.MESSAGE_TABLE}")
    run["paired_start"] = paired_probes(bench, args, soaked_url, reference_url)
    per_round = args.messages // args.rounds
    worker = start_worker(bench, f"soak-{settings}")
    rounds = []
    first = 1
    for r in range(args.rounds):
        last = args.messages if r == args.rounds - 1 else first + per_round - 1
        started = time.perf_counter()
        feed_round(first, last, args.chunk, worker)
        seconds = time.perf_counter() - started
        rounds.append(
            {"round": r + 1, "messages": last - first + 1, "seconds": seconds}
            | {"jobs_per_s": (last - first + 1) / seconds, "sizes": snapshot()}
        )
        print(
            f"  {settings:8} round {r + 1:2}: {last - first + 1:,} in {seconds:6.1f} s"
            f" ({(last - first + 1) / seconds:8,.0f} jobs/s), queue table"
            f" {rounds[-1]['sizes'][db.MESSAGE_TABLE]['total_bytes'] / 2**20:6.1f} MiB",
            file=sys.stderr,
        )
        first = last + 1
    worker.stop()
    worker.check_clean(f"soak run {settings} (SIGTERM)")
    run["rounds"] = rounds
    run["finished_rows"] = db.count(HISTORY_TABLE)
    run["dead_letters"] = db.count(db.DEADLETTER_TABLE)
    if run["finished_rows"] != args.messages or run["dead_letters"]:
        raise db.CheckFailed(
            f"soak run {settings}: {run['finished_rows']:,} finished of {args.messages:,},"
            f" {run['dead_letters']} dead letters"
        )
    run["drained"] = snapshot()
    run["settle_s"] = wait_for_autovacuum(
        run["drained"][db.MESSAGE_TABLE]["autovacuum_count"], args.settle
    )
    run["end"] = snapshot()
    run["probe_end"] = claim_probe(args.claim_calls, args.claim_batch)
    run["after_probe_end"] = snapshot()
    db.execute(f"VACUUM {db.MESSAGE_TABLE}")
    run["paired_end"] = paired_probes(bench, args, soaked_url, reference_url)
    run["rounds_end"] = paired_rounds(bench, args, soaked_url, reference_url, per_round)
    if args.reindex_probe:
        # The end's probe left its claimed rows dead: vacuum them as autovacuum
        # did before the end's probe, then rebuild the indexes.
        db.execute(f"VACUUM {db.MESSAGE_TABLE}")
        db.execute(f"REINDEX TABLE {db.MESSAGE_TABLE}")
        run["probe_reindexed"] = claim_probe(args.claim_calls, args.claim_batch)
        run["after_probe_reindexed"] = snapshot()
        print(
            "  claim probe after REINDEX: server CPU mean"
            f" {run['probe_reindexed']['server_cpu_mean_ms']:.3f} ms, p50"
            f" {run['probe_reindexed']['p50_ms']:.3f} ms (end: "
            f"{run['probe_end']['server_cpu_mean_ms']:.3f} / {run['probe_end']['p50_ms']:.3f})",
            file=sys.stderr,
        )
    return run


def environment():
    return {
        "started_at": now_iso(),
        "command": command_line(),
        "commit": git_commit(),
        "postgres": db.scalar("SHOW server_version"),
        "settings": {
            name: db.scalar(f"SHOW {name}")
            for name in ("shared_buffers", "autovacuum", "autovacuum_naptime", "synchronous_commit")
        },
        **description(),
        "load_average_start": load_average(),
    }


def run(args, logs):
    cluster = throwaway_pg.ThrowawayCluster.create(major=15, prefix="pgqueue-soak-pg-")
    try:
        with cluster.connect(autocommit=True) as conn:
            # A server setting, of this cluster only: how often autovacuum
            # visits each database, whatever the tables' own thresholds.
            conn.execute(f"ALTER SYSTEM SET autovacuum_naptime = {int(args.naptime)}")
            conn.execute("SELECT pg_reload_conf()")
        urls, references = {}, {}
        for settings in args.table_settings:
            name = f"pgqueue_bench_soak_{settings}"
            for dbname in (name, name + "_other", name + "_ref", name + "_ref_other"):
                cluster.create_database(dbname)
            urls[settings], references[settings] = cluster.url(name), cluster.url(name + "_ref")
            db.migrate(db.pgqueue_env(urls[settings]))
            db.migrate(db.pgqueue_env(references[settings]))
        first_url = urls[args.table_settings[0]]
        env = db.pgqueue_env(first_url)
        db.setup_django(env)
        bench = Bench(first_url, env, logs.path, worker_args=args.worker_args.split())
        result = {"environment": environment(), "options": vars(args), "runs": []}
        for settings in args.table_settings:
            if settings == "postgres":
                use_database(bench, references[settings])
                for statement in reset_statements():
                    db.execute(statement)
            use_database(bench, urls[settings])
            print(f"run {settings}: {args.messages:,} messages", file=sys.stderr)
            result["runs"].append(soak_run(bench, args, settings, references[settings]))
        result["environment"]["load_average_end"] = load_average()
        result["checks"] = checks(result, args.tolerance)
    finally:
        from django.db import connections

        connections.close_all()
        cluster.close()
    print_report(result)
    return write_checked(result, args.json)


def report_only(args):
    with open(args.report) as f:
        result = json.load(f)
    result["checks"] = checks(result, args.tolerance)
    print_report(result)
    return 0 if all(c["passed"] for c in result["checks"]) else 3


def main(argv=None):
    args = parse_args(argv)
    if args.report:
        return report_only(args)
    return run_with_logs("pgqueue-soak-", args.keep_logs, lambda logs: run(args, logs))
