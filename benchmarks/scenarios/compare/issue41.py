"""Issue 41's targets (performance), computed from one run of the compare
scenario: ratios of figures measured side by side, the drains' from the
rounds run in turn (``paired_drains``) when there are. Each is named
"issue 41: ..."; n/a when a system or figure it needs was not measured."""

from __future__ import annotations

import statistics
from typing import Any

from benchmarks.scenarios.compare.run import best_variant, paired_ratio
from benchmarks.scenarios.compare.targets import Targets, jobs

NONATOMIC_VS_GRAPHILE = 1.5  # 1. tuned atomic=False vs graphile-worker tuned, 1 process
ATOMIC_VS_GRAPHILE = 1.3  # 1. tuned atomic=True
NONATOMIC_VS_RAW = 0.8  # 2. tuned atomic=False vs the raw loop, batch 100, 1 process
TWO_VS_ONE = 1.6  # 2. two default workers vs one
DEFAULTS_VS_TUNED = 0.85  # 3.
SERVER_CPU_VS_GRAPHILE = 1.0  # 4. server CPU per message, at most graphile-worker's
WAL_VS_GRAPHILE = 1.25  # 4. WAL bytes per message, history on
ENQUEUE_MANY_VS_RAW = 0.85  # 5. enqueue_many, chunks of 1,000, vs the raw bulk INSERT
# 7. latency at load: p99 at most graphile-worker's at the same offered rate

PREFIX = "issue 41: "
SERVER = {"server_cpu_us_per_job": (0, "server CPU", "us"), "wal_bytes_per_job": (1, "WAL", "B")}


def server_figures(
    result: dict[str, Any], key: str, name: str, rounds: list[dict[str, Any]], figure: str
) -> list[float]:
    """``figure`` (server_cpu_us_per_job or wal_bytes_per_job) of every
    one-process drain of variant ``key``: the main runs' and the rounds'."""
    index = SERVER[figure][0]
    run = jobs(result, key, 1)[1] or {}
    values = [r.get(figure) for r in run.get("all", [])]
    values += [(r.get(f"{name}/{key}") or [None, None])[index] for r in rounds]
    return [v for v in values if v is not None]


def backends_text(pgq: dict[str, Any], key: str, graphile: dict[str, Any], other: str) -> str:
    """The CPU of the systems' own backends only (main runs), beside the whole server's."""
    mine = (jobs(pgq, key, 1)[1] or {}).get("backends_cpu_us_per_job")
    theirs = (jobs(graphile, other, 1)[1] or {}).get("backends_cpu_us_per_job")
    if mine is None or theirs is None:
        return ""
    return f"; their own backends only: {mine:,.1f} vs {theirs:,.1f} us = {mine / theirs:.2f}x"


def server_cost(
    targets: Targets,
    pgq: dict[str, Any],
    graphile: dict[str, Any] | None,
    rounds: list[dict[str, Any]],
) -> None:
    """Target 4: the server's CPU and WAL per message, django-pgqueue's tuned
    workers (1 process) against graphile-worker's fastest variant."""
    best = best_variant(graphile) if graphile else None
    history = pgq.get("keep_finished_s")
    for figure, factor in (
        ("server_cpu_us_per_job", SERVER_CPU_VS_GRAPHILE),
        ("wal_bytes_per_job", WAL_VS_GRAPHILE),
    ):
        _, what, unit = SERVER[figure]
        for handlers, key in (("atomic=False", "nonatomic"), ("atomic=True", "atomic")):
            name = f"{PREFIX}{what} per message, {handlers} tuned, 1 process"
            required = f"<= {factor:g}x graphile-worker's (its fastest variant)"
            if figure == "wal_bytes_per_job" and history is not None:
                name += f" (history {'on' if history else 'OFF'})"
            if not best or not graphile:
                targets.add(name, required, note="graphile-worker not run")
                continue
            mine = server_figures(pgq, key, "pgqueue", rounds, figure)
            other = server_figures(graphile, best[0], "graphile", rounds, figure)
            if not mine or not other:
                targets.add(name, required, note="not measured (the server not on this machine?)")
                continue
            m, o = statistics.median(mine), statistics.median(other)
            value = (
                f"{m:,.1f} vs {o:,.1f} {unit} = {m / o:.2f}x (medians of {len(mine)} and"
                f" {len(other)} drains, main runs and rounds; the whole server"
            )
            if figure == "server_cpu_us_per_job":
                value += backends_text(pgq, key, graphile, best[0])
            value += ")"
            targets.add(name, required, value, m <= factor * o)


