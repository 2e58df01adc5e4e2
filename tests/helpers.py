from slogate.router.latency import PROFILES, BatchLatencyModel
from slogate.router.request import SLO, Request, Tier
from slogate.router.view import ReplicaView

PROFILE = PROFILES["llama3.1-8b@a100-80g"]


def view(rid: int = 0, budget: int = 4) -> ReplicaView:
    return ReplicaView(rid, BatchLatencyModel(PROFILE), budget=budget)


def req(rid: int, arrival: float = 0.0, inp: int = 100, slo: SLO | None = None, bound: float = 100, mean: float | None = None,
        tier: Tier | None = None, tenant: str = "default") -> Request:
    r = Request(rid, arrival, inp, slo or SLO.deadline(20.0), tier=tier or Tier(), tenant=tenant)
    r.len_bound = bound
    r.len_mean = bound if mean is None else mean
    return r
