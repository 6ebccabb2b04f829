"""A claimed message as the worker carries it from its claim to its
acknowledgement (``Job``), and how a handler's run ends (the outcomes)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from django_pgqueue import lifecycle, registry, running, tracing
from django_pgqueue.exceptions import Permanent
from django_pgqueue.models import Message
from django_pgqueue.registry import HandlerSpec
from django_pgqueue.workflows.runs import WorkflowRun
from django_pgqueue.workflows.steps import result_json

logger = logging.getLogger(__package__)

# How a handler's run ends: done and acknowledged with its transaction (atomic
# handlers); done, its acknowledgement waiting to be flushed (atomic=False);
# failed, the retry or dead letter recorded; lost (lease gone, timed out,
# handed back), nothing recorded.
DONE, ACK_PENDING, FAILED, LOST = "done", "ack_pending", "failed", "lost"
# Its cancellation was asked and the run ended without finishing: cancelled.
CANCELLED = "cancelled"
# The outcomes that finish a message at once (an ACK_PENDING one finishes when
# its acknowledgement removes the row).
SETTLED = (DONE, FAILED, CANCELLED)


class LeaseLost(Exception):
    """The handler's lease is gone: roll its work back."""


class _MessageOfRow:
    """``Job.message``: the Message is built from the claim's row when first
    read, in a handler thread (the main loop goes on to its next claim
    sooner), then kept in the job's ``__dict__``, where later reads find it
    as a plain attribute (a non-data descriptor: no call per read)."""

    def __get__(self, job: Job | None, owner: type[Job]) -> Message:
        if job is None:
            raise AttributeError("message")
        message = job.__dict__["message"] = lifecycle.message_from_row(job.row, job.database)
        if message.workflow_step_id is not None:
            message.workflow = WorkflowRun.of_step(message.workflow_step_id, job.database)
        return message


@dataclass(eq=False)
class Job:
    row: tuple[Any, ...]  # the claim's row (``message`` is built from it)
    spec: HandlerSpec | None
    database: str | None = None  # the alias it was claimed from (None: the queue's)
    started: float | None = None  # time.monotonic() when a thread picked it up
    deadline: float | None = None
    thread: int | None = None
    abandoned: bool = False  # timed out or handed back: its late result is discarded
    lease_lost: bool = False
    duration: float | None = None  # seconds the handler took
    queued: bool = True  # submitted to the pool, no thread has taken it yet
    batch: list[Job] | None = None  # the jobs sharing its transaction (atomic handlers)
    uncommitted: bool = False  # its handler succeeded; the batch has not committed yet
    failure: BaseException | None = None  # its handler raised; recorded after the batch
    # When an acknowledgement first found its row locked by another
    # transaction, and whether that was logged.
    ack_busy_since: float | None = None
    ack_busy_logged: bool = False
    # Cancellation was asked for its message (the handler's cancel_requested()).
    cancel_requested: bool = False
    # A workflow step's handler returned: its result, as JSON text.
    step_result: str | None = None
    # With tracing on: the CONSUMER span of its run, ended when the run ends
    # (Executor.finished), after its retry or dead letter is recorded on it.
    span: Any = None
    # An async handler's run on the worker's event loop (worker.event_loop):
    # it counts in the loop's room (Ledger), and its asyncio task is what a
    # timeout or a cancellation cancels.
    on_loop: bool = False
    task: Any = None
    message = _MessageOfRow()

    def run_handler(self) -> object:
        """Run its handler on its message, in this thread."""
        spec, message = self._spec_for_run(), self.message
        # (Written out, not a context manager shared with run_handler_async:
        # this runs for every message of the handler threads.)
        run = running.current.set(self)  # what cancel_requested() reads
        try:
            tracer = tracing.tracer()
            if tracer is None:
                value = registry.call(spec, message)
            else:
                with tracing.active(self._span(tracer)):
                    value = registry.call(spec, message)
        finally:
            running.current.reset(run)
        return self._returned(value)

    async def run_handler_async(self) -> object:
        """Run its ``async def`` handler on its message, on this event loop
        (the run and the span are context variables: each task has its own)."""
        spec, message = self._spec_for_run(), self.message
        run = running.current.set(self)
        try:
            tracer = tracing.tracer()
            if tracer is None:
                value = await spec.func(message)
            else:
                with tracing.active(self._span(tracer)):
                    value = await spec.func(message)
        finally:
            running.current.reset(run)
        return self._returned(value)

    def _spec_for_run(self) -> HandlerSpec:
        """The handler to run; raises what fails the run before it starts."""
        message = self.message
        undecodable = message.__dict__.get(lifecycle.UNDECODABLE)
        if undecodable:
            # Another client's SQL stored JSON that Python cannot load: no
            # handler could read it, so it goes to the dead letters as it is.
            raise Permanent(undecodable)
        if self.spec is None:
            raise LookupError(f"no handler for topic {message.topic!r}")
        return self.spec

    def _span(self, tracer: Any) -> Any:
        """Its CONSUMER span, started on its first run (an atomic batch that
        rolled back runs it again in the same span)."""
        if self.span is None:
            message = self.message
            self.span = tracing.start_consumer(
                tracer, message.headers, message.queue, message.topic, message.pk,
                message.attempts,
            )  # fmt: skip
        return self.span

    def _returned(self, value: object) -> object:
        if self.message.workflow_step_id is not None:
            # Kept with the step (a value JSON cannot hold fails the run).
            self.step_result = result_json(value)
        return value

    def interrupt(self, reason: str) -> None:
        """Cancel its async handler's task (a timeout, a cancellation asked),
        from any thread: the coroutine gets CancelledError at its await. A
        handler in a thread is not interrupted (it reads cancel_requested())."""
        task = self.task
        if task is not None:
            task.get_loop().call_soon_threadsafe(task.cancel, reason)

    def end_span(self, outcome: str) -> None:
        """Its run ended with ``outcome``: end its span, if it has one."""
        span, self.span = self.span, None
        if span is not None:
            tracing.end(span, outcome)

    def handler_returned(self) -> None:
        """Its handler returned or raised: how long it ran; it cannot time out any more."""
        if self.started is not None:
            self.duration = time.monotonic() - self.started
        self.deadline = None

    def log_lease_lost_before_commit(self) -> None:
        message = self.message
        logger.warning(
            "Message id=%s topic=%s attempt=%s: lease lost before the commit; "
            "the handler's database writes were rolled back",
            message.pk,
            message.topic,
            message.attempts,
        )