def scaling(targets: Targets, pgq: dict[str, Any]) -> None:
    """Target 2: two default workers against one (the main runs' medians)."""
    for handlers, key in (
        ("atomic=False", "nonatomic-defaults"),
        ("atomic=True", "atomic-defaults"),
    ):
        name = f"{PREFIX}two default workers vs one, {handlers}"
        required = f">= {TWO_VS_ONE:g}x"
        one, two = jobs(pgq, key, 1)[0], jobs(pgq, key, 2)[0]
        if not one or not two:
            targets.add(name, required, note="needs --processes 1,2 and the defaults variants")
            continue
        value = f"{two / one:.2f}x ({two:,.0f} vs {one:,.0f}/s, medians of the main runs)"
        targets.add(name, required, value, two / one >= TWO_VS_ONE)


def load_latency(targets: Targets, pgq: dict[str, Any], graphile: dict[str, Any] | None) -> None:
    """Target 7: django-pgqueue's p99 enqueue-to-start at each offered rate at
    most graphile-worker's."""
    mine = {r["rate"]: r for r in pgq.get("load") or [] if "p99_ms" in r}
    other = {r["rate"]: r for r in (graphile or {}).get("load") or [] if "p99_ms" in r}
    for item in sorted(set(mine) | set(other), key=lambda i: (i.endswith("%"), i)):
        rate = f"{item} of each one's drain rate" if item.endswith("%") else f"{item}/s"
        name = f"{PREFIX}latency at load p99, {rate} offered"
        required = "<= graphile-worker's p99"
        if item not in mine or item not in other:
            targets.add(name, required, note="not measured for both")
            continue
        m, o = mine[item], other[item]
        value = (
            f"{m['p99_ms']:.1f} vs {o['p99_ms']:.1f} ms (p50 {m['p50_ms']:.1f} vs"
            f" {o['p50_ms']:.1f}; offered {m['offered_per_s']:,.0f} vs {o['offered_per_s']:,.0f}/s,"
            f" sent {m['sent_per_s']:,.0f} vs {o['sent_per_s']:,.0f}/s)"
        )
        notes = [
            f"{who}: offered rate not reached"
            for who, r in (("ours", m), ("graphile-worker", o))
            if not r["reached"]
        ]
        notes += [
            f"{who}: {r['missing']} lost, {r['duplicated']} duplicated"
            for who, r in (("ours", m), ("graphile-worker", o))
            if r["missing"] or r["duplicated"]
        ]
        complete = not (m["missing"] or m["duplicated"])
        targets.add(
            name, required, value, m["p99_ms"] <= o["p99_ms"] and complete, "; ".join(notes)
        )


def issue41_targets(
    results: list[dict[str, Any]], paired: dict[str, Any] | None
) -> list[dict[str, Any]]:
    by = {r["name"]: r for r in results if r.get("status") == "ok"}
    raw, pgq, graphile = by.get("raw"), by.get("pgqueue"), by.get("graphile")
    targets = Targets()
    if not pgq:
        targets.add(f"{PREFIX}targets", "-", note="django-pgqueue was not run")
        return targets.items
    nonatomic, atomic = jobs(pgq, "nonatomic", 1)[0], jobs(pgq, "atomic", 1)[0]
    for handlers, mine, key, factor in (
        ("atomic=False", nonatomic, "nonatomic", NONATOMIC_VS_GRAPHILE),
        ("atomic=True", atomic, "atomic", ATOMIC_VS_GRAPHILE),
    ):
        name = f"{PREFIX}drain, {handlers} tuned vs graphile-worker tuned"
        targets.peer(name, mine, key, "graphile", graphile, factor, paired)
    targets.share(
        f"{PREFIX}drain, atomic=False tuned vs the raw loop, 1 process",
        NONATOMIC_VS_RAW,
        "raw batch-100",
        paired_ratio(paired, "pgqueue/nonatomic", "raw/batch100"),
        "rounds",
        nonatomic,
        jobs(raw, "batch100", 1)[0],
    )
    scaling(targets, pgq)
    for handlers, tuned in (("atomic=False", "nonatomic"), ("atomic=True", "atomic")):
        key, name = f"{tuned}-defaults", f"{PREFIX}defaults vs tuned, {handlers}, 1 process"
        targets.share(
            name,
            DEFAULTS_VS_TUNED,
            f"{handlers} tuned",
            paired_ratio(paired, f"pgqueue/{key}", f"pgqueue/{tuned}"),
            "rounds",
            jobs(pgq, key, 1)[0],
            jobs(pgq, tuned, 1)[0],
        )
    server_cost(targets, pgq, graphile, (paired or {}).get("server_rounds", []))
    targets.share(
        f"{PREFIX}enqueue_many(), chunks of 1,000",
        ENQUEUE_MANY_VS_RAW,
        "raw bulk insert",
        None,
        "runs",
        pgq.get("enqueue_bulk_per_s"),
        (raw or {}).get("enqueue_bulk_per_s"),
    )
    load_latency(targets, pgq, graphile)
    return targets.items
