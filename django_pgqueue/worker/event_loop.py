"""Async handlers on one event loop: ``async def`` handlers with
atomic=False run as asyncio tasks in a thread of their own, up to
``async_concurrency`` at once, beside the handler threads. A coroutine that
waits on the network holds neither a thread nor a database connection.

The database work around a coroutine (recording its retry or dead letter,
acknowledging a batch) blocks, so it never runs on the loop: each run that
ends goes to the settling threads (two, with their own connections), which
end it as a handler thread ends its own (``Executor.settle``). A timeout
or a cancellation asked cancels the task (``Job.interrupt``): the
coroutine gets CancelledError at its await.
At shutdown the tasks still running once the grace is over are cancelled,
after their messages were handed back.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from typing import Protocol

from asgiref.sync import sync_to_async
from django.db import connections

from django_pgqueue.db import drop_broken_connections
from django_pgqueue.worker import threads
from django_pgqueue.worker.config import WorkerConfig
from django_pgqueue.worker.job import LOST, Job

logger = logging.getLogger(__package__)

# Threads that settle the runs the loop ends: each takes a run's database
# work (an acknowledgement batch, a retry's record) while the others go on.
SETTLING_THREADS = 2


class Runner(Protocol):
    """What the loop needs of the executor."""

    def begin(self, job: Job) -> bool:
        """Take ``job`` for its run (no database work); False if it was
        handed back or abandoned meanwhile."""
        ...

    def settle(self, job: Job, failure: BaseException | None, ran: bool = True) -> None:
        """End ``job``'s run in this (settling) thread: it succeeded, failed
        with ``failure``, or (``ran`` False) never ran, its cancellation
        having been asked before it started."""
        ...

    def finished(self, job: Job, outcome: str) -> None:
        """``job``'s run ended with ``outcome`` (the worker no longer holds it)."""
        ...


class EventLoop:
    def __init__(self, config: WorkerConfig, runner: Runner) -> None:
        self._worker_id = config.worker_id
        self._concurrency = config.async_concurrency
        self._runner = runner
        self._loop: asyncio.AbstractEventLoop | None = None  # made by start()
        # Bounds the coroutines running at once (the Ledger's capacity
        # already bounds what is claimed for them; this holds it to the
        # setting even while prefetched jobs wait).
        self._slots: asyncio.Semaphore | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._ended: queue.SimpleQueue[tuple[Job, BaseException | None, bool] | None] = (
            queue.SimpleQueue()
        )
        # Made by start(), in the engine's context (its database): the
        # loop's tasks inherit the context of the loop's thread.
        self._thread: threading.Thread | None = None
        self._settling: list[threading.Thread] = []

    def start(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._settling = [
            threads.start(self._settle, f"pgqueue-settle-{n}")
            for n in range(1, SETTLING_THREADS + 1)
        ]
        self._thread = threads.start(self._run, "pgqueue-event-loop")

    def submit(self, job: Job) -> None:
        """Run ``job``'s async handler (from any thread, once started)."""
        assert self._loop is not None, "start() first"
        self._loop.call_soon_threadsafe(self._begin, job)

    def stop(self, timeout: float = 5.0) -> None:
        """Cancel the tasks still running (their jobs were handed back or
        abandoned: they record nothing), stop the loop and its thread, then
        the settling threads once they have settled what they hold."""
        loop = self._loop
        if loop is None:
            return  # never started
        if self._thread is not None and self._thread.is_alive():
            future = asyncio.run_coroutine_threadsafe(self._cancel_all(), loop)
            try:
                future.result(timeout)
            except Exception:  # noqa: BLE001  (a loop that cannot answer is stopped anyway)
                logger.warning("Worker %s: the event loop did not stop its tasks", self._worker_id)
            loop.call_soon_threadsafe(loop.stop)
            self._thread.join(timeout)
        for _ in self._settling:
            self._ended.put(None)
        for thread in self._settling:
            thread.join(timeout)

    # --- the loop's thread ----------------------------------------------------------

    def _run(self) -> None:
        loop = self._loop
        assert loop is not None
        asyncio.set_event_loop(loop)
        self._slots = asyncio.Semaphore(self._concurrency)
        try:
            loop.run_forever()
        finally:
            loop.close()

    def _begin(self, job: Job) -> None:
        assert self._loop is not None
        task = self._loop.create_task(self._run_job(job))
        job.task = task  # before the task runs: Job.interrupt reaches it from now on
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run_job(self, job: Job) -> None:
        assert self._slots is not None
        async with self._slots:
            if not self._runner.begin(job):  # handed back or abandoned meanwhile
                return
            if job.cancel_requested:  # told before it started: it never runs
                self._ended.put((job, None, False))
                return
            try:
                await job.run_handler_async()
            except BaseException as exc:  # noqa: BLE001  (a handler may raise anything)
                failure: BaseException | None = exc
            else:
                failure = None
            job.handler_returned()
        if job.abandoned:
            # Timed out (the main loop recorded it) or handed back at
            # shutdown: whatever the coroutine did is discarded.
            return
        self._ended.put((job, failure, True))

    async def _cancel_all(self) -> None:
        tasks = [task for task in self._tasks if not task.done()]
        for task in tasks:
            task.cancel("the worker is stopping")
        await asyncio.gather(*tasks, return_exceptions=True)
        # The handlers' ORM calls (Django's async ORM, sync_to_async) ran in
        # asgiref's one thread for thread-sensitive calls: close its
        # connection there, as the handler threads close theirs.
        await sync_to_async(connections.close_all, thread_sensitive=True)()

    # --- the settling threads ------------------------------------------------------------

    def _settle(self) -> None:
        try:
            while (ended := self._ended.get()) is not None:
                job, failure, ran = ended
                if job.abandoned:
                    continue
                try:
                    self._runner.settle(job, failure, ran)
                except BaseException:  # noqa: BLE001  (its lease brings the message back)
                    drop_broken_connections()
                    logger.exception(
                        "Worker %s: the end of message id=%s could not be recorded; it runs "
                        "again once its lease expires",
                        self._worker_id,
                        job.message.pk,
                    )
                    # The worker lets go of it: its slot, and shutdown, wait no more.
                    self._runner.finished(job, LOST)
        finally:
            connections.close_all()
