from __future__ import annotations

import asyncio
import itertools
import re
from array import array
from types import SimpleNamespace

import orjson
import pytest
from helpers import view

from slogate.gateway.admission import Admission, Ticket
from slogate.gateway.config import GatewayConfig, WorkflowsConfig
from slogate.gateway.errors import APIError
from slogate.gateway.exchange import AnswerText, Exchange
from slogate.gateway.fleet import Backend
from slogate.gateway.pacing import Pacer, paced
from slogate.gateway.resume import by_ids, continued, ids_body
from slogate.gateway.slo import resolve
from slogate.gateway.sse import hide_ids, inspect
from slogate.gateway.upstream import Upstream, engine_asks
from slogate.gateway.workflows import WorkflowBook
from slogate.router.prefix import PrefixCache, text_block_hashes
from slogate.router.registry import make_ordering, make_placement
from slogate.router.request import SLO, Request, SLOClass
from slogate.router.scheduler import Scheduler

CFG = GatewayConfig.model_validate({
    "backends": [{"url": "http://127.0.0.1:1"}],
    "slo": {"models": {"m": {"tbt_ms": 80}}},
    "tiers": {"default": {}, "high": {"weight": 2, "slo": {"ttft_ms": 700}}, "low": {"weight": 0.5, "slo": {"kind": "best_effort"}}},
    "service_tiers": {"priority": "high", "flex": "low"},
})


def r(body: dict, headers: dict | None = None, now: float = 100.0):
    return resolve({"model": "m", **body}, headers or {}, CFG, WorkflowBook(WorkflowsConfig()), now)


def test_defaults_stream_is_latency_and_plain_is_deadline() -> None:
    s = r({"stream": True})
    assert s.slo.kind is SLOClass.LATENCY and s.slo.ttft_s == 1.0 and s.slo.tbt_s == 0.08  # model default tbt
    d = r({})
    assert d.slo.kind is SLOClass.DEADLINE and d.slo.deadline_s == 20.0 and d.waiting_s == 5.0


def test_a_partial_default_slo_keeps_the_rest_of_the_built_in_one() -> None:
    # `slo: {default: {ttft_ms: ...}}` alone once left the TBT unset: every request failed (500).
    cfg = GatewayConfig.model_validate({"backends": [{"url": "http://127.0.0.1:1"}], "slo": {"default": {"ttft_ms": 3000}}})
    s = resolve({"model": "m", "stream": True}, {}, cfg, WorkflowBook(WorkflowsConfig()), 100.0)
    assert s.slo.kind is SLOClass.LATENCY and s.slo.ttft_s == 3.0 and s.slo.tbt_s == 0.05 and s.waiting_s == 5.0
    d = resolve({"model": "m"}, {}, cfg, WorkflowBook(WorkflowsConfig()), 100.0)
    assert d.slo.kind is SLOClass.DEADLINE and d.slo.deadline_s == 20.0


def test_only_a_tbt_someone_chose_counts_as_chosen() -> None:
    # Paced only then.
    plain = GatewayConfig.model_validate({"backends": [{"url": "http://127.0.0.1:1"}]})
    assert not resolve({"model": "m", "stream": True}, {}, plain, WorkflowBook(WorkflowsConfig()), 100.0).tbt_chosen
    assert resolve({"model": "m", "stream": True, "slo": {"tbt_ms": 50}}, {}, plain, WorkflowBook(WorkflowsConfig()), 100.0).tbt_chosen
    assert r({"stream": True}).tbt_chosen  # the model's default is an operator's choice
    # Shed once its first token cannot be on time (GMAX strict_ttft), only then.
    assert not resolve({"model": "m", "stream": True}, {}, plain, WorkflowBook(WorkflowsConfig()), 100.0).ttft_chosen
    assert resolve({"model": "m", "stream": True, "slo": {"ttft_ms": 900}}, {}, plain, WorkflowBook(WorkflowsConfig()), 100.0).ttft_chosen


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
    reg = WorkflowBook(WorkflowsConfig())
    a = resolve({"model": "m", "workflow": {"id": "w", "stage": 0, "deadline_ms": 10_000}}, {}, CFG, reg, 100.0)
    b = resolve({"model": "m", "workflow": {"id": "w", "stage": 1}}, {}, CFG, reg, 104.0)
    assert a.slo.kind is SLOClass.COMPOUND and a.slo.deadline_s == pytest.approx(10.0)
    assert b.slo.deadline_s == pytest.approx(6.0) and b.stage == 1 and b.workflow is a.workflow
    assert a.waiting_s == pytest.approx(10.0) and b.waiting_s == pytest.approx(6.0)  # a call may wait while its workflow can make it
    c = resolve({"model": "m", "workflow": {"id": "w"}, "slo": {"waiting_ms": 500}}, {}, CFG, reg, 105.0)
    assert c.waiting_s == pytest.approx(0.5)  # unless it says otherwise
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


