"""What `capacity.absorb` adds to a decision with every replica full (it then runs on every frame):
`Scheduler.absorbed` over a queue of 100 / 1,000 / 2,000 waiting latency requests, 8 replicas of
48 streams each, beside one GMAX selection over the same queue (what a decision costs anyway).
Two cases: streams with seconds of slack (each absorbed first token spends some, until none is
left) and streams at their pace (every check fails: the most checks a decision can make).

    python bench/absorb_cost.py
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from slogate.router.latency import BatchLatencyModel
from slogate.router.request import SLO, Request
from slogate.router.scheduler import Scheduler
from slogate.router.view import ReplicaView

NOW = 100.0


def fleet(pace: float) -> list[ReplicaView]:
    views = []
    for i in range(8):
        v = ReplicaView(i, BatchLatencyModel.named(), budget=48)
        for k in range(48):
            r = Request(10_000 * (i + 1) + k, NOW - 10, 500, SLO.latency(1.0, 0.05))
            r.len_bound = r.len_mean = 400
            v.claim(r, NOW - 10)
            v.first_token(r, NOW - 9.5)
            r.generated, r.first_token_at, r.last_token_at = 100, NOW - 99 * pace, NOW
        v.stream_cost = 0.0002
        views.append(v)
    return views


def queue(n: int) -> list[Request]:
    out = []
    for i in range(n):  # arrivals over the last second: the oldest are due within `at_risk_s`
        r = Request(i + 1, NOW - 0.8 * (i % 100) / 100, 300, SLO.latency(1.0, 0.05))
        r.len_bound = r.len_mean = 200
        out.append(r)
    return out


def run(n: int, pace: float, what: str, reps: int = 10) -> float:
    """Median milliseconds of one call."""
    times = []
    for _ in range(reps):
        s = Scheduler.from_combo("gmax+gorouting")
        s.absorb = True
        views, waiting = fleet(pace), queue(n)
        t = time.perf_counter()
        if what == "absorbed":
            s.absorbed(NOW, waiting, views)
        else:
            s.ordering.select(NOW, waiting, 0, views)
        times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times)


def main() -> None:
    print("| waiting | GMAX selection, ms | absorbed, streams with slack, ms | absorbed, streams at their pace, ms |")
    print("|---:|---:|---:|---:|")
    for n in (100, 1000, 2000):
        print(f"| {n} | {run(n, 0.03, 'select'):.2f} | {run(n, 0.03, 'absorbed'):.2f} | {run(n, 0.0499, 'absorbed'):.2f} |")


if __name__ == "__main__":
    main()
