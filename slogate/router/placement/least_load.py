"""`least-load`: fewest requests in flight."""

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
