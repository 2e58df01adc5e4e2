"""A catalogue of malformed requests against a live gateway: each gets a 4xx in the OpenAI error
shape (never a 5xx, never a crash), and the gateway serves normally afterwards."""

from __future__ import annotations

import json
from contextlib import ExitStack
from typing import Any

import httpx
import openai
import pytest
from servers import ServerThread

from slogate.gateway.app import create_app
from slogate.gateway.config import GatewayConfig
from slogate.predictors.online import OnlineLengthPredictor
from slogate.sim.server import create_engine_app

MODEL = "sim-model"
LIMIT = 8192  # a configured body limit, far below the default 4 MiB
MSG = [{"role": "user", "content": "hi"}]


def chat(**kw: Any) -> bytes:
    return json.dumps({"model": MODEL, "messages": MSG, **kw}).encode()


BODIES: list[tuple[str, str, bytes, int]] = [
    ("invalid JSON", "chat", b"{not json", 400),
    ("empty body", "chat", b"", 400),
    ("JSON array", "chat", b"[1, 2]", 400),
    ("JSON string", "chat", b'"hello"', 400),
    ("JSON null", "chat", b"null", 400),
    ("invalid UTF-8", "chat", b"\xff\xfe\x00{", 400),
    ("deeply nested arrays", "chat", b"[" * 3000 + b"]" * 3000, 400),  # past the parser's recursion limit, within the body limit
    ("deeply nested objects", "chat", b'{"a":' * 1200 + b"1" + b"}" * 1200, 400),
    ("missing model", "chat", json.dumps({"messages": MSG}).encode(), 400),
    ("model not a string", "chat", json.dumps({"model": 7, "messages": MSG}).encode(), 400),
    ("empty model", "chat", json.dumps({"model": "", "messages": MSG}).encode(), 400),
    ("unknown model", "chat", json.dumps({"model": "nope", "messages": MSG}).encode(), 404),
    ("missing messages", "chat", json.dumps({"model": MODEL}).encode(), 400),
    ("messages an object", "chat", json.dumps({"model": MODEL, "messages": {"role": "user"}}).encode(), 400),
    ("messages empty", "chat", json.dumps({"model": MODEL, "messages": []}).encode(), 400),
    ("message not an object", "chat", json.dumps({"model": MODEL, "messages": [1]}).encode(), 400),
    ("message without role", "chat", json.dumps({"model": MODEL, "messages": [{"content": "x"}]}).encode(), 400),
    ("stream not a boolean", "chat", chat(stream="yes"), 400),
    ("max_tokens negative", "chat", chat(max_tokens=-1), 400),
    ("max_tokens zero", "chat", chat(max_tokens=0), 400),
    ("max_tokens fractional", "chat", chat(max_tokens=1.5), 400),
    ("max_tokens a string", "chat", chat(max_tokens="10"), 400),
    ("temperature a string", "chat", chat(temperature="hot"), 400),
    ("temperature NaN", "chat", b'{"model": "sim-model", "messages": [{"role": "user", "content": "x"}], "temperature": NaN}', 400),
    ("temperature Infinity", "chat", b'{"model": "sim-model", "messages": [{"role": "user", "content": "x"}], "temperature": Infinity}', 400),
    ("stream_options not an object", "chat", chat(stream=True, stream_options=True), 400),
    ("slo not an object", "chat", chat(slo=5), 400),
    ("slo negative", "chat", chat(slo={"ttft_ms": -100}), 400),
    ("slo zero", "chat", chat(slo={"deadline_ms": 0}), 400),
    ("slo NaN", "chat", b'{"model": "sim-model", "messages": [{"role": "user", "content": "x"}], "slo": {"tbt_ms": NaN}}', 400),
    ("slo huge", "chat", chat(slo={"deadline_ms": 1e30}), 400),
    ("slo below a millisecond", "chat", chat(slo={"waiting_ms": 1e-300}), 400),
    ("slo a string", "chat", chat(slo={"ttft_ms": "fast"}), 400),
    ("slo unknown field", "chat", chat(slo={"ttft": 100}), 400),
    ("slo unknown kind", "chat", chat(slo={"kind": "urgent"}), 400),
    ("deadline negative", "chat", chat(deadline=-1), 400),
    ("target_tbt zero", "chat", chat(target_tbt=0), 400),
    ("waiting_time huge", "chat", chat(waiting_time=1e12), 400),
    ("unknown tier", "chat", chat(priority="platinum"), 400),
    ("priority fractional", "chat", chat(priority=1.5), 400),
    ("workflow a string", "chat", chat(workflow="w1"), 400),
    ("workflow id not a string", "chat", chat(workflow={"id": 5}), 400),
    ("workflow stage negative", "chat", chat(workflow={"id": "w", "stage": -1}), 400),
    ("workflow deadline negative", "chat", chat(workflow={"id": "w", "deadline_ms": -5}), 400),
    ("completions without prompt", "completions", json.dumps({"model": MODEL}).encode(), 400),
    ("completions prompt a number", "completions", json.dumps({"model": MODEL, "prompt": 5}).encode(), 400),
    ("responses without input", "responses", json.dumps({"model": MODEL}).encode(), 400),
    ("oversized body", "chat", chat(pad="x" * (LIMIT + 100)), 413),
]
HEADERS: list[tuple[str, dict[str, str], int]] = [
    ("ttft header not a number", {"x-slogate-ttft-ms": "abc"}, 400),
    ("tbt header negative", {"x-slogate-tbt-ms": "-5"}, 400),
    ("deadline header NaN", {"x-slogate-deadline-ms": "nan"}, 400),
    ("deadline header infinite", {"x-slogate-deadline-ms": "inf"}, 400),
    ("class header unknown", {"x-slogate-class": "urgent"}, 400),
    ("tier header unknown", {"x-slogate-tier": "platinum"}, 400),
    ("workflow stage header not an integer", {"x-slogate-workflow-id": "w", "x-slogate-workflow-stage": "x"}, 400),
    ("llm-d tpot header zero", {"x-llm-d-slo-tpot-ms": "0"}, 400),
]
PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions", "responses": "/v1/responses"}


