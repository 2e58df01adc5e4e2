"""The peers' prefix-cache-aware placements, as baselines for GoRouting with a prefix index.

- `cache-aware`: vllm-router's default and the SGLang gateway's (same algorithm, same defaults,
  docs of vllm-router 0.1.x / sgl-router): while the fleet is balanced, the replica whose own
  record shares the longest prefix with the prompt if that share exceeds `cache_threshold`,
  else the replica with the smallest record; once the busiest has more than `balance_abs`
  requests over the idlest *and* more than `balance_rel` times as many, the least loaded. Its
  record is its own (a radix tree of everything sent, bounded far above any KV cache), not the
  engine's: it believes evicted prefixes are still there.
- `prefix-score`: llm-d's default scoring profile: prefix-cache match (weight 3), queue depth
  (2) and KV-cache utilisation (2), each scaled to [0, 1], highest total wins.
- `session-hash`: consistent (rendezvous) hashing on a session key, as sticky-session load
  balancers do: the `session` a client names, else the prompt's first blocks.

Each keeps its own picture of the caches (`PrefixCache` per replica, learned from its own
choices); none of them weighs an SLO.
"""

from __future__ import annotations

from collections.abc import Sequence

from slogate.router.placement.base import RECORD_BLOCKS, OwnRecord
from slogate.router.request import Request
from slogate.router.view import ReplicaView


class CacheAware(OwnRecord):
    name = "cache-aware"

    def __init__(self, cache_threshold: float = 0.3, balance_abs: int = 64, balance_rel: float = 1.5,
                 record_blocks: int | None = RECORD_BLOCKS, seed: int = 0) -> None:
        super().__init__(record_blocks, seed)
        self.cache_threshold, self.balance_abs, self.balance_rel = cache_threshold, balance_abs, balance_rel

    def place(self, now: float, req: Request, replicas: Sequence[ReplicaView]) -> ReplicaView | None:
        room = self.with_room(replicas)
        if not room:
            return None
        loads = [p.inflight for p in room]
        hi, lo = max(loads), min(loads)
        if hi - lo > self.balance_abs and hi > lo * self.balance_rel:
            return self.chose(self.argmin_random_ties(room, lambda p: p.inflight), req)
        if req.prefix:
            best = max(self.record(p).match(req.prefix) for p in room)
            if best / len(req.prefix) > self.cache_threshold:
                return self.chose(self.rng.choice([p for p in room if self.record(p).match(req.prefix) == best]), req)
        return self.chose(self.argmin_random_ties(room, lambda p: len(self.record(p))), req)