def test_pacer_releases_at_the_engine_pace_and_builds_a_bounded_reserve() -> None:
    p = Pacer(0.1, ceiling=0.8, reserve_tbts=4, build=0.25)
    assert p.due(10.0, 1) == 10.0  # first token at once
    # The engine makes a token every 10 ms: released 25% slower while the reserve builds.
    at = [p.due(10.0 + 0.01 * k, 1) for k in range(1, 200)]
    lag = [a - (10.0 + 0.01 * k) for k, a in enumerate(at, 1)]
    assert lag[0] == pytest.approx(0.0025)
    assert all(x >= 0 for x in lag) and max(lag) <= 0.4 + 1e-9  # never more than 4 TBTs behind the engine
    assert lag[-1] == pytest.approx(0.4)  # ...and the full reserve is built
    # A 300 ms stall: the held tokens keep going out, so the client sees no gap near 300 ms.
    nxt = p.due(10.0 + 0.01 * 199 + 0.3, 1)
    assert nxt - at[-1] < 0.05
    assert p.slack(10.0 + 0.01 * 199) == pytest.approx(201 * 0.1 - 1.99)  # 201 tokens in on a 100 ms timeline


def test_pacer_never_holds_past_the_ceiling_timeline() -> None:
    """An engine far faster than the TBT with a large reserve: tokens are held, but token k
    never later than t0 + k·0.8·TBT, so the mean TPOT stays under the SLO with a margin."""
    p = Pacer(0.05, ceiling=0.8, reserve_tbts=100, build=1.0)
    p.due(0.0, 1)
    at = [p.due(0.001 * k, 1) for k in range(1, 101)]
    assert all(a <= k * 0.04 + 1e-9 for k, a in enumerate(at, 1))
    assert at[-1] / 100 <= 0.04


def test_pacer_never_delays_a_slow_engine() -> None:
    """An engine slower than the ceiling pace: every token goes out the moment it arrives."""
    p = Pacer(0.05)
    for k in range(50):
        t = k * 0.06 + (0.2 if k >= 25 else 0.0)  # a 200 ms stall at token 25
        assert p.due(t, 1) == t


def test_paced_stream_spreads_a_burst_and_lets_go_of_what_it_holds_when_the_engine_ends() -> None:
    """Ten tokens 20 ms apart, a 150 ms stall, ten at once, ten more 20 ms apart, five at once
    and the end: the mid-stream burst goes out spread at about the engine's pace; once the
    engine's stream has ended nothing is left to hide, so the last burst goes out at once and
    the answer ends when the engine's does (held, it would end up to the reserve later)."""
    async def main() -> tuple[list[float], float, float]:
        loop = asyncio.get_running_loop()
        ended: list[float] = []
        last_arrival = 0.0

        async def src():
            nonlocal last_arrival
            i = 0
            for gap, n in ((0.02, 10), (0.15, 1), (0.0, 9), (0.02, 10), (0.02, 1), (0.0, 4)):
                for _ in range(n):
                    await asyncio.sleep(gap)
                    last_arrival = loop.time()
                    yield i, 1, last_arrival
                    i += 1
        p = Pacer(0.05, clock=loop.time)
        out = []
        async for _ in paced(src(), p, on_end=lambda ok: ended.append(loop.time())):
            out.append(loop.time())
        return out, ended[0], last_arrival

    t, ended, last_arrival = asyncio.run(main())
    assert len(t) == 35
    burst = [b - a for a, b in itertools.pairwise(t[10:20])]
    assert min(burst) >= 0.005  # spread, not dumped
    assert ended <= t[-1] + 0.005  # the slot is free once the engine is done, not after the client
    assert t[-1] - last_arrival <= 0.015  # nothing held past the engine's end


def test_events_read_together_are_one_pace_observation() -> None:
    """The first token and the next arriving in one read must not teach the pacer a zero gap
    (it would never hold anything again); a read of 3 tokens 30 ms after the last is 10 ms a token."""
    p = Pacer(0.05, ceiling=0.8, reserve_tbts=100, build=1.0)
    p.due(1.0, 1)
    p.due(1.0, 1)  # same read as the first token: no observation
    assert p.gap is None
    p.due(1.02, 1)
    assert p.gap == pytest.approx(0.02)
    for _ in range(3):
        p.due(1.05, 1)  # three tokens in one read, 30 ms after the previous
    assert p.gap == pytest.approx(0.8 * 0.02 + 0.2 * 0.01)
    assert p.due(1.07, 1) > 1.07  # still held behind the engine


