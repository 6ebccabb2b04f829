"""Claims: whether to claim now and how many, and the claim itself, one
round trip that also carries the waiting acknowledgements and the promotion
of released message groups (``lifecycle.ack_and_claim_rows``). The queues
claimed from are those not paused nor waiting for a slot of their limits
(``QueueControls``): in order, or, with weights, sharing each claim by
weight (``QueueShares``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from django_pgqueue import conf, groups, lifecycle, registry
from django_pgqueue.sql import claim as claim_sql
from django_pgqueue.worker.acks import Acks
from django_pgqueue.worker.config import Metrics, WorkerConfig
from django_pgqueue.worker.controls import QueueControls
from django_pgqueue.worker.job import Job
from django_pgqueue.worker.ledger import Ledger
from django_pgqueue.worker.shares import QueueShares
from django_pgqueue.worker.wakeup import Wakeup

# Seconds a queue found to have partitions is claimed with the whole pick
# (sql.claim.CLAIM_SQL) before a claim with the default partition's stream
# alone looks again (one that finds them still there goes on with the pick).
PARTITIONS_RECHECK = 10.0


@dataclass(eq=False)
class Claimer:
    config: WorkerConfig
    ledger: Ledger
    wakeup: Wakeup
    acks: Acks
    submit: Callable[[Job], None]  # hands a claimed job to the handler threads
    metrics: Metrics
    controls: QueueControls  # paused queues and limits: what to claim from, how many
    claimed: int = field(default=0, init=False)  # messages claimed by this worker
    few_ready: bool = field(default=False, init=False)  # the last claim came back short
    # The weights' turn between claims (None: no weights, queues in order).
    shares: QueueShares | None = field(default=None, init=False)
    # Queue -> when (time.monotonic()) a claim last found it has partitions
    # (rows with a partition key or a round): claimed with the whole pick
    # for PARTITIONS_RECHECK seconds from then; the others with the default
    # partition's stream alone, which says when they have some.
    partitioned: dict[str, float] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        if self.config.weights:
            self.shares = QueueShares(self.config.weights)

    def size(self) -> int:
        """How many messages to claim now (``Ledger.claim_size``), never
        past --max-messages."""
        size = self.ledger.claim_size()
        if self.config.max_messages is not None:
            size = min(size, self.config.max_messages - self.claimed)
        return size

    def wanted(self, ready: bool) -> bool:
        """May I claim: messages may be ready (``ready``: the last claim was
        full, a notification came, a poll found some), and there is room."""
        return ready and self.size() > 0

    def limit_reached(self) -> bool:
        """--max-messages are claimed: claim no more."""
        return self.config.max_messages is not None and self.claimed >= self.config.max_messages

    def claim(self) -> tuple[int, int]:
        """Claim up to ``size()`` messages and hand them to the handler
        threads; returns (how many it asked for, how many it got)."""
        config = self.config
        asked = self.size()
        queues = self.controls.claimable(time.monotonic())
        if not queues:
            # Every queue of its is paused or waits for a slot of its limits:
            # no claim, but what a claim's round trip would carry goes on
            # (else the loop would keep coming back for it).
            self.acks.flush()
            if self.wakeup.take_groups():
                groups.promote_groups()
            return asked, 0
        # (A workflow step's is sent apart: with its step's bookkeeping.)
        acks = self.acks.carried(self.ledger.take_unacked())
        promote = self.wakeup.take_groups() or any(job.message.group_key for job in acks)
        now = time.monotonic()
        partitioned = self.partitioned
        plain = [
            q for q in queues if now - partitioned.get(q, -PARTITIONS_RECHECK) >= PARTITIONS_RECHECK
        ]
        started = time.perf_counter()
        try:
            result = lifecycle.ack_and_claim_rows(
                [job.message for job in acks],
                queues,
                asked,
                config.worker_id,
                config.lease_seconds,
                few_ready=self.few_ready,
                promote=promote,
                limits=self.controls.claim_limits(),
                shares=(
                    self.shares.slots(queues, asked)
                    if self.shares is not None and len(queues) > 1
                    else None
                ),
                plain_queues=plain,
                wait_briefly=self.acks.wait_briefly(acks),
            )
        except BaseException:
            self.acks.put_back(acks)  # flushed again next time
            if promote:
                self.wakeup.release_groups()
            raise
        rows = result.rows
        for name, found in result.partitioned.items():
            if found:
                partitioned[name] = now
            else:
                partitioned.pop(name, None)
        if result.limited:
            self.controls.claimed(result.limited, time.monotonic())
        if result.groups_left:
            self.wakeup.release_groups()
        self.metrics.claimed(len(rows), time.perf_counter() - started)
        # After a short claim the next one expects few (ack_and_claim_rows's few_ready).
        self.few_ready = len(rows) < asked
        self.acks.acknowledged(acks, result.acked, result.busy)
        self.claimed += len(rows)
        lookup, topic, database = registry.lookup, claim_sql.ROW_TOPIC, conf.database_alias()
        jobs = [Job(row=row, spec=lookup(row[topic]), database=database) for row in rows]
        self.ledger.add(jobs)
        for job in jobs:
            self.submit(job)
        return asked, len(rows)
