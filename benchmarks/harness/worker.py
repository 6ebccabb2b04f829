"""``manage.py pgqueue_worker`` as a benchmark's child process, and the
``Bench`` a scenario runs in (database, environment, logs, tree)."""

from __future__ import annotations

import math
import re
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.harness.db import CheckFailed, database_name, other_url
from benchmarks.harness.pgstats import Stats
from benchmarks.harness.processes import Process
from benchmarks.harness.tree import Tree

# The testproject's handlers for benchmarks (testproject/demo/handlers.py).
TOPIC_ATOMIC = "bench.noop"  # atomic=True, does nothing
TOPIC_NONATOMIC = "bench.noop_nonatomic"  # atomic=False, does nothing
TOPIC_LATENCY = "bench.latency"  # saves a demo.Handled row first thing (no BENCH_LATENCY_FILE)

# The queue seen from a connection of its own (harness.monitor): the first
# message (the lowest id, claimed first) left the waiting state; no message
# waits or runs any more. Both are index look-ups.
CLAIMED_SQL = (
    "SELECT coalesce((SELECT status <> 'waiting' FROM django_pgqueue_message WHERE id = %s), true)"
)
EMPTY_SQL = (
    "SELECT NOT (EXISTS (SELECT 1 FROM django_pgqueue_message WHERE status = 'processing')"
    " OR EXISTS (SELECT 1 FROM django_pgqueue_message WHERE status = 'waiting'))"
)

# An error from a worker fails the benchmark; warnings are counted and reported.
ERROR_LINE = re.compile(r"^\S+ \S+ (ERROR|CRITICAL) |^Traceback", re.MULTILINE)
WARNING_LINE = re.compile(r"^\S+ \S+ WARNING (.*)$", re.MULTILINE)
VARYING = re.compile(r"\b(id=\d+|attempt=\d+|[\w.-]+:\d+:[0-9a-f]+|\d+(\.\d+)?)")


@dataclass
class Bench:
    """Where a scenario runs: the bench database ``url`` (and its ``_other``),
    the workers' environment and log folder, the tree under test, options
    added to every worker, and every warning the workers logged, by kind."""

    url: str
    env: dict[str, str]
    log_dir: Path
    tree: Tree = field(default_factory=Tree.here)
    worker_args: list[str] = field(default_factory=list)
    warnings: Counter[str] = field(default_factory=Counter)

    @property
    def dbname(self) -> str:
        return database_name(self.url)

    def use_database(self, url: str) -> None:
        """Point the workers started from now on at ``url`` (and its ``_other``)."""
        self.url = url
        self.env = dict(self.env, DATABASE_URL=url, OTHER_DATABASE_URL=other_url(url))

    def worker(self, name: str, options: Sequence[str]) -> Worker:
        """Start ``pgqueue_worker --log-level WARNING`` with ``options`` and
        the bench's own, its output in ``<log_dir>/<name>.log``."""
        argv = self.tree.manage(
            "pgqueue_worker", "--log-level", "WARNING", *options, *self.worker_args
        )
        return Worker(
            argv,
            env=self.tree.env(self.env),
            cwd=self.tree.testproject,
            log_path=Path(self.log_dir) / f"{name}.log",
            warnings=self.warnings,
        )


class Worker(Process):
    """A pgqueue worker process, its log checked when it is done."""

    def __init__(
        self,
        argv: Sequence[str],
        *,
        env: dict[str, str],
        cwd: Path,
        log_path: Path,
        warnings: Counter[str],
    ) -> None:
        super().__init__(argv, env=env, cwd=cwd, log_path=log_path)
        self.warnings = warnings

    def finish(self, timeout: float) -> int:
        """Wait for the worker to exit (``--burst``); a worker still running
        after ``timeout`` seconds is killed and fails the check."""
        code = self.wait(timeout)
        if code is None:
            raise CheckFailed(f"worker {self.pid} was killed after {timeout}s ({self.log_path})")
        return code

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM, as ``finish``."""
        code = self.terminate(timeout)
        if code is None:
            raise CheckFailed(f"worker {self.pid} was killed after {timeout}s ({self.log_path})")
        return code

    def check_clean(self, what: str) -> int:
        """Exit code 0 and no error in the log; returns the number of warnings
        (also counted, by kind, in the bench's ``warnings``)."""
        text = self.log_text()
        if self.returncode != 0:
            raise CheckFailed(f"{what}: worker exited {self.returncode}\n{self.log_tail()}")
        if ERROR_LINE.search(text):
            raise CheckFailed(f"{what}: the worker logged errors\n{self.log_tail()}")
        warnings = WARNING_LINE.findall(text)
        self.warnings.update(VARYING.sub("N", line) for line in warnings)
        return len(warnings)

    def wait_listening(self, stats: Stats, dbname: str, timeout: float = 60.0) -> None:
        """Wait until the worker's listener connection is idle in the database."""
        deadline = time.monotonic() + timeout
        name = f"pgqueue_listener#{self.pid}"
        while time.monotonic() < deadline:
            if self.poll() is not None:
                raise CheckFailed(f"worker exited {self.returncode} at start\n{self.log_text()}")
            backends = stats.worker_backends(dbname, self.pid).values()
            if any(app == name and state == "idle" for app, state, *_ in backends):
                return
            time.sleep(0.02)
        raise CheckFailed(f"worker {self.pid} did not start listening within {timeout}s")


def idle_statements_allowed(window: float, poll_interval: float) -> int:
    """At most one statement per poll interval, the interval being jittered
    by +-10%: one per shortest interval in ``window``, plus one."""
    return math.floor(window / (0.9 * poll_interval)) + 1


# A worker configuration: (--concurrency, --batch-size or None for the command's default).
Combo = tuple[int, int | None]


def worker_options(concurrency: int, batch_size: int | None, *extra: str) -> list[str]:
    options = ["--concurrency", str(concurrency), *extra]
    if batch_size is not None:
        options += ["--batch-size", str(batch_size)]
    return options
