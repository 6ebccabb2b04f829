"""Two trees of django-pgqueue measured in turn (the ab scenario): the
same client script (benchmarks/peers/bench_pgqueue.py, the public API only:
enqueue, enqueue_many) and the same worker command (``manage.py
pgqueue_worker``, ``--burst`` for the drains) run with each tree's Python,
package and testproject, on the same server, one database per tree."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from benchmarks.harness.numbers import in_turn, median, round_ratios, spread
from benchmarks.harness.output import table
from benchmarks.harness.pgstats import Stats
from benchmarks.scenarios.compare import StepFailed
from benchmarks.scenarios.compare.measure import (
    drain_run,
    enqueue_bulk,
    enqueue_single,
    measure_latency,
)
from benchmarks.scenarios.compare.systems import PgQueue

SIDES = ("before", "after")
# The database's cost per message of a drain, from drain_run (the whole
# server's CPU and WAL over it): reported beside the rates.
COSTS = {"server_cpu_us_per_job": ("server CPU", "us/msg"), "wal_bytes_per_job": ("WAL", "B/msg")}


@dataclass(frozen=True)
class Scenario:
    key: str
    label: str
    unit: str
    higher_is_better: bool
    measure: Callable[[PgQueue, Stats, Any, str], tuple[float, dict[str, Any]]]


def _variant(system: PgQueue, key: str) -> Any:
    return next(v for v in system.variants() if v.key == key)


def _drain(key: str) -> Callable[[PgQueue, Stats, Any, str], tuple[float, dict[str, Any]]]:
    def measure(system: PgQueue, stats: Stats, opts: Any, tag: str) -> tuple[float, dict]:
        run = drain_run(system, stats, _variant(system, key), 1, opts.messages, tag)
        if run["problems"] or not run.get("jobs_per_s"):
            raise StepFailed("; ".join(run["problems"]) or "no rate")
        details = {"wall_s": run["wall_s"], "drain_s": run["drain_s"]}
        details.update({cost: run[cost] for cost in COSTS if run.get(cost) is not None})
        return run["jobs_per_s"], details

    return measure


def _enqueue(system: PgQueue, stats: Stats, opts: Any, tag: str) -> tuple[float, dict]:
    return enqueue_single(system, _variant(system, "atomic"), opts.enqueue_messages), {}


def _enqueue_many(system: PgQueue, stats: Stats, opts: Any, tag: str) -> tuple[float, dict]:
    return enqueue_bulk(system, _variant(system, "atomic"), opts.messages), {}


def _latency(system: PgQueue, stats: Stats, opts: Any, tag: str) -> tuple[float, dict]:
    lat = measure_latency(system, opts.latency_samples, opts.latency_spacing_ms / 1000)
    if lat["missing"] or lat["duplicated"] or "p50_ms" not in lat:
        raise StepFailed(f"latency: {lat['missing']} missing, {lat['duplicated']} duplicated")
    return lat["p50_ms"], {k: lat[k] for k in ("p95_ms", "p99_ms", "max_ms")}


SCENARIOS = {
    s.key: s
    for s in (
        Scenario("nonatomic", "throughput, atomic=False", "jobs/s", True, _drain("nonatomic")),
        Scenario("atomic", "throughput, atomic=True", "jobs/s", True, _drain("atomic")),
        Scenario("enqueue", "enqueue(), one per transaction", "msg/s", True, _enqueue),
        Scenario("enqueue_many", "enqueue_many()", "msg/s", True, _enqueue_many),
        Scenario("latency", "latency p50, commit to handler start", "ms", False, _latency),
    )
}


def run_rounds(
    systems: dict[str, PgQueue], stats: Stats, opts: Any, scenarios: list[str]
) -> dict[str, list[dict[str, Any]]]:
    """``opts.rounds`` rounds; in each, every scenario runs on both sides one
    after the other, the order of the sides alternating from round to round
    (before after, after before, ...). Returns {scenario: [{side: value,
    "<side>_details": ..., "errors": [...]} per round]}."""
    rounds: dict[str, list[dict[str, Any]]] = {key: [] for key in scenarios}
    for n in range(opts.rounds):
        order = in_turn(n, SIDES)
        for key in scenarios:
            scenario = SCENARIOS[key]
            entry: dict[str, Any] = {"order": order, "errors": []}
            for side in order:
                try:
                    value, details = scenario.measure(systems[side], stats, opts, f"{side}{n}")
                except StepFailed as exc:
                    entry["errors"].append(f"{side}: {exc}")
                    print(f"  round {n + 1} {key} {side} FAILED: {exc}", file=sys.stderr)
                    continue
                entry[side] = value
                entry[f"{side}_details"] = details
            rounds[key].append(entry)
            shown = ", ".join(f"{side} {entry[side]:,.2f}" for side in order if side in entry)
            print(f"  round {n + 1}/{opts.rounds} {key:13} {shown}", file=sys.stderr)
    return rounds


def verdict(ratio: float | None, higher_is_better: bool, tolerance: float) -> str:
    """Whether after/before ``ratio`` is within the noise (+-tolerance), better or worse."""
    if ratio is None:
        return "n/a"
    gain = ratio if higher_is_better else 1.0 / ratio
    if gain >= 1.0 + tolerance:
        return "better"
    if gain >= 1.0 - tolerance:
        return f"within +-{tolerance:.0%}"
    return "WORSE"


def summarize(rounds: dict[str, list[dict[str, Any]]], tolerance: float) -> dict[str, Any]:
    """Per scenario: each side's median and range over the rounds; the
    median and range of the rounds' after/before ratios (a round's two runs
    share the machine's moment); and the verdict."""
    out = {}
    for key, entries in rounds.items():
        scenario = SCENARIOS[key]
        sides = {side: [e[side] for e in entries if side in e] for side in SIDES}
        ratios = round_ratios((e.get("after"), e.get("before")) for e in entries)
        ratio = median(ratios)
        out[key] = {
            "label": scenario.label,
            "unit": scenario.unit,
            "higher_is_better": scenario.higher_is_better,
            **{f"{side}_median": median(values) for side, values in sides.items()},
            **{f"{side}_range": spread(values) for side, values in sides.items()},
            "ratio": ratio,
            "ratio_range": spread(ratios),
            "rounds_compared": len(ratios),
            "verdict": verdict(ratio, scenario.higher_is_better, tolerance),
            "costs": _costs(entries),
        }
    return out


