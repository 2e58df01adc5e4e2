from __future__ import annotations

import asyncio
import itertools

import pytest

from gateway.config import GatewayConfig
from gateway.errors import APIError
from gateway.pacing import Pacer, paced
from gateway.slo import WorkflowRegistry, resolve
from gateway.sse import inspect
from router.request import SLOClass

CFG = GatewayConfig.model_validate({
    "backends": [{"url": "http://127.0.0.1:1"}],
    "slo": {"models": {"m": {"tbt_ms": 80}}},
    "tiers": {"default": {}, "high": {"weight": 2, "slo": {"ttft_ms": 700}}, "low": {"weight": 0.5, "slo": {"kind": "best_effort"}}},
    "service_tiers": {"priority": "high", "flex": "low"},
})


def r(body: dict, headers: dict | None = None, now: float = 100.0):
    return resolve({"model": "m", **body}, headers or {}, CFG, WorkflowRegistry(), now)


def test_defaults_stream_is_latency_and_plain_is_deadline() -> None:
    s = r({"stream": True})
    assert s.slo.kind is SLOClass.LATENCY and s.slo.ttft_s == 2.0 and s.slo.tbt_s == 0.08  # model default tbt
    d = r({})
    assert d.slo.kind is SLOClass.DEADLINE and d.slo.deadline_s == 20.0 and d.waiting_s == 5.0


def test_precedence_body_over_headers_over_service_tier_over_defaults() -> None:
    hdr = {"x-slogate-ttft-ms": "900", "x-llm-d-slo-tpot-ms": "40"}
    assert r({"stream": True, "service_tier": "priority"}).slo.ttft_s == 0.7  # the tier's default
    both = r({"stream": True, "service_tier": "priority"}, hdr)
    assert both.slo.ttft_s == 0.9 and both.slo.tbt_s == 0.04 and both.tier.name == "high"
    body = r({"stream": True, "service_tier": "priority", "slo": {"ttft_ms": 300}}, hdr)
    assert body.slo.ttft_s == 0.3 and body.slo.tbt_s == 0.04 and body.sources["ttft_ms"] == "body"
    jit = r({"target_ttft": 1.5, "target_tbt": 0.05, "waiting_time": 2}, hdr)
    assert jit.slo.kind is SLOClass.LATENCY and jit.slo.ttft_s == 1.5 and jit.slo.tbt_s == 0.05 and jit.waiting_s == 2.0
    dl = r({"deadline": 7, "stream": True})
    assert dl.slo.kind is SLOClass.DEADLINE and dl.slo.deadline_s == 7.0
    assert r({"priority": "high"}, {"x-slogate-tier": "low"}).tier.name == "high"
    assert r({}, {"x-slogate-tier": "low"}).tier.name == "low"


def test_best_effort_tier_and_our_fields_stripped() -> None:
    be = r({"service_tier": "flex", "slo": {"waiting_ms": 10}, "extra": 1})
    assert be.slo.kind is SLOClass.BEST_EFFORT and be.waiting_s == 600.0  # best effort is never refused for waiting
    assert be.body == {"model": "m", "service_tier": "flex", "extra": 1}
    assert r({"priority": 5}).vllm_priority == 5 and r({"priority": 5}).body["priority"] == 5


def test_workflows_share_one_deadline() -> None:
    reg = WorkflowRegistry()
    a = resolve({"model": "m", "workflow": {"id": "w", "stage": 0, "deadline_ms": 10_000}}, {}, CFG, reg, 100.0)
    b = resolve({"model": "m", "workflow": {"id": "w", "stage": 1}}, {}, CFG, reg, 104.0)
    assert a.slo.kind is SLOClass.COMPOUND and a.slo.deadline_s == pytest.approx(10.0)
    assert b.slo.deadline_s == pytest.approx(6.0) and b.stage == 1 and b.workflow is a.workflow
    h = resolve({"model": "m"}, {"x-slogate-workflow-id": "v", "x-slogate-workflow-stage": "2"}, CFG, reg, 0.0)
    assert h.workflow is not None and h.stage == 2


@pytest.mark.parametrize("body", [
    {"slo": {"ttft_ms": 0}}, {"slo": {"ttft_ms": -1}}, {"slo": {"ttft_ms": 1e12}}, {"slo": {"ttft_ms": True}},
    {"slo": {"ttft_ms": "nan"}}, {"slo": {"speed": 1}}, {"slo": []}, {"slo": {"kind": "urgent"}}, {"deadline": -2},
    {"priority": "gold"}, {"priority": 1.5}, {"workflow": {"stage": 1}}, {"workflow": {"id": "w", "stage": -1}},
])
def test_invalid_slo_values_are_400s(body: dict) -> None:
    with pytest.raises(APIError) as e:
        r(body)
    assert e.value.status == 400 and e.value.body()["error"]["message"]


def test_sse_inspection() -> None:
    assert inspect(b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n').tokens == 1
    assert inspect(b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n\n').tokens == 0
    u = inspect(b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":9}}\n\n')
    assert u.usage_only and u.usage_out == 9
    assert inspect(b"data: [DONE]\n\n").done
    assert inspect(b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta","delta":"x"}\n\n').tokens == 1
    assert inspect(b'data: {"error":{"message":"x"}}\n\n').error


def test_pacer_holds_early_tokens_on_the_tbt_timeline() -> None:
    p = Pacer(0.1)
    assert p.due(10.0, 1) == 10.0  # first token at once
    assert p.due(10.01, 1) == pytest.approx(10.1)  # early: held
    assert p.due(10.02, 1) == pytest.approx(10.2)
    assert p.slack(10.02) == pytest.approx(0.28)
    assert p.due(11.0, 1) == 11.0  # late: straight through


def test_paced_stream_releases_on_time() -> None:
    async def main() -> list[float]:
        async def src():
            loop = asyncio.get_running_loop()
            for i in range(5):
                yield i, 1, loop.time()
        p = Pacer(0.02, clock=asyncio.get_running_loop().time)
        out = []
        async for _ in paced(src(), p):
            out.append(asyncio.get_running_loop().time())
        return out

    t = asyncio.run(main())
    gaps = [b - a for a, b in itertools.pairwise(t)]
    assert all(g >= 0.015 for g in gaps)
