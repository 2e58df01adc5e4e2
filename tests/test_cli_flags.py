"""`slogate serve` flags for the common knobs: each maps to one config key, overrides the file and
the environment, is rejected with that key when bad, and is listed in `--help` and the reference."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import yaml
from faults import gauge
from servers import ServerThread
from typer.testing import CliRunner

from slogate.cli import app
from slogate.gateway.config import CLI_FLAGS, GatewayConfig, apply_flags, load_config
from slogate.sim.server import create_engine_app
from slogate.testing.ports import free_port
from slogate.testing.procs import wait_http

ROOT = Path(__file__).resolve().parent.parent


def file_and_env(tmp_path: Path, doc: dict, env: dict[str, str] | None = None) -> GatewayConfig:
    p = tmp_path / "gw.yaml"
    p.write_text(yaml.safe_dump(doc))
    return load_config(p, env or {})


def test_policy_flags_override_file_and_environment(tmp_path: Path) -> None:
    cfg = file_and_env(tmp_path, {"policies": {"ordering": "fcfs", "placement": "p2c", "frame_s": 0.2}},
                       {"SLOGATE_ORDERING": "edf", "SLOGATE_PLACEMENT": "random"})
    assert (cfg.policies.ordering, cfg.policies.placement) == ("edf", "random")  # env over file
    out = apply_flags(cfg, ordering="sjf", placement="round-robin")
    assert (out.policies.ordering, out.policies.placement, out.policies.frame_s) == ("sjf", "round-robin", 0.2)
    assert apply_flags(cfg).policies.ordering == "edf"  # a flag not given changes nothing
    with pytest.raises(ValueError, match="unknown ordering policy 'gmaxx'"):
        apply_flags(cfg, ordering="gmaxx")


def test_budget_flags_set_every_backend(tmp_path: Path) -> None:
    cfg = file_and_env(tmp_path, {"backends": [{"url": "http://a:1", "budget": 10, "name": "a"}, {"url": "http://b:1", "budget": 20}]})
    out = apply_flags(cfg, budget=3, learn_budget=False)
    assert [b.budget for b in out.backends] == [3, 3] and out.backends[0].name == "a" and out.capacity.learn is False
    assert apply_flags(cfg, learn_budget=True).capacity.learn is True
    with pytest.raises(ValueError, match="budget"):
        apply_flags(cfg, budget=0)


def test_pacing_flag_keeps_the_rest_of_the_pacing_section(tmp_path: Path) -> None:
    cfg = file_and_env(tmp_path, {"pacing": {"enabled": True, "ceiling": 0.7}})
    out = apply_flags(cfg, pacing=False)
    assert out.pacing.enabled is False and out.pacing.ceiling == 0.7
    assert apply_flags(file_and_env(tmp_path, {"pacing": False}), pacing=True).pacing.enabled is True


def test_slo_default_flags_override_only_what_they_name(tmp_path: Path) -> None:
    cfg = file_and_env(tmp_path, {"slo": {"default": {"kind": "auto", "ttft_ms": 500, "tbt_ms": 80}}})
    out = apply_flags(cfg, tbt_ms=40, deadline_ms=9000, waiting_ms=1500)
    d = out.slo.default
    assert (d.ttft_ms, d.tbt_ms, d.deadline_ms, d.waiting_ms) == (500, 40, 9000, 1500)
    assert apply_flags(cfg, ttft_ms=250).slo.default.ttft_ms == 250
    with pytest.raises(ValueError, match="tbt_ms"):
        apply_flags(cfg, tbt_ms=-5)


def test_backend_flags_keep_the_files_settings_for_a_url_and_take_kv_events(tmp_path: Path) -> None:
    cfg = file_and_env(tmp_path, {"backends": [{"url": "http://a:1", "budget": 7, "kv_events": "tcp://a:5557"}],
                                  "prefix": {"tokenizer": str(tmp_path)}})
    out = apply_flags(cfg, backends=["http://a:1/", "http://b:1"])
    assert [(b.url, b.budget, b.kv_events) for b in out.backends] == [("http://a:1", 7, "tcp://a:5557"), ("http://b:1", 48, None)]
    out = apply_flags(cfg, backends=["http://a:1/v1", "https://b/openai/v1/", "http://v1", "dns+http://vllm:8000/v1"])
    assert [(b.url, b.budget) for b in out.backends] == [("http://a:1", 7), ("https://b/openai", 48), ("http://v1", 48), ("dns+http://vllm:8000", 48)]
    out = apply_flags(cfg, backends=["http://a:1", "http://b:1"], kv_events=["tcp://{host}:5557"], tokenizer="/models/x")
    assert [b.kv_events for b in out.backends] == ["tcp://{host}:5557"] * 2 and str(out.prefix.tokenizer) == "/models/x"
    with pytest.raises(ValueError, match="one per backend"):
        apply_flags(cfg, backends=["http://a:1", "http://b:1", "http://c:1"], kv_events=["tcp://x:1", "tcp://y:1"])
    with pytest.raises(ValueError, match="ZMQ endpoint"):
        apply_flags(cfg, kv_events=["http://a:5557"])
    with pytest.raises(ValueError, match=r"needs prefix\.tokenizer"):
        apply_flags(file_and_env(tmp_path, {"backends": [{"url": "http://a:1"}]}), kv_events=["tcp://a:1"])


def test_redis_flag_overrides_the_environment(tmp_path: Path) -> None:
    cfg = file_and_env(tmp_path, {"state": {"prefix": "p"}}, {"SLOGATE_REDIS_URL": "redis://10.0.0.1:6379/0"})
    assert (cfg.state.kind, cfg.state.url) == ("redis", "redis://10.0.0.1:6379/0")
    out = apply_flags(cfg, redis_url="redis://127.0.0.1:6390/2")
    assert (out.state.kind, out.state.url, out.state.prefix) == ("redis", "redis://127.0.0.1:6390/2", "p")


def test_the_command_line_passes_its_flags_and_rejects_bad_ones(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[GatewayConfig] = []

    async def fake_serve(cfg: GatewayConfig, *a: object, **kw: object) -> None:
        seen.append(cfg)

    monkeypatch.setattr("slogate.embedded.serve_with_sim_engines", fake_serve)
    monkeypatch.setenv("SLOGATE_ORDERING", "edf")
    f = tmp_path / "gw.yaml"
    f.write_text(yaml.safe_dump({"backends": [{"url": "http://127.0.0.1:9"}], "policies": {"ordering": "fcfs"}}))
    r = CliRunner().invoke(app, ["serve", "--config", str(f), "--ordering", "plas", "--budget", "5", "--no-pacing", "--ttft-ms", "700",
                                 "--redis-url", "redis://127.0.0.1:6391/0", "--no-learn-budget"])
    assert r.exit_code == 0, r.output
    cfg = seen[-1]
    assert cfg.policies.ordering == "plas" and cfg.backends[0].budget == 5 and not cfg.pacing.enabled and not cfg.capacity.learn
    assert cfg.slo.default.ttft_ms == 700 and cfg.state.kind == "redis" and cfg.state.url.endswith(":6391/0")
    r = CliRunner().invoke(app, ["serve", "--config", str(f), "--placement", "nearest"], env={"COLUMNS": "300"})
    assert r.exit_code != 0 and "unknown placement policy 'nearest'" in r.output, r.output
    assert len(seen) == 1


def test_every_flag_is_in_the_help_and_the_reference() -> None:
    r = CliRunner().invoke(app, ["serve", "--help"], env={"COLUMNS": "200", "NO_COLOR": "1", "TERM": "dumb"})
    text = re.sub(r"\x1b\[[0-9;]*m", "", r.output)
    ref = (ROOT / "docs" / "reference" / "configuration.md").read_text()
    for flag, (key, _) in CLI_FLAGS.items():
        for name in re.findall(r"--[a-z-]+", flag):
            assert name in text, name
        assert f"`{flag}` | `{key}`" in ref, flag


def test_a_budget_flag_takes_effect_in_a_running_gateway() -> None:
    # A real `slogate serve` process: --budget 2 --no-learn-budget holds the replica at 2.
    with ServerThread(create_engine_app("sim-model")) as eng:
        port = free_port()
        # The URL as an OpenAI SDK's base_url has it (…/v1/): the gateway keeps the server's root.
        p = subprocess.Popen([sys.executable, "-c", "from slogate.cli import app; app()", "serve", "--backend", f"{eng.url}/v1/", "--port", str(port),
                              "--budget", "2", "--no-learn-budget", "--log-level", "warning"], start_new_session=True)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_http(f"{url}/health", timeout=30)
            assert gauge(url, "slogate_replica_budget") == 2
            r = httpx.post(f"{url}/v1/chat/completions", json={"model": "sim-model", "messages": [{"role": "user", "content": "x"}],
                                                               "max_tokens": 3}, timeout=30)
            assert r.status_code == 200, r.text
        finally:
            p.terminate()
            p.wait(20)
