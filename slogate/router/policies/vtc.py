"""Weighted Virtual Token Counter (Sheng et al., OSDI'24; weighted variant as in PROSERVE §5).

Each tenant has a counter of tokens served divided by its weight; the tenant with the
smallest counter is served next (FCFS within a tenant). A tenant returning from idle is
lifted to the smallest active counter so it cannot bank credit while away.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from slogate.router.policies.base import OrderingPolicy, Selection
from slogate.router.request import Request
from slogate.router.view import ReplicaView

W_IN, W_OUT = 1.0, 2.0


class WeightedVTC(OrderingPolicy):
    name = "vtc"

    def __init__(self) -> None:
        self.counters: dict[str, float] = {}

    def _charge(self, req: Request, tokens: float) -> None:
        self.counters[req.tenant] = self.counters.get(req.tenant, 0.0) + tokens / max(req.tier.weight, 1e-9)

    def select(self, now: float, waiting: Sequence[Request], slots: int, replicas: Sequence[ReplicaView]) -> Selection:
        if slots <= 0 or not waiting:
            return Selection()
        queues: dict[str, list[Request]] = {}
        for r in sorted(waiting, key=lambda r: r.arrival):
            queues.setdefault(r.tenant, []).append(r)
        floor = min((self.counters[t] for t in queues if t in self.counters), default=0.0)
        for t in queues:
            self.counters[t] = max(self.counters.get(t, floor), floor)
        heap = [(self.counters[t], t) for t in queues]
        heapq.heapify(heap)
        pos = dict.fromkeys(queues, 0)
        out: list[Request] = []
        while heap and len(out) < slots:
            _c, t = heapq.heappop(heap)
            r = queues[t][pos[t]]
            pos[t] += 1
            out.append(r)
            # Charge the prompt now; output is charged as it is generated (on_service).
            self._charge(r, W_IN * r.context_tokens)
            if pos[t] < len(queues[t]):
                heapq.heappush(heap, (self.counters[t], t))
        return Selection(dispatch=out)

    def on_service(self, req: Request, tokens: int, now: float) -> None:
        self._charge(req, W_OUT * tokens)
