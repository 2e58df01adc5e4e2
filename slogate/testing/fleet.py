"""A local fleet for load tests and benchmarks: simulated engines and one `slogate serve`,
each in its own process (so they can be measured, killed and restarted separately)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

from slogate.testing.ports import free_port

MODEL = "sim-model"


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_http(url: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not come up")


def start_fleet(engines: int, budget: int, ttft_ms: float, itl_ms: float, extra_cfg: dict | None = None,
                engine_args: tuple[str, ...] = ()) -> tuple[list[subprocess.Popen], subprocess.Popen, str, Path]:
    cli = [sys.executable, "-c", "from slogate.cli import app; app()"]
    procs, urls = [], []
    for _ in range(engines):
        p = free_port()
        args = ["--fixed-ttft-ms", str(ttft_ms), "--fixed-itl-ms", str(itl_ms)] if not engine_args else list(engine_args)
        procs.append(subprocess.Popen([*cli, "engine", "--port", str(p), "--model", MODEL, *args], start_new_session=True,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        urls.append(f"http://127.0.0.1:{p}")
    for u in urls:
        wait_http(f"{u}/v1/models")
    cfg = {"backends": [{"url": u, "name": f"e{i}", "models": [MODEL], "budget": budget} for i, u in enumerate(urls)],
           "max_queue": 5000, **(extra_cfg or {})}
    path = Path(tempfile.mkdtemp()) / "gw.yaml"
    path.write_text(yaml.safe_dump(cfg))
    port = free_port()
    gw = subprocess.Popen([*cli, "serve", "--config", str(path), "--port", str(port), "--log-level", "warning"], start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    wait_http(f"{url}/health")
    return procs, gw, url, path


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
