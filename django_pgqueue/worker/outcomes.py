"""What follows a handler's run: a success is logged, counted in the metrics
and signalled (``done``); a failure is classified and, by the failure
policy, retried later or dead-lettered (``record_failure``)."""

from __future__ import annotations

import datetime
import logging
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

from django.db import DatabaseError

from django_pgqueue import lifecycle, policy, signals, tracing
from django_pgqueue.db import connection_lost, drop_broken_connections, first_line
from django_pgqueue.exceptions import Retry, describe
from django_pgqueue.models import Category, Message
from django_pgqueue.observability.metrics import CANCELLED as CANCELLED_OUTCOME
from django_pgqueue.observability.metrics import DEAD_LETTERED, RETRIED
from django_pgqueue.worker.config import Metrics
from django_pgqueue.worker.controls import QueueControls
from django_pgqueue.worker.job import CANCELLED, DONE, FAILED, LOST, Job
from django_pgqueue.worker.summary import Summary

logger = logging.getLogger(__package__)


@dataclass(eq=False)
class Outcomes:
    worker_id: str
    metrics: Metrics
    # The queues' run-time state: a finished message of a concurrency-limited
    # queue frees a slot (QueueControls.settled).
    controls: QueueControls | None = None
    # The time its retries and dead letters are dated; None, the database's
    # clock (django_pgqueue.testing's drain(now=...) fabricates it).
    now: datetime.datetime | None = None
    # The periodic summary's counts (the worker's; None: not counted).
    summary: Summary | None = None
    # Takes a job whose run ended because its connection died, to hand its
    # message back once the database answers (worker.cutoff; None: its
    # lease brings it back).
    cut_off: Callable[[Job], None] | None = None

    def done(self, message: Message, duration: float | None) -> None:
        """``message`` was acknowledged after its handler ran ``duration`` seconds."""
        if self.summary is not None:
            self.summary.count(DONE)
        self._report_done(message, duration)

    def all_done(self, jobs: list[Job]) -> None:
        """The messages of ``jobs`` were acknowledged (one batch: counted at once)."""
        if self.summary is not None and jobs:
            self.summary.count(DONE, len(jobs))
        report = self._report_done
        for job in jobs:
            report(job.message, job.duration)

    def _report_done(self, message: Message, duration: float | None) -> None:
        self.metrics.finished(message, DONE, duration)  # the outcome label, "done"
        controls = self.controls
        if controls is not None and message.queue in controls.concurrency_limited:
            controls.settled(message.queue)
        # The hot path: nothing is built for a log record nobody keeps or a
        # signal nobody receives. One line per message is DEBUG: at INFO the
        # worker writes a summary per interval (worker.summary).
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "Message id=%s topic=%s attempt=%s done in %.3fs",
                message.id,
                message.topic,
                message.attempts,
                duration,
                extra={
                    "message_id": message.id,
                    "topic": message.topic,
                    "attempt": message.attempts,
                    "duration": duration,
                    "state": "done",
                },
            )
        # (The receivers list first: has_listeners takes a lock and two calls.)
        if signals.message_done.receivers and signals.message_done.has_listeners(type(message)):
            signals.send(
                signals.message_done,
                sender=type(message),
                message=message,
                duration=duration,
                worker=self.worker_id,
            )

    def record_failure(self, job: Job, exc: BaseException, category: Category | None = None) -> str:
        """Retry or dead-letter ``job``'s message after ``exc``; returns FAILED,
        or LOST when its lease was gone or the database refused the record
        (the lease then expires and maintenance returns the message)."""
        message, spec = job.message, job.spec
        if job.cancel_requested:
            # It stopped early, or failed, once told: cancelled, never retried.
            return self.cancelled(job, _error_text(exc))
        duration = None if job.started is None else time.monotonic() - job.started
        try:
            if category is None:
                category = policy.classify(exc, message)
        except Exception:  # a broken CLASSIFIER must not lose the message
            logger.exception("Message id=%s: classification failed; using UNKNOWN", message.pk)
            category = Category.UNKNOWN
        reason = describe(exc)
        trace = "".join(traceback.format_exception(exc))
        decision = policy.decide(
            category,
            message.attempts,
            policy.max_attempts_for(message, spec),
            spec,
            retry_after=exc.after if isinstance(exc, Retry) else None,
        )
        try:
            if decision.action == policy.RETRY:
                if not lifecycle.retry_later(
                    message,
                    decision.delay,
                    category,
                    f"{reason}\n\n{trace}".strip(),
                    now=self.now,
                ):
                    return self._cancelled_meanwhile(job, exc)
                self._retried(message, category, reason, decision.delay, duration)
                if job.span is not None:
                    tracing.retried(job.span, category, reason, decision.delay)
            elif (
                lifecycle.dead_letter(
                    message, category, reason, trace, worker=self.worker_id, now=self.now
                )
                is None
            ):
                return self._cancelled_meanwhile(job, exc)
            else:
                self.metrics.finished(message, DEAD_LETTERED, duration)
                if self.summary is not None:
                    self.summary.count(DEAD_LETTERED)
                if job.span is not None:
                    tracing.dead_lettered(job.span, category, reason)
        except DatabaseError as db_error:
            drop_broken_connections()
            if self.lost_connection(job, db_error):
                logger.warning(
                    "Message id=%s topic=%s: could not record the failure, the database is "
                    "unreachable (%s); it is handed back once it answers",
                    message.pk,
                    message.topic,
                    first_line(db_error),
                )
                return LOST
            logger.exception(
                "Message id=%s topic=%s: could not record the failure; its lease will expire "
                "and maintenance will return it to the queue",
                message.pk,
                message.topic,
            )
            return LOST
        self._settled(message)
        return FAILED

    def cancelled(self, job: Job, error: str = "") -> str:
        """End ``job``'s run, whose cancellation was asked, as cancelled
        (``error``: why it ended, if its handler raised); CANCELLED, or LOST
        when its lease was gone or the database refused the record."""
        message = job.message
        duration = None if job.started is None else time.monotonic() - job.started
        try:
            if not lifecycle.cancel_running(message, error, self.worker_id):
                return LOST
        except DatabaseError as db_error:
            drop_broken_connections()
            if self.lost_connection(job, db_error):
                return LOST
            logger.exception(
                "Message id=%s topic=%s: could not record its cancellation; its lease will "
                "expire and maintenance will cancel it",
                message.pk,
                message.topic,
            )
            return LOST
        self.metrics.finished(message, CANCELLED_OUTCOME, duration)
        if self.summary is not None:
            self.summary.count(CANCELLED_OUTCOME)
        self._settled(message)
        return CANCELLED

    def lost_connection(self, job: Job, error: BaseException) -> bool:
        """If ``error`` says the connection died, hand ``job`` to ``cut_off``
        (its message goes back once the database answers) and say True."""
        if self.cut_off is None or not connection_lost(error):
            return False
        self.cut_off(job)
        return True

    def _cancelled_meanwhile(self, job: Job, exc: BaseException) -> str:
        """The retry or dead letter found no row to change: the lease is lost,
        or the message's cancellation was asked meanwhile (the notification
        had not reached this worker yet), which its guard refuses."""
        if lifecycle.still_leased([job.message]):
            job.cancel_requested = True
            return self.cancelled(job, _error_text(exc))
        return LOST

    def _settled(self, message: Message) -> None:
        controls = self.controls
        if controls is not None and message.queue in controls.concurrency_limited:
            controls.settled(message.queue)

    def _retried(
        self,
        message: Message,
        category: Category,
        reason: str,
        delay: float,
        duration: float | None,
    ) -> None:
        self.metrics.finished(message, RETRIED, duration)
        if self.summary is not None:
            self.summary.count(RETRIED)
        logger.info(
            "Message id=%s topic=%s attempt=%s failed (%s: %s); retry in %.1fs",
            message.pk,
            message.topic,
            message.attempts,
            category,
            reason,
            delay,
            extra={
                "message_id": message.pk,
                "topic": message.topic,
                "attempt": message.attempts,
                "category": category,
                "state": "retry_scheduled",
            },
        )
        signals.send(
            signals.message_retried,
            sender=type(message),
            message=message,
            category=category,
            reason=reason,
            delay=delay,
            worker=self.worker_id,
        )


def _error_text(exc: BaseException) -> str:
    """What a run that ended with ``exc`` records: the error and its traceback."""
    return f"{describe(exc)}\n\n{''.join(traceback.format_exception(exc))}".strip()
