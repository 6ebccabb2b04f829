#!/usr/bin/env python
"""Scale benchmark: one worker with a million delayed messages and a million
dead letters in the tables, and one worker's memory over a million messages.

Runs against a database of its own (default ``pgqueue_bench_scale``, created
and migrated if missing, emptied by every run), never the developer's. See
benchmarks/README.md ("scale.py") for what is measured and how to read it.

    .venv/bin/python benchmarks/scale.py [--json out.json] [--skip memory]
"""

import argparse
import datetime
import json
import os
import platform
import re
import shlex
import signal
import socket
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))
import throughput as tp  # noqa: E402  (the helpers of the one-worker benchmark)

DEFAULT_URL = "postgres://postgres@127.0.0.1:5432/pgqueue_bench_scale"
MESSAGE_TABLE = "django_pgqueue_message"
DEADLETTER_TABLE = "django_pgqueue_deadletter"
PARTIAL_INDEXES = ("pgqueue_msg_claim_idx", "pgqueue_msg_due_idx")
PKEY_INDEX = f"{MESSAGE_TABLE}_pkey"
QUEUE = "default"  # the queue the bench messages go to and the worker drains
CLAIM_WORKER_ID = "bench-scale"
CLAIM_LEASE_SECONDS = 60
# --subscriptions none: the testproject's stream subscribers are the test
# suite's; a project without any runs no stream thread.
DEFAULT_WORKER_ARGS = "--concurrency 4 --batch-size 100 --subscriptions none"
TOPICS = (("nonatomic", tp.TOPIC_NONATOMIC, False), ("atomic", tp.TOPIC_ATOMIC, True))
# The baseline is measured again after the loaded state (the load removed):
# on a shared machine, the difference between the two is the noise floor.
STATES = ("baseline", "loaded", "baseline2")
BASELINES = ("baseline", "baseline2")

# Statements of a claim that are transaction control, not the claim itself,
# alone or leading a string of several statements ("SET LOCAL ...; UPDATE ...").
CONTROL = re.compile(r"^\s*(SAVEPOINT|RELEASE|ROLLBACK|BEGIN|COMMIT|SET)\b", re.IGNORECASE)
LEADING_CONTROL = re.compile(
    r"^\s*(?:(?:SAVEPOINT|RELEASE|ROLLBACK|BEGIN|COMMIT|SET)\b[^;%]*;\s*)+", re.IGNORECASE
)
MAIN_VERB = re.compile(r"^\s*(?:WITH\b.*?\)\s*)?(SELECT|UPDATE|DELETE|INSERT)\b", re.I | re.S)

CLK_TCK = os.sysconf("SC_CLK_TCK")


# --- small helpers -----------------------------------------------------------------------


def execute(statement, params=None):
    return tp.execute(statement, params)


def scalar(statement, params=None):
    return execute(statement, params)[0][0]


def fmt_ratio(value):
    return "-" if value is None else f"{value:.3f}"


def fmt_ms(value):
    return "-" if value is None else f"{value:.3f}"


def fmt_percent(value):
    return "-" if value is None else f"{value:.0f}"


def mib(n_bytes):
    return n_bytes / 1024.0 / 1024.0


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def load_average():
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return None


def proc_status(pid):
    """(VmRSS, VmHWM) of ``pid`` in KiB, or None once it is gone."""
    rss = hwm = None
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    rss = int(line.split()[1])
                elif line.startswith("VmHWM:"):
                    hwm = int(line.split()[1])
    except (OSError, ValueError):
        return None
    return rss, hwm


def proc_cpu_seconds(pid):
    """User plus system CPU seconds of ``pid`` so far (all its threads), or None."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()  # after "pid (comm)"; utime, stime are 14, 15
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_claim_limit(worker_args):
    """What an idle worker with these options asks one claim for:
    min(--concurrency, --batch-size), the command's defaults being 4 and = concurrency."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=None)
    known, _ = parser.parse_known_args(worker_args)
    return min(known.concurrency, known.batch_size or known.concurrency)


# --- Prometheus metrics of a worker ------------------------------------------------------


def scrape(port):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=10) as response:
        return response.read().decode()


def histogram_quantile(buckets, q):
    """Like PromQL's histogram_quantile: linear inside the bucket the rank falls in.
    ``buckets``: [(upper bound, cumulative count)]. None without observations."""
    buckets = sorted(buckets)
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    prev_le, prev_count = 0.0, 0.0
    for le, cumulative in buckets:
        if cumulative >= rank:
            if le == float("inf"):
                return prev_le  # beyond the last finite bound: a lower bound
            if cumulative == prev_count:
                return le
            return prev_le + (le - prev_le) * (rank - prev_count) / (cumulative - prev_count)
        prev_le, prev_count = le, cumulative
    return prev_le


def worker_metrics(text):
    """The claim figures and message counters of one scrape."""
    from prometheus_client.parser import text_string_to_metric_families

    claim_buckets, batch = [], {}
    claim_sum = claim_count = 0.0
    messages = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name, labels, value = sample.name, sample.labels, sample.value
            if name == "pgqueue_worker_claim_duration_seconds_bucket":
                claim_buckets.append((float(labels["le"]), value))
            elif name == "pgqueue_worker_claim_duration_seconds_sum":
                claim_sum = value
            elif name == "pgqueue_worker_claim_duration_seconds_count":
                claim_count = value
            elif name == "pgqueue_worker_claim_batch_size_sum":
                batch["sum"] = value
            elif name == "pgqueue_worker_claim_batch_size_count":
                batch["count"] = value
            elif name == "pgqueue_worker_messages_total":
                key = f"{labels.get('topic')}/{labels.get('outcome')}"
                messages[key] = messages.get(key, 0) + value
    return {
        "claims": int(claim_count),
        "claim_mean_ms": 1000.0 * claim_sum / claim_count if claim_count else None,
        "claim_p50_ms": _ms(histogram_quantile(claim_buckets, 0.50)),
        "claim_p99_ms": _ms(histogram_quantile(claim_buckets, 0.99)),
        "claim_batch_mean": batch["sum"] / batch["count"] if batch.get("count") else None,
        "messages_total": messages,
    }


def _ms(seconds):
    return None if seconds is None else 1000.0 * seconds


# --- 1. the worker draining N messages ---------------------------------------------------


@dataclass
class DrainRun:
    state: str
    topic: str
    atomic: bool
    messages: int
    enqueue_per_s: float  # enqueue_many(), one statement
    drain_s: float  # first message claimed to the last one acknowledged, seen in the database
    jobs_per_s: float  # messages / drain_s
    start_to_empty_s: float  # worker process start to the queue empty (start-up included)
    worker_cpu_percent: float | None  # during the drain, of one core
    machine_busy_percent: float | None  # all cores, during the drain
    claims: int | None  # the worker's claim histogram, scraped once the queue was empty
    claim_mean_ms: float | None
    claim_p50_ms: float | None  # estimated from the histogram buckets
    claim_p99_ms: float | None
    claim_batch_mean: float | None
    handled_by_metrics: float | None  # pgqueue_worker_messages_total, outcome done
    peak_rss_mib: float
    worker_warnings: int
    round: int | None = None  # --in-turn: the round (its baseline and loaded pass are a pair)


