"""Gateway overhead at N concurrent streams: direct to the engines vs a bare pass-through proxy
vs slogate vs vllm-router (Rust), side by side in one run (docs/benchmarks.md).

Starts N_ENGINES simulated engines (`slogate engine`), the bare proxy, `slogate serve` and
vllm-router (its default policy, cache_aware; where installed) as separate processes, then for each target runs the same closed loop of CONCURRENCY streaming
clients (httpx, each request max_tokens=TOKENS with ignore_eos) for DURATION seconds, and
reports TTFT percentiles, the added TTFT vs direct, and streamed tokens per second.

    python bench/gateway_overhead.py --concurrency 100 --duration 20 --out bench/results/gateway_overhead.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from slogate.testing.ports import free_port
from slogate.testing.procs import spawn, stop, wait_http

MODEL = "sim-model"


def wait_up(url: str, timeout: float = 30.0) -> None:
    wait_http(url, timeout, below=500)


async def one(client: httpx.AsyncClient, url: str, tokens: int, extra: dict) -> tuple[float, int, float]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "benchmark prompt " * 8}], "max_tokens": tokens,
            "ignore_eos": True, "stream": True, **extra}
    t0 = time.perf_counter()
    ttft, n = None, 0
    async with client.stream("POST", url, json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {") and '"content":"tok' in line.replace(" ", ""):
                n += 1
                if ttft is None:
                    ttft = time.perf_counter() - t0
    return ttft or float("nan"), n, time.perf_counter() - t0


async def closed_loop(urls: str | list[str], concurrency: int, duration: float, tokens: int, extra: dict, stagger: float = 0.0) -> dict:
    """`concurrency` clients, each sending one streaming request after another (round-robin over `urls`)."""
    pool = [urls] if isinstance(urls, str) else urls
    limits = httpx.Limits(max_connections=concurrency + 10, max_keepalive_connections=concurrency + 10)
    ttfts: list[float] = []
    total = 0
    errors = 0
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:
        await one(client, pool[0], 4, extra)  # warm the connections and the engines
        rr = __import__("itertools").cycle(pool)
        t_end = time.perf_counter() + duration
        t0 = time.perf_counter()

        async def worker(k: int) -> None:
            nonlocal total, errors
            # Stagger the start over one request's duration: a closed loop started in lockstep sends
            # its requests in synchronized waves, and the TTFT then measures the wave, not the proxy.
            await asyncio.sleep(stagger * k / concurrency)
            while time.perf_counter() < t_end:
                try:
                    ttft, n, _ = await one(client, next(rr), tokens, extra)
                    ttfts.append(ttft)
                    total += n
                except httpx.HTTPError:
                    errors += 1

        await asyncio.gather(*(worker(k) for k in range(concurrency)))
        wall = time.perf_counter() - t0
    a = np.asarray(ttfts) * 1e3
    return {"requests": len(ttfts), "errors": errors, "ttft_p50_ms": round(float(np.percentile(a, 50)), 2),
            "ttft_p99_ms": round(float(np.percentile(a, 99)), 2), "tokens_per_s": round(total / wall, 1), "wall_s": round(wall, 1)}


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        parts = f.read().rsplit(")", 1)[1].split()
    return (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", type=int, default=100)
    ap.add_argument("--duration", type=float, default=20.0)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--time-scale", type=float, default=3.0, help="engine step-time multiplier (keeps 2 cores from saturating)")
    ap.add_argument("--fixed-ttft-ms", type=float, help="fixed-latency engines: TTFT independent of load, so a proxy's addition shows")
    ap.add_argument("--fixed-itl-ms", type=float, default=50.0)
    ap.add_argument("--burst", action="store_true", help="no stagger: all clients start together, so every request "
                    "arrives in a burst of CONCURRENCY simultaneous ones")
    ap.add_argument("--knobs", default="", help="YAML lines added to slogate's config (a knob study), e.g. 'capacity: {slow_start: false}'")
    ap.add_argument("--slo", action="store_true", help="also drive slogate with an SLO in every request (paced streams)")
    ap.add_argument("--slo-tbt-ms", type=float, default=100.0, help="the TBT those requests ask for (above the engine's ITL)")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        eng_urls = []
        for _ in range(a.engines):
            p = free_port()
            mode = (["--fixed-ttft-ms", str(a.fixed_ttft_ms), "--fixed-itl-ms", str(a.fixed_itl_ms)] if a.fixed_ttft_ms is not None
                    else ["--max-num-seqs", "256", "--time-scale", str(a.time_scale)])
            procs.append(spawn(["slogate", "engine", "--port", str(p), "--model", MODEL, *mode]))
            eng_urls.append(f"http://127.0.0.1:{p}")
        for u in eng_urls:
            wait_up(u + "/health")
        pp = free_port()
        pt = spawn([sys.executable, str(Path(__file__).parent / "passthrough.py"), "--port", str(pp),
                    *[x for u in eng_urls for x in ("--backend", u)]])
        procs.append(pt)
        cfg = Path(tempfile.mkdtemp()) / "gw.yaml"
        cfg.write_text((a.knobs + "\n" if a.knobs else "") + "backends:\n" + "".join(f"  - {{url: {u}, models: [{MODEL}], budget: 256}}\n" for u in eng_urls))
        gp = free_port()
        gw = spawn(["slogate", "serve", "--config", str(cfg), "--port", str(gp), "--log-level", "warning"])
        procs.append(gw)
        wait_up(f"http://127.0.0.1:{pp}/v1/chat/completions")
        wait_up(f"http://127.0.0.1:{gp}/health")
        targets = {"direct": ([f"{u}/v1/chat/completions" for u in eng_urls], {}),
                   "passthrough": (f"http://127.0.0.1:{pp}/v1/chat/completions", {}),
                   "slogate": (f"http://127.0.0.1:{gp}/v1/chat/completions", {})}
        proxies = {"slogate": gw, "passthrough": pt}
        if a.slo:
            # The same gateway, each request carrying an SLO: its stream goes through the smoothing buffer
            targets["slogate-slo"] = (f"http://127.0.0.1:{gp}/v1/chat/completions", {"slo": {"ttft_ms": 1000, "tbt_ms": a.slo_tbt_ms}})
            proxies["slogate-slo"] = gw
        if shutil.which("vllm-router"):
            vp = free_port()
            vr = spawn(["vllm-router", "--host", "127.0.0.1", "--port", str(vp), "--worker-urls", *eng_urls, "--log-level", "warning"])
            procs.append(vr)
            wait_up(f"http://127.0.0.1:{vp}/health", timeout=60)
            targets["vllm-router"] = (f"http://127.0.0.1:{vp}/v1/chat/completions", {})
            proxies["vllm-router"] = vr
        runs: dict[str, list[dict]] = {k: [] for k in targets}
        for rep in range(a.repeats):
            for name, (url, extra) in targets.items():
                proxy = proxies.get(name)
                c0 = cpu_seconds(proxy.pid) if proxy else 0.0
                stagger = (a.fixed_ttft_ms or 0) / 1e3 + a.tokens * a.fixed_itl_ms / 1e3 if a.fixed_ttft_ms is not None else 2.0
                stagger = 0.0 if a.burst else stagger
                r = asyncio.run(closed_loop(url, a.concurrency, a.duration, a.tokens, extra, stagger))
                if proxy:
                    r["proxy_cpu_s"] = round(cpu_seconds(proxy.pid) - c0, 2)
                    r["proxy_cpu_ms_per_request"] = round(r["proxy_cpu_s"] / max(r["requests"], 1) * 1e3, 2)
                runs[name].append(r)
                print(f"rep {rep} {name:12s} {r}", flush=True)
        med = {k: {m: float(np.median([r[m] for r in v])) for m in ("ttft_p50_ms", "ttft_p99_ms", "tokens_per_s")} for k, v in runs.items()}
        summary = {
            "added_ttft_p50_ms": round(med["slogate"]["ttft_p50_ms"] - med["direct"]["ttft_p50_ms"], 2),
            "added_ttft_p99_ms": round(med["slogate"]["ttft_p99_ms"] - med["direct"]["ttft_p99_ms"], 2),
            "passthrough_added_ttft_p50_ms": round(med["passthrough"]["ttft_p50_ms"] - med["direct"]["ttft_p50_ms"], 2),
            "throughput_vs_passthrough": round(med["slogate"]["tokens_per_s"] / med["passthrough"]["tokens_per_s"], 3),
        }
        if "vllm-router" in med:
            summary |= {"vllm_router_added_ttft_p50_ms": round(med["vllm-router"]["ttft_p50_ms"] - med["direct"]["ttft_p50_ms"], 2),
                        "vllm_router_added_ttft_p99_ms": round(med["vllm-router"]["ttft_p99_ms"] - med["direct"]["ttft_p99_ms"], 2)}
        print(json.dumps(summary, indent=1))
        if a.out:
            a.out.write_text(json.dumps({"args": vars(a) | {"out": str(a.out)}, "runs": runs, "median": med, "summary": summary}, indent=1))
    finally:
        stop(procs)


if __name__ == "__main__":
    main()
