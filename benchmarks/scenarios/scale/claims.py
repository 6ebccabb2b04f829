"""The worker's claim timed in this process, in four situations, with its plan."""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from benchmarks.harness import db, internals
from benchmarks.harness.numbers import percentile
from benchmarks.harness.worker import TOPIC_NONATOMIC
from benchmarks.scenarios.scale import CLAIM_LEASE_SECONDS, CLAIM_WORKER_ID, QUEUE
from benchmarks.scenarios.scale.drain import delete_bench_rows
from benchmarks.scenarios.scale.fill import insert_messages
from benchmarks.scenarios.scale.plans import buffers, execution_ms, explain, indexes, plan_verdict


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
    # CPU time of the server backend per claim (/proc/<pid>/schedstat): what
    # the claim costs the server, less at the mercy of the machine's other
    # work than the wall clock
    server_cpu_mean_ms: float | None = None
    # the same of the acknowledgement of each claim's messages (the full
    # scenario: the worker's batch acknowledgement of atomic=False handlers)
    ack_server_cpu_mean_ms: float | None = None


@dataclass
class ClaimSizes:
    calls: int  # claims of the full scenario
    sparse_calls: int  # claims of each scenario with few or no messages ready
    batch: int  # what a claim asks for with a backlog
    limit: int  # what an idle worker asks for


def insert_ready(n: int, topic: str = TOPIC_NONATOMIC) -> None:
    """``n`` ready messages in QUEUE by plain SQL (every other column is its db_default)."""
    insert_messages(1, n, topic)


def claim_statements(limit: int, few_ready: bool = False) -> tuple[list, int]:
    """The statements one claim of QUEUE runs now, and how many it would take."""
    return internals.claim_statements(
        QUEUE, limit, CLAIM_WORKER_ID, CLAIM_LEASE_SECONDS, few_ready=few_ready
    )


def backend_pid() -> int:
    """The server process of this process's queue connection."""
    with internals.queue_connection().cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        return int(cursor.fetchone()[0])


def cpu_ns(pid: int) -> int:
    """CPU time of process ``pid`` so far, in nanoseconds (the server runs on
    this machine: the benchmarks run beside it)."""
    with open(f"/proc/{pid}/schedstat") as f:
        return int(f.read().split()[0])


def prepared_claim_plans() -> tuple[int, ...]:
    """(generic_plans, custom_plans) summed over the claim statements this
    connection has prepared (psycopg prepares one after prepare_threshold
    calls): the difference across the timed calls tells how often PostgreSQL
    ran a cached generic plan and how often it planned the claim anew."""
    with internals.queue_connection().cursor() as cursor:
        cursor.execute(
            "SELECT coalesce(sum(generic_plans), 0), coalesce(sum(custom_plans), 0)"
            " FROM pg_prepared_statements WHERE statement LIKE %s",
            [f"%UPDATE %{db.MESSAGE_TABLE}% AS m SET status = 'processing'%"],
        )
        return tuple(int(n) for n in cursor.fetchone())


def _first_call_skipped(fn: Callable[[], None]) -> Callable[[], None]:
    """A setup for every claim but the first (whose message is already there)."""
    calls = [0]

    def setup() -> None:
        if calls[0]:
            fn()
        calls[0] += 1

    return setup


