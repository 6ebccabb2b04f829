"""The claim and the acknowledgement of many, as the tests drive them.

Built on the worker's own path (lifecycle.ack_and_claim_rows, then
lifecycle.message_from_row for each row; lifecycle.ack_unlocked), so a test
claims and acknowledges exactly as a worker does, with messages in hand.
"""

from django_pgqueue import lifecycle


def ack_and_claim(acks, queues, limit, worker_id, lease_seconds, now=None, few_ready=False):
    """Acknowledge ``acks`` and claim, in one round trip: (the acknowledged
    ids, the claimed messages in claim order)."""
    result = lifecycle.ack_and_claim_rows(
        acks, queues, limit, worker_id, lease_seconds, now, few_ready
    )
    return result.acked, [lifecycle.message_from_row(row) for row in result.rows]


def claim(queues, limit, worker_id, lease_seconds, now=None, few_ready=False):
    """Lease up to ``limit`` ready messages of ``queues`` to ``worker_id``:
    the messages as leased, in claim order."""
    return ack_and_claim((), queues, limit, worker_id, lease_seconds, now, few_ready)[1]


def ack_many(messages):
    """Finish many messages in one DELETE: the ids still held by their lease
    and now finished."""
    return lifecycle.ack_unlocked(messages)[0]
