#!/usr/bin/env python
"""Chaos soak: many messages, several worker processes, faults on a schedule,
and a count of what was lost or handled twice.

    .venv/bin/python -m benchmarks chaos --throwaway-cluster

runs on a PostgreSQL cluster of its own, created for the run and removed at
the end;

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/pgqueue_chaos \\
        .venv/bin/python -m benchmarks chaos

against the database of DATABASE_URL (created and migrated if needed; its
queue tables must be empty, or pass --reset to empty them), without the
restart fault. In the testproject (testproject/demo/handlers.py, the
chaos.* topics):

- ``--messages`` (50,000) messages over four topics, two handled by
  ``atomic=True`` handlers and two by ``atomic=False`` ones, enqueued in
  ``--waves`` waves while the faults go on. Every handling that succeeds
  writes a ledger row (demo.Handled). A ``--fail-rate`` share of the
  messages fail on chosen attempts, with an exception of each category
  (transient, dependency, permanent, business, unknown, Retry); a
  handler sleeps ``--work-ms`` on average (a ``--slow-rate`` share 50 to 300
  ms), so that faults find messages in flight.
- ``--workers`` (4) ``pgqueue_worker`` processes. Every ``--fault-interval``
  seconds one fault, in shuffled rounds of the ``--faults`` kinds: ``kill9``
  (SIGKILL to a random worker, replaced at once), ``sigterm`` (graceful stop
  of another, replaced), ``terminate`` (``pg_terminate_backend`` of every
  connection of a worker), ``restart`` (PostgreSQL itself, with
  ``pg_ctl -D <datadir> restart -m immediate``: a crash and recovery). The
  restart fault only ever restarts the cluster it is told about: either
  ``--throwaway-cluster`` (the soak creates a cluster of its own in a
  temporary directory, with benchmarks/harness/throwaway_pg.py, runs against it
  instead of DATABASE_URL and removes it at the end), or
  ``--restart-datadir`` naming the data directory of the server behind
  DATABASE_URL (checked against the server's ``data_directory``; as root,
  pg_ctl runs as the directory's owner). Without either, the default faults
  leave ``restart`` out.
- An invariant checked every ``--check-interval`` seconds during the run, in
  one snapshot per check: every message enqueued is in exactly one of the
  queue table, the dead letters, or done (absent from both, with a ledger
  row); a message of an atomic topic never has a ledger row while it is
  still in the queue or among the dead letters.

``--failover sync`` (or ``async``) runs the soak on a throwaway primary and
a streaming standby of it (synchronous or not), every process on a
multi-host DATABASE_URL (``target_session_attrs=read-write``), and mid-run
kills the primary (``kill -9`` of the postmaster and every child) and
promotes the standby; the other faults are left out unless ``--faults``
names some (``restart`` excluded), and the lease is 30 s unless ``--lease``
says otherwise, so that a message waiting for its lease shows. It reports
when the workers had connected again, when the first handling and every
message leased at the kill came back, and the enqueues lost in the window
(must be 0 with ``sync``; benchmarks/scenarios/chaos/failover.py).

At the end it prints (and writes with ``--json``): enqueued, done,
dead-lettered, lost (must be 0), handled twice for atomic handlers (must be
0), extra handlings for non-atomic ones (must not exceed the messages that
were leased to a worker when a fault hit it: ``exposed``), invariant
violations (must be 0), worker exits nobody caused (must be 0), the faults
injected by kind, wall time and throughput. The exit status is 0 only if
every one of those holds. The parts are in benchmarks/scenarios/chaos/.
"""

import argparse
import json
import os
import random
import tempfile
import time
from pathlib import Path

from benchmarks.harness import db, throwaway_pg
from benchmarks.scenarios.chaos import FAULT_KINDS, MAX_ATTEMPTS, log, with_retry
from benchmarks.scenarios.chaos.faults import Faults, Restarter
from benchmarks.scenarios.chaos.invariant import InvariantChecker
from benchmarks.scenarios.chaos.ledger import (
    empty_tables,
    enqueue_wave,
    final_counts,
    ok,
    queue_is_empty,
)
from benchmarks.scenarios.chaos.workers import Workers


