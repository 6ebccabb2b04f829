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

One module per kind of transition: ``claim`` (with the worker's round trip),
``acks``, ``requeue`` (back to waiting), ``deadletter``; ``guards`` holds the
lease guard they share. A guard that matches no row is a named outcome, the
lease was lost (the message was rescued, timed out or finished elsewhere):
logged and returned as False or None, never an exception. So a late
acknowledgement never finishes a rescued message, and a rescue never
overwrites a finished one.

The statements the ORM cannot say are in ``sql``. ``now`` is a parameter
wherever time matters; None means the database's clock.
"""

from django_pgqueue.lifecycle.acks import ack, ack_leased, ack_unlocked, still_leased
from django_pgqueue.lifecycle.claim import ClaimResult, ack_and_claim_rows, message_from_row
from django_pgqueue.lifecycle.deadletter import dead_letter
from django_pgqueue.lifecycle.guards import (
    LEASE_EXPIRED,
    LEASE_MISSING,
    LOST_RUN_REASONS,
    UNDECODABLE,
    WORKER_LOST,
)
from django_pgqueue.lifecycle.requeue import release, requeue_lost, retry_later, run_now

# Names the worker reaches here: the worker's liveness (its heartbeat, its
# leases, its idle poll) lives in liveness.py; the positions in the claim's
# rows (ClaimResult.rows) are the claim statement's, in sql.py.
from django_pgqueue.liveness import Beat, Probe, extend_leases, heartbeat, probe, unregister
from django_pgqueue.sql import ROW_ID, ROW_TOPIC

__all__ = [
    "LEASE_EXPIRED",
    "LEASE_MISSING",
    "LOST_RUN_REASONS",
    "ROW_ID",
    "ROW_TOPIC",
    "UNDECODABLE",
    "WORKER_LOST",
    "Beat",
    "ClaimResult",
    "Probe",
    "ack",
    "ack_and_claim_rows",
    "ack_leased",
    "ack_unlocked",
    "dead_letter",
    "extend_leases",
    "heartbeat",
    "message_from_row",
    "probe",
    "release",
    "requeue_lost",
    "retry_later",
    "run_now",
    "still_leased",
    "unregister",
]
