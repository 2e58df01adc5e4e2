"""Scheduler scaling: one GMAX decision over N waiting requests, and a whole simulation.

    python bench/scheduler_scaling.py [--data ../shared/data]

Prints p50/p95 of one `Scheduler.schedule` call (gmax+gorouting, 8 replicas, 16 free
slots) for N = 100 … 10,000 waiting requests, next to fcfs+least-load for scale, then the
wall time of a 10,000-request, 8-replica simulation of the Azure conversation trace.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

from slogate.router.latency import DEFAULT_PROFILE, PROFILES, BatchLatencyModel
from slogate.router.request import SLO, Request, Tier, Workflow
from slogate.router.scheduler import Scheduler
from slogate.router.view import ReplicaView


def waiting(n: int, rng: random.Random) -> list[Request]:
    tiers = [Tier("high", 2.0), Tier("low", 1.0)]
    out = []
    for i in range(n):
        kind = i % 3
        if kind == 0:
            slo = SLO.latency(2.0, 0.1)
        elif kind == 1:
            slo = SLO.deadline(20.0)
        else:
            slo = SLO.compound(40.0)
        r = Request(i, rng.uniform(0, 10), rng.randint(50, 4000), slo, tier=rng.choice(tiers))
        if kind == 2:
            r.workflow = Workflow(f"w{i % 50}", 0.0, 200.0)
        r.len_bound = rng.randint(10, 800)
        r.len_mean = r.len_bound / 2
        out.append(r)
    return out


def replicas() -> list[ReplicaView]:
    reps = [ReplicaView(i, BatchLatencyModel(PROFILES[DEFAULT_PROFILE]), budget=48) for i in range(8)]
    for p in reps:  # 46 of 48 slots busy on each replica: 16 free in all
        for k in range(46):
            r = Request(10_000_000 + 100 * p.rid + k, 0.0, 1000, SLO.deadline(20.0))
            p.claim(r, 0.0)
            if k % 2:
                p.first_token(r, 0.1)
    return reps


def time_decision(combo: str, n: int, repeats: int = 15) -> tuple[float, float]:
    rng = random.Random(0)
    reqs = waiting(n, rng)
    samples = []
    for _ in range(repeats):
        sched = Scheduler.from_combo(combo)
        reps = replicas()
        t = time.perf_counter()
        sched.schedule(10.0, reqs, reps)
        samples.append(time.perf_counter() - t)
    samples.sort()
    return statistics.median(samples), samples[int(0.95 * (len(samples) - 1))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default=str(Path(__file__).resolve().parents[2] / "shared" / "data"))
    args = ap.parse_args()
    print("| waiting | gmax+gorouting p50 | p95 | fcfs+least-load p50 |")
    print("|---:|---:|---:|---:|")
    for n in (100, 1000, 5000, 10_000):
        g50, g95 = time_decision("gmax+gorouting", n)
        f50, _ = time_decision("fcfs+least-load", n)
        print(f"| {n:,} | {1e3 * g50:.2f} ms | {1e3 * g95:.2f} ms | {1e3 * f50:.2f} ms |")
    trace = Path(args.data) / "trace_azure2023_conv.csv"
    if trace.exists():
        from slogate.sim.runner import Experiment, SimConfig

        cfg = SimConfig(trace=str(trace), workflows=str(Path(args.data) / "workflows_chatdev.jsonl"), replicas=8, rate_scale=20, max_requests=10_000)
        for combo in ("gmax+gorouting", "fcfs+least-load"):
            t = time.perf_counter()
            row = Experiment(cfg).run(combo)
            print(f"simulation {combo}: {row['requests']:,} requests, 8 replicas, x20 load: {time.perf_counter() - t:.1f} s wall")
    else:
        print(f"(no trace at {trace}: skipped the whole-simulation timing)")


if __name__ == "__main__":
    main()
