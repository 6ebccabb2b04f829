"""The scale scenario's checks: the loaded state against the baseline, each figure as
the median of the rounds' loaded/baseline ratios (--in-turn), else the ratio
of the medians; marked inconclusive when the baseline itself moved more."""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

from benchmarks.harness.numbers import median, percentile, round_ratios
from benchmarks.scenarios.scale import BASELINES, PARTIAL_INDEXES, TOPICS

Entry = dict[str, Any]


def conclusive(
    passed: bool, ratio: float, higher_is_better: bool, moved: float | None, tolerance: float
) -> bool:
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


def paired_ratios(entries: list[Entry], value: Callable[[Entry], float | None]) -> list[float]:
    """--in-turn: loaded/baseline of ``value(entry)`` in each round that has
    both (a round's baseline pass, named baseline or baseline2, and its loaded
    pass ran a minute apart: their ratio leaves out how the machine's speed
    drifted from round to round, which pooling all passes keeps in)."""
    rounds: dict[int, dict[str, float | None]] = {}
    for entry in entries:
        if entry.get("round") is not None:
            kind = "loaded" if entry["state"] == "loaded" else "baseline"
            rounds.setdefault(entry["round"], {})[kind] = value(entry)
    return round_ratios((r.get("loaded"), r.get("baseline")) for _, r in sorted(rounds.items()))


def noise_floor(result: dict[str, Any]) -> dict[str, float]:
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


class Checks:
    """The list of checks, each a dict (see ``ratio``)."""

    def __init__(self, result: dict[str, Any], tolerance: float, slack_ms: float) -> None:
        self.tolerance, self.slack_ms = tolerance, slack_ms
        self.noise = noise_floor(result)
        self.items: list[dict[str, Any]] = []

    def ratio(
        self,
        name: str,
        baseline: float | None,
        loaded: float | None,
        higher_is_better: bool,
        unit: str = "",
        noise_key: str | None = None,
        paired: list[float] | tuple[float, ...] = (),
    ) -> None:
        """``paired``: the rounds' ratios (--in-turn); their median decides,
        else the ratio of ``loaded`` to ``baseline`` (medians of all passes)."""
        if baseline is None or loaded is None or not baseline:
            return
        tolerance = self.tolerance
        moved = self.noise.get(noise_key) if noise_key else None
        pooled = loaded / baseline
        ratio = median(paired) if paired else pooled
        assert ratio is not None
        of = f"median of {len(paired)} rounds' loaded/baseline" if paired else "loaded/baseline"
        if higher_is_better:
            ok = ratio >= 1.0 - tolerance
            rule = f">= {1.0 - tolerance:.2f}"
        else:
            ok = ratio <= 1.0 + tolerance + self.slack_ms / baseline
            rule = f"<= {1.0 + tolerance:.2f}" + (
                f" (+{self.slack_ms:g} ms)" if self.slack_ms else ""
            )
        self.items.append(
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

    def drains(self, result: dict[str, Any]) -> None:
        drains = result.get("drain", {})
        for _, topic, atomic in TOPICS:
            base, load = drains.get(f"baselines/{topic}"), drains.get(f"loaded/{topic}")
            if not (base and load):
                continue
            label = "atomic=True" if atomic else "atomic=False"
            runs = [r for r in result["drain_runs"] if r["topic"] == topic]
            for what, key, higher, unit in (
                ("worker jobs/s", "jobs_per_s", True, "jobs/s"),
                ("worker claim mean", "claim_mean_ms", False, "ms"),
            ):
                self.ratio(
                    f"{what}, {label}",
                    base[key],
                    load[key],
                    higher,
                    unit,
                    f"{what}, {topic}",
                    paired_ratios(runs, operator.itemgetter(key)),
                )

    def claims(self, result: dict[str, Any]) -> None:
        claims = result.get("claims", [])
        loaded_claims: dict[str, list[Entry]] = {}  # scenario -> its loaded passes
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
                self.ratio(
                    f"claim p50, {scenario}",
                    percentile(base, 50),
                    percentile(loaded, 50),
                    False,
                    "ms",
                    f"claim p50, {scenario}",
                    paired_ratios(
                        [b for b in claims if b["scenario"] == scenario],
                        lambda b: percentile(b["times_ms"], 50),
                    ),
                )
                first = next(
                    b for b in claims if b["state"] == "baseline" and b["scenario"] == scenario
                )
                self.items[-1]["server_side"] = (
                    f"EXPLAIN ANALYZE: baseline {first['plan_execution_ms']:.3f} ms, "
                    f"{first['plan_buffers']} buffers; loaded {c['plan_execution_ms']:.3f} ms, "
                    f"{c['plan_buffers']} buffers"
                )
                self.server_cpu(claims, scenario, passes)
            self.items.append(
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

    def server_cpu(self, claims: list[Entry], scenario: str, passes: list[Entry]) -> None:
        """The server backend's CPU time per claim, and per acknowledgement
        where the scenario acknowledges, loaded against baseline (results
        written before the scale scenario measured them have none)."""
        mine = [b for b in claims if b["scenario"] == scenario]
        for what, key in (("claim", "server_cpu_mean_ms"), ("ack", "ack_server_cpu_mean_ms")):
            base = [b.get(key) for b in mine if b["state"] in BASELINES]
            loaded = [p.get(key) for p in passes]
            if None in base or None in loaded or not base:
                continue
            self.ratio(
                f"{what} server CPU, {scenario}",
                median(base),
                median(loaded),
                False,
                "ms",
                paired=paired_ratios(mine, lambda entry, key=key: entry[key]),
            )

    def memory(self, result: dict[str, Any]) -> None:
        memory = result.get("memory")
        if memory and memory.get("rss_10k_mib"):
            self.items.append(
                {
                    "check": f"worker RSS at {memory['messages']:,} vs at 10,000 handled",
                    "baseline": memory["rss_10k_mib"],
                    "loaded": memory["rss_end_mib"],
                    "ratio": memory["rss_end_mib"] / memory["rss_10k_mib"],
                    "rule": f"<= {1.0 + self.tolerance:.2f}",
                    "unit": "MiB",
                    "passed": memory["rss_end_mib"]
                    <= memory["rss_10k_mib"] * (1.0 + self.tolerance),
                }
            )


def checks(result: dict[str, Any], tolerance: float, slack_ms: float) -> list[dict[str, Any]]:
    """Every check of ``result``, in order: drains, claims, memory."""
    found = Checks(result, tolerance, slack_ms)
    found.drains(result)
    found.claims(result)
    found.memory(result)
    return found.items
