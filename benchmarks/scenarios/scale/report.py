"""The scale scenario's printed report."""

from __future__ import annotations

from typing import Any

from benchmarks.harness.db import MESSAGE_TABLE
from benchmarks.harness.output import fmt, mib, print_warnings, table
from benchmarks.scenarios.scale import PKEY_INDEX, QUEUE
from benchmarks.scenarios.scale.checks import noise_floor

DRAIN_HEADERS = [
    h.replace("_", " ")
    for h in (
        "state topic jobs/s claims batch claim_mean_ms p50~ p99~ enqueue/s wcpu% box% RSS_MiB"
    ).split()
]
CLAIM_HEADERS = [
    h.replace("_", " ")
    for h in (
        "state scenario asks ready p50 p99 mean max server_cpu ack_cpu buffers plan_ms index"
    ).split()
]


def fmt_value(value: Any, unit: str) -> str:
    if isinstance(value, str) or value is None:
        return "-" if value is None else value
    if unit == "jobs/s":
        return f"{value:,.0f}"
    if unit == "MiB":
        return f"{value:.1f}"
    return f"{value:.3f}"


def print_environment(env: dict[str, Any]) -> None:
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


def print_fill(fill: dict[str, Any]) -> None:
    print(
        f"\nLoaded state: {fill['delayed_messages']:,} delayed messages (half in queue "
        f"'{QUEUE}', run_at 1-2 days ahead, priorities {fill['delayed_priorities']}) and "
        f"{fill['dead_letters']:,} dead letters"
    )
    print(
        f"  fill {fill['total_s']:.1f} s: messages {fill['messages_s']:.1f} s, dead letters "
        f"{fill['dead_letters_s']:.1f} s, VACUUM ANALYZE {fill['vacuum_analyze_s']:.1f} s"
    )
    rows = [
        [
            name,
            f"{s['rows']:,}",
            f"{mib(s['total_bytes']):,.0f}",
            f"{mib(s['heap_bytes']):,.0f}",
            f"{mib(s['indexes_bytes']):,.0f}",
        ]
        for name, s in fill["sizes"].items()
    ]
    print(table(["table", "rows", "total MiB", "heap MiB", "indexes MiB"], rows))
    idx = fill["sizes"][MESSAGE_TABLE]["index_bytes"]
    print(
        "  message table indexes: "
        + ", ".join(f"{name} {mib(size):.0f} MiB" for name, size in idx.items())
    )


def drain_row(r: dict[str, Any]) -> list[Any]:
    return [
        r["state"],
        r["topic"],
        f"{r['jobs_per_s']:,.0f}",
        r["claims"] if r["claims"] is not None else "-",
        fmt(r["claim_batch_mean"], ".1f"),
        fmt(r["claim_mean_ms"], ".3f"),
        fmt(r["claim_p50_ms"], ".3f"),
        fmt(r["claim_p99_ms"], ".3f"),
        f"{r['enqueue_per_s']:,.0f}",
        fmt(r["worker_cpu_percent"], ".0f"),
        fmt(r["machine_busy_percent"], ".0f"),
        f"{r['peak_rss_mib']:.0f}",
    ]


def print_drains(result: dict[str, Any]) -> None:
    runs = result.get("drain_runs", [])
    if not runs:
        return
    print(
        f"\nWorker drain: one pgqueue_worker (not --burst), {runs[0]['messages']:,} no-op "
        f"messages per run, jobs/s = messages / (first claim to queue empty, watched in the "
        f"database); claim figures from its pgqueue_worker_claim_duration_seconds histogram"
    )
    print(table(DRAIN_HEADERS, [drain_row(r) for r in runs]))
    print("  median per state and topic:")
    for key, d in result["drain"].items():
        print(
            f"    {key:32} {d['jobs_per_s']:8,.0f} jobs/s  claim mean "
            f"{fmt(d['claim_mean_ms'], '.3f')} ms  p50~ {fmt(d['claim_p50_ms'], '.3f')}  p99~ "
            f"{fmt(d['claim_p99_ms'], '.3f')}  (runs: "
            + ", ".join(f"{x:,.0f}" for x in d["runs_jobs_per_s"])
            + ")"
        )


def claim_row(c: dict[str, Any]) -> list[Any]:
    return [
        c["state"],
        c["scenario"],
        c["limit"],
        c["ready"],
        *(fmt(c[key], ".3f") for key in ("p50_ms", "p99_ms", "mean_ms", "max_ms")),
        fmt(c.get("server_cpu_mean_ms"), ".3f"),
        fmt(c.get("ack_server_cpu_mean_ms"), ".3f"),
        c["plan_buffers"],
        fmt(c["plan_execution_ms"], ".3f"),
        ",".join(c["plan_indexes"]) or "-",
    ]


def print_claims(claims: list[dict[str, Any]]) -> None:
    print(
        f"\nThe worker's claim in this process, {claims[0]['calls']} calls of the full"
        f" scenario, {claims[-1]['calls']} of each other"
        " (ms; server cpu, ack cpu: the backend's CPU time, mean per claim and per"
        " acknowledgement of its messages; buffers and index from"
        " EXPLAIN (ANALYZE, BUFFERS) of the captured statements)"
    )
    print(table(CLAIM_HEADERS, [claim_row(c) for c in claims]))
    described: dict[str, str] = {}
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


def print_memory(memory: dict[str, Any]) -> None:
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


def print_checks(result: dict[str, Any]) -> None:
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
            f"{fmt_value(c['loaded'], c['unit']):>9}  ratio {fmt(c['ratio'], '.3f')}{pooled}"
            f"  ({c['rule']})"
        )
        if c.get("server_side"):
            print(f"        {c['server_side']}")
        if not c.get("conclusive", True):
            print(
                f"        ^ inconclusive: the baseline changed by a factor {c['noise_floor']:.2f}"
                " between its two passes (noisy machine); run again or use more --repeat"
            )


def print_report(result: dict[str, Any]) -> None:
    print_environment(result["environment"])
    if result.get("fill"):
        print_fill(result["fill"])
    print_drains(result)
    if result.get("claims"):
        print_claims(result["claims"])
    if result.get("memory"):
        print_memory(result["memory"])
    print_warnings(result.get("worker_warnings", {}))
    print_checks(result)
