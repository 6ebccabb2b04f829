"""django-pgqueue's targets, computed from one run of the compare scenario: PASS, FAIL,
or n/a when a figure they need was not measured."""

from __future__ import annotations

import statistics
from typing import Any

from benchmarks.harness.worker import idle_statements_allowed
from benchmarks.scenarios.compare.run import best_variant, paired_ratio

# The targets of the issue, checked as ratios in the same run.
TARGET_NONATOMIC_VS_RAW = 0.5  # atomic=False, 1 process, vs raw batch-100, 1 process
TARGET_ATOMIC_JOBS = 5000.0  # atomic=True, 1 process
TARGET_ENQUEUE_VS_RAW = 0.8  # enqueue() one per transaction vs raw one per transaction
TARGET_ENQUEUE_MANY_VS_RAW = 0.6  # enqueue_many (chunks of 1,000) vs the raw bulk insert
TARGET_P50_MS = 3.0
TARGET_P99_MS = 15.0
TARGET_NONATOMIC_VS_PGQUEUER = 2.0
TARGET_ATOMIC_VS_PGQUEUER = 1.0
TARGET_NONATOMIC_VS_GRAPHILE = 1.05  # ahead of the fastest peer: graphile-worker, tuned
TARGET_ATOMIC_VS_GRAPHILE = 0.9
TARGET_DEFAULTS_VS_TUNED = 0.8  # the worker with no option vs --pgqueue-worker-args
TARGET_NONATOMIC_CPU_US = 20.0  # worker CPU per job, atomic=False tuned, 1 process
TARGET_VS_SLOW_PEERS = 20.0  # procrastinate and django-tasks-db

Pairs = list[tuple[float, float]]


def jobs(result: dict[str, Any] | None, variant: str, processes: int) -> tuple[Any, Any]:
    """(jobs/s, the run) of a system's variant with that many processes, or (None, None)."""
    try:
        run = result["variants"][variant]["runs"][str(processes)]  # type: ignore[index]
    except (KeyError, TypeError):
        return None, None
    return run.get("jobs_per_s"), run


def in_turn_text(value: str, pairs: Pairs, what: str, label: str = "") -> str:
    """``value``, the median of the ``pairs`` (mine, other) run in turn."""
    shown = ", ".join(f"{m:,.0f}/{o:,.0f}" for m, o in pairs)
    return f"{value}, the median of {len(pairs)} {what} run in turn ({label}{shown})"


