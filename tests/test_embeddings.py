"""Embeddings, rerank, score, tokenize and detokenize go through the gateway like every request:
to a replica that serves the model, queued within its budget, retried on a failing replica,
counted in the metrics; bad bodies get a 400 in the OpenAI shape."""

from __future__ import annotations

import asyncio
import math
import time
from contextlib import ExitStack
from typing import Any

import httpx
import openai
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from faults import gauge
from servers import ServerThread

from slogate.gateway.app import create_app
from slogate.gateway.config import GatewayConfig
from slogate.sim.server import create_engine_app
from slogate.testing.prom import samples, scrape

MODEL = "sim-model"


def gateway(*engine_urls: str, budget: int = 8, **extra: Any) -> GatewayConfig:
    return GatewayConfig.model_validate({"backends": [{"url": u, "name": f"e{i}", "models": [MODEL], "budget": budget}
                                                      for i, u in enumerate(engine_urls)],
                                         "health_interval_s": 0.3, "capacity": {"learn": False}, **extra})


def test_embeddings_through_the_openai_sdk() -> None:
    with ServerThread(create_engine_app(MODEL)) as eng, ServerThread(create_app(gateway(eng.url))) as gw:
        c = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0)
        r = c.embeddings.create(model=MODEL, input=["a cat", "a dog", "a cat"])  # the SDK asks for base64 and decodes it
        vecs = [d.embedding for d in r.data]
        assert [d.index for d in r.data] == [0, 1, 2] and all(len(v) == 16 for v in vecs)
        assert all(abs(math.hypot(*v) - 1) < 1e-5 for v in vecs)
        assert vecs[0] == vecs[2] != vecs[1]
        assert r.usage.prompt_tokens > 0
        f = c.embeddings.create(model=MODEL, input="a cat", encoding_format="float", dimensions=8, extra_body={"slo": {"deadline_ms": 5000}})
        assert len(f.data[0].embedding) == 8
        done = {(s["slo_class"], s["outcome"]): v for s, v in _samples(gw.url, "slogate_requests_total")}
        assert done == {("deadline", "completed"): 2.0}, done
        # bad input: the OpenAI error shape, before any replica is used
        with_no_input = httpx.post(f"{gw.url}/v1/embeddings", json={"model": MODEL})
        assert with_no_input.status_code == 400 and with_no_input.json()["error"]["param"] == "input"
        bad_format = httpx.post(f"{gw.url}/v1/embeddings", json={"model": MODEL, "input": "x", "encoding_format": "hex"})
        assert bad_format.status_code == 400 and bad_format.json()["error"]["param"] == "encoding_format"
        unknown = httpx.post(f"{gw.url}/v1/embeddings", json={"model": "nope", "input": "x"})
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"


def test_embeddings_count_against_the_replica_budget() -> None:
    # budget 1, a 300 ms prefill: four concurrent requests run one at a time, never two at the engine.
    with ExitStack() as st:
        eng = st.enter_context(ServerThread(create_engine_app(MODEL, fixed_ttft_ms=300, fixed_itl_ms=10)))
        gw = st.enter_context(ServerThread(create_app(gateway(eng.url, budget=1))))

        async def four() -> list[int]:
            async with httpx.AsyncClient(timeout=30) as c:
                rs = await asyncio.gather(*(c.post(f"{gw.url}/v1/embeddings", json={"model": MODEL, "input": f"text {i}"}) for i in range(4)))
            return [r.status_code for r in rs]

        t0 = time.monotonic()
        assert asyncio.run(four()) == [200] * 4
        assert time.monotonic() - t0 >= 4 * 0.3 * 0.9
        assert gauge(eng.url, "slogate_sim_peak_requests") == 1


def recording_engine(calls: list[tuple[str, dict]], fail: bool = False) -> FastAPI:
    """A replica that records each pooling call; with `fail`, every one is a 503 (a broken replica)."""
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": MODEL, "object": "model"}]}

    async def record(request: Request) -> Any:
        body = await request.json()
        calls.append((request.url.path, body))
        if fail:
            return JSONResponse({"error": {"message": "engine overloaded"}}, status_code=503)
        if request.url.path == "/tokenize":
            return {"count": 3, "max_model_len": 2048, "tokens": [1, 2, 3]}
        if request.url.path == "/detokenize":
            return {"prompt": "abc"}
        if request.url.path == "/v1/rerank":
            return {"id": "r", "model": MODEL, "usage": {"total_tokens": 9}, "results": [{"index": 0, "relevance_score": 0.9}]}
        return {"id": "s", "object": "list", "model": MODEL, "data": [{"index": 0, "object": "score", "score": 0.5}], "usage": {"prompt_tokens": 4}}

    for path in ("/tokenize", "/detokenize", "/v1/rerank", "/v1/score"):
        app.add_api_route(path, record, methods=["POST"])
    return app


def test_rerank_score_and_tokenizer_calls_are_routed_and_retried() -> None:
    good: list[tuple[str, dict]] = []
    bad: list[tuple[str, dict]] = []
    with ExitStack() as st:
        e_bad = st.enter_context(ServerThread(recording_engine(bad, fail=True)))
        e_good = st.enter_context(ServerThread(recording_engine(good)))
        gw = st.enter_context(ServerThread(create_app(gateway(e_bad.url, e_good.url, retries=2))))
        with httpx.Client(base_url=gw.url, timeout=30) as c:
            r = c.post("/v1/rerank", json={"model": MODEL, "query": "q", "documents": ["a", "b"], "slo": {"deadline_ms": 9000}})
            assert r.status_code == 200 and r.json()["results"][0]["relevance_score"] == 0.9
            assert c.post("/v1/score", json={"model": MODEL, "text_1": "a", "text_2": ["b"]}).json()["data"][0]["score"] == 0.5
            tok = c.post("/tokenize", json={"prompt": "abc"})  # no model: the one the fleet serves
            assert tok.status_code == 200 and tok.json()["tokens"] == [1, 2, 3]
            assert c.post("/detokenize", json={"model": MODEL, "tokens": [1, 2, 3]}).json()["prompt"] == "abc"
            assert c.post("/v1/rerank", json={"model": MODEL, "query": "q", "documents": []}).status_code == 400
        # Every call reached the good replica with the engine's fields only (slogate's stripped,
        # the model filled in); whichever went to the broken one first was retried.
        assert [p for p, _ in good] == ["/v1/rerank", "/v1/score", "/tokenize", "/detokenize"]
        assert all(b["model"] == MODEL and "slo" not in b for _, b in good), good
        assert good[0][1]["documents"] == ["a", "b"]
        retried = sum(v for labels, v in _samples(gw.url, "slogate_retries_total") if labels.get("backend") == "e0")
        assert retried == len(bad)


def test_a_replica_without_the_endpoint_answers_404_through_the_gateway() -> None:
    with ServerThread(create_engine_app(MODEL)) as eng, ServerThread(create_app(gateway(eng.url))) as gw:
        r = httpx.post(f"{gw.url}/v1/rerank", json={"model": MODEL, "query": "q", "documents": ["a"]})
        assert r.status_code == 404  # the simulated engine has no rerank: its answer, not a gateway error,
        assert r.json()["error"]["message"] == "upstream: Not Found"  # in the OpenAI shape (it sent FastAPI's)
        assert gauge(gw.url, "slogate_replica_inflight", backend="e0") == 0


def _samples(url: str, name: str) -> list[tuple[dict[str, str], float]]:
    return samples(scrape(url), name)
