"""What pricing by the free replicas' caches (GMAX `cache_where_room`) adds to one GMAX estimate,
in its worst case: every waiting turn cached on the one full replica, 7 replicas free, decisions
within one frame (where `best_cached` and `room_cached` keep their hits), on and off side by side.

    python bench/cache_where_room_cost.py
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from slogate.router.latency import BatchLatencyModel
from slogate.router.policies import GMAX
from slogate.router.prefix import PrefixCache
from slogate.router.request import SLO, Request
from slogate.router.view import ReplicaView


def run(n_wait: int, on: bool, reps: int = 20) -> float:
    """Median milliseconds of one estimate over `n_wait` waiting turns."""
    views = []
    for i in range(8):
        v = ReplicaView(i, BatchLatencyModel.named(), budget=1 if i == 0 else 64)
        v.cache = PrefixCache(200_000)
        views.append(v)
    reqs = []
    for k in range(n_wait):
        blocks = tuple(range(k * 100, k * 100 + 64))
        views[0].cache.insert(blocks)  # every turn's history on the full replica
        r = Request(k, 0.0, 64 * 32, SLO.deadline(30.0))
        r.prefix, r.tokens_per_block = (*blocks, 10**9 + k), 32.0
        reqs.append(r)
    views[0].claim(Request(10**6, 0.0, 10, SLO.deadline(60.0)), 0.0)  # replica 0 is full
    g = GMAX(seed=0, cache_where_room=on)
    ts = []
    for i in range(reps):
        t0 = time.perf_counter()
        g.estimate(0.01 * (i % 2), reqs, views)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1000


if __name__ == "__main__":
    for n in (100, 1000, 2000):
        print(f"{n} waiting: estimate off {run(n, False):.2f} ms, on {run(n, True):.2f} ms")
