"""`power-of-two` (old key `p2c`): the less loaded of two sampled replicas."""

from __future__ import annotations

from collections.abc import Sequence

from slogate.router.placement.base import PlacementPolicy
from slogate.router.request import Request
from slogate.router.view import ReplicaView


class PowerOfTwo(PlacementPolicy):
    """Sample two replicas with room, keep the one with fewer requests in flight."""

    name = "power-of-two"
    aliases = ("p2c",)

    def place(self, now: float, req: Request, replicas: Sequence[ReplicaView]) -> ReplicaView | None:
        room = self.with_room(replicas)
        if len(room) <= 2:
            return min(room, key=lambda p: p.inflight) if room else None
        a, b = self.rng.sample(room, 2)
        return a if a.inflight <= b.inflight else b
