"""Processes a test or benchmark starts (engines, gateways, routers, redis): each in its own
session so it and its children stop together; readiness by HTTP; a stop that escalates."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import IO

import httpx

SLOGATE = [sys.executable, "-c", "from slogate.cli import app; app()"]  # this interpreter's slogate, whatever is on PATH


def spawn(cmd: Sequence[str], log: IO[bytes] | None = None, quiet: bool = True) -> subprocess.Popen[bytes]:
    """Start `cmd` in a new session; its output goes to `log`, else nowhere (`quiet`) or to ours."""
    out = log if log is not None else subprocess.DEVNULL if quiet else None
    return subprocess.Popen(list(cmd), stdout=out, stderr=subprocess.STDOUT if log is not None else out, start_new_session=True)


def slogate(*args: str, log: IO[bytes] | None = None, quiet: bool = True) -> subprocess.Popen[bytes]:
    """`slogate ARGS...` (serve, engine) as a process."""
    return spawn([*SLOGATE, *args], log, quiet)


def wait_http(url: str, timeout: float = 60, below: int = 300) -> None:
    """Until `url` answers with a status below `below` (300: success; 500: up at all)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1).status_code < below:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not come up")


def start_redis(port: int, directory: str | os.PathLike[str], timeout: float = 10) -> subprocess.Popen[bytes]:
    """A redis-server of our own on 127.0.0.1:`port` (nothing persisted), once it takes connections;
    FileNotFoundError where redis-server is not installed."""
    exe = shutil.which("redis-server")
    if exe is None:
        raise FileNotFoundError("redis-server is not installed")
    p = spawn([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(directory)])
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return p
        except OSError:
            time.sleep(0.05)
    stop([p])
    raise RuntimeError("redis-server did not start")


def stop(procs: Sequence[subprocess.Popen], grace: float = 20) -> None:
    """SIGTERM to each process group, then SIGKILL for whatever has not exited after `grace` s."""
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(grace)
        except subprocess.TimeoutExpired:
            print(f"process {p.args!r:.80} ignored SIGTERM for {grace:g} s; killing it", file=sys.stderr)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)
