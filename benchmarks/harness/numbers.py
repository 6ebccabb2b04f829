"""Percentiles, medians and the ratios of rounds run in turn."""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence


def percentile(values: Sequence[float], p: float) -> float:
    """Nearest-rank-interpolated percentile of ``values`` (0 <= p <= 100)."""
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    rank = (len(ordered) - 1) * p / 100.0
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def distribution(values: Sequence[float], unit: str = "ms") -> dict[str, float]:
    """p50, p95, p99, min, max and mean of ``values``, keyed ``p50_<unit>``, ..."""
    figures = {f"p{p}": percentile(values, p) for p in (50, 95, 99)}
    figures |= {"min": min(values), "max": max(values), "mean": statistics.fmean(values)}
    return {f"{name}_{unit}": value for name, value in figures.items()}


def median(values: Iterable[float | None]) -> float | None:
    """The median of the values that are not None, or None."""
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def in_turn(round_index: int, sides: Sequence[str]) -> list[str]:
    """The order of ``sides`` in round ``round_index``: as given in even
    rounds, reversed in odd ones (A B, B A, A B, ...), so that neither side
    always runs first, on a machine warmer or colder than the other's."""
    return list(sides) if round_index % 2 == 0 else list(reversed(sides))


def round_ratios(pairs: Iterable[tuple[float | None, float | None]]) -> list[float]:
    """mine/other of each round that measured both (a round's two passes
    share the machine's moment, which on a shared machine drifts by tens of
    percent within minutes: their ratio leaves the drift out)."""
    return [mine / other for mine, other in pairs if mine is not None and other]


def spread(values: Sequence[float]) -> tuple[float, float] | None:
    """(lowest, highest) of ``values``, or None."""
    return (min(values), max(values)) if values else None
