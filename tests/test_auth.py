"""API keys end to end: 401 / 403 / 429 in the OpenAI shape, tiers and SLO floors from the key,
limits shared through Redis by two gateways, admin endpoints, keys never in metrics."""

from __future__ import annotations

from contextlib import ExitStack

import httpx
import openai
import pytest
from servers import ServerThread

from slogate.gateway.app import create_app
from slogate.gateway.auth import key_hash
from slogate.gateway.config import GatewayConfig, WorkflowsConfig
from slogate.gateway.slo import resolve
from slogate.gateway.workflows import WorkflowBook
from slogate.sim.server import create_engine_app

MODEL = "sim-model"
GOLD, BASIC, ADMIN = "sk-gold-0123456789", "sk-basic-abcdef", "sk-admin-xyz"


def cfg(engine_url: str, state: dict | None = None) -> GatewayConfig:
    return GatewayConfig.model_validate({
        "backends": [{"url": engine_url, "models": [MODEL, "other-model"], "budget": 16}],
        "tiers": {"default": {}, "gold": {"weight": 3}, "basic": {"weight": 1}},
        "policies": {"params": {"fairness": 0.3}},
        "auth": {"enabled": True, "admin_sha256": key_hash(ADMIN), "keys": [
            {"sha256": key_hash(GOLD), "tenant": "acme", "tier": "gold", "slo_floor": {"ttft_ms": 500, "tbt_ms": 40}},
            {"sha256": key_hash(BASIC), "tenant": "bob", "tier": "basic", "models": [MODEL], "rpm": 3},
        ]},
        "state": state or {},
    })


def test_key_tier_is_authoritative_and_the_slo_floor_clamps() -> None:
    c = cfg("http://127.0.0.1:1")
    gold = c.auth.keys[0]
    r = resolve({"model": MODEL, "stream": True, "priority": "basic", "slo": {"ttft_ms": 50, "tbt_ms": 10}}, {}, c, WorkflowBook(WorkflowsConfig()), 0.0, gold)
    assert r.tier.name == "gold" and r.slo.ttft_s == 0.5 and r.slo.tbt_s == 0.04 and r.sources["ttft_ms"] == "key_floor"
    r2 = resolve({"model": MODEL, "stream": True, "slo": {"ttft_ms": 900}}, {}, c, WorkflowBook(WorkflowsConfig()), 0.0, gold)
    assert r2.slo.ttft_s == 0.9  # looser than the floor: as asked


def test_every_auth_status_in_the_openai_shape() -> None:
    with ExitStack() as st:
        eng = st.enter_context(ServerThread(create_engine_app(MODEL)))
        app = create_app(cfg(eng.url))
        gw = st.enter_context(ServerThread(app))
        url = f"{gw.url}/v1"
        msg = [{"role": "user", "content": "x"}]
        with pytest.raises(openai.AuthenticationError) as e:
            openai.OpenAI(base_url=url, api_key="sk-wrong", max_retries=0).chat.completions.create(model=MODEL, messages=msg)
        assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
        r = httpx.post(f"{url}/chat/completions", json={"model": MODEL, "messages": msg})
        assert r.status_code == 401 and set(r.json()["error"]) >= {"message", "type", "param", "code"}
        basic = openai.OpenAI(base_url=url, api_key=BASIC, max_retries=0)
        # The models a key may use, and only with a key; one it may not use does not exist for it.
        assert httpx.get(f"{url}/models").status_code == 401 and httpx.get(f"{url}/models/{MODEL}").status_code == 401
        assert [m.id for m in basic.models.list().data] == [MODEL] and basic.models.retrieve(MODEL).id == MODEL
        with pytest.raises(openai.NotFoundError) as e5:
            basic.models.retrieve("other-model")
        assert e5.value.body["code"] == "model_not_found"
        assert [m.id for m in openai.OpenAI(base_url=url, api_key=GOLD, max_retries=0).models.list().data] == ["other-model", MODEL]
        with pytest.raises(openai.PermissionDeniedError) as e2:
            basic.chat.completions.create(model="other-model", messages=msg, max_tokens=2)
        assert e2.value.body["code"] == "model_not_allowed"
        for _ in range(3):
            basic.chat.completions.create(model=MODEL, messages=msg, max_tokens=2)
        with pytest.raises(openai.RateLimitError) as e3:
            basic.chat.completions.create(model=MODEL, messages=msg, max_tokens=2)
        assert e3.value.body["code"] == "rate_limit_exceeded" and int(e3.value.response.headers["retry-after"]) >= 1
        gold = openai.OpenAI(base_url=url, api_key=GOLD, max_retries=0)
        assert gold.chat.completions.create(model=MODEL, messages=msg, max_tokens=2, extra_body={"ignore_eos": True}).usage.completion_tokens == 2
        with pytest.raises(openai.NotFoundError) as e4:  # a typo: told what it may ask for instead
            gold.chat.completions.create(model="sim-modle", messages=msg, max_tokens=2)
        assert "Served here: `other-model`, `sim-model`." in e4.value.body["message"], e4.value.body
        # admin endpoint: key required, and the right one
        assert httpx.get(f"{gw.url}/admin/state").status_code == 401
        assert httpx.get(f"{gw.url}/admin/state", headers={"authorization": f"Bearer {GOLD}"}).status_code == 401
        st_ = httpx.get(f"{gw.url}/admin/state", headers={"authorization": f"Bearer {ADMIN}"})
        assert st_.status_code == 200 and st_.json()["replicas"][0]["budget"] == 8  # slow start: 8 of the 16 configured, light load
        # the key's tenant is what GMAX's fairness blend accounts service to
        served = app.state.gateway.groups[MODEL].scheduler.ordering.served
        assert set(served) >= {"acme", "bob"}
        metrics = httpx.get(f"{gw.url}/metrics").text
        for k in (GOLD, BASIC, ADMIN, key_hash(GOLD)):
            assert k not in metrics
        assert 'tier="gold"' in metrics


def test_rate_limits_are_shared_by_gateways_through_redis(redis_url: str) -> None:
    with ExitStack() as st:
        eng = st.enter_context(ServerThread(create_engine_app(MODEL)))
        # A loaded CI box can miss the 0.25 s default, and a gateway on local state counts alone.
        state = {"kind": "redis", "url": redis_url, "prefix": "authtest", "timeout_s": 5.0}
        gws = [st.enter_context(ServerThread(create_app(cfg(eng.url, state)))) for _ in range(2)]
        codes = []
        for i in range(6):
            r = httpx.post(f"{gws[i % 2].url}/v1/chat/completions", headers={"authorization": f"Bearer {BASIC}"},
                           json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2})
            codes.append(r.status_code)
        assert codes.count(200) == 3 and codes.count(429) == 3  # one limit of 3/min across both gateways
