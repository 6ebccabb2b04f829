"""Every measurement of one system, and the runs made again in turn (the
raw loop and django-pgqueue's enqueue; the one-process drains the targets
compare), whose ratios leave out how the machine's speed drifted."""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable
from typing import Any

import psycopg

from benchmarks.harness.numbers import median, round_ratios
from benchmarks.harness.pgstats import Stats
from benchmarks.scenarios.compare import REPEAT_MAX_DRAIN_S, StepFailed
from benchmarks.scenarios.compare.load import load_text, measure_load, offered_rate
from benchmarks.scenarios.compare.measure import (
    drain_run,
    enqueue_single,
    measure_idle,
    measure_latency,
    representative,
    startup_cpu,
)
from benchmarks.scenarios.compare.system import System
from benchmarks.scenarios.compare.systems import PgQueue

Result = dict[str, Any]


def set_up(system: System, result: Result) -> bool:
    """Install and set up ``system``; False (``result`` says why) when it cannot be."""
    try:
        system.install(system.opts.log_dir)
        system.info = system.client("info")
        system.setup_database()
    except Exception as exc:  # cannot be installed or set up: not run, the others go on
        result["status"] = "not run"
        result["reason"] = (
            str(exc) if isinstance(exc, StepFailed) else f"{type(exc).__name__}: {exc}"
        )
        print(f"  NOT RUN: {exc}", file=sys.stderr)
        return False
    result["versions"] = system.info.get("versions")
    result["python"] = system.info.get("python")
    result["runtime"] = system.info.get("runtime") or f"Python {result['python']}"
    result["database"] = system.dbname
    result["worker_args"] = system.worker_args
    result["notes"] = {
        "worker": system.worker_note,
        "enqueue_single": system.single_note,
        "enqueue_bulk": system.bulk_note,
        "idle": system.poll_note,
    }
    if system.pins:
        result["pins"] = system.pins
        result["pip_freeze"] = system.pip_freeze()
    return True


def server_text(run: dict[str, Any]) -> str:
    """The server's CPU and WAL per job of a drain run, for the progress lines."""
    cpu, wal = run.get("server_cpu_us_per_job"), run.get("wal_bytes_per_job")
    text = f", server CPU {cpu:6.1f} us/job" if cpu is not None else ""
    if (backends := run.get("backends_cpu_us_per_job")) is not None:
        text += f" (its backends {backends:5.1f})"
    return text + (f", WAL {wal:5.0f} B/job" if wal is not None else "")


def drains(system: System, stats: Stats, step: Callable[..., Any]) -> dict[str, Any]:
    """Drain throughput, 1 and 2 worker processes, per variant (each fills the
    queue with the bulk API first: that is the bulk enqueue figure)."""
    opts = system.opts
    out = {}
    for variant in system.variants():
        # A worker's start-up and exit CPU, taken off the drains' CPU per job.
        startup_runs = step(
            f"{variant.label}, start-up CPU", lambda v=variant: startup_cpu(system, v)
        )
        startup = statistics.median(startup_runs) if startup_runs else None
        runs = {}
        for processes in opts.processes:
            repeats = []
            for i in range(opts.repeat):
                run = step(
                    f"{variant.label}, {processes} process(es)",
                    lambda v=variant, p=processes, i=i, s=startup: drain_run(
                        system, stats, v, p, opts.messages, f"r{i}", s
                    ),
                )
                if run is None:
                    break
                repeats.append(run)
                jobs = run.get("jobs_per_s")
                cpu = run.get("worker_cpu_us_per_job")
                note = f"; {'; '.join(run['problems'])}" if run["problems"] else ""
                print(
                    f"  {variant.label:42} {processes}p: "
                    + (f"{jobs:9,.0f} jobs/s" if jobs else "        -")
                    + (f", worker CPU {cpu:6.1f} us/job" if cpu is not None else "")
                    + server_text(run)
                    + f" (bulk enqueue {run['bulk_enqueue_per_s']:,.0f}/s){note}",
                    file=sys.stderr,
                )
                if run["timed_out"] or (run.get("drain_s") or 0) > REPEAT_MAX_DRAIN_S:
                    break  # slow enough to be steady: not repeated
            if repeats:
                runs[str(processes)] = representative(repeats)
        out[variant.key] = {
            "label": variant.label,
            "worker": system.command_text(variant, True),
            "worker_env": variant.env,
            "startup_cpu_s": startup,  # the median of startup_cpu_runs, taken off
            "startup_cpu_runs": startup_runs,
            "runs": runs,
        }
    return out


