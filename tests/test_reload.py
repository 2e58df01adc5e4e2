"""Config reload without a restart (`slogate serve --config F`, then SIGHUP or a change to F):
new requests see the new backends, keys and tiers; a running stream is untouched; a broken file
changes nothing and says why in the log. Also an operator's drain through /admin."""

from __future__ import annotations

import asyncio
import hashlib
import signal
import subprocess
import time
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from slogate.testing.ports import free_port
from slogate.testing.procs import slogate, stop, wait_http
from slogate.testing.prom import metric

MODEL = "sim-model"
ADMIN = "admin-key"


def _sha(k: str) -> str:
    return hashlib.sha256(k.encode()).hexdigest()


def _cfg(engines: list[str], keys: dict[str, str], tiers: dict) -> dict:
    """`keys`: key → its tier."""
    return {"backends": [{"url": u, "models": [MODEL], "budget": 8, "name": f"e{i}"} for i, u in enumerate(engines)],
            "health_interval_s": 0.3, "tiers": tiers,
            "auth": {"enabled": True, "admin_sha256": _sha(ADMIN),
                     "keys": [{"sha256": _sha(k), "tenant": k, "tier": t} for k, t in keys.items()]}}


def _chat(gw: str, key: str, max_tokens: int = 4) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens}
    return httpx.post(f"{gw}/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"}, timeout=30)


def _admin(gw: str, method: str, path: str) -> httpx.Response:
    return httpx.request(method, f"{gw}{path}", headers={"authorization": f"Bearer {ADMIN}"}, timeout=10)


def _until(cond, what: str, timeout: float = 15.0) -> None:  # type: ignore[no-untyped-def]
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, what
        time.sleep(0.1)


@pytest.fixture
def fleet(tmp_path: Path):
    procs: list[subprocess.Popen[bytes]] = []
    engines = []
    try:
        for _ in range(2):
            p = free_port()
            procs.append(slogate("engine", "--port", str(p), "--model", MODEL, "--fixed-ttft-ms", "10", "--fixed-itl-ms", "20"))
            engines.append(f"http://127.0.0.1:{p}")
        for u in engines:
            wait_http(f"{u}/v1/models")
        path = tmp_path / "gw.yaml"
        path.write_text(yaml.safe_dump(_cfg(engines[:1], {"key-a": "default"}, {"default": {}})))
        gp = free_port()
        log = (tmp_path / "gw.log").open("wb")
        gw = slogate("serve", "--config", str(path), "--port", str(gp), "--log-level", "info", log=log)
        procs.append(gw)
        url = f"http://127.0.0.1:{gp}"
        wait_http(f"{url}/health/live")
        _until(lambda: _admin(url, "GET", "/admin/state").status_code == 200, "gateway not ready")
        yield engines, url, gw, path, tmp_path / "gw.log"
    finally:
        stop(procs)


def test_reload_applies_to_new_requests_only_and_rejects_a_broken_file(fleet) -> None:
    engines, gw, proc, path, log = fleet
    assert _chat(gw, "key-b").status_code == 401

    async def long_stream() -> tuple[str, str | None]:
        c = openai.AsyncOpenAI(base_url=f"{gw}/v1", api_key="key-a", max_retries=0)
        s = await c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "long"}], stream=True, max_tokens=150,
                                            extra_body={"ignore_eos": True})
        text, finish = "", None
        async for ch in s:
            if ch.choices:
                text += ch.choices[0].delta.content or ""
                finish = ch.choices[0].finish_reason or finish
        await c.close()
        return text, finish

    async def scenario() -> tuple[str, str | None]:
        running = asyncio.create_task(long_stream())  # ~3 s of tokens: it spans the reload
        await asyncio.sleep(0.8)
        path.write_text(yaml.safe_dump(_cfg(engines, {"key-a": "default", "key-b": "gold"}, {"default": {}, "gold": {"weight": 3}})))
        proc.send_signal(signal.SIGHUP)
        await asyncio.to_thread(_until, lambda: _chat(gw, "key-b").status_code == 200, "the new key was never accepted")
        assert not running.done(), "the running stream ended before the reload: the test proves nothing"
        return await running

    text, finish = asyncio.run(scenario())
    assert len(text.split()) == 150 and finish == "length"  # the stream that spanned the reload is whole
    assert metric(gw, "slogate_requests_total", tier="gold") >= 1  # the new key's requests run in the new tier
    _until(lambda: len(_admin(gw, "GET", "/admin/state").json()["replicas"]) == 2, "the new backend never joined")
    for _ in range(12):
        assert _chat(gw, "key-b").status_code == 200
    assert metric(engines[1], "slogate_sim_finished_total") > 0  # new requests reach the new backend
    assert metric(gw, "slogate_config_reloads_total", result="applied") == 1

    # A broken file (an unknown policy) changes nothing: noticed by the file watch, logged, rejected.
    broken = _cfg(engines[:1], {"key-a": "default"}, {"default": {}})
    broken["policies"] = {"ordering": "no-such-policy"}
    path.write_text(yaml.safe_dump(broken))
    _until(lambda: metric(gw, "slogate_config_reloads_total", result="rejected") == 1, "the broken file was not noticed")
    assert "rejected" in log.read_text() and "no-such-policy" in log.read_text()
    assert _chat(gw, "key-b").status_code == 200  # the keys, tiers and backends of the last good config stay
    assert len(_admin(gw, "GET", "/admin/state").json()["replicas"]) == 2
    r = _admin(gw, "POST", "/admin/reload")
    assert r.status_code == 400 and "no-such-policy" in r.json()["error"]["message"]


def test_admin_drain_holds_a_replica_out_and_lets_it_back(fleet) -> None:
    engines, gw, _proc, path, _log = fleet
    path.write_text(yaml.safe_dump(_cfg(engines, {"key-a": "default"}, {"default": {}})))
    assert _admin(gw, "POST", "/admin/reload").status_code == 200
    _until(lambda: all(r["healthy"] for r in _admin(gw, "GET", "/admin/state").json()["replicas"]), "replicas not healthy")
    r = _admin(gw, "POST", "/admin/backends/e1/drain")
    assert r.status_code == 200 and r.json()["state"] == "drained"
    before = metric(engines[1], "slogate_sim_finished_total")
    for _ in range(10):
        assert _chat(gw, "key-a").status_code == 200
    assert metric(engines[1], "slogate_sim_finished_total") == before  # nothing new went there
    assert _admin(gw, "POST", "/admin/backends/nope/drain").status_code == 404
    assert _admin(gw, "POST", "/admin/backends/e1/undrain").json()["state"] == "active"
    for _ in range(16):
        assert _chat(gw, "key-a").status_code == 200
    assert metric(engines[1], "slogate_sim_finished_total") > before
