"""Background duties that one worker at a time performs.

``run_once`` is called by every worker's heartbeat thread; the first to take
the transaction-scoped advisory lock does the work, the others skip. Each
duty returns counts; the loop in worker.py only schedules.
"""

import datetime
import logging
import os
import time
from dataclasses import dataclass

from django.db.models.functions import Now

from django_pgqueue import conf, lifecycle, streams
from django_pgqueue.models import WorkerHeartbeat

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MaintenanceResult:
    rescued: int
    rescued_dead_lettered: int
    workers_pruned: int = 0
    events_pruned: int = 0  # streams: events past their retention


# A dead worker's row stays this long after its last heartbeat, so status and
# the admin still show what died; then maintenance deletes it.
DEAD_WORKER_RETENTION = datetime.timedelta(days=1)


def run_once(now=None, rescue_limit=1000):
    """Do one round of maintenance if no other worker is doing it.

    Returns a MaintenanceResult, or None when another worker holds the lock.
    """
    with lifecycle.worker_transaction():
        if not lifecycle.try_maintenance_lock():
            logger.debug(
                "Maintenance round in process %s skipped: another holds the lock", os.getpid()
            )
            return None
        began = time.time()
        rescue = lifecycle.rescue_expired(now=now, limit=rescue_limit)
        pruned, _ = (
            WorkerHeartbeat.objects.using(conf.database_alias())
            .filter(expires_at__lt=(now or Now()) - DEAD_WORKER_RETENTION)
            .delete()
        )
        # Streams: the events every subscription has passed, past their retention.
        events_pruned = streams.prune_events(now=now)
        # Logged before the commit releases the lock: the rounds' times, in
        # the logs of every worker, never overlap (one worker at a time).
        logger.debug(
            "Maintenance round in process %s from %.6f to %.6f (Unix time)",
            os.getpid(),
            began,
            time.time(),
        )
    result = MaintenanceResult(
        rescued=rescue.requeued,
        rescued_dead_lettered=rescue.dead_lettered,
        workers_pruned=pruned,
        events_pruned=events_pruned,
    )
    if rescue.requeued or rescue.dead_lettered:
        logger.info(
            "Maintenance: rescued %s message(s) of lost workers, dead-lettered %s",
            rescue.requeued,
            rescue.dead_lettered,
            extra={"rescued": rescue.requeued},
        )
    return result
