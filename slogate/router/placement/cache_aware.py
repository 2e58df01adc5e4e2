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

from slogate.router.placement.base import PlacementPolicy
from slogate.router.prefix import PrefixCache, rendezvous
from slogate.router.request import Request
from slogate.router.view import ReplicaView

_RECORD_BLOCKS = 1 << 17  # a record that in practice never evicts (vllm-router: 2^24 chars)


class _OwnRecord(PlacementPolicy):
    """A placement that learns its own picture of each replica's cache from its choices."""

    def __init__(self, record_blocks: int | None = None, seed: int = 0) -> None:
        super().__init__(seed)
        self.record_blocks = record_blocks
        self.records: dict[int, PrefixCache] = {}

    def record(self, p: ReplicaView) -> PrefixCache:
        rec = self.records.get(p.rid)
        if rec is None:
            cap = self.record_blocks or (p.cache.capacity if p.cache is not None else _RECORD_BLOCKS)
            rec = self.records[p.rid] = PrefixCache(cap)
        return rec

    def chose(self, p: ReplicaView, req: Request) -> ReplicaView:
        if req.prefix:
            self.record(p).insert(req.prefix)
        return p


class CacheAware(_OwnRecord):
    name = "cache-aware"

    def __init__(self, cache_threshold: float = 0.3, balance_abs: int = 64, balance_rel: float = 1.5,
                 record_blocks: int | None = _RECORD_BLOCKS, seed: int = 0) -> None:
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


class PrefixScore(_OwnRecord):
    name = "prefix-score"

    def __init__(self, w_prefix: float = 3.0, w_queue: float = 2.0, w_kv: float = 2.0, kv_tokens: int = 400_000,
                 record_blocks: int | None = None, seed: int = 0) -> None:
        super().__init__(record_blocks, seed)
        self.w_prefix, self.w_queue, self.w_kv, self.kv_tokens = w_prefix, w_queue, w_kv, kv_tokens

    def _kv_tokens(self, p: ReplicaView, req: Request) -> float:
        if p.cache is not None and req.tokens_per_block:
            return p.cache.capacity * req.tokens_per_block
        return self.kv_tokens

    def place(self, now: float, req: Request, replicas: Sequence[ReplicaView]) -> ReplicaView | None:
        room = self.with_room(replicas)
        if not room:
            return None
        queues = [len(p.prefill_queue) + p.remote_prefill for p in room]
        q_hi, q_lo = max(queues), min(queues)
        n = len(req.prefix)

        def score(i: int, p: ReplicaView) -> float:
            prefix = self.record(p).match(req.prefix) / n if n else 0.0
            queue = 1.0 if q_hi == q_lo else (q_hi - queues[i]) / (q_hi - q_lo)
            kv = 1.0 - min((p.decode_kv + p.prefill_ctx + p.remote_kv) / self._kv_tokens(p, req), 1.0)
            return self.w_prefix * prefix + self.w_queue * queue + self.w_kv * kv

        scores = [score(i, p) for i, p in enumerate(room)]
        best = max(scores)
        return self.chose(self.rng.choice([p for p, s in zip(room, scores, strict=True) if s == best]), req)


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