def parse_args(argv):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--messages", type=int, default=50_000, help="messages enqueued in all")
    p.add_argument("--workers", type=int, default=4, help="worker processes at any time")
    p.add_argument("--concurrency", type=int, default=4, help="handler threads per worker")
    p.add_argument("--waves", type=int, default=10, help="the messages come in this many waves")
    p.add_argument("--wave-interval", type=float, default=2.0, help="seconds between waves")
    p.add_argument("--fault-interval", type=float, default=3.0, help="seconds between faults")
    p.add_argument(
        "--faults",
        default=None,
        help=f"comma-separated kinds to inject, of {','.join(FAULT_KINDS)} (default: all,"
        " restart only with --throwaway-cluster or --restart-datadir)",
    )
    p.add_argument(
        "--throwaway-cluster",
        action="store_true",
        help="create a PostgreSQL cluster of our own (initdb in a temporary directory, a free"
        " port), run against it instead of DATABASE_URL and restart it for the restart fault;"
        " removed at the end",
    )
    p.add_argument(
        "--restart-datadir",
        help="the restart fault restarts the cluster of this data directory, which must be the"
        " server behind DATABASE_URL (no other cluster is ever restarted)",
    )
    p.add_argument(
        "--pg-ctl",
        help="pg_ctl for --restart-datadir (default: that of the data directory's major version)",
    )
    p.add_argument(
        "--restart-log",
        default=os.devnull,
        help="the log file of the server that the restart fault starts again (pg_ctl -l)",
    )
    p.add_argument("--fail-rate", type=float, default=0.2, help="share of messages that fail")
    p.add_argument(
        "--work-ms",
        type=float,
        default=2.0,
        help="mean handler time, milliseconds (exponential), so that faults find work in flight",
    )
    p.add_argument("--slow-rate", type=float, default=0.02, help="share that sleep 50-300 ms")
    p.add_argument(
        "--lease",
        type=float,
        default=None,
        help="the workers' --lease, seconds (default 3, with --failover 30)",
    )
    p.add_argument(
        "--failover",
        choices=("sync", "async"),
        help="run on a throwaway primary and its synchronous or asynchronous standby, and fail"
        " over mid-run (kill -9 of the primary, the standby promoted)",
    )
    p.add_argument("--check-interval", type=float, default=0.5, help="invariant check, seconds")
    p.add_argument("--timeout", type=float, default=1800.0, help="give up after, seconds")
    p.add_argument("--seed", type=int, default=None, help="random seed (default: random)")
    p.add_argument("--reset", action="store_true", help="empty the queue tables first")
    p.add_argument("--json", help="write the result to this file")
    p.add_argument("--log-dir", help="worker logs (default: a new temporary directory)")
    args = p.parse_args(argv)
    if args.throwaway_cluster and args.restart_datadir:
        p.error("--throwaway-cluster and --restart-datadir exclude each other")
    if args.failover and (args.throwaway_cluster or args.restart_datadir):
        p.error("--failover makes its own clusters: no --throwaway-cluster, --restart-datadir")
    if args.lease is None:
        args.lease = 30.0 if args.failover else 3.0
    if args.failover and args.faults is None:
        args.faults = ""  # the failover alone
    if args.pg_ctl and not args.restart_datadir:
        p.error("--pg-ctl goes with --restart-datadir")
    can_restart = args.throwaway_cluster or args.restart_datadir
    if args.faults is None:
        args.faults = ",".join(k for k in FAULT_KINDS if k != "restart" or can_restart)
    faults = [f.strip() for f in args.faults.split(",") if f.strip()]
    unknown = sorted(set(faults) - set(FAULT_KINDS))
    if unknown:
        p.error(f"--faults: unknown kind(s) {', '.join(unknown)}; choose from {FAULT_KINDS}")
    args.faults = faults
    for name in ("messages", "workers", "concurrency", "waves"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1")
    if args.waves > args.messages:
        p.error("--waves must not exceed --messages")
    for name in ("wave_interval", "fault_interval", "lease", "check_interval", "timeout"):
        if not getattr(args, name) > 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    if args.work_ms < 0:
        p.error("--work-ms must not be negative")
    for name in ("fail_rate", "slow_rate"):
        if not 0 <= getattr(args, name) <= 1:
            p.error(f"--{name.replace('_', '-')} must be between 0 and 1")
    if "restart" in faults and args.failover:
        p.error("--failover: the restart fault would restart the primary it killed")
    if "restart" in faults and not can_restart:
        p.error(
            "--faults restart restarts only a cluster it is told about: pass"
            " --throwaway-cluster, or --restart-datadir with the data directory of"
            " DATABASE_URL's server; or leave restart out of --faults"
        )
    if args.restart_datadir:
        args.restart_datadir = os.path.realpath(args.restart_datadir)
        if not os.path.isfile(os.path.join(args.restart_datadir, "PG_VERSION")):
            p.error(f"--restart-datadir {args.restart_datadir}: not a PostgreSQL data directory")
        if args.pg_ctl is None:
            try:
                args.pg_ctl = os.path.join(
                    throwaway_pg.bindir_for_datadir(args.restart_datadir), "pg_ctl"
                )
            except throwaway_pg.ClusterError as exc:
                p.error(f"--restart-datadir: {exc}")
    return args


def setup_django():
    """This process's Django, on DATABASE_URL (the testproject's settings, DEBUG off
    unless the environment says otherwise)."""
    db.setup_django(
        {
            "DJANGO_SETTINGS_MODULE": os.environ.get(
                "DJANGO_SETTINGS_MODULE", "testproject.settings"
            ),
            "DEBUG": os.environ.get("DEBUG", "False"),
        }
    )


def dsn():
    from django.db import connection

    params = connection.settings_dict
    parts = {
        "dbname": params["NAME"],
        "user": params["USER"],
        "password": params["PASSWORD"],
        "host": params["HOST"],
        "port": params["PORT"],
        # Several hosts (--failover): the one that takes writes.
        "target_session_attrs": params["OPTIONS"].get("target_session_attrs"),
    }
    return " ".join(f"{k}='{v}'" for k, v in parts.items() if v)


def run(args, failover=None):
    from django.core.management import call_command
    from django.db import connection

    seed = args.seed if args.seed is not None else random.randrange(2**32)
    random.seed(seed)
    rng = random.Random(seed)
    restarter = None
    if args.restart_datadir:
        restarter = Restarter(args.restart_datadir, args.pg_ctl, args.restart_log)
        restarter.check_serves(connection)
    call_command("migrate", verbosity=0)
    if args.throwaway_cluster or failover is not None:
        call_command("migrate", database="other", verbosity=0)
    empty_tables(args.reset)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="pgqueue-chaos-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    log(
        f"chaos soak on {connection.settings_dict['NAME']!r}: {args.messages:,} messages,"
        f" {args.workers} workers, faults {','.join(args.faults) or 'none'}, seed {seed},"
        f" worker logs in {log_dir}"
    )
    pgqueue = {
        "MAX_ATTEMPTS": MAX_ATTEMPTS,
        "HEARTBEAT_INTERVAL": 1.0,
        "POLL_INTERVAL": 1.0,
        "BACKOFF_BASE": 0.05,
        "BACKOFF_CAP": 0.5,
    }
    workers = Workers(args, log_dir, pgqueue)
    if failover is not None:
        failover.live_workers = lambda: len(workers.live)
    faults = Faults(args.faults, workers, restarter)
    checker = InvariantChecker(dsn(), args.check_interval)
    checker.start()
    started = time.monotonic()
    deadline = started + args.timeout
    for _ in range(args.workers):
        workers.start()

    wave_sizes = [args.messages // args.waves] * args.waves
    wave_sizes[-1] += args.messages - sum(wave_sizes)
    enqueued = 0
    next_wave = started
    next_fault = started + args.fault_interval
    wave = 0
    timed_out = False
    while True:
        now = time.monotonic()
        if now > deadline:
            timed_out = True
            log("timed out")
            break
        workers.reap()
        if wave < args.waves and now >= next_wave:
            enqueued += enqueue_wave(wave, wave_sizes[wave], args, rng)
            log(f"wave {wave + 1}/{args.waves}: {enqueued:,} enqueued")
            wave += 1
            next_wave = now + args.wave_interval
        enqueuing = wave < args.waves
        pending = checker.pending
        # Faults go on while there is work; a round that has begun finishes.
        busy = enqueuing or pending is None or pending > 0
        if failover is not None:
            if not failover.performed and wave > args.waves // 2 and failover.busy():
                failover.perform()
                faults.exposed += len(failover.in_flight)
            with_retry(failover.measure, "measuring the failover")
        if now >= next_fault and (busy or faults.round):
            faults.inject()
            next_fault = time.monotonic() + args.fault_interval * random.uniform(0.7, 1.3)
        measured = failover is None or (failover.performed and failover.measured)
        if not enqueuing and not faults.round and pending == 0 and checker.checks and measured:
            if with_retry(queue_is_empty, "checking the queue"):
                break
        time.sleep(0.05)
    drained = time.monotonic()
    workers.stop_all()
    checker.stop()
    result = final_counts(args, seed, enqueued, drained - started, workers, faults, checker)
    result["timed_out"] = timed_out
    if failover is not None:
        result["failover"] = failover.result(enqueued)
    result["log_dir"] = str(log_dir)
    result["ok"] = ok(result)
    if failover is not None:
        # The failover happened; with a synchronous standby, it lost nothing.
        lost = result["failover"].get("enqueues_lost")
        result["ok"] = (
            result["ok"] and failover.performed and (not failover.synchronous or lost == 0)
        )
    return result


def report(result):
    faults = ", ".join(f"{kind} {n}" for kind, n in result["faults"].items()) or "none"
    categories = ", ".join(f"{c} {n}" for c, n in result["dead_letter_categories"].items())
    lines = [
        f"enqueued                    {result['enqueued']:,}",
        f"done                        {result['done']:,}",
        f"dead-lettered               {result['dead_lettered']:,} ({categories or '-'})",
        f"lost                        {result['lost']:,}  (must be 0)",
        f"still queued                {result['still_queued']:,}  (must be 0)",
        f"handled twice, atomic       {result['handled_twice_atomic']:,}  (must be 0)",
        f"extra handlings, non-atomic {result['extra_handlings_nonatomic']:,}"
        f"  (at most {result['exposed_in_flight']:,}: leased to workers when faults hit)",
        f"invariant checks            {result['invariant_checks']:,},"
        f" {len(result['invariant_violations'])} violation(s)",
        f"unexpected worker exits     {len(result['unexpected_worker_exits'])}",
        f"faults                      {faults} ({result['workers_started']} workers started)",
        f"wall time                   {result['seconds']:.1f} s,"
        f" {result['messages_per_s']:,.0f} messages/s",
        f"result                      {'PASS' if result['ok'] else 'FAIL'}",
    ]
    failover = result.get("failover")
    if failover and failover.get("performed"):
        lost = "must be 0" if failover["mode"] == "sync" else "the asynchronous window"
        lines[-1:-1] = [
            f"{'failover (' + failover['mode'] + ')':28}{failover['in_flight_at_kill']:,} leased"
            f" at the kill, promoted in {failover['kill_to_promoted_s']:.2f} s",
            f"  after the promotion         workers connected"
            f" {failover.get('promoted_to_workers_reconnected_s', '-')} s, first handled"
            f" {failover.get('promoted_to_first_handled_s', '-')} s, every leased message"
            f" back {failover.get('promoted_to_in_flight_back_s', '-')} s",
            f"  enqueues lost               {failover['enqueues_lost']:,}  ({lost})",
        ]
    print("\n".join(lines), flush=True)


def main(argv=None):
    args = parse_args(argv)
    cluster = None
    clusters = []
    failover = None
    if args.failover:
        from benchmarks.harness import replication
        from benchmarks.scenarios.chaos.failover import Failover

        primary = throwaway_pg.ThrowawayCluster.create(prefix="pgqueue-chaos-pg-")
        clusters.append(primary)
        for name in ("pgqueue_chaos", "pgqueue_chaos_other"):
            primary.create_database(name)
        standby = replication.make_standby(primary, synchronous=args.failover == "sync")
        clusters.append(standby)
        os.environ["DATABASE_URL"] = replication.multi_host_url(clusters, "pgqueue_chaos")
        os.environ["OTHER_DATABASE_URL"] = replication.multi_host_url(
            clusters, "pgqueue_chaos_other"
        )
        log(f"primary on port {primary.port}, {args.failover} standby on port {standby.port}")
    if args.throwaway_cluster:
        cluster = throwaway_pg.ThrowawayCluster.create(prefix="pgqueue-chaos-pg-")
        for name in ("pgqueue_chaos", "pgqueue_chaos_other"):
            cluster.create_database(name)
        # Ours and the workers' (they inherit the environment).
        os.environ["DATABASE_URL"] = cluster.url("pgqueue_chaos")
        os.environ["OTHER_DATABASE_URL"] = cluster.url("pgqueue_chaos_other")
        args.restart_datadir = str(cluster.datadir)
        args.pg_ctl = cluster.pg_ctl_path
        if args.restart_log == os.devnull:
            args.restart_log = str(cluster.log_path)
        log(f"throwaway cluster in {cluster.datadir}, port {cluster.port}")
    try:
        setup_django()
        if clusters:
            failover = Failover(clusters[0], clusters[1], args.failover == "sync")
        result = run(args, failover)
    finally:
        if cluster is not None or clusters:
            from django.db import connections

            connections.close_all()
        for made in [cluster, *reversed(clusters)]:
            if made is not None:
                made.close()
    report(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0 if result["ok"] else 1
