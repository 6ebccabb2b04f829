"""Enqueue commit to handler start, with an idle listening worker."""

from __future__ import annotations

import time
from dataclasses import dataclass

from benchmarks.harness import db
from benchmarks.harness.monitor import wait_until
from benchmarks.harness.numbers import distribution, percentile
from benchmarks.harness.pgstats import Stats
from benchmarks.harness.worker import TOPIC_LATENCY, Bench, Combo, worker_options


@dataclass
class LatencyResult:
    concurrency: int
    batch_size: int | None
    samples: int
    spacing_ms: float
    p50_ms: float
    p95_ms: float
    p99_ms: float
    min_ms: float
    max_ms: float
    mean_ms: float
    enqueue_call_p50_ms: float
    peak_rss_mib: float


def latency(
    bench: Bench, stats: Stats, combo: Combo, samples: int, spacing: float
) -> LatencyResult:
    """``samples`` bench.latency messages enqueued one at a time in
    autocommit, ``spacing`` seconds apart, the wall clock read as enqueue()
    returns (the commit is done then); the handler saves a demo.Handled row
    first thing, whose handled_at (the worker's clock, same machine) is the
    start. ``combo``: the worker's (concurrency, batch size). Every message
    must be handled exactly once; the worker is then stopped with SIGTERM
    and must exit 0."""
    from demo.models import Handled
    from django.db import connection

    from django_pgqueue import enqueue

    db.truncate()
    worker = bench.worker("latency", worker_options(*combo))
    worker.wait_listening(stats, bench.dbname)
    time.sleep(1.0)  # let the start-up claim and maintenance pass
    if connection.in_atomic_block:
        raise db.CheckFailed("the benchmark's own connection is inside a transaction")
    committed = {}
    call_ms = []
    for i in range(samples):
        started = time.time()
        message = enqueue(TOPIC_LATENCY, {"i": i})  # autocommit: committed on return
        done = time.time()
        committed[message.pk] = done
        call_ms.append(1000.0 * (done - started))
        time.sleep(spacing)
    if not wait_until(
        lambda: (
            Handled.objects.filter(topic=TOPIC_LATENCY).count() >= samples
            and db.count(db.MESSAGE_TABLE) == 0
        ),
        30,
        poll=0.05,
    ):
        raise db.CheckFailed(
            "timed out after 30s waiting for the latency messages to be handled and acknowledged"
        )
    worker.stop()
    worker.check_clean("latency worker (SIGTERM)")
    if db.count(db.DEADLETTER_TABLE):
        raise db.CheckFailed("latency run: dead letters exist")

    handled = list(
        Handled.objects.filter(topic=TOPIC_LATENCY).values_list("message_id", "handled_at")
    )
    ids = [pk for pk, _ in handled]
    if sorted(ids) != sorted(committed):
        raise db.CheckFailed(
            f"latency run: {len(handled)} Handled rows for {len(committed)} messages "
            "(missing or duplicated handler runs)"
        )
    values = [1000.0 * (at.timestamp() - committed[pk]) for pk, at in handled]
    return LatencyResult(
        concurrency=combo[0],
        batch_size=combo[1],
        samples=samples,
        spacing_ms=1000.0 * spacing,
        **distribution(values),
        enqueue_call_p50_ms=percentile(call_ms, 50),
        peak_rss_mib=worker.peak_rss_mib,
    )
