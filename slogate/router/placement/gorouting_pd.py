"""`gorouting-pd`: GoRouting for prefill/decode-disaggregated fleets."""

from __future__ import annotations

from collections.abc import Sequence

from slogate.router.placement.gorouting import GoRouting
from slogate.router.request import Request
from slogate.router.view import ReplicaView


class GoRoutingPD(GoRouting):
    """P/D-disaggregated GoRouting: returns the prefill replica; `place_pair` gives both."""

    name = "gorouting-pd"

    def place(self, now: float, req: Request, replicas: Sequence[ReplicaView]) -> ReplicaView | None:
        pair = self.place_pair(now, req, replicas)
        return pair[0] if pair else None

    def place_pair(self, now: float, req: Request, replicas: Sequence[ReplicaView]) -> tuple[ReplicaView, ReplicaView] | None:
        prefill = [p for p in replicas if p.role == "prefill" and p.free > 0]
        decode = [p for p in replicas if p.role == "decode" and p.healthy]
        p_inst = self._choose(now, req, prefill)
        if p_inst is None or not decode:
            return None
        d_inst = max(decode, key=lambda p: (p.free_kv_blocks if p.free_kv_blocks is not None else -p.inflight))
        return p_inst, d_inst
