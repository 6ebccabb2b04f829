"""Two sides measured in turn, round after round, and their ratio against a
target: the shape of the scenarios that set a feature beside plain messages
(workflows, partitioned, routed)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

from benchmarks.harness.machine import load_average
from benchmarks.harness.numbers import in_turn, median, spread
from benchmarks.harness.output import command_line, fmt, table, write_json


def run_rounds(
    rounds: int, sides: Sequence[str], measure: Callable[[str, str], dict[str, Any]]
) -> list[dict[str, dict[str, Any]]]:
    """``rounds`` rounds; in each, ``measure(side, name)`` for every side, the
    order alternating from round to round. Each result has ``enqueue_s`` and
    ``per_s``, printed on stderr as it comes."""
    width = max(map(len, sides))
    results = []
    for index in range(rounds):
        figures = {}
        for side in in_turn(index, list(sides)):
            figures[side] = measure(side, f"r{index + 1}-{side}")
            print(
                f"  round {index + 1} {side:{width}}: enqueue {figures[side]['enqueue_s']:.2f} s,"
                f" drained {figures[side]['per_s']:,.0f}/s",
                file=sys.stderr,
            )
        results.append(figures)
    return results


def figure(values: Sequence[float], spec: str) -> list[str]:
    """The median of ``values`` and their range, formatted with ``spec``."""
    low, high = spread(values) or (None, None)
    return [fmt(median(values), spec), f"{fmt(low, spec)}-{fmt(high, spec)}"]


def report(
    heading: str, rows: list[list[str]], ratios: list[float], target: float, claim: str
) -> dict[str, Any]:
    """Print ``heading``, the table of ``rows`` (each a label and ``figure``),
    and whether the median of ``ratios`` reaches ``target`` ("target:
    ``claim``: met"); returns the summary written to the JSON."""
    print(f"\n{heading}")
    print(table(["", "median", "range"], rows))
    ratio = median(ratios)
    verdict = "met" if ratio is not None and ratio >= target else "MISSED"
    print(f"target: {claim}: {verdict}")
    load = load_average()
    if load:
        print(f"load average at the end: {' '.join(f'{x:.2f}' for x in load)} (a shared machine:"
              " compare the ratio, measured in turn, rather than the rates)")  # fmt: skip
    return {"ratio": ratio, "ratios": ratios, "target": target, "met": verdict == "met"}


def write_results(args: Any, rounds: list[Any], summary: dict[str, Any]) -> None:
    """With ``--json``: every round's figures, the options and the summary."""
    if args.json:
        write_json(args.json, {"command": command_line(), "options": vars(args),
                               "rounds": rounds, "summary": summary})  # fmt: skip
        print(f"wrote {args.json}")
