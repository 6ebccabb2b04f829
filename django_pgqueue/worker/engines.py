"""A worker process that serves queues on several databases: one ``Worker``
(an engine, for one database) per database, each running in a thread of its
own, with its own connections, LISTEN, leases, heartbeat row, maintenance,
scheduler and stream delivery on that database.

``pgqueue_worker`` runs one ``Worker`` as before when everything it serves is
on one database, and ``Engines`` when it is on several (``plan`` says which).
The options (--concurrency, --batch-size, --max-messages...) apply to each
engine. A database that is down fails only its own engine, which backs off
and retries as a lone worker does; the others go on, and the health port
says which database fails (``observability.health``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from django_pgqueue import conf
from django_pgqueue.streams.subscribers import select
from django_pgqueue.worker import shutdown, threads
from django_pgqueue.worker.config import new_worker_id
from django_pgqueue.worker.core import Worker

logger = logging.getLogger(__package__)

# What an engine serves: its queues (a list, or {queue: weight}), or None for
# the configured queues on its database.
EngineQueues = list[str] | dict[str, int] | None


def plan(
    queues: Iterable[str] | Mapping[str, int] | None,
    subscriptions: str | Sequence[str] | None,
) -> dict[str, EngineQueues]:
    """{database alias: what its engine serves} for a worker process serving
    ``queues`` (None: the configured ones, ``PGQUEUE["QUEUES"]``) and the
    stream ``subscriptions`` (as ``--subscriptions`` gives them): the
    databases of the queues (``conf.queues_by_database``), then those of
    the subscriptions' streams (their engines may serve no queue)."""
    names = conf.queues() if queues is None else list(queues)
    grouped = conf.queues_by_database(names)
    for spec in select(subscriptions):
        grouped.setdefault(conf.stream_database(spec.stream), [])
    if queues is None:
        return dict.fromkeys(grouped)
    if isinstance(queues, Mapping):
        return {alias: {name: queues[name] for name in part} for alias, part in grouped.items()}
    return {alias: list(part) for alias, part in grouped.items()}


class Engines:
    """One ``Worker`` per database, run side by side in this process (the
    same worker id on each database). ``run()`` blocks until every engine
    has ended: stopped (``stop()`` fans out), or, with --burst or
    --max-messages, each by itself. An engine that crashes stops the
    others, and ``run()`` raises its error once they have ended."""

    def __init__(
        self,
        databases: Mapping[str, EngineQueues],
        worker_id: str | None = None,
        **options: Any,
    ) -> None:
        worker_id = worker_id or new_worker_id()
        self.worker_id = worker_id
        # {alias: its engine}, in the order of ``databases``
        self.engines = {
            alias: Worker(queues=queues, database=alias, worker_id=worker_id, **options)
            for alias, queues in databases.items()
        }
        self._ended = threading.Event()  # an engine's run() returned or raised
        self._errors: dict[str, BaseException] = {}

    @property
    def queues(self) -> list[str]:
        return [queue for engine in self.engines.values() for queue in engine.queues]

    @property
    def processed(self) -> int:
        return sum(engine.processed for engine in self.engines.values())

    @property
    def stream_delivery_died(self) -> str | None:
        """Why a stream delivery thread died, with its database (None while
        they live)."""
        for alias, engine in self.engines.items():
            died = engine.stream_delivery_died
            if died:
                return f"on database {alias}: {died}"
        return None

    def run(self, install_signals: bool = False) -> int:
        """Run every engine until all have ended; returns how many messages
        they processed. Signals (SIGTERM, SIGINT) are handled once, here, on
        the main thread: the first stops every engine, a second exits."""
        previous = shutdown.install_signals(self.worker_id, self.stop) if install_signals else None
        logger.info(
            "Worker %s: one engine per database: %s",
            self.worker_id,
            "; ".join(
                f"{alias} ({', '.join(engine.queues) or 'no queue'})"
                for alias, engine in self.engines.items()
            ),
        )
        try:
            running = [
                threads.start(self._runner(alias, engine), f"pgqueue-engine-{alias}")
                for alias, engine in self.engines.items()
            ]
            while any(thread.is_alive() for thread in running):
                # Short waits: the main thread stays free for the signals.
                if self._ended.wait(0.5):
                    self._ended.clear()
                    if self._errors:
                        self.stop()
            for thread in running:
                thread.join()
        finally:
            shutdown.restore_signals(previous)
        for alias, error in self._errors.items():
            raise RuntimeError(f"the engine of database {alias!r} crashed: {error}") from error
        return self.processed

    def stop(self) -> None:
        """Stop every engine (from any thread or a signal handler)."""
        for engine in self.engines.values():
            engine.stop()

    def _runner(self, alias: str, engine: Worker) -> Callable[[], None]:
        def run() -> None:
            try:
                engine.run()
            except BaseException as exc:  # noqa: BLE001  (the others stop, run() raises it)
                logger.exception(
                    "Worker %s: the engine of database %s crashed", self.worker_id, alias
                )
                self._errors[alias] = exc
            finally:
                self._ended.set()

        return run