class Drain:
    """Watches the bench messages (an id range, read through the primary key,
    whatever else the table holds) every few milliseconds: when the first is
    claimed and when none is left. Reads the machine's and the worker's CPU
    time at both moments."""

    def __init__(self, url, first_id, last_id, pid, interval=0.005):
        self.conn = psycopg.connect(url, autocommit=True)
        self.first_id, self.last_id, self.pid = first_id, last_id, pid
        self.interval = interval
        self.first_claim = self.empty = None
        self.cpu = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="drain-watch", daemon=True)

    def start(self):
        self._thread.start()

    def _mark(self, what):
        self.cpu[what] = (tp.cpu_times(), proc_cpu_seconds(self.pid))
        return time.perf_counter()

    def _run(self):
        first = f"SELECT status FROM {MESSAGE_TABLE} WHERE id = %s"
        left = f"SELECT EXISTS (SELECT 1 FROM {MESSAGE_TABLE} WHERE id BETWEEN %s AND %s)"
        while not self._stop.is_set() and self.empty is None:
            if self.first_claim is None:
                row = self.conn.execute(first, [self.first_id]).fetchone()
                if row is None or row[0] != "waiting":
                    self.first_claim = self._mark("first")
            elif not self.conn.execute(left, [self.first_id, self.last_id]).fetchone()[0]:
                self.empty = self._mark("empty")
            self._stop.wait(self.interval)

    def stop(self):
        self._stop.set()
        self._thread.join()
        self.conn.close()

    def worker_cpu_percent(self):
        a, b = self.cpu.get("first", (None, None))[1], self.cpu.get("empty", (None, None))[1]
        if a is None or b is None or not self.empty or self.empty <= self.first_claim:
            return None
        return 100.0 * (b - a) / (self.empty - self.first_claim)

    def machine_busy_percent(self):
        return tp.busy_percent(self.cpu.get("first", (None,))[0], self.cpu.get("empty", (None,))[0])


def delete_bench_rows():
    execute(f"DELETE FROM {MESSAGE_TABLE} WHERE topic LIKE 'bench.%%'")


def drain_run(ctx, state, topic, atomic, n, index):
    from django_pgqueue import enqueue_many

    delete_bench_rows()
    before = scalar(f"SELECT coalesce(max(id), 0) FROM {MESSAGE_TABLE}")
    dead_before = scalar(f"SELECT coalesce(max(id), 0) FROM {DEADLETTER_TABLE}")
    items = [{"payload": {"n": i}} for i in range(n)]
    started = time.perf_counter()
    enqueue_many(items, topic=topic, queue=QUEUE)
    enqueue_s = time.perf_counter() - started
    first_id, last_id, written = execute(
        f"SELECT min(id), max(id), count(*) FROM {MESSAGE_TABLE} WHERE id > %s", [before]
    )[0]
    if written != n:
        raise tp.CheckFailed(f"enqueue_many wrote {written} rows, not {n}")
    execute(f"VACUUM ANALYZE {MESSAGE_TABLE}")

    name = f"{state}-{topic}-{index}"
    port = free_port() if ctx.metrics else None
    options = list(ctx.worker_args)
    if port:
        options += ["--metrics-port", str(port), "--http-host", "127.0.0.1"]
    worker = tp.WorkerProcess(ctx.env, ctx.log_dir, name, options)
    watch = Drain(ctx.url, first_id, last_id, worker.pid)
    watch.start()
    metrics = {}
    try:
        deadline = time.monotonic() + max(120.0, n / 200.0)
        while watch.empty is None:
            if worker.proc.poll() is not None:
                raise tp.CheckFailed(
                    f"{name}: the worker exited {worker.proc.returncode} before the queue was"
                    f" empty\n{tp.tail(worker.log_text())}"
                )
            if time.monotonic() > deadline:
                raise tp.CheckFailed(f"{name}: the queue was not empty after {n / 200.0:.0f} s")
            time.sleep(0.02)
        if port:
            metrics = worker_metrics(scrape(port))
    finally:
        watch.stop()
    worker.terminate()
    warnings = worker.check_clean(f"{name} (SIGTERM)")
    dead_after = scalar(f"SELECT coalesce(max(id), 0) FROM {DEADLETTER_TABLE}")
    if dead_after != dead_before:
        raise tp.CheckFailed(f"{name}: {dead_after - dead_before} new dead letter(s)")
    if watch.first_claim is None:
        raise tp.CheckFailed(f"{name}: the watch did not see the first claim")
    drain_s = watch.empty - watch.first_claim
    handled = metrics.get("messages_total", {}).get(f"{topic}/done")
    if port and handled != n:
        raise tp.CheckFailed(f"{name}: the worker's metrics count {handled} handled, not {n}")
    return DrainRun(
        state=state,
        topic=topic,
        atomic=atomic,
        messages=n,
        enqueue_per_s=n / enqueue_s,
        drain_s=drain_s,
        jobs_per_s=n / drain_s,
        start_to_empty_s=watch.empty - worker.started,
        worker_cpu_percent=watch.worker_cpu_percent(),
        machine_busy_percent=watch.machine_busy_percent(),
        claims=metrics.get("claims"),
        claim_mean_ms=metrics.get("claim_mean_ms"),
        claim_p50_ms=metrics.get("claim_p50_ms"),
        claim_p99_ms=metrics.get("claim_p99_ms"),
        claim_batch_mean=metrics.get("claim_batch_mean"),
        handled_by_metrics=handled,
        peak_rss_mib=worker.peak_rss_mib,
        worker_warnings=warnings,
    )


# --- 2. the claim in-process: latency and plan -------------------------------------------


def insert_ready(n, topic=tp.TOPIC_NONATOMIC):
    """``n`` ready messages in QUEUE by plain SQL (every other column is its db_default)."""
    execute(
        f"INSERT INTO {MESSAGE_TABLE} (queue, topic, payload)"
        " SELECT %s, %s, jsonb_build_object('n', i) FROM generate_series(1, %s) AS i",
        [QUEUE, topic, n],
    )


def queue_connection():
    from django.db import connections

    from django_pgqueue import conf

    return connections[conf.get("DATABASE")]


class _Undo(Exception):
    pass


def capture_claim(limit, few_ready=False):
    """The statements one ``lifecycle.claim`` runs now, captured through Django's
    execute_wrapper inside a transaction that is rolled back (nothing changes).
    Returns ([(sql, params)], number of messages it would have claimed)."""
    from django.db import transaction

    from django_pgqueue import lifecycle

    conn = queue_connection()
    captured, got = [], []

    def wrapper(execute, sql, params, many, context):
        captured.append((sql, params, many))
        return execute(sql, params, many, context)

    with conn.execute_wrapper(wrapper):
        try:
            with transaction.atomic(using=conn.alias):
                got = lifecycle.claim(
                    [QUEUE], limit, CLAIM_WORKER_ID, CLAIM_LEASE_SECONDS, few_ready=few_ready
                )
                raise _Undo
        except _Undo:
            pass
    statements = []
    for sql, params, many in captured:
        sql = LEADING_CONTROL.sub("", sql)  # EXPLAIN takes one statement
        if not many and sql.strip() and not CONTROL.match(sql) and MESSAGE_TABLE in sql:
            statements.append((sql, params))
    if not statements:
        raise tp.CheckFailed("could not capture the claim's statements (see capture_claim)")
    return statements, len(got)


def _plan_nodes(node):
    yield node
    for child in node.get("Plans", ()):
        yield from _plan_nodes(child)