def test_a_stream_with_its_whole_answer_out_is_never_preempted() -> None:
    """Preempted after its last token (its finish still to come), a stream would be continued for
    one more token: the gateway refuses such a preemption, and a finish ends preemptibility."""
    assert inspect(b'data: {"choices":[{"delta":{},"finish_reason":"length"}]}\n\n').finished
    assert not inspect(b'data: {"choices":[{"delta":{"content":"a"},"finish_reason":null}]}\n\n').finished

    async def go() -> list[int]:
        adm = Admission(Scheduler(make_ordering("fcfs"), make_placement("least-load")), [view(0)])
        stopped: list[int] = []
        for rid, generated in ((1, 19), (2, 20)):
            req = Request(rid, 0.0, 10, SLO.best_effort(), max_tokens=20, generated=generated)
            t = Ticket(req, asyncio.get_running_loop().create_future(), 1e9, replica=0)
            t.preempt = lambda rid=rid: stopped.append(rid)
            adm.running[rid] = t
            assert adm.preempt(req) is (generated < 20)
        return stopped

    assert asyncio.run(go()) == [1]


def test_a_continuation_from_token_ids_is_the_engines_own_sequence() -> None:
    """gateway/resume.py: a cut chat answer goes on as a completion of prompt ids + answer ids,
    and its chunks reach the client as chat chunks of the first attempt's stream."""
    first = (b'data: {"id":"chatcmpl-a","object":"chat.completion.chunk","created":7,"model":"m","choices":[{"index":0,'
             b'"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}],"prompt_token_ids":[1,2,3]}\n\n')
    info = inspect(first)
    assert info.prompt_ids == [1, 2, 3] and info.head == ("chatcmpl-a", 7)
    tok = b'data: {"id":"chatcmpl-a","choices":[{"index":0,"delta":{"content":"ab"},"finish_reason":null,"token_ids":[5,6]}]}\n\n'
    assert inspect(tok).ids == [5, 6]
    assert hide_ids(tok) == tok.replace(b"[5,6]", b"null") and hide_ids(first).endswith(b'"prompt_token_ids":null}\n\n')
    ex = Exchange("chat", None, None, None, ("m", "t", "c"), True, False)  # type: ignore[arg-type]
    ex.ids, ex.prompt_ids, ex.head = [5, 6], [1, 2, 3], ("chatcmpl-a", 7)
    assert by_ids(ex, 2) and not by_ids(ex, 3)
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [], "max_completion_tokens": 10, "temperature": 0,
            "min_tokens": 4, "stream": True, "return_token_ids": True}
    c = ids_body(body, ex, None)
    assert c == {"model": "m", "prompt": [1, 2, 3, 5, 6], "max_tokens": 8, "min_tokens": 2, "temperature": 0, "stream": True,
                 "return_token_ids": True}
    # From the last token whose text the client has (the engine held the rest back as part of a
    # character): those tokens are made again, and the length left grows by them.
    back = ids_body(body, ex, None, keep=1)
    assert back is not None and back["prompt"] == [1, 2, 3, 5] and back["max_tokens"] == 9 and back["min_tokens"] == 3
    del body["max_completion_tokens"]
    assert ids_body(body, ex, None) is None  # a completion's default is 16 tokens: unknown length left, no continuation
    assert ids_body(body, ex, 100)["max_tokens"] == 95  # type: ignore[index]
    cont = (b'data: {"id":"cmpl-b","object":"text_completion","created":9,"model":"m","choices":[{"index":0,"text":"cd",'
            b'"logprobs":null,"finish_reason":"length","stop_reason":null,"token_ids":[8]}],"usage":{"prompt_tokens":5,"completion_tokens":1}}\n\n')
    got = orjson.loads(continued(cont, ex)[6:])
    assert got == {"id": "chatcmpl-a", "object": "chat.completion.chunk", "created": 7, "model": "m",
                   "choices": [{"index": 0, "delta": {"content": "cd"}, "logprobs": None, "finish_reason": "length", "stop_reason": None,
                                "token_ids": [8]}],
                   "usage": {"prompt_tokens": 5, "completion_tokens": 1}}
    assert continued(b"data: [DONE]\n\n", ex) == b"data: [DONE]\n\n"
    ex.kind = "completions"  # a legacy completion keeps its shape, under the first attempt's id
    assert orjson.loads(continued(cont, ex)[6:])["id"] == "chatcmpl-a"


