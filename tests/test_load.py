"""A thousand concurrent streaming clients through one gateway process (CI-sized; the 10-minute
soak with the RSS fit is bench/load_soak.py): every stream completes with all its tokens and
[DONE], no errors."""

from __future__ import annotations

import asyncio

from slogate.testing.fleet import MODEL, rss_mb, start_fleet
from slogate.testing.loadgen import closed_loop
from slogate.testing.procs import stop


def test_a_thousand_concurrent_streams_through_one_gateway_all_complete() -> None:
    clients, tokens = 1000, 20
    # Engines at one token a second: each client holds one 20 s stream for the whole window.
    procs, gw, url, _ = start_fleet(4, clients // 4 + 10, 100, 1000, {"pacing": True, "capacity": {"learn": False}})
    try:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "load"}], "max_tokens": tokens, "stream": True,
                "ignore_eos": True, "slo": {"kind": "latency", "ttft_ms": 5000, "tbt_ms": 1000, "waiting_ms": 30000}}
        peak = 0

        async def run():
            async def watch() -> None:
                nonlocal peak
                while True:
                    peak = max(peak, rss_mb(gw.pid))
                    await asyncio.sleep(1)
            w = asyncio.create_task(watch())
            rep = await closed_loop(url, clients, 12, body, timeout_s=90, ramp_s=5)
            w.cancel()
            return rep

        rep = asyncio.run(run())
    finally:
        stop([gw, *procs])
    s = rep.summary()
    assert s["requests"] >= clients, s
    assert s["completed"] == s["requests"], s  # no refusals, errors or broken streams
    assert all(r.tokens == tokens for r in rep.results), "a stream lost tokens"
    assert peak < 1024, f"gateway RSS {peak:.0f} MB"