def measure(
    state: str,
    scenario: str,
    description: str,
    limit: int,
    ready: int,
    calls: int,
    setup_each: Callable[[], None] | None = None,
    few_ready: bool = False,
    ack: bool = False,
) -> ClaimScenario:
    """``calls`` claims of ``limit``, each finding ``ready`` messages; their
    plan first. Claimed messages are deleted untimed, or with ``ack``
    acknowledged as the worker does, the server's CPU time of that measured."""
    statements, would = claim_statements(limit, few_ready)
    if would != min(limit, ready):
        raise db.CheckFailed(
            f"{state}/{scenario}: the claim would take {would} message(s), "
            f"expected {min(limit, ready)}"
        )
    summaries = explain(statements)
    times, cpu, ack_cpu = [], [], []
    before = prepared_claim_plans()
    pid = backend_pid()
    for _ in range(calls):
        if setup_each:
            setup_each()
        cpu_before = cpu_ns(pid)
        started = time.perf_counter()
        messages = internals.claim(
            [QUEUE], limit, CLAIM_WORKER_ID, CLAIM_LEASE_SECONDS, few_ready=few_ready
        )
        times.append(1000.0 * (time.perf_counter() - started))
        cpu.append((cpu_ns(pid) - cpu_before) / 1e6)
        if len(messages) != min(limit, ready):
            raise db.CheckFailed(
                f"{state}/{scenario}: a claim returned {len(messages)}, "
                f"expected {min(limit, ready)}"
            )
        if messages and ack:
            cpu_before = cpu_ns(pid)
            internals.ack_many(messages)
            ack_cpu.append((cpu_ns(pid) - cpu_before) / 1e6)
        elif messages:
            db.execute(
                f"DELETE FROM {db.MESSAGE_TABLE} WHERE id = ANY(%s)", [[m.pk for m in messages]]
            )
    after = prepared_claim_plans()
    generic, custom = (a - b for a, b in zip(after, before, strict=True))
    result = ClaimScenario(
        state=state,
        scenario=scenario,
        description=description,
        limit=limit,
        ready=ready,
        calls=calls,
        p50_ms=percentile(times, 50),
        p99_ms=percentile(times, 99),
        mean_ms=statistics.fmean(times),
        max_ms=max(times),
        plan_indexes=indexes(summaries),
        plan_buffers=buffers(summaries),
        plan_uses_partial_index=plan_verdict(summaries),
        plan_execution_ms=execution_ms(summaries),
        plans=summaries,
        times_ms=[round(t, 4) for t in times],
        generic_plans=generic,
        custom_plans=custom,
        server_cpu_mean_ms=statistics.fmean(cpu),
        ack_server_cpu_mean_ms=statistics.fmean(ack_cpu) if ack_cpu else None,
    )
    print(
        f"  {state:8} claim {scenario:18} p50 {result.p50_ms:7.3f} ms  p99"
        f" {result.p99_ms:7.3f} ms  server CPU {result.server_cpu_mean_ms:6.3f} ms"
        f"  {result.plan_buffers:6} buffers"
        f"  {','.join(result.plan_indexes)}  generic/custom plans"
        f" {result.generic_plans}/{result.custom_plans}",
        file=sys.stderr,
    )
    return result


def claim_scenarios(sizes: ClaimSizes, state: str) -> list[ClaimScenario]:
    """The worker's claim timed in this process, in four situations:

    full   - a backlog of ready messages (stats analysed with it there): claims
             of --claim-batch, each returning that many; acknowledged between
             calls as the worker acknowledges atomic=False handlers' messages
             (the server's CPU time of that measured, not the wall clock).
    sparse-busy-stats - one ready message per claim, asking for the worker's
             claim size, with the planner statistics still those of the backlog
             (ANALYZE ran while it was there, as after a burst, before
             autovacuum comes by).
    sparse - the same after ANALYZE of the quiet queue.
    empty  - nothing ready.
    The last three claim with few_ready=True, as the worker does after a
    claim that came back short; and more often: a claim of few is a
    fraction of a millisecond, where a hiccup of the machine weighs on the
    median of a few dozen.
    """
    batch, small = sizes.batch, sizes.limit
    backlog = sizes.calls * batch
    delete_bench_rows()
    insert_ready(backlog)
    db.execute(f"VACUUM ANALYZE {db.MESSAGE_TABLE}")  # statistics with the backlog in them
    results = [
        measure(
            state,
            "full",
            f"{batch} of a backlog of {backlog:,}, each batch acknowledged",
            batch,
            backlog,
            sizes.calls,
            ack=True,
        )
    ]
    db.execute(f"VACUUM {db.MESSAGE_TABLE}")  # the dead rows go, the statistics stay
    for scenario, stats_of in (("sparse-busy-stats", "from the backlog"), ("sparse", None)):
        if stats_of is None:
            db.execute(f"VACUUM ANALYZE {db.MESSAGE_TABLE}")  # statistics of the quiet queue
            stats_of = "of the quiet queue"
        insert_ready(1)
        results.append(
            measure(
                state,
                scenario,
                f"1 ready, asks {small}; statistics {stats_of}",
                small,
                1,
                sizes.sparse_calls,
                setup_each=_first_call_skipped(lambda: insert_ready(1)),
                few_ready=True,
            )
        )
    results.append(
        measure(
            state,
            "empty",
            f"nothing ready, asks {small}",
            small,
            0,
            sizes.sparse_calls,
            few_ready=True,
        )
    )
    delete_bench_rows()
    return results
