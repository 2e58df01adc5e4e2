"""SlideBatching (PROSERVE §4.2, Alg. 1) as a gateway ordering.

Every request gets exec (its prefill time), remain (time to its next due token) and
density = w_r(next token)/exec. The latency budget is max(min remain, η); a request is
URGENT when remain < γ·φ_a(Q) (eq. 8, spread over the replicas), and URGENT requests go
first by density, the rest by remain (deadline first). The boundary slides with load.
"""

from __future__ import annotations

from collections.abc import Sequence

from slogate.router.policies.base import OrderingPolicy, Selection
from slogate.router.request import Request, SLOClass
from slogate.router.view import ReplicaView, fleet_speed


class SlideBatching(OrderingPolicy):
    name = "slide"

    def __init__(self, gamma: float = 1.0, eta_s: float = 0.05, w_p: float = 1.0) -> None:
        self.gamma, self.eta_s, self.w_p = gamma, eta_s, w_p

    def select(self, now: float, waiting: Sequence[Request], slots: int, replicas: Sequence[ReplicaView]) -> Selection:
        if slots <= 0 or not waiting:
            return Selection()
        live, model, v = fleet_speed(replicas)
        rows = []
        for r in waiting:
            ex = model.prefill_time(r.context_tokens) + model.t_c
            due = r.ttft_deadline if r.kind is SLOClass.LATENCY else r.deadline_at - r.remaining_bound * v
            rows.append((r, ex, due - now, r.tier.weight * self.w_p / ex))
        t_min = min(row[2] for row in rows)
        t_budget = max(t_min, self.eta_s)
        t_c = model.t_c
        scale = t_budget / (t_budget - t_c) if t_budget > t_c else 2.0
        phi_a = scale * sum(row[1] for row in rows) / len(live)
        urgent = [row for row in rows if row[2] < self.gamma * phi_a]
        normal = [row for row in rows if row[2] >= self.gamma * phi_a]
        urgent.sort(key=lambda row: -row[3])
        normal.sort(key=lambda row: row[2])
        return Selection(dispatch=[row[0] for row in (urgent + normal)[:slots]])
