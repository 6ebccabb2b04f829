"""What an idle listening worker asks the database."""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass, field

from benchmarks.harness import db
from benchmarks.harness.pgstats import Statements, Stats, one_line, record_statements
from benchmarks.harness.worker import Bench, Combo, idle_statements_allowed, worker_options

# The design goal: at most one statement per poll interval.
GOAL_QUERIES_PER_POLL = 1


@dataclass
class IdleResult:
    poll_interval_s: float
    window_s: float  # the idle window, after start-up and settling
    lifetime_s: float  # the worker process, start to exit
    lifetime_transactions: int  # pg_stat_database delta over the worker's whole life
    startup_statements: int  # sampled before the window: start-up and settling
    window_statements: dict = field(default_factory=dict)  # role -> {query: count}
    main_loop_statements: int = 0  # in the window
    main_loop_statements_per_poll: float = 0.0
    main_loop_mean_gap_s: float | None = None  # between consecutive main-loop statements
    allowed_statements: int = 0  # one per poll: window / shortest jittered interval, + 1
    other_statements: int = 0  # in the window, heartbeat and listener
    sample_every_ms: float = 0.0
    peak_rss_mib: float = 0.0


def idle_cost(
    bench: Bench, stats: Stats, combo: Combo, poll_interval: float, window: float, settle: float
) -> IdleResult:
    """Count what an idle listening worker asks the database.

    The worker's backends are sampled in pg_stat_activity every few
    milliseconds from its start: each shows its latest statement and when it
    started, so every new (backend, query_start) is a statement (a lower
    bound: two statements between two samples count once). Statements whose
    query_start falls in the window are the idle cost. As a cross-check, the
    bench database's transaction counter is read before the worker starts
    and after its backends exited: a backend may keep its counters for up to
    10 s while it lives, so only the whole life is exact.
    """
    from django.db import connection

    db.truncate()
    for table in db.TABLES:  # so that autovacuum has no reason to visit during the window
        db.execute(f"VACUUM ANALYZE {table}")
    connection.close()  # a backend reports its pending counters when it exits
    stats.wait_no_clients(bench.dbname, timeout=10.0, workers=False)
    xacts_before = stats.transactions(bench.dbname)
    worker = bench.worker("idle", worker_options(*combo, "--poll-interval", str(poll_interval)))
    listener = f"pgqueue_listener#{worker.pid}"
    seen: Statements = {}
    window_start = window_end = None
    samples = 0
    deadline = time.monotonic() + 60
    while window_end is None or time.time() < window_end:
        backends = stats.worker_backends(bench.dbname, worker.pid)
        record_statements(seen, [(bpid, *rest) for bpid, rest in backends.items()])
        if window_start is None:
            if any(app == listener and state == "idle" for app, state, *_ in backends.values()):
                window_start = time.time() + settle
                window_end = window_start + window
            elif worker.poll() is not None or time.monotonic() > deadline:
                raise db.CheckFailed(f"idle worker did not start listening\n{worker.log_text()}")
        elif time.time() >= window_start:
            samples += 1
        time.sleep(0.005)
    worker.stop()
    worker.check_clean("idle worker (SIGTERM)")
    stats.wait_gone(bench.dbname, worker.pid)
    xacts = stats.transactions(bench.dbname) - xacts_before
    assert window_start is not None and window_end is not None
    return IdleResult(
        **classify(seen, listener, window_start, window_end, poll_interval, window),
        lifetime_s=worker.elapsed,
        lifetime_transactions=xacts,
        sample_every_ms=1000.0 * window / max(samples, 1),
        peak_rss_mib=worker.peak_rss_mib,
    )


def classify(
    seen: Statements,
    listener: str,
    window_start: float,
    window_end: float,
    poll_interval: float,
    window: float,
) -> dict:
    """The statements of the window by connection: the heartbeat's is the one
    that takes the maintenance lock; the listener's has its own
    application_name; the rest is the main loop's."""
    heartbeat = {
        bpid for (bpid, _), (_, query) in seen.items() if "pg_try_advisory_xact_lock" in query
    }
    lo = datetime.datetime.fromtimestamp(window_start, datetime.UTC)
    hi = datetime.datetime.fromtimestamp(window_end, datetime.UTC)
    by_role: dict[str, dict[str, int]] = {}
    main = other = before = 0
    main_starts = []
    for (bpid, start), (app, query) in seen.items():
        if start < lo:
            before += 1
            continue
        if start >= hi:
            continue
        if app == listener:
            role = "listener"
        elif bpid in heartbeat:
            role = "heartbeat"
        else:
            role = "main loop"
        if role == "main loop":
            main += 1
            main_starts.append(start)
        else:
            other += 1
        queries = by_role.setdefault(role, {})
        text = one_line(query, 70)
        queries[text] = queries.get(text, 0) + 1
    return {
        "poll_interval_s": poll_interval,
        "window_s": window,
        "startup_statements": before,
        "window_statements": by_role,
        "main_loop_statements": main,
        "main_loop_statements_per_poll": main * poll_interval / window,
        "main_loop_mean_gap_s": (
            (max(main_starts) - min(main_starts)).total_seconds() / (len(main_starts) - 1)
            if len(main_starts) > 1
            else None
        ),
        "allowed_statements": idle_statements_allowed(window, poll_interval),
        "other_statements": other,
    }
