"""Simulated-annealing priority mapping (Huang et al., SC'25) as a gateway ordering.

Searches permutations of the most urgent waiting requests to maximise
G = SLO attainment / mean latency, predicted by list-scheduling the order onto the
cluster's slots with the latency model. Bounded work per decision (`max_n`, `iters`).
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Sequence

from slogate.router.policies.base import OrderingPolicy, Selection
from slogate.router.request import Request, SLOClass
from slogate.router.view import ReplicaView, fleet_speed


class SimulatedAnnealing(OrderingPolicy):
    name = "simulated-annealing"
    aliases = ("sa",)

    def __init__(self, max_n: int = 24, iters: int = 120, t0: float = 1.0, cooling: float = 0.96, seed: int = 0) -> None:
        self.max_n, self.iters, self.t0, self.cooling = max_n, iters, t0, cooling
        self.rng = random.Random(seed)

    def _objective(self, order: list[int], cost: list[float], due: list[float], free_at: list[float], now: float) -> float:
        slots = list(free_at)
        heapq.heapify(slots)
        met, lat = 0, 0.0
        for i in order:
            start = heapq.heappop(slots)
            end = start + cost[i]
            heapq.heappush(slots, end)
            met += end <= due[i]
            lat += end - now
        return met / max(lat / len(order), 1e-9)

    def select(self, now: float, waiting: Sequence[Request], slots: int, replicas: Sequence[ReplicaView]) -> Selection:
        if slots <= 0 or not waiting:
            return Selection()
        live, model, v = fleet_speed(replicas)
        pool = sorted(waiting, key=lambda r: r.ttft_deadline)[: self.max_n]
        if len(pool) <= 1:
            return Selection(dispatch=pool[:slots])
        # For latency requests the SLO event is the first token; otherwise the whole answer.
        cost = [
            model.prefill_time(r.context_tokens) + model.t_c + (0.0 if r.kind is SLOClass.LATENCY else r.len_mean * v)
            for r in pool
        ]
        due = [r.ttft_deadline if r.kind is SLOClass.LATENCY else r.deadline_at for r in pool]
        busy = sum(p.inflight for p in live)
        typical = sum(cost) / len(cost)
        free_at = [now] * slots + [now + typical] * min(busy, len(pool))
        best = list(range(len(pool)))
        best.sort(key=lambda i: due[i])  # EDF start (the paper's second seed)
        cur, cur_g = list(best), self._objective(best, cost, due, free_at, now)
        best_g, temp = cur_g, self.t0
        for _ in range(self.iters):
            i, j = self.rng.sample(range(len(cur)), 2)
            cand = list(cur)
            cand[i], cand[j] = cand[j], cand[i]
            g = self._objective(cand, cost, due, free_at, now)
            if g >= cur_g or self.rng.random() < math.exp((g - cur_g) / max(temp * abs(cur_g) + 1e-12, 1e-12)):
                cur, cur_g = cand, g
                if g > best_g:
                    best, best_g = list(cand), g
            temp *= self.cooling
        return Selection(dispatch=[pool[i] for i in best[:slots]])
