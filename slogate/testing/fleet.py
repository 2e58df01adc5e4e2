"""A local fleet for load tests and benchmarks: simulated engines and one `slogate serve`,
each in its own process (so they can be measured, killed and restarted separately)."""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

import yaml

from slogate.testing.ports import free_port
from slogate.testing.procs import slogate, wait_http

MODEL = "sim-model"


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_engines(engines: int, ttft_ms: float, itl_ms: float, engine_args: tuple[str, ...] = ()) -> tuple[list[subprocess.Popen], list[str]]:
    """`engines` simulated engines, fixed-latency unless `engine_args` says otherwise, up and serving."""
    procs, urls = [], []
    for _ in range(engines):
        p = free_port()
        args = ["--fixed-ttft-ms", str(ttft_ms), "--fixed-itl-ms", str(itl_ms)] if not engine_args else list(engine_args)
        procs.append(slogate("engine", "--port", str(p), "--model", MODEL, *args))
        urls.append(f"http://127.0.0.1:{p}")
    for u in urls:
        wait_http(f"{u}/v1/models")
    return procs, urls


def start_fleet(engines: int, budget: int, ttft_ms: float, itl_ms: float, extra_cfg: dict | None = None,
                engine_args: tuple[str, ...] = ()) -> tuple[list[subprocess.Popen], subprocess.Popen, str, Path]:
    procs, urls = start_engines(engines, ttft_ms, itl_ms, engine_args)
    cfg = {"backends": [{"url": u, "name": f"e{i}", "models": [MODEL], "budget": budget} for i, u in enumerate(urls)],
           "max_queue": 5000, **(extra_cfg or {})}
    path = Path(tempfile.mkdtemp()) / "gw.yaml"
    path.write_text(yaml.safe_dump(cfg))
    port = free_port()
    gw = slogate("serve", "--config", str(path), "--port", str(port), "--log-level", "warning", quiet=False)
    url = f"http://127.0.0.1:{port}"
    wait_http(f"{url}/health")
    return procs, gw, url, path