@pytest.fixture(scope="module")
def gw():
    with ExitStack() as st:
        eng = st.enter_context(ServerThread(create_engine_app(MODEL, fixed_ttft_ms=5, fixed_itl_ms=1)))
        cfg = GatewayConfig.model_validate({"backends": [{"url": eng.url, "models": [MODEL], "budget": 8}], "max_body_bytes": LIMIT,
                                            "policies": {"frame_s": 0.05}})
        yield st.enter_context(ServerThread(create_app(cfg, OnlineLengthPredictor())))


def assert_openai_error(r: httpx.Response, status: int) -> None:
    assert r.status_code == status, r.text[:300]
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str) and err["message"]


@pytest.mark.parametrize("name,kind,body,status", BODIES, ids=[b[0] for b in BODIES])
def test_malformed_bodies_get_a_clear_4xx(gw, name: str, kind: str, body: bytes, status: int) -> None:
    r = httpx.post(gw.url + PATHS[kind], content=body, headers={"content-type": "application/json"}, timeout=30)
    assert_openai_error(r, status)


@pytest.mark.parametrize("name,headers,status", HEADERS, ids=[h[0] for h in HEADERS])
def test_malformed_slo_headers_get_a_clear_4xx(gw, name: str, headers: dict[str, str], status: int) -> None:
    r = httpx.post(gw.url + PATHS["chat"], content=chat(), headers={"content-type": "application/json", **headers})
    assert_openai_error(r, status)


def test_an_oversized_body_without_content_length_is_cut_off(gw) -> None:
    def chunks():
        yield b'{"model": "sim-model", "messages": [{"role": "user", "content": "'
        for _ in range(20):
            yield b"x" * 1024
        yield b'"}]}'

    r = httpx.post(gw.url + PATHS["chat"], content=chunks(), headers={"content-type": "application/json"})
    assert_openai_error(r, 413)


def test_wrong_method_and_path_are_openai_errors_too(gw) -> None:
    r = httpx.get(gw.url + PATHS["chat"])
    assert_openai_error(r, 405)
    assert r.headers["allow"] == "POST"
    assert_openai_error(httpx.post(gw.url + "/v1/embeddings-nope", content=b"{}"), 404)


def test_the_gateway_still_serves_after_the_catalogue_and_counted_no_5xx(gw) -> None:
    c = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0)
    r = c.chat.completions.create(model=MODEL, messages=MSG, max_tokens=3)  # type: ignore[arg-type]
    assert r.choices[0].message.content
    text = httpx.get(gw.url + "/metrics").text
    assert 'outcome="error"' not in text and 'outcome="failed"' not in text
