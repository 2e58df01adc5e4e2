"""The placement interface: choose a replica with room for one request, or None."""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import ClassVar

from slogate.router.prefix import PrefixCache
from slogate.router.request import RESUME_WITHIN_S, Request
from slogate.router.view import ReplicaView


class PlacementPolicy(ABC):
    name: ClassVar[str]  # the registry key (router/registry.py), also the module's file name
    aliases: ClassVar[tuple[str, ...]] = ()  # older keys that still select it

    def __init__(self, seed: int = 0) -> None:
        self.rng = random.Random(seed)
        # How long a paused answer's reader may wait for its next token (the scheduler's, set by it)
        self.resume_within_s = RESUME_WITHIN_S

    @abstractmethod
    def place(self, now: float, req: Request, replicas: Sequence[ReplicaView]) -> ReplicaView | None: ...

    @staticmethod
    def with_room(replicas: Sequence[ReplicaView]) -> list[ReplicaView]:
        return [p for p in replicas if p.free > 0 and p.role != "decode"]

    def argmin_random_ties(self, items: Sequence[ReplicaView], key) -> ReplicaView:  # type: ignore[no-untyped-def]
        """argmin with ties broken at random, so equal replicas share load evenly."""
        best = min(key(p) for p in items)
        return self.rng.choice([p for p in items if key(p) == best])


RECORD_BLOCKS = 1 << 17  # a record that in practice never evicts (vllm-router: 2^24 chars)


class OwnRecord(PlacementPolicy):
    """A placement that learns its own picture of each replica's cache from its choices."""

    def __init__(self, record_blocks: int | None = None, seed: int = 0) -> None:
        super().__init__(seed)
        self.record_blocks = record_blocks
        self.records: dict[int, PrefixCache] = {}

    def record(self, p: ReplicaView) -> PrefixCache:
        rec = self.records.get(p.rid)
        if rec is None:
            cap = self.record_blocks or (p.cache.capacity if p.cache is not None else RECORD_BLOCKS)
            rec = self.records[p.rid] = PrefixCache(cap)
        return rec

    def chose(self, p: ReplicaView, req: Request) -> ReplicaView:
        if req.prefix:
            self.record(p).insert(req.prefix)
        return p
