"""The ``pgqueue-listener`` thread: LISTENs on a dedicated psycopg connection
(never one of Django's pooled connections, which would carry the LISTEN to
their next user) and wakes the main loop when a NOTIFY names one of its
queues, or a grouped message arrived (``notify.listen``)."""

from __future__ import annotations

import logging
import threading

from django_pgqueue import notify
from django_pgqueue.worker.config import Metrics, WorkerConfig
from django_pgqueue.worker.wakeup import Wakeup

logger = logging.getLogger(__package__)


def start(
    config: WorkerConfig, wakeup: Wakeup, metrics: Metrics, exit: threading.Event
) -> threading.Thread:
    """Start the listener; it ends once ``exit`` is set."""
    queues = set(config.queues)

    def notified(channel: str, payload: str) -> None:
        if channel == notify.GROUPS_CHANNEL:
            wakeup.release_groups()
            wakeup.notify()
        elif payload in queues:
            wakeup.notify()

    def listen() -> None:
        notify.listen(
            [notify.CHANNEL, notify.GROUPS_CHANNEL],
            notified,
            on_connect=wakeup.notify,  # poll once: notifications missed while away are gone
            stop=exit,
            name=f"Worker {config.worker_id} listener",
            log=logger,
            reconnected=lambda: metrics.reconnected("listener"),
        )

    thread = threading.Thread(target=listen, name="pgqueue-listener", daemon=True)
    thread.start()
    return thread
