"""`random`: any replica with room."""

from __future__ import annotations

from collections.abc import Sequence

from slogate.router.placement.base import PlacementPolicy
from slogate.router.request import Request
from slogate.router.view import ReplicaView


class RandomPlacement(PlacementPolicy):
    name = "random"

    def place(self, now: float, req: Request, replicas: Sequence[ReplicaView]) -> ReplicaView | None:
        room = self.with_room(replicas)
        return self.rng.choice(room) if room else None
