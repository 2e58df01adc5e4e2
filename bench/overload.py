"""Overload: one `slogate serve` in front of simulated engines with the batch latency model
(step time grows with the batch, like vLLM). First the fleet's capacity is measured (closed
loop, one client per budget slot); then Poisson arrivals at 1x and 3x that rate, latency-class
streams with a TTFT/TBT SLO. Reports token goodput of admitted requests (the gateway's
/metrics), SLO attainment, how the rest was refused (429/503 with Retry-After), and the
gateway's RSS.

    python bench/overload.py --duration 60 --out bench/results/overload.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from slogate.testing import prom
from slogate.testing.fleet import MODEL, rss_mb, start_fleet
from slogate.testing.loadgen import stream_once
from slogate.testing.procs import stop


def scrape(url: str) -> dict[str, float]:
    text = prom.scrape(url)
    out: Counter[str] = Counter()
    for name in ("slogate_token_goodput_total", "slogate_request_goodput_total", "slogate_tokens_total"):
        out[name] = sum(v for lab, v in prom.samples(text, name) if name != "slogate_tokens_total" or lab.get("direction") == "output")
    for lab, v in prom.samples(text, "slogate_requests_total"):
        out["outcome:" + lab["outcome"]] += v
    return dict(out)


async def open_loop(url: str, rate: float, duration: float, body: dict, seed: int) -> list:
    rng = random.Random(seed)
    results, tasks = [], []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        t_end = time.monotonic() + duration
        nxt = time.monotonic()
        while nxt < t_end:
            await asyncio.sleep(max(0.0, nxt - time.monotonic()))
            tasks.append(asyncio.create_task(stream_once(s, f"{url}/v1/chat/completions", body, 120)))
            nxt += rng.expovariate(rate)
        results = await asyncio.gather(*tasks)
    return results


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--budget", type=int, default=32)
    ap.add_argument("--time-scale", type=float, default=4.0, help="slows the simulated A100 so this machine's CPU is not the bottleneck")
    ap.add_argument("--tokens", type=int, default=50)
    ap.add_argument("--duration", type=float, default=60)
    ap.add_argument("--factors", default="1,3")
    ap.add_argument("--probe-rate", type=float, default=30.0, help="offered load for the capacity probe (req/s)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    engine_args = ("--max-num-seqs", "64", "--time-scale", str(a.time_scale))
    slo = {"kind": "latency", "ttft_ms": 2000, "tbt_ms": 250, "waiting_ms": 1500}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "overload " * 20}], "max_tokens": a.tokens, "stream": True,
            "ignore_eos": True, "slo": slo}
    report: dict = {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()}, "slo": slo, "runs": []}
    procs, gw, url, _ = start_fleet(a.engines, a.budget, 0, 0, {"pacing": True}, engine_args=engine_args)
    try:
        # Capacity: what the fleet completes within the gateway's admission when offered far more
        # than it can take (open loop at --probe-rate for 30 s; the first 10 s are warm-up).
        t0 = time.monotonic()
        probe = asyncio.run(open_loop(url, a.probe_rate, 30, body, a.seed + 100))
        ok = [r for r in probe if r.status == 200 and r.complete and r.started > t0 + 10]
        capacity = len(ok) / 20
        report["capacity_req_per_s"] = round(capacity, 2)
        print(f"capacity ≈ {capacity:.2f} req/s")
        for f in [float(x) for x in a.factors.split(",")]:
            time.sleep(3)
            before = scrape(url)
            rss0 = rss_mb(gw.pid)
            peak = [rss0]

            async def run(f: float = f, peak: list[float] = peak) -> list:
                async def sample() -> None:
                    while True:
                        peak.append(rss_mb(gw.pid))
                        await asyncio.sleep(2)
                t = asyncio.create_task(sample())
                res = await open_loop(url, capacity * f, a.duration, body, a.seed)
                t.cancel()
                return res

            t1 = time.monotonic()
            res = asyncio.run(run())
            wall = time.monotonic() - t1
            after = scrape(url)
            d = {k: after.get(k, 0) - before.get(k, 0) for k in after}
            statuses = Counter(r.status for r in res)
            refused = [r for r in res if r.status in (429, 503)]
            row = {"factor": f, "rate": round(capacity * f, 2), "requests": len(res), "statuses": dict(statuses),
                   "refused_with_retry_after": sum(r.retry_after is not None for r in refused), "refused": len(refused),
                   "broken_streams": sum(r.status == 200 and not r.complete for r in res),
                   "other_errors": sum(r.status not in (200, 429, 503) for r in res),
                   "token_goodput_per_s": round(d.get("slogate_token_goodput_total", 0) / wall, 1),
                   "output_tokens_per_s": round(d.get("slogate_tokens_total", 0) / wall, 1),
                   "request_goodput_per_s": round(d.get("slogate_request_goodput_total", 0) / wall, 2),
                   "slo_attainment_admitted": round(d.get("slogate_request_goodput_total", 0) / max(d.get("outcome:completed", 0), 1), 3),
                   "rss_mb_start": round(rss0, 1), "rss_mb_peak": round(max(peak), 1), "rss_mb_end": round(rss_mb(gw.pid), 1)}
            report["runs"].append(row)
            print(json.dumps(row))
    finally:
        stop([gw, *procs])
    runs = {r["factor"]: r for r in report["runs"]}
    if 1.0 in runs and 3.0 in runs:
        report["goodput_3x_over_1x"] = round(runs[3.0]["token_goodput_per_s"] / max(runs[1.0]["token_goodput_per_s"], 1e-9), 3)
        print(f"goodput at 3x / at 1x = {report['goodput_3x_over_1x']}")
    if a.out:
        a.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