def test_a_stream_is_counted_by_token_ids_only_where_they_cover_its_whole_answer() -> None:
    """A vLLM replica that has shown token ids is not asked for the running usage in every chunk
    (the ids count each chunk's tokens), except for an answer resumed from an attempt that gave
    none (a mixed fleet): its ids start mid-answer and cannot count it, so the usage must."""
    cfg = GatewayConfig.model_validate({"backends": [{"url": "http://127.0.0.1:1", "kind": "vllm"}]})
    up = Upstream(cfg, None, None)  # type: ignore[arg-type]
    b = Backend(cfg.backends[0], view(), "v")
    b.gives_ids = True

    def asked(ex: Exchange) -> dict:
        ex.res = SimpleNamespace(body={"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True, "max_tokens": 50})
        return up.body(b, ex)

    fresh = Exchange("chat", None, None, None, ("m", "t", "c"), True, False, text=AnswerText())  # type: ignore[arg-type]
    got = asked(fresh)
    assert got["return_token_ids"] and not got["stream_options"].get("continuous_usage_stats"), got
    # What bench/gateway_ttft.py sends the engine itself to price these asks is what is sent here.
    assert {k: got[k] for k in ("stream_options", "return_token_ids")} == engine_asks("vllm", True, True, True)
    # Resumed after 5 tokens made on an SGLang replica (no ids): text continuation, usage per chunk.
    mixed = Exchange("chat", None, None, None, ("m", "t", "c"), True, False, text=AnswerText(), resumed=5)  # type: ignore[arg-type]
    mixed.text.write("abcde")  # type: ignore[union-attr]
    got = asked(mixed)
    assert got["stream_options"]["continuous_usage_stats"] and got["max_tokens"] == 45, got
    # Resumed after 2 tokens whose ids the gateway has: continued by ids, counted by them.
    whole = Exchange("chat", None, None, None, ("m", "t", "c"), True, False, text=AnswerText(), resumed=2)  # type: ignore[arg-type]
    whole.ids, whole.prompt_ids, whole.ids_whole = array("l", [5, 6]), [1, 2, 3], 2
    got = asked(whole)
    assert got["prompt"] == [1, 2, 3, 5, 6] and not got["stream_options"].get("continuous_usage_stats"), got
    b.gives_ids = False  # not yet seen to give ids: the usage counts
    assert asked(Exchange("chat", None, None, None, ("m", "t", "c"), True, False, text=AnswerText()))["stream_options"]["continuous_usage_stats"]  # type: ignore[arg-type]


def test_the_debug_log_says_where_each_request_went_and_why(caplog: pytest.LogCaptureFixture) -> None:
    """With debug logging on, a dispatch names its replica and what every replica held, GoRouting
    says what it weighed, and the first token says how long its prefill took (the below-knee
    TTFT diagnosis in docs/benchmarks.md rests on these lines)."""
    caplog.set_level("DEBUG", logger="slogate")

    async def go() -> int | None:
        clock = [10.0]
        views = [view(0), view(1)]
        for v in views:  # prefix caches tracked, both cold
            v.cache = PrefixCache(1000)
        adm = Admission(Scheduler(make_ordering("gmax"), make_placement("gorouting")), views, clock=lambda: clock[0])
        q = Request(1, 10.0, 200, SLO.latency(1.0, 0.05))
        q.len_bound = q.len_mean = 50
        q.prefix, q.tokens_per_block = text_block_hashes("a prompt no replica has seen " * 30), 32.0
        t = await adm.acquire(q, waiting_s=5.0)
        clock[0] = 10.3
        adm.tokens(t, 1, clock[0])
        return t.replica

    rid = asyncio.run(go())
    lines = [rec.getMessage() for rec in caplog.records]
    place = next(m for m in lines if m.startswith("place 1:"))
    assert "candidates [0, 1]" in place and "light" in place
    dispatch = next(m for m in lines if m.startswith("dispatch 1 "))
    assert f"to {rid} after" in dispatch and "0: " in dispatch and "1: " in dispatch and "backlog" in dispatch
    # Its own prefill is the same on both cold replicas: on the one chosen, not priced as a hit on
    # the prompt `claim` has just entered in that replica's prefix picture.
    own = re.findall(r"own prefill ([0-9.]+) s", dispatch)
    assert len(own) == 2 and own[0] == own[1] and float(own[0]) > 0, dispatch
    assert f"first token 1 on {rid}: 0.300 s after dispatch" in lines
