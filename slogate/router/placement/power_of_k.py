"""GMAX power-of-K placement (JITServe §4.3): score the request on K sampled replicas with a
replica-specific priority (goodput / t_gen at that replica's current speed) and take the best."""

from __future__ import annotations

from collections.abc import Sequence

from slogate.router.placement.base import PlacementPolicy
from slogate.router.policies.gmax import GMAX
from slogate.router.request import Request
from slogate.router.view import ReplicaView


class PowerOfK(PlacementPolicy):
    name = "power-of-k"
    aliases = ("pok",)

    def __init__(self, k: int | None = None, seed: int = 0) -> None:
        super().__init__(seed)
        self.k = k  # None: K = M, full coverage (the paper's recommendation)
        self._scorer = GMAX(preempt=False, delta=0.0)

    def place(self, now: float, req: Request, replicas: Sequence[ReplicaView]) -> ReplicaView | None:
        room = self.with_room(replicas)
        if not room:
            return None
        if self.k is not None and self.k < len(room):
            room = self.rng.sample(room, self.k)
        scores = [float(self._scorer.estimate(now, [req], [p])[0][0]) for p in room]
        best = max(scores)
        return self.rng.choice([p for p, s in zip(room, scores, strict=True) if s == best])