def explain(statements):
    """EXPLAIN (ANALYZE, BUFFERS) of the claim's statements, in order, in a
    transaction that is rolled back. Returns one summary per statement."""
    from django.db import transaction

    conn = queue_connection()
    outputs = {}
    for fmt in ("JSON", "TEXT"):
        rows = []
        with transaction.atomic(using=conn.alias):
            with conn.cursor() as cursor:
                for sql, params in statements:
                    cursor.execute(f"EXPLAIN (ANALYZE, BUFFERS, FORMAT {fmt}) {sql}", params)
                    rows.append(cursor.fetchall())
            transaction.set_rollback(True, using=conn.alias)
        outputs[fmt] = rows
    summaries = []
    for (sql, _), json_rows, text_rows in zip(
        statements, outputs["JSON"], outputs["TEXT"], strict=True
    ):
        doc = json_rows[0][0]
        doc = json.loads(doc) if isinstance(doc, str) else doc
        top = doc[0]
        nodes = list(_plan_nodes(top["Plan"]))
        words = sql.split()
        verb = MAIN_VERB.match(sql)
        kind = (verb.group(1).upper() if verb else words[0].upper()) + (
            " ... FOR UPDATE" if "FOR UPDATE" in sql.upper() else ""
        )
        summaries.append(
            {
                "statement": kind,
                "sql": " ".join(words),
                "indexes": sorted({n["Index Name"] for n in nodes if "Index Name" in n}),
                "seq_scans": sorted(
                    {n.get("Relation Name", "?") for n in nodes if n["Node Type"] == "Seq Scan"}
                ),
                "shared_hit": top["Plan"].get("Shared Hit Blocks", 0),
                "shared_read": top["Plan"].get("Shared Read Blocks", 0),
                "rows": top["Plan"].get("Actual Rows"),
                "execution_ms": top.get("Execution Time"),
                "planning_ms": top.get("Planning Time"),
                "text": "\n".join(row[0] for row in text_rows),
            }
        )
    return summaries


def plan_verdict(summaries):
    """Uses a partial index of the claim, and no sequential scan of the message table."""
    indexes = {i for s in summaries for i in s["indexes"]}
    seq = {t for s in summaries for t in s["seq_scans"]}
    return bool(indexes & set(PARTIAL_INDEXES)) and MESSAGE_TABLE not in seq


@dataclass
class ClaimScenario:
    state: str
    scenario: str
    description: str
    limit: int  # what each claim asks for
    ready: int  # ready bench messages when each claim starts
    calls: int
    p50_ms: float
    p99_ms: float
    mean_ms: float
    max_ms: float
    plan_indexes: list = field(default_factory=list)  # of the claim's statements
    plan_buffers: int = 0  # shared hit + read, all of the claim's statements
    plan_uses_partial_index: bool = False
    plan_execution_ms: float = 0.0
    plans: list = field(default_factory=list)
    times_ms: list = field(default_factory=list)
    round: int | None = None  # as DrainRun.round
    # pg_prepared_statements of the claim's statement after the calls: how
    # often PostgreSQL ran its generic plan and how often it planned anew
    generic_plans: int | None = None
    custom_plans: int | None = None


def claim_scenarios(ctx, state):
    """lifecycle.claim() timed in this process, in four situations:

    full   - a backlog of ready messages (stats analysed with it there): claims
             of --claim-batch, each returning that many; acknowledged (deleted)
             untimed between calls.
    sparse-busy-stats - one ready message per claim, asking for the worker's
             claim size, with the planner statistics still those of the backlog
             (ANALYZE ran while it was there, as after a burst, before
             autovacuum comes by).
    sparse - the same after ANALYZE of the quiet queue.
    empty  - nothing ready.
    The last three claim with few_ready=True, as the worker does after a
    claim that came back short.
    """
    from django_pgqueue import lifecycle

    batch, small = ctx.claim_batch, ctx.claim_limit
    results = []

    def measure(scenario, description, limit, ready, setup_each=None, few_ready=False):
        # A claim of few is a fraction of a millisecond: more of them, or a
        # hiccup of the machine weighs on the median of a few dozen ms.
        calls = ctx.sparse_claim_calls if few_ready else ctx.claim_calls
        statements, would = capture_claim(limit, few_ready)
        if would != min(limit, ready):
            raise tp.CheckFailed(
                f"{state}/{scenario}: the claim would take {would} message(s), "
                f"expected {min(limit, ready)}"
            )
        summaries = explain(statements)
        times = []
        before = prepared_claim_plans()
        for _ in range(calls):
            if setup_each:
                setup_each()
            started = time.perf_counter()
            messages = lifecycle.claim(
                [QUEUE], limit, CLAIM_WORKER_ID, CLAIM_LEASE_SECONDS, few_ready=few_ready
            )
            times.append(1000.0 * (time.perf_counter() - started))
            if len(messages) != min(limit, ready):
                raise tp.CheckFailed(
                    f"{state}/{scenario}: a claim returned {len(messages)}, "
                    f"expected {min(limit, ready)}"
                )
            if messages:
                execute(
                    f"DELETE FROM {MESSAGE_TABLE} WHERE id = ANY(%s)", [[m.pk for m in messages]]
                )
        after = prepared_claim_plans()
        plan_counts = [a - b for a, b in zip(after, before, strict=True)]
        result = ClaimScenario(
            state=state,
            scenario=scenario,
            description=description,
            limit=limit,
            ready=ready,
            calls=calls,
            p50_ms=tp.percentile(times, 50),
            p99_ms=tp.percentile(times, 99),
            mean_ms=statistics.fmean(times),
            max_ms=max(times),
            plan_indexes=sorted({i for s in summaries for i in s["indexes"]}),
            plan_buffers=sum(s["shared_hit"] + s["shared_read"] for s in summaries),
            plan_uses_partial_index=plan_verdict(summaries),
            plan_execution_ms=sum(s["execution_ms"] or 0 for s in summaries),
            plans=summaries,
            times_ms=[round(t, 4) for t in times],
            generic_plans=plan_counts[0],
            custom_plans=plan_counts[1],
        )
        results.append(result)
        print(
            f"  {state:8} claim {scenario:18} p50 {result.p50_ms:7.3f} ms  p99"
            f" {result.p99_ms:7.3f} ms  {result.plan_buffers:6} buffers"
            f"  {','.join(result.plan_indexes)}  generic/custom plans"
            f" {result.generic_plans}/{result.custom_plans}",
            file=sys.stderr,
        )

    backlog = ctx.claim_calls * batch
    delete_bench_rows()
    insert_ready(backlog)
    execute(f"VACUUM ANALYZE {MESSAGE_TABLE}")  # statistics with the backlog in them
    measure("full", f"{batch} of a backlog of {backlog:,}", batch, backlog)

    execute(f"VACUUM {MESSAGE_TABLE}")  # the dead rows go, the statistics stay
    insert_ready(1)
    measure(
        "sparse-busy-stats",
        f"1 ready, asks {small}; statistics from the backlog",
        small,
        1,
        setup_each=_first_call_skipped(lambda: insert_ready(1)),
        few_ready=True,
    )

    execute(f"VACUUM ANALYZE {MESSAGE_TABLE}")  # statistics of the quiet queue
    insert_ready(1)
    measure(
        "sparse",
        f"1 ready, asks {small}; statistics of the quiet queue",
        small,
        1,
        setup_each=_first_call_skipped(lambda: insert_ready(1)),
        few_ready=True,
    )
    measure("empty", f"nothing ready, asks {small}", small, 0, few_ready=True)
    delete_bench_rows()
    return results


def prepared_claim_plans():
    """(generic_plans, custom_plans) summed over the claim statements this
    connection has prepared (psycopg prepares one after prepare_threshold
    calls): the difference across the timed calls tells how often PostgreSQL
    ran a cached generic plan and how often it planned the claim anew."""
    with queue_connection().cursor() as cursor:
        cursor.execute(
            "SELECT coalesce(sum(generic_plans), 0), coalesce(sum(custom_plans), 0)"
            " FROM pg_prepared_statements WHERE statement LIKE %s",
            [f"%UPDATE %{MESSAGE_TABLE}% AS m SET status = 'processing'%"],
        )
        return tuple(int(n) for n in cursor.fetchone())


def _first_call_skipped(fn):
    """A setup for every claim but the first (whose message is already there)."""
    calls = [0]

    def setup():
        if calls[0]:
            fn()
        calls[0] += 1

    return setup


# --- the loaded state ----------------------------------------------------------------------

