"""What pricing new replicas by the fleet's first tokens costs a decision (`view.FleetPrefill`).

    python bench/fleet_prefill_cost.py

While any replica has fewer than 8 first tokens timed, every scheduling decision prices it by the
fleet's pooled first tokens. Under load few first tokens are timed alone, so a replica can stay
"new" for long. Side by side, for N replicas of which one is new: the pool kept between decisions
(`FleetPrefill`, as the scheduler holds it: pooled again only when a first token was timed) and
pooled afresh every decision (a new `FleetPrefill` each call: what the scheduler did before).
"""

from __future__ import annotations

import random
import statistics
import time

from slogate.router.latency import DEFAULT_PROFILE, PROFILES, BatchLatencyModel
from slogate.router.view import FleetPrefill, ReplicaView


def fleet(n: int, rng: random.Random) -> list[ReplicaView]:
    reps = [ReplicaView(rid=i, model=BatchLatencyModel(PROFILES[DEFAULT_PROFILE])) for i in range(n)]
    for p in reps[1:]:
        for k in range(8):
            p.model.observe_prefill(rng.uniform(0.1, 0.5), 300, now=k)
    for k in range(3):  # the new one: 3 of its own
        reps[0].model.observe_prefill(rng.uniform(0.1, 0.5), 300, now=k)
    return reps


def per_call_us(fn: object, calls: int) -> float:
    best = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(calls):
            fn()  # type: ignore[operator]
        best.append((time.perf_counter() - t) / calls * 1e6)
    return statistics.median(best)


def main() -> None:
    rng = random.Random(0)
    print("| replicas | kept between decisions, us | pooled every decision, us | ratio |")
    print("|---:|---:|---:|---:|")
    for n in (2, 16, 128, 1024):
        reps = fleet(n, rng)
        kept = FleetPrefill()
        calls = max(20, 20_000 // n)
        a = per_call_us(lambda: kept.share(reps), calls)  # noqa: B023 - called within the iteration
        b = per_call_us(lambda: FleetPrefill().share(reps), calls)  # noqa: B023
        print(f"| {n} | {a:.1f} | {b:.1f} | {b / a:.1f}x |")


if __name__ == "__main__":
    main()
