"""Load and soak: a thousand concurrent streaming clients through ONE `slogate serve` process
to simulated engines (separate processes), for minutes; samples the gateway's RSS.

    python bench/load_soak.py --clients 1000 --duration 600 --out bench/results/load_soak.json

Reports every stream's fate (completed with all its tokens and [DONE], or not), the gateway's
RSS over time, and its growth after warm-up (a linear fit, MB per minute), plus the gateway's
CPU. The clients run in this process (aiohttp), the gateway and engines in their own.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from slogate.testing.fleet import MODEL, cpu_s, rss_mb, start_fleet
from slogate.testing.loadgen import closed_loop
from slogate.testing.procs import stop


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, default=1000)
    ap.add_argument("--duration", type=float, default=600)
    ap.add_argument("--warmup", type=float, default=60, help="seconds excluded from the RSS growth fit")
    ap.add_argument("--engines", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=20)
    ap.add_argument("--itl-ms", type=float, default=500)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    budget = a.clients // a.engines + 10  # room for every client: this run is about holding load, not shedding it
    procs, gw, url, _ = start_fleet(a.engines, budget, 100, a.itl_ms, {"pacing": True})
    body = {"model": MODEL, "messages": [{"role": "user", "content": "soak"}], "max_tokens": a.tokens, "stream": True,
            "ignore_eos": True, "slo": {"kind": "latency", "ttft_ms": 5000, "tbt_ms": a.itl_ms * 2}}
    samples: list[tuple[float, float]] = []
    t0 = time.monotonic()
    cpu0 = cpu_s(gw.pid)

    async def sampler() -> None:
        while True:
            samples.append((time.monotonic() - t0, rss_mb(gw.pid)))
            await asyncio.sleep(5)

    async def run():
        task = asyncio.create_task(sampler())
        rep = await closed_loop(url, a.clients, a.duration, body, timeout_s=120, ramp_s=10)
        task.cancel()
        return rep

    try:
        rep = asyncio.run(run())
        wall = time.monotonic() - t0
        cpu = cpu_s(gw.pid) - cpu0
        samples.append((wall, rss_mb(gw.pid)))
    finally:
        stop([gw, *procs])
    s = rep.summary()
    ts = np.array([t for t, _ in samples])
    rs = np.array([r for _, r in samples])
    late = ts >= min(a.warmup, ts.max() / 2)
    slope = float(np.polyfit(ts[late] / 60, rs[late], 1)[0]) if late.sum() >= 3 else float("nan")
    wrong_tokens = sum(r.status == 200 and r.complete and r.tokens != a.tokens for r in rep.results)
    out = {"config": vars(a) | {"out": str(a.out) if a.out else None}, **s, "wrong_token_count": wrong_tokens,
           "streams_per_s": round(s["completed"] / wall, 1), "tokens_per_s": round(s["completed"] * a.tokens / wall, 1),
           "gateway_cpu_share": round(cpu / wall, 3),
           "rss_mb": {"after_warmup": round(float(rs[late][0]), 1), "max": round(float(rs.max()), 1), "end": round(float(rs[-1]), 1),
                      "growth_mb_per_min_after_warmup": round(slope, 3)},
           "rss_samples": [(round(t, 1), round(r, 1)) for t, r in samples]}
    print(json.dumps({k: v for k, v in out.items() if k != "rss_samples"}, indent=2))
    if a.out:
        a.out.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
