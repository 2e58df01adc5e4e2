"""The gateway's CPU per request against a bare Python pass-through, side by side.

Two simulated engines (fixed latency: first token after 100 ms, then one every 20 ms) behind
either `slogate serve --backend A --backend B` (its defaults) or bench/passthrough.py (httpx +
Starlette, round robin, no parsing: what any Python hop costs); Poisson arrivals of chat streams
with ~450-word prompts and 30-token answers, the shape of the prefix-cache benchmark's traffic. The
router's CPU (user + system, from /proc) is read over the load window; the two alternate,
`--repeats` times each, so a drifting host affects both.

    python bench/hop_cpu.py --rate 6 --duration 20 --repeats 3 --out bench/results/hop_cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

import openai

from slogate.testing.fleet import cpu_s
from slogate.testing.ports import free_port
from slogate.testing.procs import slogate, spawn, stop, wait_http

ROOT = Path(__file__).resolve().parents[1]

WORDS = ["the", "of", "and", "to", "in", "is", "was", "for", "on", "that", "with", "as", "by", "at"]


async def load(url: str, rate: float, duration: float, seed: int) -> int:
    rng = random.Random(seed)
    c = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)

    async def one() -> None:
        s = await c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(450))}],
                                            max_tokens=30, stream=True, extra_body={"ignore_eos": True})
        async for _ in s:
            pass

    tasks, t0 = [], time.monotonic()
    while time.monotonic() - t0 < duration:
        tasks.append(asyncio.create_task(one()))
        await asyncio.sleep(rng.expovariate(rate))
    done = await asyncio.gather(*tasks, return_exceptions=True)
    await c.close()
    return sum(not isinstance(d, BaseException) for d in done)


def run(system: str, engines: list[str], rate: float, duration: float, seed: int) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    backends = [a for u in engines for a in ("--backend", u)]
    if system == "passthrough":
        p = spawn([sys.executable, str(ROOT / "bench" / "passthrough.py"), "--port", str(port), *backends], quiet=False)
        wait_http(f"{url}/v1/chat/completions", timeout=60, below=500)
    else:
        p = slogate("serve", "--port", str(port), "--log-level", "warning", *backends, quiet=False)
        wait_http(f"{url}/health", timeout=60)
    try:
        time.sleep(3)
        c0, t0 = cpu_s(p.pid), time.monotonic()
        time.sleep(5)
        idle = (cpu_s(p.pid) - c0) / (time.monotonic() - t0)
        c0, t0 = cpu_s(p.pid), time.monotonic()
        ok = asyncio.run(load(url, rate, duration, seed))
        used = cpu_s(p.pid) - c0
        wall = time.monotonic() - t0
    finally:
        stop([p])
    return {"system": system, "seed": seed, "completed": ok, "idle_cores": round(idle, 4), "cores": round(used / wall, 4),
            "cpu_ms_per_request": round(used / max(ok, 1) * 1000, 2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rate", type=float, default=6.0)
    ap.add_argument("--duration", type=float, default=20.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    ports = [free_port(), free_port()]
    engines = [slogate("engine", "--port", str(p), "--model", "tiny", "--fixed-ttft-ms", "100", "--fixed-itl-ms", "20", quiet=False)
               for p in ports]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    rows = []
    try:
        for u in urls:
            wait_http(f"{u}/v1/models", timeout=60)
        for rep in range(a.repeats):
            for system in (("slogate", "passthrough") if rep % 2 == 0 else ("passthrough", "slogate")):
                rows.append(run(system, urls, a.rate, a.duration, rep))
                print(json.dumps(rows[-1]), flush=True)
    finally:
        stop(engines)
    med = {s: statistics.median(r["cpu_ms_per_request"] for r in rows if r["system"] == s) for s in ("slogate", "passthrough")}
    doc = {"config": {"rate": a.rate, "duration": a.duration, "repeats": a.repeats}, "rows": rows,
           "median_cpu_ms_per_request": med, "ratio": round(med["slogate"] / med["passthrough"], 3)}
    print(json.dumps(doc["median_cpu_ms_per_request"]), "ratio", doc["ratio"])
    if a.out:
        a.out.write_text(json.dumps(doc, indent=2))


if __name__ == "__main__":
    main()
