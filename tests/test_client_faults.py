"""Client faults over raw sockets: clients that vanish at random points (queued, before the first
byte, mid-stream, waiting for a whole answer, mid-body) free their replica slots within a second;
clients that stop reading do not slow the other streams, and what the gateway buffers for them
stays bounded."""

from __future__ import annotations

import asyncio
import json
import random
import socket
import time
from contextlib import ExitStack

import httpx
import pytest
from faults import EngineProcess, gauge
from servers import ServerThread

from slogate.gateway.app import create_app
from slogate.gateway.config import GatewayConfig
from slogate.predictors.online import OnlineLengthPredictor

MODEL = "sim-model"


def request_bytes(port: int, body: dict, partial: bool = False) -> bytes:
    raw = json.dumps(body).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(raw)}\r\n\r\n").encode()
    return head + (raw[: len(raw) // 2] if partial else raw)


async def vanishing_client(port: int, rng: random.Random) -> str:
    """One request; the client disconnects at a random point. Returns where."""
    point = rng.choice(["mid_body", "queued_or_headers", "after_k_events", "non_stream_wait"])
    stream = point != "non_stream_wait"
    body = {"model": MODEL, "messages": [{"role": "user", "content": "bye"}], "max_tokens": 400, "stream": stream,
            "extra": "x", "ignore_eos": True, "slo": {"deadline_ms": 60000, "waiting_ms": 60000}}
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request_bytes(port, body, partial=point == "mid_body"))
    await writer.drain()
    if point == "after_k_events":
        k = rng.randint(1, 30)
        seen = 0
        while seen < k:
            line = await asyncio.wait_for(reader.readline(), 30)
            if not line:
                break
            seen += line.startswith(b"data:")
    else:
        await asyncio.sleep(rng.uniform(0.0, 0.6))
    writer.transport.abort()  # RST, like a client process that died
    return point


def engine_running(e: EngineProcess) -> float:
    return e.metric("vllm:num_requests_running")


def test_clients_vanishing_at_random_points_free_their_slots_within_a_second() -> None:
    with ExitStack() as st:
        engines = [st.enter_context(EngineProcess(None, "--fixed-ttft-ms", "200", "--fixed-itl-ms", "20")) for _ in range(2)]
        cfg = GatewayConfig.model_validate({"backends": [{"url": e.url, "name": f"e{i}", "models": [MODEL], "budget": 4}
                                                         for i, e in enumerate(engines)],
                                            "policies": {"frame_s": 0.05}, "pacing": False})
        gw = st.enter_context(ServerThread(create_app(cfg, OnlineLengthPredictor())))

        async def run() -> list[str]:
            rng = random.Random(7)
            tasks = []
            for _ in range(60):  # 60 clients against 8 slots: many vanish while queued
                tasks.append(asyncio.create_task(vanishing_client(gw.port, rng)))
                await asyncio.sleep(rng.uniform(0, 0.03))
            return await asyncio.gather(*tasks)

        points = asyncio.run(run())
        gone_at = time.monotonic()
        assert {"mid_body", "queued_or_headers", "after_k_events", "non_stream_wait"} <= set(points)
        # Within a second of the last client leaving: nothing queued, nothing in flight, and the
        # engines themselves have aborted every sequence.
        freed_at = None
        while time.monotonic() - gone_at < 5:
            q = gauge(gw.url, "slogate_queue_depth", model=MODEL)
            inflight = sum(gauge(gw.url, "slogate_replica_inflight", backend=f"e{i}") or 0 for i in range(2))
            if q == 0 and inflight == 0 and all(engine_running(e) == 0 for e in engines):
                freed_at = time.monotonic()
                break
            time.sleep(0.05)
        assert freed_at is not None and freed_at - gone_at <= 1.0, freed_at and freed_at - gone_at
        assert sum(e.metric("slogate_sim_aborted_total") for e in engines) >= 5  # streams cut at the engine, not run to the end
        # The gateway still serves.
        r = httpx.post(f"{gw.url}/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 3},
                       timeout=30)
        assert r.status_code == 200


@pytest.mark.parametrize("slow_readers", [6])
def test_slow_readers_do_not_stall_other_streams_and_their_buffers_stay_bounded(slow_readers: int) -> None:
    import tracemalloc

    with ExitStack() as st:
        # The slow readers' replica is fast: each stalled stream could produce 80,000 tokens (~12 MB,
        # far more than the kernel's socket buffers take) within two seconds. The normal clients use another replica (another model), so the only
        # thing the two groups share is the gateway.
        slow_eng = st.enter_context(EngineProcess(None, "--fixed-ttft-ms", "5", "--fixed-itl-ms", "0.02", model="slow-model"))
        eng = st.enter_context(EngineProcess(None, "--fixed-ttft-ms", "5", "--fixed-itl-ms", "1"))
        cfg = GatewayConfig.model_validate({"backends": [{"url": slow_eng.url, "name": "slow", "models": ["slow-model"], "budget": 64},
                                                         {"url": eng.url, "name": "e", "models": [MODEL], "budget": 64}],
                                            "policies": {"frame_s": 0.05}, "pacing": False})
        gw = st.enter_context(ServerThread(create_app(cfg, OnlineLengthPredictor())))
        slow_body = {"model": "slow-model", "messages": [{"role": "user", "content": "slow"}], "max_tokens": 80_000, "stream": True,
                     "ignore_eos": True, "slo": {"deadline_ms": 600000}}
        socks = []
        tracemalloc.start()
        base, _ = tracemalloc.get_traced_memory()
        for _ in range(slow_readers):
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.connect(("127.0.0.1", gw.port))
            s.sendall(request_bytes(gw.port, slow_body))  # ... and never read
            socks.append(s)
        time.sleep(4.0)  # long enough for the engine to produce every slow stream in full, were nothing pushing back
        held, _peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()

        # Normal clients alongside: their streams complete at the engine's pace.
        t0 = time.monotonic()
        with httpx.Client(timeout=30) as c:
            for _ in range(10):
                with c.stream("POST", f"{gw.url}/v1/chat/completions",
                              json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 200,
                                    "stream": True, "ignore_eos": True}) as r:
                    lines = list(r.iter_lines())
                n = sum(1 for line in lines if line.startswith("data:") and "content" in line)
                assert r.status_code == 200 and n >= 200, (r.status_code, lines[-3:])
        normal_s = (time.monotonic() - t0) / 10
        for s in socks:
            s.close()
    # 200 tokens at 1 ms: ~0.2 s each; a gateway stalled by the slow readers would take far longer.
    assert normal_s < 0.6, normal_s
    # What the gateway holds for the stalled streams is bounded by socket and stream-reader
    # buffers (the last upstream read and its events, under 1 MB each; the kernel's socket buffers
    # take up to ~4 MB more), not by their length (~12 MB each, 72 MB in all; ~48 MB past the kernel).
    print(f"gateway heap held for {slow_readers} stalled streams: {(held - base) / 2**20:.2f} MB")
    assert (held - base) < slow_readers * 2**20, (held - base) / 2**20
