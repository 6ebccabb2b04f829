"""The ``pgqueue-listener`` thread: LISTENs on a dedicated psycopg connection
(never one of Django's pooled connections, which would carry the LISTEN to
their next user) and wakes the main loop when a NOTIFY names one of its
queues, or a grouped message arrived (``notify.listen``); hands what the
control channel says (a queue paused, resumed or limited; cancellation
asked) to the worker's QueueControls."""

from __future__ import annotations

import logging
import threading

from django_pgqueue import notify
from django_pgqueue.worker import threads
from django_pgqueue.worker.config import Metrics, WorkerConfig
from django_pgqueue.worker.controls import QueueControls
from django_pgqueue.worker.wakeup import Wakeup

logger = logging.getLogger(__package__)


def start(
    config: WorkerConfig,
    wakeup: Wakeup,
    metrics: Metrics,
    exit: threading.Event,
    controls: QueueControls,
) -> threading.Thread:
    """Start the listener; it ends once ``exit`` is set."""
    queues = set(config.queues)

    def notified(channel: str, payload: str) -> None:
        if channel == notify.GROUPS_CHANNEL:
            wakeup.release_groups()
            wakeup.notify()
        elif channel == notify.CONTROL_CHANNEL:
            controls.notified(payload)
        elif payload in queues:
            controls.queue_notified(payload)
            wakeup.notify()

    def listen() -> None:
        notify.listen(
            [notify.CHANNEL, notify.GROUPS_CHANNEL, notify.CONTROL_CHANNEL],
            notified,
            # Poll once and read the queues' state again: notifications
            # missed while away are gone.
            on_connect=controls.reread,
            stop=exit,
            name=f"Worker {config.worker_id} listener",
            log=logger,
            reconnected=lambda: metrics.reconnected("listener"),
        )

    return threads.start(listen, "pgqueue-listener")
