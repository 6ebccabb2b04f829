"""A worker's options, resolved once: its constructor's arguments over the
PGQUEUE settings. Every part of the worker reads them from here."""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from django_pgqueue import conf, registry
from django_pgqueue.observability.metrics import NullMetrics, WorkerMetrics
from django_pgqueue.registry import HandlerSpec

# What a worker reports its counters and histograms to.
Metrics = WorkerMetrics | NullMetrics

# Default --batch-size: the most messages one claim takes (and one batch of
# acknowledgements). benchmarks/worker_options.py: claims of 200 drained no-op
# messages 1.3x as fast as claims of 100 (docs/howto/sizing.rst).
DEFAULT_BATCH_SIZE = 200
# --prefetch auto (the default): hold ahead of the running handlers about
# what they finish in this many seconds, judged by their recent durations,
# and at most this many batches. Short handlers get large claims that go
# out while the threads still have work; slow ones get none ahead, so they
# do not wait in this worker while another one is free.
AUTO_PREFETCH_SECONDS = 0.1
AUTO_PREFETCH_BATCHES = 2


def runs_on_event_loop(spec: HandlerSpec | None) -> bool:
    """Whether the handler ``spec`` runs on the event loop: an ``async def``
    one with atomic=False (an atomic one needs its thread's transaction)."""
    return spec is not None and spec.is_async and not spec.atomic


def on_event_loop(specs: Iterable[HandlerSpec]) -> bool:
    """Whether any of the handlers ``specs`` runs on the event loop."""
    return any(runs_on_event_loop(spec) for spec in specs)


def new_worker_id(hostname: str | None = None) -> str:
    """A worker process's id: "host:pid:random" (every engine of a process
    that serves several databases shares it)."""
    return f"{hostname or socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


def _database(queues: list[str], database: str | None) -> str:
    """The database of an engine serving ``queues``: ``database`` when
    given (every queue must be on it), else the one their queues are on
    (``PGQUEUE["DATABASE"]`` for none). A ValueError when they are on several:
    one engine serves one database."""
    grouped = conf.queues_by_database(queues)
    if database is not None:
        problem = conf.alias_problem(database)
        if problem:
            raise ValueError(f"database {database!r}: the alias {problem}")
        elsewhere = {alias: names for alias, names in grouped.items() if alias != database}
        if elsewhere:
            raise ValueError(
                f"a worker on the database {database!r} cannot serve queues of other "
                f"databases ({_listed(elsewhere)}); give it the queues of {database!r} only"
            )
        return database
    if len(grouped) > 1:
        raise ValueError(
            f"the queues are on several databases ({_listed(grouped)}), and a Worker serves "
            "one: give it the queues of one database (database= names it), or run "
            "manage.py pgqueue_worker, which runs one engine per database"
        )
    return next(iter(grouped), conf.get("DATABASE"))


def _listed(grouped: Mapping[str, list[str]]) -> str:
    """ "default: a, b; other: bulk"."""
    return "; ".join(f"{alias}: {', '.join(names)}" for alias, names in grouped.items())