class Targets:
    """The list of targets, each {target, value, required, met, note}; met
    is None when a figure it needs was not measured."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []

    def add(
        self, name: str, required: str, value: str | None = None, met: Any = None, note: str = ""
    ) -> None:
        self.items.append(
            {"target": name, "value": value or "-", "required": required, "met": met,
             "note": note}
        )  # fmt: skip

    def share(
        self,
        name: str,
        minimum: float,
        of: str,
        in_turn: tuple[float, Pairs] | None,
        what: str,
        mine: float | None,
        other: float | None,
    ) -> None:
        """django-pgqueue's figure as a share of another's: from the runs made
        in turn when there are, else from the main runs."""
        required = f">= {minimum:.0%} of {of}"
        if in_turn:
            ratio, pairs = in_turn
            self.add(name, required, in_turn_text(f"{ratio:.1%}", pairs, what), ratio >= minimum)
        elif mine and other:
            ratio = mine / other
            value = f"{mine:,.0f}/s = {ratio:.1%} of {other:,.0f}/s"
            self.add(name, required, value, ratio >= minimum)
        else:
            self.add(name, required, note="not measured")

    def cpu(self, name: str, limit: float, run: dict[str, Any] | None, more: list[Any]) -> None:
        """Worker CPU per job (start-up subtracted) below ``limit`` microseconds:
        the median of the main runs' (``run``) and of the rounds' (``more``)."""
        required = f"< {limit:g} us"
        each = [r.get("worker_cpu_us_per_job") for r in (run or {}).get("all", [])] + more
        each = [x for x in each if x is not None]
        if not each:
            self.add(name, required, note="not measured")
            return
        value = statistics.median(each)
        text = (
            f"{value:.1f} us, the median of {len(each)} runs, main and in turn"
            f" ({', '.join(f'{x:.1f}' for x in each)}; start-up"
            f" {(run or {}).get('startup_cpu_s', 0) * 1000:.0f} ms CPU subtracted)"
        )
        if value <= 0:  # the start-up's own variation is larger than the work
            self.add(name, required, text, None, "below the start-up's noise: more --messages")
            return
        self.add(name, required, text, value < limit)

    def rate(self, name: str, minimum: float, value: float | None) -> None:
        required = f">= {minimum:,.0f}/s"
        if value:
            self.add(name, required, f"{value:,.0f}/s", value >= minimum)
        else:
            self.add(name, required, note="not measured")

    def latency(self, lat: dict[str, Any]) -> None:
        for key, limit in (("p50", TARGET_P50_MS), ("p99", TARGET_P99_MS)):
            name = f"latency {key}, commit to handler start"
            required = f"< {limit:g} ms"
            if f"{key}_ms" not in lat:
                self.add(name, required, note="not measured")
                continue
            complete = lat["missing"] == 0 and lat["duplicated"] == 0
            note = "" if complete else f"{lat['missing']} missing, {lat['duplicated']} duplicated"
            value = lat[f"{key}_ms"]
            self.add(name, required, f"{value:.2f} ms", value < limit and complete, note)

    def idle(self, pgq: dict[str, Any]) -> None:
        name = "idle worker: statements per poll interval"
        idle = pgq.get("idle")
        if not idle:
            self.add(name, "one per poll interval", note="not measured")
            return
        poll = pgq.get("poll_interval_s") or 5.0
        allowed = idle_statements_allowed(idle["window_s"], poll)
        value = f"{idle['queries']} in {idle['window_s']:g} s (poll {poll:g} s)"
        required = f"<= {allowed} (one per poll, +-10% jitter)"
        self.add(name, required, value, idle["queries"] <= allowed)

    def peer(
        self,
        name: str,
        mine: float | None,
        variant: str,
        peer: str,
        result: dict[str, Any] | None,
        factor: float,
        drains_in_turn: dict[str, Any] | None,
    ) -> None:
        """django-pgqueue's drain against the peer's best one-process variant."""
        required = f">= {factor:g}x (1 process, the peer's best variant)"
        if result is None:
            self.add(name, required, note=f"{peer} not run")
            return
        candidates = [
            (run.get("jobs_per_s"), v["label"], run)
            for v in result["variants"].values()
            if (run := v["runs"].get("1")) and run.get("jobs_per_s")
        ]
        if not mine or not candidates:
            self.add(name, required, note="not measured")
            return
        value, label, run = max(candidates, key=lambda c: c[0])
        note = ""
        if run.get("timed_out"):
            note = "the peer hit the timeout: its rate is over the part drained"
        best = best_variant(result)
        in_turn = best and paired_ratio(drains_in_turn, f"pgqueue/{variant}", f"{peer}/{best[0]}")
        if in_turn:
            ratio, pairs = in_turn
            text = in_turn_text(f"{ratio:.2f}x", pairs, "rounds", f"{label}: ")
            self.add(name, required, text, ratio >= factor, note)
            return
        text = f"{mine / value:.2f}x ({mine:,.0f} vs {value:,.0f}/s, {label})"
        self.add(name, required, text, mine / value >= factor, note)


def build_targets(
    results: list[dict[str, Any]], opts: Any, drains_in_turn: dict[str, Any] | None = None
) -> list[dict[str, Any]]:
    """django-pgqueue's targets. Drain ratios come from ``drains_in_turn``
    (paired_drains) when it has them."""
    by = {r["name"]: r for r in results if r.get("status") == "ok"}
    raw, pgq = by.get("raw"), by.get("pgqueue")
    targets = Targets()
    if not pgq:
        targets.add("django-pgqueue targets", "-", note="django-pgqueue was not run")
        return targets.items
    atomic = jobs(pgq, "atomic", 1)[0]
    nonatomic, nonatomic_run = jobs(pgq, "nonatomic", 1)
    for handlers, tuned in (("atomic=False", "nonatomic"), ("atomic=True", "atomic")):
        key, name = f"{tuned}-defaults", f"{handlers}, worker defaults, 1 process"
        required = f"{handlers} tuned"
        if not {key, tuned} <= pgq["variants"].keys():
            targets.add(name, f">= {TARGET_DEFAULTS_VS_TUNED:.0%} of {required}", note="not run")
            continue
        targets.share(
            name,
            TARGET_DEFAULTS_VS_TUNED,
            required,
            paired_ratio(drains_in_turn, f"pgqueue/{key}", f"pgqueue/{tuned}"),
            "rounds",
            jobs(pgq, key, 1)[0],
            jobs(pgq, tuned, 1)[0],
        )
    targets.cpu(
        "worker CPU per job, atomic=False tuned, 1 process",
        TARGET_NONATOMIC_CPU_US,
        nonatomic_run,
        [r.get("pgqueue/nonatomic") for r in (drains_in_turn or {}).get("cpu_rounds", [])],
    )
    targets.share(
        "atomic=False throughput, 1 process",
        TARGET_NONATOMIC_VS_RAW,
        "raw batch-100",
        paired_ratio(drains_in_turn, "pgqueue/nonatomic", "raw/batch100"),
        "rounds",
        nonatomic,
        jobs(raw, "batch100", 1)[0],
    )
    targets.rate("atomic=True throughput, 1 process", TARGET_ATOMIC_JOBS, atomic)
    paired = pgq.get("enqueue_single_paired")
    targets.share(
        "enqueue(), one per transaction",
        TARGET_ENQUEUE_VS_RAW,
        "raw one-per-transaction",
        (paired["ratio"], [(q, r) for r, q in paired["pairs"]]) if paired else None,
        "pairs",
        pgq.get("enqueue_single_per_s"),
        (raw or {}).get("enqueue_single_per_s"),
    )
    targets.share(
        "enqueue_many()",
        TARGET_ENQUEUE_MANY_VS_RAW,
        "raw bulk insert",
        None,
        "runs",
        pgq.get("enqueue_bulk_per_s"),
        (raw or {}).get("enqueue_bulk_per_s"),
    )
    targets.latency(pgq.get("latency") or {})
    targets.idle(pgq)
    for name, mine, variant, peer, factor in (
        ("atomic=False vs pgqueuer", nonatomic, "nonatomic", "pgqueuer",
         TARGET_NONATOMIC_VS_PGQUEUER),
        ("atomic=True vs pgqueuer", atomic, "atomic", "pgqueuer", TARGET_ATOMIC_VS_PGQUEUER),
        ("atomic=False vs graphile-worker", nonatomic, "nonatomic", "graphile",
         TARGET_NONATOMIC_VS_GRAPHILE),
        ("atomic=True vs graphile-worker", atomic, "atomic", "graphile",
         TARGET_ATOMIC_VS_GRAPHILE),
        ("atomic=True vs procrastinate", atomic, "atomic", "procrastinate", TARGET_VS_SLOW_PEERS),
        ("atomic=True vs django-tasks-db", atomic, "atomic", "django-tasks-db",
         TARGET_VS_SLOW_PEERS),
    ):  # fmt: skip
        targets.peer(name, mine, variant, peer, by.get(peer), factor, drains_in_turn)
    return targets.items
