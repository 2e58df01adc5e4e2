"""End-to-end: the real openai SDK → slogate gateway → simulated engines, all over HTTP on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from contextlib import ExitStack
from typing import Any

import httpx
import openai
import pytest
from fastapi import FastAPI, Request
from servers import ServerThread

from slogate.gateway.app import create_app
from slogate.gateway.config import BackendConfig, GatewayConfig, load_config
from slogate.predictors.online import OnlineLengthPredictor
from slogate.sim.server import create_engine_app
from slogate.testing.prom import metric

MODEL = "sim-model"


def gateway_cfg(urls: list[str], **kw: Any) -> GatewayConfig:
    budget = kw.pop("budget", 16)
    raw = {"backends": [{"url": u, "models": [MODEL], "budget": budget, **kw.pop("backend_kw", {})} for u in urls],
           "policies": {"frame_s": 0.05}, "health_interval_s": 0.3, **kw}
    return GatewayConfig.model_validate(raw)


@pytest.fixture(scope="module")
def fleet():
    """Two simulated engines and a gateway in front of them."""
    with ExitStack() as st:
        engines = [st.enter_context(ServerThread(create_engine_app(MODEL))) for _ in range(2)]
        gw = st.enter_context(ServerThread(create_app(gateway_cfg([e.url for e in engines]), OnlineLengthPredictor())))
        yield gw, engines


def client(gw: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0)


# ------------------------------------------------------------------ the OpenAI API surface
def test_chat_completions_responses_stream_and_not(fleet) -> None:
    gw, _ = fleet
    c = client(gw)
    assert [m.id for m in c.models.list().data] == [MODEL]
    assert c.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as e:
        c.models.retrieve("no-such-model")
    assert e.value.status_code == 404 and e.value.body["code"] == "model_not_found" and "no-such-model" in e.value.body["message"]
    r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=12, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 12 and r.choices[0].message.content.count("tok") == 12
    chunks = list(c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=9, stream=True,
                                            extra_body={"ignore_eos": True}))
    assert sum(1 for ch in chunks if ch.choices and ch.choices[0].delta.content) == 9
    assert all(ch.choices for ch in chunks)  # the usage chunk the gateway asked for is not passed on
    chunks = list(c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=7, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert chunks[-1].usage.completion_tokens == 7
    r2 = c.completions.create(model=MODEL, prompt="hello", max_tokens=5, extra_body={"ignore_eos": True})
    assert r2.usage.completion_tokens == 5
    assert sum(1 for ch in c.completions.create(model=MODEL, prompt="x", max_tokens=4, stream=True, extra_body={"ignore_eos": True})
               if ch.choices and ch.choices[0].text) == 4
    r3 = c.responses.create(model=MODEL, input="hello", max_output_tokens=6, extra_body={"ignore_eos": True})
    assert r3.usage.output_tokens == 6 and r3.output_text.count("tok") == 6
    events = [e.type for e in c.responses.create(model=MODEL, input="hello", max_output_tokens=3, stream=True, extra_body={"ignore_eos": True})]
    assert events.count("response.output_text.delta") == 3 and events[-1] == "response.completed"


def test_errors_have_the_openai_shape(fleet) -> None:
    gw, _ = fleet
    c = client(gw)
    with pytest.raises(openai.NotFoundError) as e:
        c.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert e.value.body["code"] == "model_not_found"
    assert f"Served here: `{MODEL}`." in e.value.body["message"], e.value.body  # what it could have asked for
    with pytest.raises(openai.BadRequestError) as e2:
        c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], extra_body={"slo": {"tbt_ms": "fast"}})
    assert e2.value.body["param"] == "slo.tbt_ms"
    url = f"{gw.url}/v1/chat/completions"
    cases = [(b"{not json", 400), (b"[1, 2]", 400), (json.dumps({"model": MODEL}).encode(), 400),
             (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": -5}).encode(), 400),
             (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stream": "yes"}).encode(), 400),
             (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "slo": {"ttft_ms": float("nan")}}).encode(), 400),
             (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "priority": "platinum"}).encode(), 400),
             (b"\xff\xfe\x00", 400), (b"[" * 100_000 + b"]" * 100_000, 400)]
    for body, status in cases:
        r = httpx.post(url, content=body, headers={"content-type": "application/json"})
        assert r.status_code == status, (body[:40], r.text)
        assert set(r.json()["error"]) >= {"message", "type", "param", "code"}
    big = httpx.post(url, content=b'{"model": "' + b"x" * (5 * 1024 * 1024) + b'"}')
    assert big.status_code == 413 and "exceeds" in big.json()["error"]["message"]


def test_client_disconnect_frees_the_slot_and_aborts_upstream(fleet) -> None:
    gw, engines = fleet
    body = {"model": MODEL, "messages": [{"role": "user", "content": "long"}], "max_tokens": 5000, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{gw.url}/v1/chat/completions", json=body, timeout=10) as r:
        lines = r.iter_lines()  # kept open: breaking out of a for loop would close the response
        for _ in range(6):
            next(lines)
        assert sum(metric(e.url, "vllm:num_requests_running") for e in engines) == 1
    t0 = time.monotonic()
    while time.monotonic() - t0 < 1.0 and sum(metric(e.url, "vllm:num_requests_running") for e in engines) > 0:
        time.sleep(0.05)
    assert sum(metric(e.url, "vllm:num_requests_running") for e in engines) == 0
    assert metric(gw.url, "slogate_replica_inflight") == 0
    assert metric(gw.url, "slogate_cancelled_total") >= 1


@pytest.mark.parametrize(("slo", "leave_at"), [(None, 3), ({"ttft_ms": 5000, "tbt_ms": 100}, 3), (None, 0)], ids=["unpaced", "paced", "at-headers"])
def test_a_client_that_leaves_while_its_event_is_being_sent_is_counted_and_frees_the_slot(slo: dict[str, float] | None, leave_at: int) -> None:
    """Starlette cancels the response when the client leaves; if that lands while it awaits the
    send of an event (the relay parked at its `yield`), the relay is closed, not cancelled; if it
    lands while the headers are sent, the relay never started at all. Driven
    through the ASGI app so the send is the place the client leaves, every run (a real socket
    races the two: a CI run against real vLLM counted no cancellation)."""
    with ServerThread(create_engine_app(MODEL)) as eng:
        app = create_app(gateway_cfg([eng.url]))

        async def run() -> tuple[float | None, float | None]:
            async with app.router.lifespan_context(app):
                gw = app.state.gateway
                body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "long"}], "max_tokens": 5000,
                                   "stream": True, "ignore_eos": True, **({"slo": slo} if slo else {})}).encode()
                scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1", "method": "POST",
                         "scheme": "http", "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions", "query_string": b"",
                         "root_path": "", "headers": [(b"host", b"test"), (b"content-type", b"application/json")],
                         "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2)}
                gone, sent = asyncio.Event(), asyncio.Event()
                events = 0

                async def receive() -> dict[str, Any]:
                    if not sent.is_set():
                        sent.set()
                        return {"type": "http.request", "body": body, "more_body": False}
                    await gone.wait()
                    return {"type": "http.disconnect"}

                async def send(msg: dict[str, Any]) -> None:
                    nonlocal events
                    events += msg["type"] == "http.response.body" and b'"content": "tok' in msg.get("body", b"")
                    if events == leave_at:  # 0: the client leaves while the headers are sent, before any event was read
                        gone.set()
                        await asyncio.Event().wait()  # the client is gone: this send never completes

                await asyncio.wait_for(app(scope, receive, send), 10)
                # Settled by the time the response returns: not whenever a garbage collection finds the relay.
                readers = [t for t in asyncio.all_tasks() if "paced.<locals>.reader" in repr(t.get_coro())]
                return (gw.metrics.registry.get_sample_value("slogate_cancelled_total", {"model": MODEL}), gw.fleet.backends[0].view.local_inflight,
                        readers)

        cancelled, inflight, readers = asyncio.run(run())
        assert cancelled == 1
        assert inflight == 0  # its slot is free
        assert not readers  # a paced stream's reader is gone (were it waiting for a slot to resume in, it would take one for nobody)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 2 and metric(eng.url, "vllm:num_requests_running") > 0:
            time.sleep(0.05)
        assert metric(eng.url, "vllm:num_requests_running") == 0  # the engine stopped generating for it


def test_metrics_count_goodput_per_class(fleet) -> None:
    gw, _ = fleet
    before = metric(gw.url, "slogate_token_goodput_total", slo_class="deadline")
    client(gw).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=10,
                                       extra_body={"ignore_eos": True, "slo": {"deadline_ms": 60000}})
    after = metric(gw.url, "slogate_token_goodput_total", slo_class="deadline")
    assert after - before == pytest.approx(10 + len("x") // 4 + 1 - 1 + 1, abs=2)  # input (estimated) + 10 output tokens
    text = httpx.get(f"{gw.url}/metrics").text
    for name in ("slogate_ttft_seconds_bucket", "slogate_queue_depth", "slogate_replica_healthy", "slogate_gateway_overhead_seconds_count",
                 "slogate_predictor_bounds_total"):
        assert name in text


def test_health(fleet) -> None:
    gw, _ = fleet
    r = httpx.get(f"{gw.url}/health")
    assert r.status_code == 200 and r.json()["healthy_backends"] == 2
    assert httpx.get(f"{gw.url}/health/ready").json() == r.json()
    assert httpx.get(f"{gw.url}/health/live").status_code == 200


# ------------------------------------------------------------------ overload
def test_waiting_time_and_full_queue_refuse_with_retry_after() -> None:
    with ExitStack() as st:
        eng = st.enter_context(ServerThread(create_engine_app(MODEL)))
        app = create_app(gateway_cfg([eng.url], budget=1, max_queue=2, policies={"ordering": "fcfs", "placement": "least-load", "frame_s": 0.05}))
        gw = st.enter_context(ServerThread(app))
        body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 200, "ignore_eos": True,
                "slo": {"deadline_ms": 60000, "waiting_ms": 150}}
        results: list[httpx.Response] = []

        def send() -> None:
            results.append(httpx.post(f"{gw.url}/v1/chat/completions", json=body, timeout=30))

        threads = [threading.Thread(target=send) for _ in range(6)]
        for t in threads:
            t.start()
            time.sleep(0.01)
        for t in threads:
            t.join()
        codes = sorted(r.status_code for r in results)
        assert codes.count(200) >= 1
        refused = [r for r in results if r.status_code in (429, 503)]
        assert len(refused) >= 3 and all(int(r.headers["retry-after"]) >= 1 for r in refused)
        assert {r.json()["error"]["type"] for r in refused} <= {"rate_limit_error", "overloaded_error"}
        assert 503 in codes and 429 in codes  # queue full, then not admitted within 150 ms
        # Every refusal, the scheduler's (429) and a full queue's (503), reaches the learners as demand
        # turned away (price_by_arrivals' guard).
        assert app.state.gateway.fleet.refused == codes.count(429) + codes.count(503)
        assert {r.json()["error"]["code"] for r in refused if r.status_code == 503} == {"queue_full"}


def test_an_slo_no_engine_can_meet_is_refused_at_once_and_says_so(fleet) -> None:
    """A first token due sooner than the prompt can be prefilled: refused on arrival, and the
    message does not blame a load there is none of (the client would retry for ever)."""
    gw, _ = fleet
    r = httpx.post(f"{gw.url}/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "x " * 2000}],
                                                          "max_tokens": 3, "stream": True, "slo": {"ttft_ms": 1, "tbt_ms": 50}}, timeout=10)
    assert r.status_code == 429 and r.json()["error"]["code"] == "slo_unattainable"
    assert "even if it started now" in r.json()["error"]["message"] and "current load" not in r.json()["error"]["message"]


def test_a_client_that_leaves_while_queued_is_dropped_from_the_queue() -> None:
    with ExitStack() as st:
        eng = st.enter_context(ServerThread(create_engine_app(MODEL)))
        gw = st.enter_context(ServerThread(create_app(gateway_cfg([eng.url], budget=1))))
        long = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 300, "ignore_eos": True,
                "slo": {"deadline_ms": 60000, "waiting_ms": 60000}}
        holder = threading.Thread(target=lambda: httpx.post(f"{gw.url}/v1/chat/completions", json=long, timeout=30))
        holder.start()
        time.sleep(0.3)
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{gw.url}/v1/chat/completions", json=long, timeout=0.5)  # queued behind it, then gone
        t0 = time.monotonic()
        while metric(gw.url, "slogate_cancelled_total") < 1 and time.monotonic() - t0 < 2:
            time.sleep(0.05)
        assert metric(gw.url, "slogate_cancelled_total") == 1
        assert metric(gw.url, "slogate_queue_depth") == 0
        holder.join()
        assert sum(metric(e, "vllm:num_requests_running") for e in [eng.url]) == 0
        assert metric(gw.url, "slogate_requests_total", outcome="completed") == 1  # the one that left never ran


# ------------------------------------------------------------------ retries and what goes upstream
def capture_backend(status: int = 200) -> tuple[FastAPI, list[dict[str, Any]]]:
    seen: list[dict[str, Any]] = []
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": MODEL, "object": "model"}]}

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(request: Request) -> Any:
        body = await request.json()
        seen.append(body)
        if status != 200:
            from fastapi.responses import JSONResponse

            return JSONResponse({"error": {"message": "boom"}}, status_code=status)
        return {"id": "c", "object": "chat.completion", "created": 0, "model": MODEL,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}

    return app, seen


def test_connect_errors_and_5xx_retry_on_another_replica() -> None:
    bad_app, bad_seen = capture_backend(status=500)
    good_app, good_seen = capture_backend()
    with ExitStack() as st:
        bad = st.enter_context(ServerThread(bad_app))
        good = st.enter_context(ServerThread(good_app))
        dead = "http://127.0.0.1:9"  # nothing listens there
        cfg = gateway_cfg([dead, bad.url, good.url], policies={"ordering": "fcfs", "placement": "round-robin", "frame_s": 0.05})
        cfg.backends[0].models = [MODEL]
        gw = st.enter_context(ServerThread(create_app(cfg)))
        c = client(gw)
        for _ in range(6):
            assert c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}]).choices[0].message.content == "ok"
        assert len(good_seen) == 6 and len(bad_seen) >= 1
        assert metric(gw.url, "slogate_retries_total") >= 1


def test_our_fields_are_stripped_and_priority_passed_to_priority_backends() -> None:
    app, seen = capture_backend()
    papp, pseen = capture_backend()
    with ExitStack() as st:
        plain = st.enter_context(ServerThread(app))
        prio = st.enter_context(ServerThread(papp))
        cfg = gateway_cfg([plain.url], tiers={"default": {}, "high": {"weight": 2}})
        gw = st.enter_context(ServerThread(create_app(cfg)))
        cfg2 = gateway_cfg([prio.url], backend_kw={"priority_scheduling": True}, tiers={"default": {}, "high": {"weight": 2}})
        gw2 = st.enter_context(ServerThread(create_app(cfg2)))
        extra = {"slo": {"ttft_ms": 500, "tbt_ms": 50}, "workflow": {"id": "w1", "stage": 0}, "deadline": 3, "priority": "high",
                 "service_tier": "priority", "target_tbt": 0.1}
        client(gw).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], extra_body=extra)
        assert not set(seen[-1]) & {"slo", "workflow", "deadline", "priority", "service_tier", "target_tbt"}
        client(gw2).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], extra_body={"priority": "high"})
        assert pseen[-1]["priority"] == -20  # heavier tier runs first on vLLM
        client(gw2).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], extra_body={"priority": 3})
        assert pseen[-1]["priority"] == 3
        client(gw).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], stream=False,
                                           extra_body={"priority": 3})
        assert "priority" not in seen[-1]


def streaming_backend(before_s: float, between_s: float, crash: bool) -> FastAPI:
    """A scripted engine: three content chunks, after a delay, then [DONE] or a dropped connection."""
    from fastapi.responses import StreamingResponse

    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": MODEL, "object": "model"}]}

    @app.post("/v1/chat/completions")
    async def chat() -> StreamingResponse:
        async def gen():
            await asyncio.sleep(before_s)
            for i in range(3):
                chunk = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": MODEL,
                         "choices": [{"index": 0, "delta": {"content": f"t{i}"}, "finish_reason": None}]}
                yield f"data: {json.dumps(chunk)}\n\n".encode()
                await asyncio.sleep(between_s)
            if crash:
                raise RuntimeError("engine crashed")  # the connection drops mid-stream
            yield b"data: [DONE]\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream")

    return app


def test_a_stream_that_breaks_after_the_first_byte_ends_with_an_error_event() -> None:
    app = streaming_backend(0.0, 0.05, crash=True)  # separate reads: the bytes before the crash reach the gateway
    with ExitStack() as st:
        eng = st.enter_context(ServerThread(app))
        gw = st.enter_context(ServerThread(create_app(gateway_cfg([eng.url]))))
        got = []
        with pytest.raises(openai.APIError, match="upstream stream failed"):
            for ch in client(gw).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], stream=True,
                                                         extra_body={"slo": {"deadline_ms": 5000}}):
                got.append(ch.choices[0].delta.content)
        assert got == ["t0", "t1", "t2"]
        assert metric(gw.url, "slogate_requests_total", outcome="failed") == 1
        assert metric(gw.url, "slogate_replica_inflight") == 0


def role_then_crash_backend() -> FastAPI:
    """An engine that sends its headers and the role chunk, then dies before the first token."""
    from fastapi.responses import StreamingResponse

    app = FastAPI()
    calls: list[int] = []
    app.state.calls = calls

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": MODEL, "object": "model"}]}

    @app.post("/v1/chat/completions")
    async def chat() -> StreamingResponse:
        calls.append(1)

        async def gen():
            chunk = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": MODEL,
                     "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}
            yield f"data: {json.dumps(chunk)}\n\n".encode()
            await asyncio.sleep(0.05)
            raise RuntimeError("engine crashed before the first token")

        return StreamingResponse(gen(), media_type="text/event-stream")

    return app


def test_a_stream_that_fails_before_its_first_token_moves_to_another_replica() -> None:
    bad = role_then_crash_backend()
    with ExitStack() as st:
        eng_bad = st.enter_context(ServerThread(bad))
        eng_good = st.enter_context(ServerThread(create_engine_app(MODEL)))
        # The failing replica first in the list and given all the room: round-robin tries it first.
        cfg = gateway_cfg([eng_bad.url, eng_good.url], policies={"frame_s": 0.05, "ordering": "fcfs", "placement": "round-robin"})
        gw = st.enter_context(ServerThread(create_app(cfg)))
        texts = []
        for _ in range(4):
            out = client(gw).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], stream=True, max_tokens=5,
                                                     extra_body={"ignore_eos": True})
            texts.append("".join(ch.choices[0].delta.content or "" for ch in out if ch.choices))
        assert all(t for t in texts)  # every stream completed, on the other replica
        assert bad.state.calls, "the failing replica was never tried"
        assert metric(gw.url, "slogate_requests_total", outcome="completed") == 4
        assert metric(gw.url, "slogate_retries_total") >= 1
        assert metric(gw.url, "slogate_replica_inflight") == 0


def test_keepalive_comments_while_the_first_token_is_slow() -> None:
    app = streaming_backend(0.7, 0.0, crash=False)  # a slow prefill
    with ExitStack() as st:
        eng = st.enter_context(ServerThread(app))
        gw = st.enter_context(ServerThread(create_app(gateway_cfg([eng.url], keepalive_s=0.2))))
        body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stream": True, "slo": {"deadline_ms": 5000}}
        with httpx.stream("POST", f"{gw.url}/v1/chat/completions", json=body, timeout=10) as r:
            lines = [ln for ln in r.iter_lines() if ln]
        assert lines.count(": keep-alive") >= 2
        assert [ln for ln in lines if ln.startswith("data: {")].__len__() == 3 and lines[-1] == "data: [DONE]"
        got = [ch.choices[0].delta.content for ch in client(gw).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], stream=True, extra_body={"slo": {"deadline_ms": 5000}})]
        assert got == ["t0", "t1", "t2"]  # the SDK ignores the comments


def test_compose_style_config_file_loads(tmp_path) -> None:
    p = tmp_path / "gw.yaml"
    p.write_text("backends:\n  - url: http://127.0.0.1:8001\n    budget: 8\npolicies: {ordering: edf, placement: p2c}\n"
                 "tiers: {high: {weight: 3, slo: {ttft_ms: 800}}}\n")
    cfg = load_config(p, env={"SLOGATE_FRAME_S": "0.1"})
    assert cfg.backends[0].budget == 8 and cfg.policies.ordering == "edf" and cfg.policies.frame_s == 0.1
    assert set(cfg.tiers) == {"default", "high"}
    with pytest.raises(ValueError):
        GatewayConfig.model_validate({"backends": [{"url": "ftp://x"}]})
    with pytest.raises(ValueError):
        GatewayConfig.model_validate({"backends": [], "bogus": 1})
    assert load_config(None, env={"SLOGATE_BACKENDS": "http://a:1,http://b:2"}).backends[1].url == "http://b:2"
    assert BackendConfig(url="http://x/").url == "http://x"
    assert re.match(r"^slogate", "slogate_ok")
