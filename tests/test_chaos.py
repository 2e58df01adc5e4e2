"""Chaos: two gateway processes sharing Redis, three engine processes, clients that sometimes
vanish — and meanwhile an engine is killed and restarted, Redis is killed and restarted, and
another engine freezes for two seconds. Every request ends (none hangs) either completed or with
a clear answer (an error event, 429/503 with Retry-After, an OpenAI-shaped 5xx); afterwards no
slot is held anywhere and both gateways serve."""

from __future__ import annotations

import asyncio
import random
import signal
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import aiohttp
import httpx
from faults import EngineProcess, gauge
from test_multigateway import start_redis

from slogate.testing.loadgen import StreamResult, stream_once
from slogate.testing.ports import free_port
from slogate.testing.procs import wait_http

MODEL = "sim-model"
BUDGET = 6


def test_chaos_run_loses_nothing(tmp_path: Path) -> None:
    rport = free_port()
    redis = {"proc": start_redis(rport, tmp_path)}
    gateways: list[subprocess.Popen[bytes]] = []
    with ExitStack() as st:
        engines = [st.enter_context(EngineProcess(None, "--fixed-ttft-ms", "50", "--fixed-itl-ms", "20")) for _ in range(3)]
        cfg = tmp_path / "gw.yaml"
        cfg.write_text("backends:\n" + "".join(f"  - {{url: {e.url}, name: e{i}, models: [{MODEL}], budget: {BUDGET}}}\n"
                                               for i, e in enumerate(engines))
                       + f"state: {{kind: redis, url: 'redis://127.0.0.1:{rport}/0', prefix: chaos{time.monotonic_ns()}, sync_s: 0.05, lease_s: 5}}\n"
                       + "health_interval_s: 0.5\nstream_idle_timeout_s: 3\npacing: false\nshutdown_grace_s: 10\n")
        urls = []
        for _ in range(2):
            p = free_port()
            errlog = open(tmp_path / f"gw{p}.log", "wb")  # noqa: SIM115 - the process's lifetime
            gateways.append(subprocess.Popen([sys.executable, "-c", "from slogate.cli import app; app()", "serve", "--config", str(cfg),
                                              "--port", str(p), "--log-level", "error"], start_new_session=True, stderr=errlog))
            urls.append(f"http://127.0.0.1:{p}")
        try:
            for u in urls:
                wait_http(f"{u}/health", 30)
            results, cancelled = asyncio.run(_load_with_chaos(urls, engines, redis, rport, tmp_path))
        finally:
            # The clients are done: let the gateways settle, then read their state before stopping them.
            # Within 10 s (a loaded CI box may take a few to close the last cancelled streams).
            t_settle = time.monotonic()
            while True:
                time.sleep(0.5)
                settled = {u: sum(gauge(u, "slogate_replica_inflight", backend=f"e{i}") or 0 for i in range(3)) for u in urls}
                if not any(settled.values()) or time.monotonic() - t_settle > 10:
                    break
            running = [e.metric("vllm:num_requests_running") for e in engines]
            peaks = [e.metric("slogate_sim_peak_requests") for e in engines]
            serves = [httpx.post(f"{u}/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                                                     "max_tokens": 3}, timeout=30).status_code for u in urls]
            for g in gateways:
                g.send_signal(signal.SIGTERM)
            for g in gateways:
                try:
                    g.wait(25)  # shutdown_grace_s (10) and then some
                except subprocess.TimeoutExpired:
                    g.send_signal(signal.SIGUSR1)  # dump its stacks, then fail with them
                    time.sleep(1)
                    g.kill()
                    logs = "\n".join(p.read_text(errors="replace")[-6000:] for p in tmp_path.glob("gw*.log"))
                    raise AssertionError("a gateway did not exit within 25 s of SIGTERM:\n" + logs) from None
            redis["proc"].terminate()
            redis["proc"].wait(10)

    kinds = {"completed": 0, "error_event": 0, "refused": 0, "gateway_5xx": 0, "other": 0}
    others = []
    for r in results:
        if r.status == 200 and r.complete:
            kinds["completed"] += 1
        elif r.status == 200 and r.error:
            kinds["error_event"] += 1
        elif r.status in (429, 503) and r.retry_after:
            kinds["refused"] += 1
        elif r.status in (502, 504):
            kinds["gateway_5xx"] += 1
        else:
            kinds["other"] += 1
            others.append((r.status, r.error))
    print("chaos outcomes:", kinds, "client cancellations:", cancelled)
    assert kinds["other"] == 0, others[:5]  # nothing hung or broke without a clear answer
    assert kinds["completed"] >= 0.8 * len(results), kinds
    assert all(v == 0 for v in settled.values()), settled  # no slot held in any gateway's view
    assert running == [0, 0, 0], running  # nor at the engines
    # Budgets held across the Redis outage. Known margin: one per gateway — a gateway frees the
    # slot of a client that vanished as it closes the upstream connection, and a busy engine may
    # read the next request before it reads that close (seen on a loaded 2-core CI box: 8 of 6
    # once in several runs). The engine that was frozen is not judged: requests given up on while
    # it was stopped sit in its socket buffers, and it starts them when it resumes, until it sees
    # their connections closed.
    assert max(peaks[0], peaks[2]) <= BUDGET + len(urls), peaks
    assert serves == [200, 200]


async def _load_with_chaos(urls: list[str], engines: list[EngineProcess], redis: dict, rport: int,
                           tmp_path: Path) -> tuple[list[StreamResult], int]:
    rng = random.Random(3)
    results: list[StreamResult] = []
    cancelled = 0
    stop_at = time.monotonic() + 14
    body = {"model": MODEL, "messages": [{"role": "user", "content": "chaos"}], "max_tokens": 30, "stream": True,
            "ignore_eos": True, "slo": {"kind": "latency", "ttft_ms": 5000, "tbt_ms": 500, "waiting_ms": 8000}}

    async def client(i: int, s: aiohttp.ClientSession) -> None:
        nonlocal cancelled
        await asyncio.sleep(i * 0.05)
        while time.monotonic() < stop_at:
            task = asyncio.ensure_future(stream_once(s, f"{urls[i % 2]}/v1/chat/completions", body, 60))
            if rng.random() < 0.2:  # a client that vanishes at a random point
                await asyncio.sleep(rng.uniform(0, 0.8))
                if not task.done():
                    task.cancel()
                    cancelled += 1
                    continue
            results.append(await task)

    def chaos() -> list[asyncio.TimerHandle]:
        loop = asyncio.get_running_loop()
        e0, e1 = engines[0], engines[1]

        def redis_down() -> None:
            redis["proc"].kill()
            redis["proc"].wait(5)

        def redis_up() -> None:
            redis["proc"] = start_redis(rport, tmp_path)

        return [loop.call_later(3, e0.kill), loop.call_later(6, e0.start), loop.call_later(5, redis_down), loop.call_later(8, redis_up),
                loop.call_later(10, e1.signal, signal.SIGSTOP), loop.call_later(12, e1.signal, signal.SIGCONT)]

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        handles = chaos()
        try:
            await asyncio.wait_for(asyncio.gather(*(client(i, s) for i in range(40))), timeout=90)
        finally:
            for h in handles:
                h.cancel()
    return results, cancelled
