"""The compare scenario's measurements: django-pgqueue beside a raw psycopg loop and
its peers, each system run from its own virtualenv through a client script
of its own (benchmarks/peers/); the ab scenario uses the same machinery for two
trees of django-pgqueue.

- ``system``: what a system under test is (its virtualenv, database, client, workers);
- ``systems``: the six systems (``graphile``: graphile-worker, on Node.js);
- ``measure``: one drain, the latency, the idle cost of one system;
- ``run``: every measurement of one system, and the runs in turn;
- ``targets`` and ``markdown``: django-pgqueue's targets, the report;
- ``ab``: the ab scenario's measurements, rounds in turn and summary.
"""

from benchmarks.harness.tree import HERE

BENCH = HERE / "benchmarks"
PEERS = BENCH / "peers"
VENVS = BENCH / ".venvs"
RESULTS = BENCH / "results"

# django-pgqueue's workers. --prefetch 200: a claim goes out while the
# previous batch still has work queued (docs/howto/sizing.rst: batch size
# and prefetch for short handlers). --subscriptions none: the testproject registers stream
# subscribers for the test suite; a project without any runs no stream
# thread, and the peers have no streams.
DEFAULT_PGQUEUE_WORKER_ARGS = "--concurrency 4 --batch-size 400 --prefetch 800 --subscriptions none"

# django-pgqueue's variants (systems.PgQueue.variants): tuned, with the
# options above, and the worker with its defaults.
PGQUEUE_VARIANTS = ("atomic", "nonatomic", "atomic-defaults", "nonatomic-defaults")

# --repeat runs each drain configuration several times (the median counts),
# except one whose drain took longer than this: slow enough to be steady.
REPEAT_MAX_DRAIN_S = 20.0


class StepFailed(Exception):
    """One measurement of one system failed; the run goes on with the next."""
