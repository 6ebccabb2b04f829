"""The message state machine: the only code that changes ``Message.status``
(but for the hand-off of message groups, in ``groups``).

Every transition is one transaction guarded by the state it expects and, for
a leased message, by its lease token (the fencing token):

    waiting --run_now--> waiting (due now)
    waiting --claim--> processing --ack--> (deleted)
                           |--retry_later--> waiting (run_at in the future)
                           |--release--> waiting (attempt not counted)
                           |--dead_letter--> DeadLetter row (message deleted)
                           '--requeue_lost--> waiting (its run was lost:
                                              maintenance's rescue)
    waiting, blocked --cancel--> cancelled (kept until CANCELLED_RETENTION)
    processing --cancel--> processing, cancellation asked --cancel_running--> cancelled

One module per kind of transition: ``claim`` (with the worker's round trip),
``acks``, ``requeue`` (back to waiting), ``deadletter``, ``cancel``; ``guards`` holds the
lease guard they share. A guard that matches no row is a named outcome, the
lease was lost (the message was rescued, timed out or finished elsewhere):
logged and returned as False or None, never an exception. So a late
acknowledgement never finishes a rescued message, and a rescue never
overwrites a finished one.

The statements the ORM cannot say are in ``sql``. ``now`` is a parameter
wherever time matters; None means the database's clock.
"""

from django_pgqueue.lifecycle.acks import (
    ack,
    ack_leased,
    ack_then,
    ack_unlocked,
    still_leased,
    unacknowledged,
)
from django_pgqueue.lifecycle.cancel import CancelResult, acancel, cancel, cancel_running
from django_pgqueue.lifecycle.claim import (
    ClaimResult,
    LimitState,
    ack_and_claim_rows,
    message_from_row,
)
from django_pgqueue.lifecycle.deadletter import dead_letter
from django_pgqueue.lifecycle.guards import (
    CONNECTION_LOST,
    LEASE_EXPIRED,
    LEASE_MISSING,
    LOST_RUN_REASONS,
    UNDECODABLE,
    WORKER_LOST,
)
from django_pgqueue.lifecycle.requeue import release, requeue_lost, retry_later, run_now

__all__ = [
    "CONNECTION_LOST",
    "LEASE_EXPIRED",
    "LEASE_MISSING",
    "LOST_RUN_REASONS",
    "UNDECODABLE",
    "WORKER_LOST",
    "CancelResult",
    "ClaimResult",
    "LimitState",
    "acancel",
    "ack",
    "ack_and_claim_rows",
    "ack_leased",
    "ack_then",
    "ack_unlocked",
    "cancel",
    "cancel_running",
    "dead_letter",
    "message_from_row",
    "release",
    "requeue_lost",
    "retry_later",
    "run_now",
    "still_leased",
    "unacknowledged",
]
