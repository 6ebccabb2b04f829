"""Queues shared by weight (``--queues default=3,bulk=1``): which queue each
slot of a claim goes to.

Smooth weighted round-robin, as nginx balances its upstreams: for each
slot every queue's credit grows by its weight, the queue with the most
credit takes the slot and gives back the weights' total. Weights 3:1 give
a, a, b, a, a, a, b, a...: the shares hold within every claim and across
claims of any size (a claim of one slot still takes ``bulk`` every fourth
time), and the credit stays between minus and plus the total, so a queue
that had no work banks nothing for later. A worker without weights never
comes here: its claims take the queues in order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence


class QueueShares:
    def __init__(self, weights: Mapping[str, int]) -> None:
        self.weights = dict(weights)
        self.credit = dict.fromkeys(weights, 0)

    def slots(self, queues: Sequence[str], size: int) -> list[str]:
        """The queue of each of ``size`` slots, in turn, between ``queues``
        (those claimable now: a paused one takes no share)."""
        weights = {name: self.weights.get(name, 1) for name in queues}
        total = sum(weights.values())
        credit = self.credit
        slots = []
        for _ in range(size):
            for name, weight in weights.items():
                credit[name] = credit.get(name, 0) + weight
            chosen = max(weights, key=credit.__getitem__)
            credit[chosen] -= total
            slots.append(chosen)
        return slots