def _costs(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """Per cost of COSTS that the rounds' details have: each side's median
    and the median and range of the rounds' after/before ratios."""
    out = {}
    for cost in COSTS:
        values = {
            side: [e[f"{side}_details"].get(cost) for e in entries if f"{side}_details" in e]
            for side in SIDES
        }
        if not any(v is not None for side in SIDES for v in values[side]):
            continue
        pairs = [
            (e.get("after_details", {}).get(cost), e.get("before_details", {}).get(cost))
            for e in entries
        ]
        ratios = round_ratios(pairs)
        out[cost] = {
            **{
                f"{side}_median": median([v for v in values[side] if v is not None])
                for side in SIDES
            },
            "ratio": median(ratios),
            "ratio_range": spread(ratios),
        }
    return out


def _value(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    return f"{value:.2f}" if unit == "ms" else f"{value:,.0f}"


def _range(bounds: tuple[float, float] | None, unit: str) -> str:
    if bounds is None:
        return "-"
    return f"{_value(bounds[0], unit)}-{_value(bounds[1], unit)}"


def print_summary(summary: dict[str, Any]) -> None:
    rows = []
    for item in summary.values():
        unit = item["unit"]
        ratio, bounds = item["ratio"], item["ratio_range"]
        rows.append(
            [
                f"{item['label']} ({unit})",
                _value(item["before_median"], unit),
                _range(item["before_range"], unit),
                _value(item["after_median"], unit),
                _range(item["after_range"], unit),
                "-" if ratio is None else f"{ratio:.3f}",
                "-" if bounds is None else f"{bounds[0]:.3f}-{bounds[1]:.3f}",
                item["rounds_compared"],
                item["verdict"],
            ]
        )
    headers = [
        "scenario",
        "before",
        "(range)",
        "after",
        "(range)",
        "after/before",
        "(rounds' range)",
        "rounds",
        "verdict",
    ]
    print(table(headers, rows))
    print(
        "  before, after: the median over the rounds; after/before: the median of the rounds'"
        " ratios (each round\n  runs both trees one after the other, the order alternating)."
        " Latency: lower is better."
    )
    costs = []
    for item in summary.values():
        for cost, figures in item.get("costs", {}).items():
            name, unit = COSTS[cost]
            ratio, bounds = figures["ratio"], figures["ratio_range"]
            costs.append(
                [
                    f"{item['label']}: {name} ({unit})",
                    "-" if figures["before_median"] is None else f"{figures['before_median']:.1f}",
                    "-" if figures["after_median"] is None else f"{figures['after_median']:.1f}",
                    "-" if ratio is None else f"{ratio:.3f}",
                    "-" if bounds is None else f"{bounds[0]:.3f}-{bounds[1]:.3f}",
                ]
            )
    if costs:
        print()
        print(table(["the database's cost", "before", "after", "after/before", "(range)"], costs))
        print(
            "  the whole server's CPU and WAL over each drain (start-up and exit included) per"
            " message; lower is better."
        )
