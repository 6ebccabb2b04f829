"""Latency at load: enqueue-to-start of a listening worker while messages
are offered at a fixed rate, open loop.

Several sender processes (the system's client, ``latency-enqueue --rate``)
share one schedule: message i is due at start + i / rate, sender j sends
messages j, j + senders, ...; each is sent when due, one transaction each,
whatever the worker does (at once when the sender is late; with
``--load-batch``, a late sender sends every message due by then in one
transaction), and its commit time is recorded when the call returns. The
handler's first act records its start (as the latency measurement's).
The senders start, connect, say "ready", and the schedule begins when all
are. Reported: commit to handler start (p50/p95/p99), due to handler start
(the same plus the senders' lag: what an open-loop client would see), the
senders' lag and the rate they reached; a rate they did not reach (one
transaction per message costs a commit each) is flagged, not hidden."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from benchmarks.harness.monitor import wait_until
from benchmarks.harness.numbers import distribution, percentile
from benchmarks.harness.processes import Process
from benchmarks.scenarios.compare import StepFailed
from benchmarks.scenarios.compare.measure import start_listening_worker
from benchmarks.scenarios.compare.system import System

LEAD_S = 0.2  # from every sender ready (connected) to message 0 due
# A sender stops sending this many times the schedule's length after its
# start (plus a second): one that cannot keep up would otherwise take
# minutes at a rate it does not reach; what it did not send is counted.
STOP_AFTER = 2.0
REACHED = 0.95  # the senders reached the offered rate when they sent at least this share of it


def parse_rates(spec: str) -> list[str]:
    """``--load-rates``: "1000,50%" -> ["1000", "50%"]; "0" or "": none."""
    items = [s.strip() for s in spec.split(",") if s.strip() and s.strip() not in ("0", "0%")]
    for item in items:
        float(item.removesuffix("%"))  # ValueError: the parser's error
    return items


def offered_rate(item: str, drain_rate: float | None) -> float | None:
    """A ``--load-rates`` item in messages/s: a number, or a percentage of
    ``drain_rate`` (None when that was not measured)."""
    if item.endswith("%"):
        return drain_rate * float(item[:-1]) / 100 if drain_rate else None
    return float(item)


def start_together(procs: list[Process], start_file: Path, seconds: float) -> float:
    """Once every sender said "ready" (connected), write the schedule's start,
    LEAD_S from now, and its stop into ``start_file``; returns the start."""

    def ready() -> bool:
        for p in procs:
            if p.poll() is not None:
                raise StepFailed(f"a sender exited {p.returncode}:\n{p.log_tail(8)}")
        return all("ready\n" in p.log_text() for p in procs)

    if not wait_until(ready, 120, poll=0.02):
        raise StepFailed("the senders were not ready within 120 s")
    start_at = time.time() + LEAD_S
    partial = start_file.with_suffix(".partial")
    partial.write_text(f"{start_at:.6f} {start_at + STOP_AFTER * seconds + 1:.6f}")
    partial.rename(start_file)
    return start_at


def measure_load(
    system: System,
    rate: float,
    seconds: float,
    senders: int,
    drain_rate: float | None,
    batch: bool = False,
) -> dict[str, Any]:
    """``rate`` x ``seconds`` messages offered to a warmed-up listening worker
    by ``senders`` processes on one open-loop schedule; ``batch``: a late
    sender sends the messages due by then in one transaction."""
    n = max(1, round(rate * seconds))
    tag = f"{rate:.0f}"
    latency_file = system.opts.log_dir / f"{system.name}-load-{tag}.txt"
    latency_file.unlink(missing_ok=True)
    worker, _ = start_listening_worker(system, f"load-{tag}", latency_file)
    procs = []
    try:
        time.sleep(1.0)  # let it go idle
        start_file = system.opts.log_dir / f"{system.name}-load-{tag}.start"
        start_file.unlink(missing_ok=True)
        procs = [
            system.start_client(
                "latency-enqueue",
                *["--n", n, "--rate", rate, "--start-file", start_file],
                *["--senders", senders, "--sender", j, "--prefix", "load"],
                *(["--batch-late"] if batch else []),
                log_name=f"load-{tag}-sender{j}",
            )
            for j in range(senders)
        ]
        start_at = start_together(procs, start_file, seconds)
        answers = [system.client_answer(p, n / 100 + 60) for p in procs]
        sent = [row for answer in answers for row in answer["sent"]]
        keys = {row[0] for row in sent}
        # An overloaded worker (offered more than it drains) needs longer to finish.
        grace = 30 + (n / drain_rate if drain_rate else 30)

        def all_handled() -> bool:
            return keys <= set(system.latency_results(latency_file))

        complete = wait_until(all_handled, grace, 0.2)
    finally:
        for p in procs:
            p.kill()
        code = worker.terminate()
    if not sent:
        raise StepFailed(f"load at {rate:,.0f}/s: no message sent")
    found = system.latency_results(latency_file)
    from_commit, from_due, lag = [], [], []
    missing = dupes = 0
    for key, committed, due in sent:
        lag.append(1000.0 * (committed - due))
        starts = found.get(key)
        if not starts:
            missing += 1
            continue
        dupes += len(starts) > 1
        from_commit.append(1000.0 * (min(starts) - committed))
        from_due.append(1000.0 * (min(starts) - due))
    last_commit = max(row[1] for row in sent)
    sent_rate = len(sent) / (last_commit - start_at + 1 / rate)
    result: dict[str, Any] = {
        "offered_per_s": rate,
        "seconds": seconds,
        "messages": n,
        "unsent": n - len(sent),  # the senders stopped, far behind (STOP_AFTER)
        "senders": senders,
        "batch": batch,
        "transactions": sum(a.get("transactions") or 0 for a in answers),
        "sent_per_s": sent_rate,
        "reached": len(sent) == n and sent_rate >= REACHED * rate,
        "late_start": max(a["ready_at"] for a in answers) > start_at,
        "send_lag_p50_ms": percentile(lag, 50),
        "send_lag_p99_ms": percentile(lag, 99),
        "handled": len(from_commit),
        "missing": missing,
        "duplicated": dupes,
        "complete": complete,
        "worker_exit": code,
        "peak_rss_mib": round(worker.peak_rss_mib, 1),
    }
    if from_commit:
        result.update(distribution(from_commit))
        result["from_due"] = distribution(from_due)
    return result


def load_text(load: dict[str, Any]) -> str:
    """One load run, for the progress lines and the report's notes."""
    if "p50_ms" not in load:
        return f"{load['offered_per_s']:,.0f}/s offered: nothing handled"
    text = (
        f"{load['offered_per_s']:,.0f}/s offered, {load['sent_per_s']:,.0f}/s sent"
        f" ({load['senders']} senders, lag p99 {load['send_lag_p99_ms']:.1f} ms): p50"
        f" {load['p50_ms']:.1f}, p95 {load['p95_ms']:.1f}, p99 {load['p99_ms']:.1f} ms"
    )
    if not load["reached"]:
        text += " (offered rate NOT reached)"
    if load["missing"] or load["duplicated"]:
        text += f" ({load['missing']} lost, {load['duplicated']} dup)"
    return text
