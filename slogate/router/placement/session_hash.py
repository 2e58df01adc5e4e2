"""`session-hash`: rendezvous hashing on a session key, a baseline."""

from __future__ import annotations

from collections.abc import Sequence

from slogate.router.placement.base import PlacementPolicy
from slogate.router.prefix import rendezvous
from slogate.router.request import Request
from slogate.router.view import ReplicaView


class SessionHash(PlacementPolicy):
    name = "session-hash"

    def __init__(self, key_blocks: int = 2, seed: int = 0) -> None:
        super().__init__(seed)
        self.key_blocks = key_blocks

    def place(self, now: float, req: Request, replicas: Sequence[ReplicaView]) -> ReplicaView | None:
        room = {p.rid: p for p in self.with_room(replicas)}
        if not room:
            return None
        if req.session:
            key = req.session
        elif req.prefix:
            key = req.prefix[min(self.key_blocks, len(req.prefix)) - 1]
        else:
            key = req.rid
        for rid in rendezvous(key & 0xFFFF_FFFF_FFFF_FFFF, [p.rid for p in replicas]):
            if rid in room:
                return room[rid]
        return None
