"""The placement interface: choose a replica with room for one request, or None."""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import ClassVar

from slogate.router.request import Request
from slogate.router.view import ReplicaView


class PlacementPolicy(ABC):
    name: ClassVar[str]

    def __init__(self, seed: int = 0) -> None:
        self.rng = random.Random(seed)

    @abstractmethod
    def place(self, now: float, req: Request, replicas: Sequence[ReplicaView]) -> ReplicaView | None: ...

    @staticmethod
    def with_room(replicas: Sequence[ReplicaView]) -> list[ReplicaView]:
        return [p for p in replicas if p.free > 0 and p.role != "decode"]

    def argmin_random_ties(self, items: Sequence[ReplicaView], key) -> ReplicaView:  # type: ignore[no-untyped-def]
        """argmin with ties broken at random, so equal replicas share load evenly."""
        best = min(key(p) for p in items)
        return self.rng.choice([p for p in items if key(p) == best])
