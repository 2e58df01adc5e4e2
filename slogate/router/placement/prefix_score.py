"""`prefix-score`: llm-d's default scorers (prefix match 3, queue 2, KV use 2), a baseline."""

from __future__ import annotations

from collections.abc import Sequence

from slogate.router.placement.base import OwnRecord
from slogate.router.request import Request
from slogate.router.view import ReplicaView


class PrefixScore(OwnRecord):
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
