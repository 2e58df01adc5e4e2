"""Load-balancing baselines: least-load, round-robin, random, power-of-two-choices."""

from __future__ import annotations

from collections.abc import Sequence

from slogate.router.placement.base import PlacementPolicy
from slogate.router.request import Request
from slogate.router.view import ReplicaView


class LeastLoad(PlacementPolicy):
    """Fewest requests in flight (ties at random) — the common gateway default."""

    name = "least-load"

    def place(self, now: float, req: Request, replicas: Sequence[ReplicaView]) -> ReplicaView | None:
        room = self.with_room(replicas)
        return self.argmin_random_ties(room, lambda p: p.inflight) if room else None


class RoundRobin(PlacementPolicy):
    name = "round-robin"

    def __init__(self, seed: int = 0) -> None:
        super().__init__(seed)
        self.next = 0

    def place(self, now: float, req: Request, replicas: Sequence[ReplicaView]) -> ReplicaView | None:
        n = len(replicas)
        for k in range(n):
            p = replicas[(self.next + k) % n]
            if p.free > 0 and p.role != "decode":
                self.next = (self.next + k + 1) % n
                return p
        return None


class RandomPlacement(PlacementPolicy):
    name = "random"

    def place(self, now: float, req: Request, replicas: Sequence[ReplicaView]) -> ReplicaView | None:
        room = self.with_room(replicas)
        return self.rng.choice(room) if room else None


class PowerOfTwo(PlacementPolicy):
    """Sample two replicas with room, keep the one with fewer requests in flight."""

    name = "p2c"

    def place(self, now: float, req: Request, replicas: Sequence[ReplicaView]) -> ReplicaView | None:
        room = self.with_room(replicas)
        if len(room) <= 2:
            return min(room, key=lambda p: p.inflight) if room else None
        a, b = self.rng.sample(room, 2)
        return a if a.inflight <= b.inflight else b
