"""The soak scenario's checks and printed report."""

from __future__ import annotations

import statistics
from math import nan
from typing import Any

from benchmarks.harness.db import MESSAGE_TABLE
from benchmarks.harness.output import fmt, mib, table
from benchmarks.scenarios.soak import HISTORY_TABLE

CLAIM_INDEX = "pgqueue_msg_claim_idx"


def _check(
    name: str, start: float, end: float, tolerance: float, higher_is_better: bool = False
) -> dict[str, Any]:
    ratio = end / start if start else None
    limit = 1 - tolerance if higher_is_better else 1 + tolerance
    if ratio is None:
        passed = False
    else:
        passed = ratio >= limit if higher_is_better else ratio <= limit
    return {
        "name": name,
        "start": start,
        "end": end,
        "ratio": ratio,
        "rule": f"{'>=' if higher_is_better else '<='} {limit:.2f}",
        "passed": passed,
    }


def checks(result: dict[str, Any], tolerance: float) -> list[dict[str, Any]]:
    """Per run: the probe's p50 and its server CPU time at the end against
    the start (both on a vacuumed table: what bloat left behind); the queue
    table's size and its claim index's after the last round against the
    largest after a round of the first half (the first rounds bring the
    table to its working size: growth after that is bloat); the worker's
    slowest round against its median one (a slowdown between vacuums)."""
    out = []
    for run in result["runs"]:
        label = run["table_settings"]
        start, end = run["probe_start"], run["probe_end"]
        rounds = run["rounds"]
        first_half = [r["sizes"][MESSAGE_TABLE] for r in rounds[: max(1, len(rounds) // 2)]]
        last = rounds[-1]["sizes"][MESSAGE_TABLE]
        rates = [r["jobs_per_s"] for r in rounds]
        paired = run.get("paired_end")
        if paired is None:  # a run from before the paired probes
            claim_checks = [
                ("claim p50 ms, end/start", start["p50_ms"], end["p50_ms"]),
                (
                    "claim server CPU ms, end/start",
                    start["server_cpu_mean_ms"],
                    end["server_cpu_mean_ms"],
                ),
            ]
        else:
            # The soaked table against the reference's, probed in turn at the
            # end: the medians of the pairs' ratios, as ratios to 1.
            claim_checks = [
                ("claim p50, soaked/reference at the end", 1.0, paired["p50_ratio"]),
                (
                    "claim server CPU, soaked/reference at the end",
                    1.0,
                    paired["server_cpu_ratio"],
                ),
            ]
        for name, a, b in (
            *claim_checks,
            (
                "queue table MiB, last/first half",
                mib(max(s["total_bytes"] for s in first_half)),
                mib(last["total_bytes"]),
            ),
            (
                f"{CLAIM_INDEX} MiB, last/first half",
                mib(max(s["index_bytes"][CLAIM_INDEX] for s in first_half)),
                mib(last["index_bytes"][CLAIM_INDEX]),
            ),
        ):
            out.append(_check(f"{label}: {name}", a, b, tolerance))
        rounds_paired = run.get("rounds_end")
        if rounds_paired is None:  # a run from before the paired rounds
            out.append(
                _check(
                    f"{label}: worker jobs/s, slowest/median round",
                    statistics.median(rates),
                    min(rates),
                    tolerance,
                    higher_is_better=True,
                )
            )
        else:
            out.append(
                _check(
                    f"{label}: worker jobs/s, soaked/reference at the end",
                    1.0,
                    rounds_paired["ratio"],
                    tolerance,
                    higher_is_better=True,
                )
            )
    return out


def _sizes_row(label: str, sizes: dict[str, Any], jobs_per_s: float | None) -> list[str]:
    msg, hist = sizes[MESSAGE_TABLE], sizes[HISTORY_TABLE]
    pkey = msg["index_bytes"].get(f"{MESSAGE_TABLE}_pkey", 0)
    return [
        label,
        "-" if jobs_per_s is None else f"{jobs_per_s:,.0f}",
        f"{mib(msg['heap_bytes']):.1f}",
        f"{mib(msg['indexes_bytes']):.1f}",
        f"{mib(msg['index_bytes'].get(CLAIM_INDEX, 0)):.2f}",
        f"{mib(msg['index_bytes'].get('pgqueue_msg_due_idx', 0)):.2f}",
        f"{mib(pkey):.2f}",
        f"{msg['live_rows']:,}",
        f"{msg['dead_rows']:,}",
        str(msg["autovacuum_count"]),
        f"{mib(hist['total_bytes']):.0f}",
    ]


HEADERS = [
    "when",
    "jobs/s",
    "heap MiB",
    "indexes MiB",
    "claim_idx",
    "due_idx",
    "pkey",
    "live",
    "dead",
    "autovacuums",
    "history MiB",
]


def print_report(result: dict[str, Any]) -> None:
    env = result["environment"]
    print(
        f"\nSoak benchmark: commit {env['commit']}, PostgreSQL {env['postgres']} (a throwaway"
        f" cluster), {env.get('cpus')} CPUs; server {env['settings']};"
        f" load average {env['load_average_start']} -> {env.get('load_average_end')}"
    )
    for run in result["runs"]:
        print(f"\n{run['table_settings']}: queue table options {run['storage_options']}")
        rows = [_sizes_row("start", run["start"], None)]
        for r in run["rounds"]:
            rows.append(_sizes_row(f"round {r['round']}", r["sizes"], r["jobs_per_s"]))
        settle = run["settle_s"]
        rows.append(_sizes_row("drained", run["drained"], None))
        rows.append(
            _sizes_row("settled" if settle is not None else "no autovacuum", run["end"], None)
        )
        print(table(HEADERS, rows))
        waited = (
            "no autovacuum came" if settle is None else f"an autovacuum came after {settle:.0f} s"
        )
        print(f"  history rows {run['finished_rows']:,}; after the drain {waited}")
        for when in ("start", "end"):
            p = run[f"probe_{when}"]
            print(
                f"  claim probe {when:11}: {p['calls']} claims of {p['batch']} from"
                f" {p['backlog']:,}: p50 {p['p50_ms']:.3f} ms, p99 {p['p99_ms']:.3f} ms, server"
                f" CPU mean {p['server_cpu_mean_ms']:.3f} ms, WAL mean"
                f" {p.get('wal_kib_mean', nan):.1f} KiB (p50 {p.get('wal_kib_p50', nan):.1f})"
                f"{', a checkpoint began' if p.get('checkpoint_during') else ''}"
                f", {p.get('claims_beside_autovacuum', '?')} beside an autovacuum;"
                f" EXPLAIN {p['plan_buffers']}"
                f" buffers, {p['plan_execution_ms']:.3f} ms, {','.join(p['plan_indexes'])}"
            )
    for run in result["runs"]:
        for when in ("start", "end"):
            paired = run.get(f"paired_{when}")
            if paired is None:
                continue
            print(
                f"  {run['table_settings']}, claim probes in turn at the {when}, soaked and"
                " reference (server CPU mean ms, p50 ms):"
            )
            for i, pair in enumerate(paired["pairs"]):
                soaked, reference = pair["soaked"], pair["reference"]
                print(
                    f"    pair {i + 1}: soaked {soaked['server_cpu_mean_ms']:.3f} /"
                    f" {soaked['p50_ms']:.3f}, reference {reference['server_cpu_mean_ms']:.3f} /"
                    f" {reference['p50_ms']:.3f}; WAL KiB {soaked['wal_kib_mean']:.1f} /"
                    f" {reference['wal_kib_mean']:.1f}; EXPLAIN buffers {soaked['plan_buffers']}"
                    f" / {reference['plan_buffers']}"
                )
            print(
                f"    median of the ratios: server CPU {paired['server_cpu_ratio']:.3f},"
                f" p50 {paired['p50_ratio']:.3f}"
            )
    for run in result["runs"]:
        rounds_paired = run.get("rounds_end")
        if rounds_paired is not None:
            print(
                f"  {run['table_settings']}, rounds of {rounds_paired['messages']:,} in turn at the"
                " end, a fresh worker each, soaked and reference (jobs/s):"
            )
            for i, pair in enumerate(rounds_paired["pairs"]):
                print(
                    f"    pair {i + 1}: soaked {pair['soaked']:,.0f},"
                    f" reference {pair['reference']:,.0f}"
                )
            print(f"    median of the ratios: {rounds_paired['ratio']:.3f}")
    print("\nChecks (ratio: the second figure over the first):")
    for c in result["checks"]:
        print(
            f"  {'PASS' if c['passed'] else 'FAIL'}  {c['name']:52} {c['start']:9.3f}"
            f" -> {c['end']:9.3f}  ratio {fmt(c['ratio'], '.3f')}  ({c['rule']})"
        )