@dataclass(frozen=True)
class WorkerConfig:
    worker_id: str
    hostname: str
    queues: list[str]  # in claim order
    concurrency: int  # handler threads
    batch_size: int  # messages per claim, at most
    # Messages claimed ahead of the running ones, so that a claim can be a
    # batch while every thread is busy (their leases are extended like the
    # running ones', and shutdown hands them back at once). With
    # ``prefetch_auto``, the most: the Ledger holds fewer for slow handlers.
    prefetch: int
    burst: bool  # exit once nothing is ready
    max_messages: int | None  # exit after claiming this many
    shutdown_timeout: float
    poll_interval: float
    lease_seconds: float
    listen: bool  # PGQUEUE["NOTIFY"]: a listener wakes the loop
    heartbeat_interval: float
    # Seconds between the INFO summaries of what it finished (0: none).
    log_summary_interval: float = 0.0
    prefetch_auto: bool = False  # --prefetch auto: see AUTO_PREFETCH_SECONDS
    # {queue: weight}: the claims shared between the queues by weight
    # (QueueShares); empty: each claim takes the queues in order.
    weights: dict[str, int] = field(default_factory=dict)
    # The most async handlers (async def, atomic=False) running at once on
    # its event loop (worker.event_loop); 0: no event loop, none of the
    # project's handlers being one (async handlers with atomic=True run in
    # the handler threads, their ORM calls in the acknowledgement's
    # transaction).
    async_concurrency: int = 0
    # The database alias it works on (``conf.on_database``): its queues'
    # messages, its row in the worker table, its leases, LISTEN and
    # maintenance. One engine serves one database; pgqueue_worker runs one
    # engine per database (``worker.engines``).
    database: str = "default"

    @classmethod
    def resolve(
        cls,
        *,
        queues: Iterable[str] | Mapping[str, int] | None,
        concurrency: int,
        batch_size: int | None,
        prefetch: int | None,
        burst: bool,
        max_messages: int | None,
        shutdown_timeout: float,
        poll_interval: float | None,
        lease_seconds: float | None,
        worker_id: str | None,
        async_concurrency: int | None = None,
        database: str | None = None,
    ) -> WorkerConfig:
        """The Worker's arguments (None: the default) over the settings."""
        hostname = socket.gethostname()
        # Large claims make fewer round trips (and, for atomic handlers, fewer
        # commits); prefetch None: as many ahead as the handlers' durations
        # warrant (Ledger), up to two batches.
        batch_size = batch_size or DEFAULT_BATCH_SIZE
        if queues is None:
            names, weights = conf.queues(), conf.queue_weights()
            if database is not None:  # the configured queues on that database
                names = [name for name in names if conf.queue_database(name) == database]
                weights = {name: weights[name] for name in names if name in weights}
        elif isinstance(queues, Mapping):
            names, weights = list(queues), dict(queues)
        else:
            names, weights = list(queues), {}
        if not names and database is None:
            names = conf.queues()
        database = _database(names, database)
        for name, weight in weights.items():
            problem = conf.weight_problem(weight)
            if problem:
                raise ValueError(f"queue {name!r}: its weight {problem} (got {weight!r})")
        if async_concurrency is None:
            async_concurrency = conf.get("ASYNC_CONCURRENCY")
        problem = conf.async_concurrency_problem(async_concurrency)
        if problem:
            raise ValueError(f"async_concurrency {problem} (got {async_concurrency!r})")
        return cls(
            worker_id=worker_id or new_worker_id(hostname),
            hostname=hostname,
            queues=names,
            database=database,
            weights=weights if len(weights) > 1 else {},
            concurrency=concurrency,
            batch_size=batch_size,
            prefetch=AUTO_PREFETCH_BATCHES * batch_size if prefetch is None else prefetch,
            prefetch_auto=prefetch is None,
            burst=burst,
            max_messages=max_messages,
            shutdown_timeout=shutdown_timeout,
            poll_interval=poll_interval or conf.get("POLL_INTERVAL"),
            lease_seconds=lease_seconds or conf.get("LEASE_SECONDS"),
            listen=conf.get("NOTIFY"),
            heartbeat_interval=conf.get("HEARTBEAT_INTERVAL"),
            log_summary_interval=conf.get("LOG_SUMMARY_INTERVAL"),
            async_concurrency=async_concurrency if on_event_loop(registry.all_handlers()) else 0,
        )

    @property
    def queues_text(self) -> str:
        """Its queues as --queues takes them: "a,b", or "a=3,b=1"."""
        weights = self.weights
        return ",".join(f"{name}={weights[name]}" if weights else name for name in self.queues)

    @property
    def capacity(self) -> int:
        """Messages it holds for its threads at most: one per thread, and the
        prefetched (with ``prefetch_auto``, the Ledger's capacity is at most
        this). The event loop's ``async_concurrency`` comes on top, while
        async handlers' messages come (Ledger)."""
        return self.concurrency + self.prefetch

    @property
    def thread_beat_after(self) -> float:
        """Seconds after the last heartbeat when the heartbeat thread writes
        one. It beats only when the polls have not: later than a poll that
        was due could (interval + a jittered poll, with room to spare), yet
        within two intervals, so the row (alive for three) never goes stale
        while the worker polls rarely or is busy."""
        interval = self.heartbeat_interval
        return min(max(1.5 * interval, interval + 1.5 * self.poll_interval), 2 * interval)

    @property
    def alive_for(self) -> float:
        """Seconds the worker's row counts as alive after a heartbeat."""
        return self.heartbeat_interval * 3
