"""The scenarios of ``python -m benchmarks``: each is a module with a
``main(argv) -> int`` (its options, its run, its exit status), over the
shared harness (benchmarks/harness/); a scenario with several parts is a
package whose ``main`` module runs them (``one_worker``, ``scale``,
``compare``, ``streams``, ``chaos``, ``soak``, ``fair``).

``SCENARIOS`` is the list ``python -m benchmarks --help`` prints, in this
order: a new scenario is a module here and a line below.
"""

from __future__ import annotations

from typing import NamedTuple


class Scenario(NamedTuple):
    module: str  # the module with main(argv)
    measures: str  # one line, for --help and benchmarks/README.md


SCENARIOS: dict[str, Scenario] = {
    "throughput": Scenario(
        "benchmarks.scenarios.one_worker.main",
        "one worker: burst drain jobs/s, enqueue-to-start latency, an idle worker's queries",
    ),
    "compare": Scenario(
        "benchmarks.scenarios.compare.main",
        "django-pgqueue beside a raw loop, pgqueuer, graphile-worker, procrastinate and"
        " django-tasks-db: enqueue, drain, latency, idle cost, CPU, RSS",
    ),
    "ab": Scenario(
        "benchmarks.scenarios.ab",
        "two source trees of django-pgqueue in turn: drain, enqueue, enqueue_many, latency",
    ),
    "scale": Scenario(
        "benchmarks.scenarios.scale.main",
        "a worker beside a million delayed messages and dead letters; memory over many messages",
    ),
    "streams": Scenario(
        "benchmarks.scenarios.streams.main",
        "ordered stream delivery: events/s and CPU per event of one subscription",
    ),
    "chaos": Scenario(
        "benchmarks.scenarios.chaos.main",
        "faults (kill -9, SIGTERM, cut connections, server crash) while workers run:"
        " nothing lost or handled twice",
    ),
    "soak": Scenario(
        "benchmarks.scenarios.soak.main",
        "many messages through a worker with autovacuum on: table and index bloat, claim cost",
    ),
    "insert-cost": Scenario(
        "benchmarks.scenarios.insert_cost",
        "where a one-message INSERT's time goes in the server: WAL, server and client CPU",
    ),
    "worker-options": Scenario(
        "benchmarks.scenarios.worker_options",
        "one burst worker per set of pgqueue_worker options, in turn: jobs/s, CPU per message",
    ),
    "instructions": Scenario(
        "benchmarks.scenarios.instructions",
        "CPU instructions per message (valgrind) of a worker, enqueue() and enqueue_many()",
    ),
    "workflows": Scenario(
        "benchmarks.scenarios.workflows",
        "a fan-out/fan-in workflow of 10,000 steps: enqueue seconds, drain steps/s beside"
        " plain messages in turn",
    ),
    "routed": Scenario(
        "benchmarks.scenarios.routed",
        "a queue routed to a second database beside a queue on the first, in turn: drain"
        " messages/s, their ratio",
    ),
    "partitioned": Scenario(
        "benchmarks.scenarios.partitioned",
        "a fair queue's messages in 100 partitions beside as many without a key, in turn:"
        " drain messages/s, their ratio",
    ),
    "async": Scenario(
        "benchmarks.scenarios.async_wait",
        "handlers that wait a second on the worker's event loop beside handler threads:"
        " drain seconds, peak RSS",
    ),
    "fair": Scenario(
        "benchmarks.scenarios.fair.main",
        "the fair claim of a million messages in 10,000 partitions beside the plain claim,"
        " in turn: claim time ratio",
    ),
    "wal": Scenario(
        "benchmarks.scenarios.wal_bytes",
        "where each byte of WAL goes per message in a worker's drain: by relation, record"
        " type and purpose",
    ),
}