TRACEBACK = (
    "Traceback (most recent call last):\\n"
    '  File "/srv/app/.venv/lib/python3.11/site-packages/django_pgqueue/worker.py",'
    " line 312, in _run\\n    result = spec.func(message)\\n"
    '  File "/srv/app/orders/handlers.py", line 42, in import_row\\n'
    "    row = parse_row(message.payload)\\n"
    '  File "/srv/app/orders/parsing.py", line 17, in parse_row\\n'
    '    raise ValueError(f"cannot process item {n}")\\n'
    "ValueError: cannot process item "
)


def fill_delayed(first, last, priorities):
    """Messages first..last, due in one to two days: half in QUEUE, a quarter each
    in two other queues; ten topics; every fourth a retry (attempts, last error)
    and every fourth with a dedup key."""
    execute(
        f"""
        INSERT INTO {MESSAGE_TABLE} (queue, topic, payload, headers, priority, run_at,
            attempts, last_error, last_error_category, first_failed_at, dedup_key)
        SELECT (ARRAY[%s, %s, 'reports', 'emails'])[1 + i %% 4],
            'scale.delayed.' || (i %% 10),
            jsonb_build_object('n', i, 'customer_id', 100000 + i %% 50000,
                               'note', 'scheduled reminder ' || i),
            jsonb_build_object('correlation_id', md5(i::text)),
            (%s::int[])[1 + i %% cardinality(%s::int[])],
            now() + interval '1 day' + (i %% 86400) * interval '1 second',
            CASE WHEN i %% 4 = 0 THEN 2 ELSE 0 END,
            CASE WHEN i %% 4 = 0 THEN 'ConnectionError: payment service unreachable'
                 ELSE '' END,
            CASE WHEN i %% 4 = 0 THEN 'transient' ELSE '' END,
            CASE WHEN i %% 4 = 0 THEN now() - interval '5 minutes' END,
            CASE WHEN i %% 4 = 1 THEN 'reminder-' || i END
        FROM generate_series(%s, %s) AS i
        """,
        [QUEUE, QUEUE, priorities, priorities, first, last],
    )


def fill_dead_letters(first, last):
    """Dead letters first..last: three queues, twenty topics, the five categories,
    60% new / 10% revived / 30% resolved, dead-lettered over the last 30 days,
    each with a reason and a traceback of about 500 bytes."""
    execute(
        f"""
        INSERT INTO {DEADLETTER_TABLE} (message_id, queue, topic, payload, headers, priority,
            category, reason, traceback, attempts, max_attempts, first_failed_at,
            last_failed_at, dead_lettered_at, worker, state, revived_at, revive_count,
            revived_by, resolved_at, resolved_by, notes)
        SELECT 100000000 + i,
            (ARRAY[%s, 'reports', 'emails'])[1 + i %% 3],
            'scale.dead.' || (i %% 20),
            jsonb_build_object('n', i, 'order_id', 1000000 + i, 'sku', 'SKU-' || (i %% 9973)),
            jsonb_build_object('correlation_id', md5(i::text)),
            0,
            (ARRAY['transient', 'dependency', 'permanent', 'business', 'unknown'])[1 + i %% 5],
            'ValueError: cannot process item ' || i,
            E'{TRACEBACK}' || i,
            5, 5,
            t - interval '1 hour', t, t,
            'worker-' || (i %% 8) || ':4242:0f0f0f0f',
            CASE WHEN i %% 10 < 6 THEN 'new' WHEN i %% 10 = 6 THEN 'revived' ELSE 'resolved' END,
            CASE WHEN i %% 10 = 6 THEN t + interval '1 hour' END,
            CASE WHEN i %% 10 = 6 THEN 1 ELSE 0 END,
            CASE WHEN i %% 10 = 6 THEN 'admin' ELSE '' END,
            CASE WHEN i %% 10 >= 7 THEN t + interval '2 hours' END,
            CASE WHEN i %% 10 >= 7 THEN 'admin' ELSE '' END,
            CASE WHEN i %% 10 >= 7 THEN 'duplicate order, refunded by hand' ELSE '' END
        FROM generate_series(%s, %s) AS i,
            LATERAL (SELECT now() - (i %% 2592000) * interval '1 second' AS t) AS ts
        """,
        [QUEUE, first, last],
    )


def chunked(fill, total, chunk, what):
    done = 0
    while done < total:
        upto = min(total, done + chunk)
        fill(done + 1, upto)
        done = upto
        print(f"  {what}: {done:,} / {total:,}", file=sys.stderr)


def table_sizes():
    out = {}
    for table in (MESSAGE_TABLE, DEADLETTER_TABLE):
        total, heap, indexes = execute(
            "SELECT pg_total_relation_size(%s::regclass), pg_relation_size(%s::regclass),"
            " pg_indexes_size(%s::regclass)",
            [table, table, table],
        )[0]
        out[table] = {
            "rows": scalar(f"SELECT count(*) FROM {table}"),
            "total_bytes": total,
            "heap_bytes": heap,
            "indexes_bytes": indexes,
            "index_bytes": dict(
                execute(
                    "SELECT indexrelid::regclass::text, pg_relation_size(indexrelid)"
                    " FROM pg_index WHERE indrelid = %s::regclass ORDER BY 1",
                    [table],
                )
            ),
        }
    return out


def fill_loaded(delayed, dead, priorities, chunk=250_000):
    started = time.perf_counter()
    chunked(lambda a, b: fill_delayed(a, b, priorities), delayed, chunk, "delayed messages")
    messages_s = time.perf_counter() - started
    t = time.perf_counter()
    chunked(fill_dead_letters, dead, chunk, "dead letters")
    dead_s = time.perf_counter() - t
    t = time.perf_counter()
    execute(f"VACUUM ANALYZE {MESSAGE_TABLE}")
    execute(f"VACUUM ANALYZE {DEADLETTER_TABLE}")
    vacuum_s = time.perf_counter() - t
    return {
        "delayed_messages": delayed,
        "dead_letters": dead,
        "delayed_priorities": priorities,
        "messages_s": messages_s,
        "dead_letters_s": dead_s,
        "vacuum_analyze_s": vacuum_s,
        "total_s": time.perf_counter() - started,
        "sizes": table_sizes(),
    }


# --- 3. memory over a million messages -----------------------------------------------------


def claim_after_churn(limit):
    """The claim of one new message right after the run (every handled message
    left a dead entry at the head of the claim index), then after VACUUM
    ANALYZE (what autovacuum would have done meanwhile)."""
    insert_ready(1)
    out = {}
    for when in ("before_vacuum", "after_vacuum"):
        if when == "after_vacuum":
            started = time.perf_counter()
            execute(f"VACUUM ANALYZE {MESSAGE_TABLE}")
            out["vacuum_s"] = time.perf_counter() - started
        statements, _ = capture_claim(limit)
        summaries = explain(statements)
        out[when] = {
            "buffers": sum(s["shared_hit"] + s["shared_read"] for s in summaries),
            "execution_ms": sum(s["execution_ms"] or 0 for s in summaries),
            "indexes": sorted({i for s in summaries for i in s["indexes"]}),
        }
    delete_bench_rows()
    return out


