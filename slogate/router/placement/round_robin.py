"""`round-robin`: each replica with room in turn."""

from __future__ import annotations

from collections.abc import Sequence

from slogate.router.placement.base import PlacementPolicy
from slogate.router.request import Request
from slogate.router.view import ReplicaView


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