def run_system(system: System, stats: Stats) -> Result:
    opts = system.opts
    result: Result = {"name": system.name, "label": system.label, "status": "ok", "errors": []}
    print(f"\n== {system.label}", file=sys.stderr)
    if not set_up(system, result):
        return result
    variants = system.variants()

    def step(what: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except Exception as exc:  # one measurement failed: record it, go on with the next
            text = str(exc) if isinstance(exc, StepFailed) else f"{type(exc).__name__}: {exc}"
            result["errors"].append(f"{what}: {text}")
            print(f"  {what} FAILED: {text}", file=sys.stderr)
            return None

    # Enqueue, one message per transaction: --repeat runs, the median counts
    # (a run is short, about a second, and commit latency here drifts).
    rates = step(
        "enqueue one per transaction",
        lambda: [
            enqueue_single(system, variants[0], opts.enqueue_messages) for _ in range(opts.repeat)
        ],
    )
    rate = statistics.median(rates) if rates else None
    result["enqueue_single_per_s"] = rate
    result["enqueue_single_all"] = rates
    if rate:
        shown = ", ".join(f"{r:,.0f}" for r in rates)
        print(f"  enqueue, one per transaction: {rate:,.0f}/s (runs: {shown})", file=sys.stderr)

    result["variants"] = drains(system, stats, step)
    bulk = [
        rate
        for v in result["variants"].values()
        for r in v["runs"].values()
        for rate in r["bulk_enqueue_all"]
    ]
    result["enqueue_bulk_per_s"] = median(bulk)
    result["enqueue_bulk_all"] = bulk

    if opts.latency_samples:
        lat = step(
            "latency",
            lambda: measure_latency(system, opts.latency_samples, opts.latency_spacing_ms / 1000),
        )
        result["latency"] = lat
        if lat and "p50_ms" in lat:
            print(
                f"  latency p50 {lat['p50_ms']:.2f} ms, p95 {lat['p95_ms']:.2f} ms, "
                f"p99 {lat['p99_ms']:.2f} ms ({lat['handled']}/{lat['samples']})",
                file=sys.stderr,
            )
    if opts.load_rates and opts.load_seconds:
        result["load"] = loads(system, result, step)
    if opts.idle_seconds:
        idle = step(
            "idle", lambda: measure_idle(system, stats, opts.idle_settle, opts.idle_seconds)
        )
        result["idle"] = idle
        if idle:
            print(
                f"  idle: {idle['queries']} queries in {idle['window_s']:g} s"
                f" ({idle['transactions']} transactions, {idle['statements']} statements seen)",
                file=sys.stderr,
            )
    if isinstance(system, PgQueue):
        result["poll_interval_s"] = system.poll_interval
        result["keep_finished_s"] = system.info.get("keep_finished")  # 0: no history
    rss = [
        x
        for v in result["variants"].values()
        for r in v["runs"].values()
        for x in r["peak_rss_mib"]
    ]
    rss += [m["peak_rss_mib"] for m in (result.get("latency"), result.get("idle")) if m]
    rss += [m["peak_rss_mib"] for m in result.get("load") or [] if "peak_rss_mib" in m]
    result["peak_rss_mib"] = max(rss) if rss else None
    try:
        system.reset()
    except psycopg.Error:
        pass
    return result


def loads(system: System, result: Result, step: Callable[..., Any]) -> list[dict[str, Any]]:
    """Latency at load, one run per ``--load-rates`` item (a percentage: of
    this system's fastest one-process drain, its own)."""
    opts = system.opts
    best = best_variant(result)
    drain_rate = result["variants"][best[0]]["runs"]["1"]["jobs_per_s"] if best else None
    out = []
    for item in opts.load_rates:
        rate = offered_rate(item, drain_rate)
        if not rate:
            out.append({"rate": item, "problem": "no one-process drain rate measured"})
            continue
        load = step(
            f"latency at {rate:,.0f}/s offered",
            lambda r=rate: measure_load(
                system, r, opts.load_seconds, opts.load_senders, drain_rate, opts.load_batch
            ),
        )
        if load:
            load["rate"] = item
            out.append(load)
            print(f"  latency at load: {load_text(load)}", file=sys.stderr)
    return out


Ran = dict[str, tuple[System, Result]]


def paired_enqueue(raw: tuple[System, Result], pgqueue: tuple[System, Result], opts: Any) -> None:
    """The one-per-transaction enqueue of the raw loop and of django-pgqueue
    again, in alternation, --repeat pairs: each is bound by the commit's WAL
    flush, whose latency on a shared machine drifts by a third within
    minutes, so the target compares runs made side by side (the median of
    the pairs' ratios), not runs made minutes apart."""
    pairs = []
    print(
        "\n== enqueue one per transaction, the raw loop and django-pgqueue in turn", file=sys.stderr
    )
    for _ in range(opts.repeat):
        pair = []
        for system, result in (raw, pgqueue):
            if result.get("status") != "ok":
                return
            pair.append(enqueue_single(system, system.variants()[0], opts.enqueue_messages))
        pairs.append(pair)
        print(
            f"  raw {pair[0]:,.0f}/s, django-pgqueue {pair[1]:,.0f}/s: {pair[1] / pair[0]:.0%}",
            file=sys.stderr,
        )
    pgqueue[1]["enqueue_single_paired"] = {
        "pairs": pairs,
        "ratio": statistics.median(round_ratios((q, r) for r, q in pairs)),
    }


def best_variant(result: Result) -> tuple[str, str] | None:
    """The key of a system's fastest one-process drain variant (its label), or None."""
    ranked = [
        (run["jobs_per_s"], key, variant["label"])
        for key, variant in (result.get("variants") or {}).items()
        if (run := variant["runs"].get("1")) and run.get("jobs_per_s")
    ]
    return max(ranked)[1:] if ranked else None


def paired_drains(ran: Ran, stats: Stats, opts: Any) -> dict[str, Any] | None:
    """The one-process drains that the targets compare, run again in turn,
    --repeat rounds: the raw loop with batch 100, django-pgqueue (every
    variant run: tuned and defaults) and the fastest variant of pgqueuer and
    of graphile-worker. Drains of different systems otherwise run minutes
    apart, and this machine's speed moves by a third within minutes, so a
    ratio of two such runs measures the moment as much as the systems. The
    targets take the median of the rounds' ratios; the table keeps the main
    runs. Each round also records the workers' CPU per job (``cpu_rounds``)
    and the server's CPU and WAL per job (``server_rounds``)."""
    entries = []
    for name in ("raw", "pgqueue"):
        if name in ran and ran[name][1].get("status") == "ok":
            keys = ["batch100"] if name == "raw" else [v.key for v in ran[name][0].variants()]
            entries += [(name, key) for key in keys]
    for peer in ("pgqueuer", "graphile"):
        if peer in ran and ran[peer][1].get("status") == "ok":
            best = best_variant(ran[peer][1])
            if best:
                entries.append((peer, best[0]))
    if not any(name == "pgqueue" for name, _ in entries) or len(entries) < 3:
        return None
    print("\n== one-process drains again, in turn (for the targets' ratios)", file=sys.stderr)
    rounds, cpu_rounds, server_rounds = [], [], []
    for i in range(opts.repeat):
        rates, cpu, server = {}, {}, {}
        for name, key in entries:
            system = ran[name][0]
            variant = next(v for v in system.variants() if v.key == key)
            try:
                startup = statistics.median(startup_cpu(system, variant))  # the main runs'
                run = drain_run(system, stats, variant, 1, opts.messages, f"pair{i}", startup)
            except Exception as exc:  # noqa: BLE001  (a failed drain: the round is incomplete)
                print(f"  {name}/{key} FAILED: {exc}", file=sys.stderr)
                return None
            if run["problems"] or run["timed_out"] or not run.get("jobs_per_s"):
                print(f"  {name}/{key}: {'; '.join(run['problems']) or 'no rate'}", file=sys.stderr)
                return None
            rates[f"{name}/{key}"] = run["jobs_per_s"]
            cpu[f"{name}/{key}"] = run.get("worker_cpu_us_per_job")
            server[f"{name}/{key}"] = [
                run.get("server_cpu_us_per_job"),
                run.get("wal_bytes_per_job"),
            ]
        rounds.append(rates)
        cpu_rounds.append(cpu)
        server_rounds.append(server)
        print("  " + ", ".join(f"{k} {v:,.0f}/s" for k, v in rates.items()), file=sys.stderr)
    return {
        "entries": [f"{n}/{k}" for n, k in entries],
        "rounds": rounds,
        "cpu_rounds": cpu_rounds,
        # [server CPU us, WAL bytes] per message of each drain of each round
        "server_rounds": server_rounds,
    }


def paired_ratio(
    paired: dict[str, Any] | None, mine: str, other: str
) -> tuple[float, list[tuple[float, float]]] | None:
    """(median of the rounds' mine/other ratios, the rounds' (mine, other)) or None."""
    if not paired or not all(mine in r and other in r for r in paired["rounds"]):
        return None
    pairs = [(r[mine], r[other]) for r in paired["rounds"]]
    return statistics.median(round_ratios(pairs)), pairs
