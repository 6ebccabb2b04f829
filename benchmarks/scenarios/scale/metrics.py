"""A worker's Prometheus metrics: its claim histogram and message counters."""

from __future__ import annotations

import urllib.request
from typing import Any


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=10) as response:
        return response.read().decode()


def histogram_quantile(buckets: list[tuple[float, float]], q: float) -> float | None:
    """Like PromQL's histogram_quantile: linear inside the bucket the rank falls in.
    ``buckets``: [(upper bound, cumulative count)]. None without observations."""
    buckets = sorted(buckets)
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    prev_le, prev_count = 0.0, 0.0
    for le, cumulative in buckets:
        if cumulative >= rank:
            if le == float("inf"):
                return prev_le  # beyond the last finite bound: a lower bound
            if cumulative == prev_count:
                return le
            return prev_le + (le - prev_le) * (rank - prev_count) / (cumulative - prev_count)
        prev_le, prev_count = le, cumulative
    return prev_le


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1000.0 * seconds


def worker_metrics(text: str) -> dict[str, Any]:
    """The claim figures and message counters of one scrape."""
    from prometheus_client.parser import text_string_to_metric_families

    claim_buckets, batch = [], {}
    claim_sum = claim_count = 0.0
    messages: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name, labels, value = sample.name, sample.labels, sample.value
            if name == "pgqueue_worker_claim_duration_seconds_bucket":
                claim_buckets.append((float(labels["le"]), value))
            elif name == "pgqueue_worker_claim_duration_seconds_sum":
                claim_sum = value
            elif name == "pgqueue_worker_claim_duration_seconds_count":
                claim_count = value
            elif name == "pgqueue_worker_claim_batch_size_sum":
                batch["sum"] = value
            elif name == "pgqueue_worker_claim_batch_size_count":
                batch["count"] = value
            elif name == "pgqueue_worker_messages_total":
                key = f"{labels.get('topic')}/{labels.get('outcome')}"
                messages[key] = messages.get(key, 0) + value
    return {
        "claims": int(claim_count),
        "claim_mean_ms": 1000.0 * claim_sum / claim_count if claim_count else None,
        "claim_p50_ms": _ms(histogram_quantile(claim_buckets, 0.50)),
        "claim_p99_ms": _ms(histogram_quantile(claim_buckets, 0.99)),
        "claim_batch_mean": batch["sum"] / batch["count"] if batch.get("count") else None,
        "messages_total": messages,
    }
