"""A replica SIGKILLed under load: what becomes of the streams it held (docs/benchmarks.md).

Starts ENGINES simulated engines (fixed latency) and `slogate serve` (defaults, budget raised so
every stream is admitted at once), sends STREAMS streaming chat requests (starts spread over RAMP s) (max_tokens
TOKENS, ignore_eos), SIGKILLs engine 0 after KILL_AFTER seconds, and counts how each stream
ended: complete (finish reason and [DONE]), with an error event, or hung (client timeout); and
whether its text is exactly `tok0 … tok{TOKENS-1}` (nothing lost, repeated or reordered).

    python bench/replica_kill.py --streams 600 --engines 3 --out bench/results/replica_kill.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
from collections import Counter
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from slogate.testing.fleet import MODEL, start_fleet
from slogate.testing.loadgen import stream_once
from slogate.testing.procs import stop
from slogate.testing.prom import metric


async def run(url: str, engine_pid: int, a: argparse.Namespace) -> list:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "kill test"}], "max_tokens": a.tokens, "stream": True, "ignore_eos": True}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        async def one(k: int):  # starts spread over RAMP seconds: 600 connects at once swamp 2 cores
            await asyncio.sleep(a.ramp * k / a.streams)
            return await stream_once(s, f"{url}/v1/chat/completions", body, a.timeout)

        tasks = [asyncio.create_task(one(k)) for k in range(a.streams)]
        await asyncio.sleep(a.kill_after)
        os.killpg(engine_pid, signal.SIGKILL)
        return await asyncio.gather(*tasks)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", type=int, default=600)
    ap.add_argument("--engines", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=100)
    ap.add_argument("--itl-ms", type=float, default=30.0)
    ap.add_argument("--kill-after", type=float, default=2.0)
    ap.add_argument("--ramp", type=float, default=1.5)
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    engines, gw, url, _ = start_fleet(a.engines, budget=a.streams, ttft_ms=50, itl_ms=a.itl_ms)
    try:
        results = asyncio.run(run(url, engines[0].pid, a))
        resumes = metric(url, "slogate_resumes_total")
    finally:
        stop([*engines, gw])
    want = "".join(f"tok{i} " for i in range(a.tokens))
    kinds = Counter("complete" if r.complete else "hung" if "Timeout" in r.error else "error event" if r.status == 200 and r.error
                    else f"status {r.status}" for r in results)
    summary = {"streams": a.streams, **kinds, "exact_text": sum(r.text == want for r in results), "resumes": resumes,
               "errors": dict(Counter(r.error[:80] for r in results if r.error).most_common(3))}
    print(json.dumps(summary, indent=1))
    if a.out:
        a.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(a).items()}, "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
