"""The handler threads: ``concurrency`` threads that take jobs from one queue,
each with its own database connection, kept open across jobs (a connection
is dropped only when it is broken)."""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from collections.abc import Callable

from django.db import connections

from django_pgqueue.worker import threads
from django_pgqueue.worker.job import Job

logger = logging.getLogger(__package__)


class HandlerPool:
    """``size`` threads that run jobs. A thread stuck in a timed-out handler
    is replaced, so a hung handler does not take capacity away; at most
    ``size`` stuck threads are replaced, beyond that capacity shrinks."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._run_job: Callable[[Job], None] | None = None
        self._tasks: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._abandoned: set[int] = set()
        self._unreplaced = 0
        self._names = itertools.count(1)

    def start(self, run_job: Callable[[Job], None]) -> None:
        """Start the threads; each runs ``run_job(job)`` for the jobs it takes."""
        self._run_job = run_job
        for _ in range(self._size):
            self._spawn()

    def _spawn(self) -> None:
        threads.start(self._work, f"pgqueue-handler-{next(self._names)}")

    def submit(self, job: Job) -> None:
        self._tasks.put(job)

    def take_nowait(self) -> Job | None:
        """The next queued job, or None when there is none (or the pool is
        shutting down: the stop marker is put back for the thread's loop)."""
        try:
            job = self._tasks.get_nowait()
        except queue.Empty:
            return None
        if job is None:
            self._tasks.put(None)
        return job

    def stuck(self) -> int:
        """Threads stuck in a timed-out handler that were not replaced."""
        return self._unreplaced

    def abandon(self, ident: int | None) -> None:
        """The thread ``ident`` runs a timed-out handler: replace it."""
        with self._lock:
            if ident is None or ident in self._abandoned:
                return
            self._abandoned.add(ident)
            if len(self._abandoned) > self._size:
                self._unreplaced += 1
                logger.error(
                    "%s handler threads are stuck past their timeouts; "
                    "capacity is reduced until they return",
                    len(self._abandoned),
                )
                return
        self._spawn()

    def shutdown(self) -> None:
        for _ in range(self._size + len(self._abandoned)):
            self._tasks.put(None)

    def _work(self) -> None:
        run_job = self._run_job
        assert run_job is not None, "start() first"
        ident = threading.get_ident()
        try:
            while True:
                job = self._tasks.get()
                if job is None:
                    break
                run_job(job)
                with self._lock:
                    if ident in self._abandoned:
                        self._abandoned.discard(ident)
                        if self._unreplaced:
                            self._unreplaced -= 1
                            continue  # this thread takes its own place again
                        break
        finally:
            connections.close_all()