def memory_run(ctx, n, interval, chunk=100_000):
    """One worker (the same options, not --burst) handles ``n`` bench.noop_nonatomic
    messages enqueued beforehand; its RSS and the number handled are sampled
    every ``interval`` seconds. Handled = the lowest id left - the first id (the
    claim takes messages in id order; off by at most the messages in flight)."""
    tp.truncate()
    started = time.perf_counter()

    def fill(first, last):
        execute(
            f"INSERT INTO {MESSAGE_TABLE} (queue, topic, payload)"
            " SELECT %s, %s, jsonb_build_object('n', i) FROM generate_series(%s, %s) AS i",
            [QUEUE, tp.TOPIC_NONATOMIC, first, last],
        )

    chunked(fill, n, chunk, "memory run messages")
    fill_s = time.perf_counter() - started
    execute(f"VACUUM ANALYZE {MESSAGE_TABLE}")
    execute("CHECKPOINT")
    first_id = scalar(f"SELECT min(id) FROM {MESSAGE_TABLE}")
    worker = tp.WorkerProcess(ctx.env, ctx.log_dir, "memory", list(ctx.worker_args))
    conn = psycopg.connect(ctx.url, autocommit=True)
    samples = []  # (seconds since start, handled, rss KiB, hwm KiB)
    deadline = time.monotonic() + max(600.0, n / 200.0)
    try:
        while True:
            status = proc_status(worker.pid)
            low = conn.execute(f"SELECT min(id) FROM {MESSAGE_TABLE}").fetchone()[0]
            if status is None or worker.proc.poll() is not None:
                raise tp.CheckFailed(
                    f"memory run: the worker exited early\n{tp.tail(worker.log_text())}"
                )
            handled = n if low is None else low - first_id
            samples.append((time.perf_counter() - worker.started, handled, *status))
            if low is None:
                break
            if time.monotonic() > deadline:
                raise tp.CheckFailed(f"memory run: {n - handled} messages left after the deadline")
            time.sleep(interval)
    finally:
        conn.close()
    worker.terminate()
    warnings = worker.check_clean("memory run (SIGTERM)")
    if scalar(f"SELECT count(*) FROM {DEADLETTER_TABLE}"):
        raise tp.CheckFailed("memory run: dead letters exist")
    after = claim_after_churn(ctx.claim_limit)

    def at(k):
        """The first sample with at least k handled."""
        return next((s for s in samples if s[1] >= k), None)

    first_work = next((s for s in samples if s[1] > 0), samples[-1])
    marks = sorted({10_000, 100_000, n // 4, n // 2, (3 * n) // 4, n} - {0})
    rss_at = {}
    for k in marks:
        s = at(k)
        if s:
            rss_at[k] = {"handled": s[1], "seconds": s[0], "rss_mib": s[2] / 1024.0}
    after_10k = [s for s in samples if s[1] >= 10_000]
    # throughput over consecutive tenths of the run
    rates = []
    step = max(1, n // 10)
    prev = first_work
    for k in range(step, n + 1, step):
        s = at(k)
        if s and s[0] > prev[0]:
            rates.append({"upto": k, "jobs_per_s": (s[1] - prev[1]) / (s[0] - prev[0])})
            prev = s
    end = samples[-1]
    return {
        "messages": n,
        "fill_s": fill_s,
        "sample_interval_s": interval,
        "samples": len(samples),
        "seconds": end[0],
        "drain_s": end[0] - first_work[0],
        "jobs_per_s": n / (end[0] - first_work[0]) if end[0] > first_work[0] else None,
        "rss_at": {str(k): v for k, v in rss_at.items()},
        "rss_10k_mib": rss_at.get(10_000, {}).get("rss_mib"),
        "rss_end_mib": end[2] / 1024.0,
        "rss_max_after_10k_mib": max(s[2] for s in after_10k) / 1024.0 if after_10k else None,
        "rss_min_after_10k_mib": min(s[2] for s in after_10k) / 1024.0 if after_10k else None,
        "hwm_mib": max(s[3] for s in samples) / 1024.0,
        "rates": rates,
        "claim_after_run": after,
        "worker_warnings": warnings,
        "series": [
            {"t": round(s[0], 2), "handled": s[1], "rss_kib": s[2]}
            for s in samples[:: max(1, len(samples) // 400)]
        ],
    }


# --- checks, report ------------------------------------------------------------------------


def conclusive(passed, ratio, higher_is_better, moved, tolerance):
    if moved is None:
        return True
    spread = max(moved, 1.0 / moved)
    if spread <= 1.0 + tolerance:
        return True
    if passed:
        return False
    if higher_is_better:
        return ratio < (1.0 - tolerance) / spread
    return ratio > (1.0 + tolerance) * spread


def paired_ratios(entries, value):
    """--in-turn: loaded/baseline of ``value(entry)`` in each round that has
    both (a round's baseline pass, named baseline or baseline2, and its loaded
    pass ran a minute apart: their ratio leaves out how the machine's speed
    drifted from round to round, which pooling all passes keeps in)."""
    rounds = {}
    for entry in entries:
        if entry.get("round") is not None:
            kind = "loaded" if entry["state"] == "loaded" else "baseline"
            rounds.setdefault(entry["round"], {})[kind] = value(entry)
    return [
        r["loaded"] / r["baseline"]
        for _, r in sorted(rounds.items())
        if r.get("baseline") and r.get("loaded") is not None
    ]


def compare(result, tolerance, slack_ms):
    checks = []
    noise = noise_floor(result)

    def check(name, baseline, loaded, higher_is_better, unit="", noise_key=None, paired=()):
        """``paired``: the rounds' ratios (--in-turn); their median decides,
        else the ratio of ``loaded`` to ``baseline`` (medians of all passes)."""
        if baseline is None or loaded is None or not baseline:
            return
        moved = noise.get(noise_key)
        pooled = loaded / baseline
        ratio = median(paired) if paired else pooled
        of = f"median of {len(paired)} rounds' loaded/baseline" if paired else "loaded/baseline"
        if higher_is_better:
            ok = ratio >= 1.0 - tolerance
            rule = f">= {1.0 - tolerance:.2f}"
        else:
            ok = ratio <= 1.0 + tolerance + slack_ms / baseline
            rule = f"<= {1.0 + tolerance:.2f}" + (f" (+{slack_ms:g} ms)" if slack_ms else "")
        checks.append(
            {
                "check": name,
                "baseline": baseline,
                "loaded": loaded,
                "ratio": ratio,
                "pooled_ratio": pooled,
                "paired_ratios": list(paired),
                "rule": f"{of} {rule}",
                "unit": unit,
                "passed": ok,
                # baseline2 / baseline: beyond the tolerance, the machine was
                # too noisy for this check to decide, unless it failed by more
                # than the noise
                "noise_floor": moved,
                "conclusive": conclusive(ok, ratio, higher_is_better, moved, tolerance),
            }
        )

    drains = result.get("drain", {})
    for _, topic, atomic in TOPICS:
        base, load = drains.get(f"baselines/{topic}"), drains.get(f"loaded/{topic}")
        if base and load:
            label = "atomic=True" if atomic else "atomic=False"
            runs = [r for r in result["drain_runs"] if r["topic"] == topic]
            check(
                f"worker jobs/s, {label}",
                base["jobs_per_s"],
                load["jobs_per_s"],
                True,
                "jobs/s",
                f"worker jobs/s, {topic}",
                paired_ratios(runs, lambda r: r["jobs_per_s"]),
            )
            check(
                f"worker claim mean, {label}",
                base["claim_mean_ms"],
                load["claim_mean_ms"],
                False,
                "ms",
                f"worker claim mean, {topic}",
                paired_ratios(runs, lambda r: r["claim_mean_ms"]),
            )
    claims = result.get("claims", [])
    loaded_claims = {}  # scenario -> its loaded passes (several with --in-turn)
    for c in claims:
        if c["state"] == "loaded":
            loaded_claims.setdefault(c["scenario"], []).append(c)
    for scenario, passes in loaded_claims.items():
        c = passes[0]
        base = [
            t for b in claims if b["state"] in BASELINES and b["scenario"] == scenario
            for t in b["times_ms"]
        ]  # fmt: skip
        loaded = [t for p in passes for t in p["times_ms"]]
        if base:
            check(
                f"claim p50, {scenario}",
                tp.percentile(base, 50),
                tp.percentile(loaded, 50),
                False,
                "ms",
                f"claim p50, {scenario}",
                paired_ratios(
                    [b for b in claims if b["scenario"] == scenario],
                    lambda b: tp.percentile(b["times_ms"], 50),
                ),
            )
            first = next(
                b for b in claims if b["state"] == "baseline" and b["scenario"] == scenario
            )
            checks[-1]["server_side"] = (
                f"EXPLAIN ANALYZE: baseline {first['plan_execution_ms']:.3f} ms, "
                f"{first['plan_buffers']} buffers; loaded {c['plan_execution_ms']:.3f} ms, "
                f"{c['plan_buffers']} buffers"
            )
        checks.append(
            {
                "check": f"claim plan uses a partial index, {scenario}",
                "baseline": None,
                "loaded": ", ".join(c["plan_indexes"]) or "none",
                "ratio": None,
                "rule": " or ".join(PARTIAL_INDEXES) + ", no Seq Scan",
                "unit": "",
                "passed": all(p["plan_uses_partial_index"] for p in passes),
            }
        )
    memory = result.get("memory")
    if memory and memory.get("rss_10k_mib"):
        checks.append(
            {
                "check": f"worker RSS at {memory['messages']:,} vs at 10,000 handled",
                "baseline": memory["rss_10k_mib"],
                "loaded": memory["rss_end_mib"],
                "ratio": memory["rss_end_mib"] / memory["rss_10k_mib"],
                "rule": f"<= {1.0 + tolerance:.2f}",
                "unit": "MiB",
                "passed": memory["rss_end_mib"] <= memory["rss_10k_mib"] * (1.0 + tolerance),
            }
        )
    return checks


def noise_floor(result):
    """baseline2 / baseline of each figure measured in both passes."""
    out = {}
    drains = result.get("drain", {})
    for _, topic, _ in TOPICS:
        a, b = drains.get(f"baseline/{topic}"), drains.get(f"baseline2/{topic}")
        if a and b:
            out[f"worker jobs/s, {topic}"] = b["jobs_per_s"] / a["jobs_per_s"]
            if a["claim_mean_ms"] and b["claim_mean_ms"]:
                out[f"worker claim mean, {topic}"] = b["claim_mean_ms"] / a["claim_mean_ms"]
    claims = {(c["state"], c["scenario"]): c for c in result.get("claims", [])}
    for (state, scenario), c in claims.items():
        if state == "baseline2" and ("baseline", scenario) in claims:
            out[f"claim p50, {scenario}"] = c["p50_ms"] / claims[("baseline", scenario)]["p50_ms"]
    return out


def fmt_value(value, unit):
    if isinstance(value, str) or value is None:
        return "-" if value is None else value
    if unit == "jobs/s":
        return f"{value:,.0f}"
    if unit == "MiB":
        return f"{value:.1f}"
    return f"{value:.3f}"


DRAIN_HEADERS = (
    "state topic jobs/s claims batch claim_mean_ms p50~ p99~ enqueue/s wcpu% box% RSS_MiB"
)
DRAIN_HEADERS = [h.replace("_", " ") for h in DRAIN_HEADERS.split()]
CLAIM_HEADERS = "state scenario asks ready p50 p99 mean max buffers plan_ms index"
CLAIM_HEADERS = [h.replace("_", " ") for h in CLAIM_HEADERS.split()]
SKIPPABLE = ["baseline", "loaded", "baseline2", "memory", "drain", "claims", "atomic", "nonatomic"]


def print_report(result):
    env = result["environment"]
    print(
        f"\nScale benchmark: commit {env['commit']}, PostgreSQL {env['postgres']}, "
        f"{env['cpus']} CPUs, Python {env['python']}"
    )
    print(f"  worker options: {env['worker_args']}")
    print(
        f"  server: shared_buffers {env['settings']['shared_buffers']}, autovacuum "
        f"{env['settings']['autovacuum']}, synchronous_commit "
        f"{env['settings']['synchronous_commit']}; load average at start "
        f"{env['load_average_start']}, at end {env.get('load_average_end')}"
    )
    fill = result.get("fill")
    if fill:
        print(
            f"\nLoaded state: {fill['delayed_messages']:,} delayed messages (half in queue "
            f"'{QUEUE}', run_at 1-2 days ahead, priorities {fill['delayed_priorities']}) and "
            f"{fill['dead_letters']:,} dead letters"
        )
        print(
            f"  fill {fill['total_s']:.1f} s: messages {fill['messages_s']:.1f} s, dead letters "
            f"{fill['dead_letters_s']:.1f} s, VACUUM ANALYZE {fill['vacuum_analyze_s']:.1f} s"
        )
        rows = []
        for table, s in fill["sizes"].items():
            rows.append(
                [
                    table,
                    f"{s['rows']:,}",
                    f"{mib(s['total_bytes']):,.0f}",
                    f"{mib(s['heap_bytes']):,.0f}",
                    f"{mib(s['indexes_bytes']):,.0f}",
                ]
            )
        print(tp.table(["table", "rows", "total MiB", "heap MiB", "indexes MiB"], rows))
        idx = fill["sizes"][MESSAGE_TABLE]["index_bytes"]
        print(
            "  message table indexes: "
            + ", ".join(f"{name} {mib(size):.0f} MiB" for name, size in idx.items())
        )
    runs = result.get("drain_runs", [])
    if runs:
        print(
            f"\nWorker drain: one pgqueue_worker (not --burst), {runs[0]['messages']:,} no-op "
            f"messages per run, jobs/s = messages / (first claim to queue empty, watched in the "
            f"database); claim figures from its pgqueue_worker_claim_duration_seconds histogram"
        )
        print(
            tp.table(
                DRAIN_HEADERS,
                [
                    [
                        r["state"],
                        r["topic"],
                        f"{r['jobs_per_s']:,.0f}",
                        r["claims"] if r["claims"] is not None else "-",
                        "-" if r["claim_batch_mean"] is None else f"{r['claim_batch_mean']:.1f}",
                        fmt_ms(r["claim_mean_ms"]),
                        fmt_ms(r["claim_p50_ms"]),
                        fmt_ms(r["claim_p99_ms"]),
                        f"{r['enqueue_per_s']:,.0f}",
                        fmt_percent(r["worker_cpu_percent"]),
                        fmt_percent(r["machine_busy_percent"]),
                        f"{r['peak_rss_mib']:.0f}",
                    ]
                    for r in runs
                ],
            )
        )
        print("  median per state and topic:")
        for key, d in result["drain"].items():
            print(
                f"    {key:32} {d['jobs_per_s']:8,.0f} jobs/s  claim mean "
                f"{fmt_ms(d['claim_mean_ms'])} ms  p50~ {fmt_ms(d['claim_p50_ms'])}  p99~ "
                f"{fmt_ms(d['claim_p99_ms'])}  (runs: "
                + ", ".join(f"{x:,.0f}" for x in d["runs_jobs_per_s"])
                + ")"
            )
    claims = result.get("claims", [])
    if claims:
        print(
            f"\nlifecycle.claim() in this process, {claims[0]['calls']} calls of the full"
            f" scenario, {claims[-1]['calls']} of each other"
            " (ms; buffers and index from EXPLAIN (ANALYZE, BUFFERS) of the captured statements)"
        )
        print(
            tp.table(
                CLAIM_HEADERS,
                [
                    [
                        c["state"],
                        c["scenario"],
                        c["limit"],
                        c["ready"],
                        fmt_ms(c["p50_ms"]),
                        fmt_ms(c["p99_ms"]),
                        fmt_ms(c["mean_ms"]),
                        fmt_ms(c["max_ms"]),
                        c["plan_buffers"],
                        fmt_ms(c["plan_execution_ms"]),
                        ",".join(c["plan_indexes"]) or "-",
                    ]
                    for c in claims
                ],
            )
        )
        described = {}
        for c in claims:
            described.setdefault(c["scenario"], c["description"])
        for scenario, description in described.items():
            print(f"  {scenario}: {description}")
        for c in claims:
            if c["state"] != "loaded":
                continue
            print(f"\nPlan of the claim, loaded state, {c['scenario']}:")
            for plan in c["plans"]:
                if plan["seq_scans"] or set(plan["indexes"]) - {PKEY_INDEX}:
                    print(f"  {plan['statement']}:")
                    print("    " + plan["text"].replace("\n", "\n    "))
                else:  # the lease update by primary key: one line is enough
                    print(
                        f"  {plan['statement']}: by primary key, "
                        f"{plan['shared_hit'] + plan['shared_read']} buffers, "
                        f"{plan['execution_ms']:.3f} ms"
                    )
    memory = result.get("memory")
    if memory:
        print(
            f"\nMemory: one worker handling {memory['messages']:,} bench.noop_nonatomic messages"
            f" in {memory['drain_s']:.0f} s ({memory['jobs_per_s']:,.0f} jobs/s; enqueued"
            f" beforehand in {memory['fill_s']:.1f} s), VmRSS sampled every"
            f" {memory['sample_interval_s']:g} s"
        )
        for k, v in memory["rss_at"].items():
            print(
                f"  at {int(k):>9,} handled (sample at {v['handled']:>9,}, {v['seconds']:6.1f} s):"
                f" RSS {v['rss_mib']:.1f} MiB"
            )
        print(
            f"  from 10,000 on: min {memory['rss_min_after_10k_mib']:.1f} MiB, max "
            f"{memory['rss_max_after_10k_mib']:.1f} MiB; VmHWM {memory['hwm_mib']:.1f} MiB"
        )
        print(
            "  jobs/s by tenth of the run: "
            + ", ".join(f"{r['jobs_per_s']:,.0f}" for r in memory["rates"])
        )
        after = memory.get("claim_after_run")
        if after:
            b, a = after["before_vacuum"], after["after_vacuum"]
            print(
                f"  then the claim of one new message (EXPLAIN ANALYZE): {b['buffers']:,} buffers,"
                f" {b['execution_ms']:.2f} ms ({', '.join(b['indexes'])}); after VACUUM ANALYZE"
                f" ({after['vacuum_s']:.1f} s): {a['buffers']:,} buffers,"
                f" {a['execution_ms']:.2f} ms"
            )
    if result.get("worker_warnings"):
        print("\nWarnings the workers logged (by kind):")
        for kind, n in sorted(result["worker_warnings"].items(), key=lambda item: -item[1]):
            print(f"  {n:5}  {kind}")
    noise = noise_floor(result)
    if noise:
        print(
            "\nNoise floor: the baseline measured again after the loaded state "
            "(baseline2 / baseline):"
        )
        for name, ratio in noise.items():
            print(f"  {name:40} {ratio:.3f}")
    print(
        "\nChecks (baseline: both baseline passes pooled; median of the runs, p50 of the calls;"
        " with --in-turn the ratio is the median of the rounds' ratios, and 'pooled' the"
        " ratio of the two columns):"
    )
    for c in result["checks"]:
        pooled = f", pooled {c['pooled_ratio']:.3f}" if c.get("paired_ratios") else ""
        print(
            f"  {'PASS' if c['passed'] else 'FAIL'}  {c['check']:48} baseline "
            f"{fmt_value(c['baseline'], c['unit']):>9}  loaded "
            f"{fmt_value(c['loaded'], c['unit']):>9}  ratio {fmt_ratio(c['ratio'])}{pooled}"
            f"  ({c['rule']})"
        )
        if c.get("server_side"):
            print(f"        {c['server_side']}")
        if not c.get("conclusive", True):
            print(
                f"        ^ inconclusive: the baseline changed by a factor {c['noise_floor']:.2f}"
                " between its two passes (noisy machine); run again or use more --repeat"
            )


# --- main ----------------------------------------------------------------------------------


def other_url(url):
    return tp.with_database(url, tp.database_name(url) + "_other")


def use_database(ctx, url):
    """Point the workers (``ctx``) and this process's Django at the database
    of ``url`` and its "_other" companion (--in-turn switches between the
    baseline's database and the loaded one)."""
    from django.db import connections

    ctx.url = url
    ctx.env = dict(ctx.env, DATABASE_URL=url, OTHER_DATABASE_URL=other_url(url))
    for alias, target in (("default", url), ("other", other_url(url))):
        connections[alias].close()
        connections[alias].settings_dict["NAME"] = tp.database_name(target)


def measure_state(ctx, args, result, topics, state, repeat, index=0, paired_round=None):
    """The drains and the in-process claims of one state, on ctx's database
    (``paired_round``: --in-turn's round, recorded with each figure)."""
    # The fill (or the previous state) leaves dirty pages and WAL behind:
    # flush them now rather than in a checkpoint during the measurements.
    execute("CHECKPOINT")
    if "drain" not in args.skip:
        for topic, atomic in topics:
            for i in range(repeat):
                run = drain_run(ctx, state, topic, atomic, args.messages, index + i)
                run.round = paired_round
                result["drain_runs"].append(asdict(run))
                print(
                    f"  {state:8} {topic:22} {run.jobs_per_s:8,.0f} jobs/s  claim mean "
                    f"{fmt_ms(run.claim_mean_ms)} ms  box "
                    f"{fmt_percent(run.machine_busy_percent)}%",
                    file=sys.stderr,
                )
    if "claims" not in args.skip:
        for claims in claim_scenarios(ctx, state):
            claims.round = paired_round
            result["claims"].append(asdict(claims))


def fill_loaded_state(args, result):
    print(
        f"filling: {args.delayed:,} delayed messages, {args.dead_letters:,} dead letters",
        file=sys.stderr,
    )
    result["fill"] = fill_loaded(args.delayed, args.dead_letters, args.priorities)


@dataclass
class Context:
    url: str
    env: dict
    log_dir: str
    worker_args: list
    metrics: bool
    claim_calls: int
    sparse_claim_calls: int
    claim_batch: int
    claim_limit: int


def parse_args(argv):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--messages", type=int, default=20000, help="messages per worker drain")
    parser.add_argument("--repeat", type=int, default=3, help="worker drains per state and topic")
    parser.add_argument(
        "--worker-args",
        default=DEFAULT_WORKER_ARGS,
        help="pgqueue_worker options of every worker (the script adds --log-level WARNING"
        " and, for the drains, --metrics-port/--http-host)",
    )
    parser.add_argument("--delayed", type=int, default=1_000_000, help="delayed messages")
    parser.add_argument(
        "--dead-letters", type=int, default=1_000_000, help="dead letters in the loaded state"
    )
    parser.add_argument(
        "--delayed-priorities",
        default="0",
        help="comma-separated priorities the delayed messages take in turn",
    )
    parser.add_argument(
        "--claim-calls", type=int, default=200, help="claims of the full scenario (of a backlog)"
    )
    parser.add_argument(
        "--sparse-claim-calls",
        type=int,
        default=1000,
        help="claims of each scenario with few or no messages ready",
    )
    parser.add_argument(
        "--claim-batch", type=int, default=100, help="what a claim asks for with a backlog"
    )
    parser.add_argument(
        "--memory-messages", type=int, default=1_000_000, help="messages of the memory run"
    )
    parser.add_argument("--sample-interval", type=float, default=0.25, help="memory sampling, s")
    parser.add_argument(
        "--tolerance", type=float, default=0.10, help="allowed loaded/baseline difference"
    )
    parser.add_argument(
        "--latency-slack-ms",
        type=float,
        default=0.0,
        help="absolute allowance on top of --tolerance for the latency checks",
    )
    parser.add_argument(
        "--skip",
        action="append",
        default=[],
        choices=SKIPPABLE,
        help="leave out a part (repeatable)",
    )
    parser.add_argument(
        "--database-url",
        default=os.environ.get("BENCH_SCALE_DATABASE_URL", DEFAULT_URL),
        help="the bench database (its name must contain 'bench'; created and migrated if"
        " missing, emptied by every run); env BENCH_SCALE_DATABASE_URL",
    )
    parser.add_argument(
        "--in-turn",
        type=int,
        default=8,
        metavar="ROUNDS",
        help="keep the loaded state in a database of its own (the bench database's name +"
        " '_loaded') and measure baseline and loaded in turn, ROUNDS rounds of one drain per"
        " topic and the claims each (the baseline passes alternate as baseline and"
        " baseline2); each check takes the median of the rounds' loaded/baseline ratios."
        " 0: baseline, loaded, baseline2 one after the other, --repeat drains each, and the"
        " ratios of the medians",
    )
    parser.add_argument("--keep-data", action="store_true", help="leave the last state in place")
    parser.add_argument("--keep-logs", action="store_true", help="keep the worker logs")
    parser.add_argument("--json", metavar="PATH", help="also write the results here as JSON")
    args = parser.parse_args(argv)
    if "bench" not in tp.database_name(args.database_url):
        parser.error(
            f"the database {tp.database_name(args.database_url)!r} does not look like a bench "
            "database (its name must contain 'bench'): every run empties its queue tables"
        )
    if (
        min(args.messages, args.repeat, args.claim_calls, args.sparse_claim_calls, args.claim_batch)
        < 1
    ):
        parser.error(
            "--messages, --repeat, --claim-calls, --sparse-claim-calls and --claim-batch"
            " must be at least 1"
        )
    if args.in_turn < 0:
        parser.error("--in-turn must be 0 or more")
    if args.in_turn and {"baseline", "loaded", "baseline2"} & set(args.skip):
        parser.error("--in-turn measures every state: no --skip of baseline, loaded, baseline2")
    if "memory" not in args.skip and args.memory_messages < 20_000:
        parser.error("--memory-messages must be at least 20,000 (RSS is compared at 10,000)")
    worker_args = shlex.split(args.worker_args)
    if "--burst" in worker_args:
        parser.error("--worker-args: no --burst (the script stops the workers itself)")
    try:
        args.priorities = [int(p) for p in args.delayed_priorities.split(",")]
    except ValueError:
        parser.error("--delayed-priorities: integers separated by commas")
    return args, worker_args


def environment(args, worker_args):
    settings = {
        name: scalar(f"SHOW {name}")
        for name in ("shared_buffers", "autovacuum", "synchronous_commit", "work_mem", "jit")
    }
    return {
        "started_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "commit": tp.git_commit(),
        "worker_args": " ".join(worker_args),
        "postgres": scalar("SHOW server_version"),
        "settings": settings,
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "load_average_start": load_average(),
    }


def main(argv=None):
    args, worker_args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    signal.signal(signal.SIGINT, signal.default_int_handler)
    url = args.database_url
    other = tp.with_database(url, tp.database_name(url) + "_other")
    env = dict(
        os.environ,
        DATABASE_URL=url,
        OTHER_DATABASE_URL=other,
        DEBUG="False",
        DJANGO_SETTINGS_MODULE="testproject.settings",
        PGQUEUE_LOG_LEVEL="WARNING",
        PYTHONUNBUFFERED="1",
    )
    os.environ["PGQUEUE_LOG_LEVEL"] = "WARNING"  # this process's claims log nothing either
    log_dir = tempfile.mkdtemp(prefix="pgqueue-scale-")
    try:
        for db in (url, other):
            if tp.ensure_database(db):
                print(f"created database {tp.database_name(db)}", file=sys.stderr)
        tp.migrate(env)
        tp.setup_django(env)
        try:
            import prometheus_client  # noqa: F401

            metrics = True
        except ImportError:
            print("prometheus_client missing: no worker claim histogram", file=sys.stderr)
            metrics = False
        ctx = Context(
            url=url,
            env=env,
            log_dir=log_dir,
            worker_args=worker_args,
            metrics=metrics,
            claim_calls=args.claim_calls,
            sparse_claim_calls=args.sparse_claim_calls,
            claim_batch=args.claim_batch,
            claim_limit=worker_claim_limit(worker_args),
        )
        result = {
            "environment": environment(args, worker_args),
            "options": {
                k: v for k, v in vars(args).items() if k not in ("json", "delayed_priorities")
            },
            "drain_runs": [],
            "claims": [],
        }
        topics = [(topic, atomic) for part, topic, atomic in TOPICS if part not in args.skip]
        tp.truncate()
        if args.in_turn:
            # Two databases, the load in one of them: the states are measured
            # a minute apart, in alternating order, instead of minutes apart.
            loaded_url = tp.with_database(url, tp.database_name(url) + "_loaded")
            for db in (loaded_url, other_url(loaded_url)):
                if tp.ensure_database(db):
                    print(f"created database {tp.database_name(db)}", file=sys.stderr)
            tp.migrate(dict(env, DATABASE_URL=loaded_url, OTHER_DATABASE_URL=other_url(loaded_url)))
            use_database(ctx, loaded_url)
            tp.truncate()
            fill_loaded_state(args, result)
            for n in range(args.in_turn):
                passes = [("baseline" if n % 2 == 0 else "baseline2", url), ("loaded", loaded_url)]
                for state, db in passes if n % 2 == 0 else reversed(passes):
                    use_database(ctx, db)
                    measure_state(ctx, args, result, topics, state, 1, index=n, paired_round=n)
            if not args.keep_data:
                tp.truncate()  # the loaded database
            use_database(ctx, url)
        for state in () if args.in_turn else STATES:
            if state in args.skip:
                continue
            if state == "baseline2":
                tp.truncate()  # the load goes: the baseline once more
            if state == "loaded":
                fill_loaded_state(args, result)
            measure_state(ctx, args, result, topics, state, args.repeat)
        result["drain"] = {}
        for state in (*STATES, "baselines"):
            states = BASELINES if state == "baselines" else (state,)
            for topic, _ in topics:
                mine = [
                    r for r in result["drain_runs"] if r["state"] in states and r["topic"] == topic
                ]
                if mine:
                    result["drain"][f"{state}/{topic}"] = {
                        key: median(r[key] for r in mine)
                        for key in ("jobs_per_s", "claim_mean_ms", "claim_p50_ms", "claim_p99_ms")
                    } | {"runs_jobs_per_s": [r["jobs_per_s"] for r in mine]}
        if "memory" not in args.skip:
            print(f"memory run: {args.memory_messages:,} messages", file=sys.stderr)
            result["memory"] = memory_run(ctx, args.memory_messages, args.sample_interval)
        result["worker_warnings"] = dict(tp.WARNINGS)
        result["environment"]["load_average_end"] = load_average()
        result["checks"] = compare(result, args.tolerance, args.latency_slack_ms)
        result["noise_floor"] = noise_floor(result)
        if not args.keep_data:
            tp.truncate()
        print_report(result)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2, default=str) + "\n")
            print(f"\nwrote {args.json}")
        return 0 if all(c["passed"] for c in result["checks"]) else 3
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except tp.CheckFailed as exc:
        print(f"\nCHECK FAILED: {exc}", file=sys.stderr)
        args.keep_logs = True
        return 1
    finally:
        for worker in list(tp._LIVE):
            worker.kill()
        if not args.keep_logs:
            for path in Path(log_dir).glob("*.log"):
                path.unlink()
            os.rmdir(log_dir)
        else:
            print(f"worker logs kept in {log_dir}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
