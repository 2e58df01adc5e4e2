"""Backends that come and go, found through a real DNS server: dnsmasq on a free port serves the
name `engines.test`, one address per simulated engine (127.0.0.2, .3, ... on one port, as pods
behind a headless Service). The fleet scales 2 → 4 → 1 while 200 streams run."""

from __future__ import annotations

import asyncio
import getpass
import hashlib
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import httpx
import openai
import pytest

from slogate.testing.ports import free_port
from slogate.testing.procs import slogate, spawn, stop, wait_http
from slogate.testing.prom import metric

MODEL = "sim-model"
NAME = "engines.test"
ADMIN = "admin-key"
TOKENS = 80


def _dnsmasq() -> str:
    exe = shutil.which("dnsmasq") or ("/usr/sbin/dnsmasq" if os.access("/usr/sbin/dnsmasq", os.X_OK) else None)
    if exe is None:
        pytest.skip("dnsmasq is not installed (.ci/run installs it)")
    return exe


class DNS:
    """dnsmasq answering for `engines.test` from a hosts file; `serve(ips)` rewrites it and HUPs."""

    def __init__(self, tmp: Path) -> None:
        self.hosts = tmp / "hosts"
        self.hosts.write_text("")
        self.port = free_port()
        self.proc = spawn([_dnsmasq(), "--keep-in-foreground", f"--port={self.port}", "--listen-address=127.0.0.1", "--bind-interfaces",
                           "--no-resolv", "--no-hosts", f"--addn-hosts={self.hosts}", "--local-ttl=0", f"--pid-file={tmp / 'dnsmasq.pid'}",
                           f"--user={getpass.getuser()}"])

    def serve(self, ips: list[str]) -> None:
        self.hosts.write_text("".join(f"{ip} {NAME}\n" for ip in ips))
        self.proc.send_signal(signal.SIGHUP)

    def answers(self) -> list[str]:
        import dns.resolver

        r = dns.resolver.Resolver(configure=False)
        r.nameservers, r.port, r.lifetime = ["127.0.0.1"], self.port, 1.0
        try:
            return sorted(a.to_text() for a in r.resolve(NAME, "A"))
        except Exception:
            return []


def _engine(ip: str, port: int) -> subprocess.Popen[bytes]:
    return slogate("engine", "--host", ip, "--port", str(port), "--model", MODEL, "--fixed-ttft-ms", "20", "--fixed-itl-ms", "20")


def _started(ip: str, port: int) -> float:
    """Requests this engine has seen (its peak concurrency is > 0 once one arrived)."""
    return metric(f"http://{ip}:{port}", "slogate_sim_finished_total") + metric(f"http://{ip}:{port}", "slogate_sim_peak_requests")


def _replicas(gw: str) -> list[dict]:
    return httpx.get(f"{gw}/admin/state", headers={"authorization": f"Bearer {ADMIN}"}, timeout=5).json()["replicas"]


async def _streams(gw: str, n: int, concurrency: int, done: list[int], errors: list[str]) -> None:
    client = openai.AsyncOpenAI(base_url=f"{gw}/v1", api_key="none", max_retries=0, timeout=120)
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        async with sem:
            try:
                stream = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"q{i}"}], stream=True,
                                                              max_tokens=TOKENS, extra_body={"ignore_eos": True})
                text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
                if len(text.split()) != TOKENS:
                    errors.append(f"stream {i}: {len(text.split())} tokens")
                done.append(i)
            except Exception as e:
                errors.append(f"stream {i}: {type(e).__name__}: {e}")

    await asyncio.gather(*(one(i) for i in range(n)))
    await client.close()


def test_dns_discovery_scales_2_4_1_under_load(tmp_path: Path) -> None:
    dns_server = DNS(tmp_path)
    port = free_port()
    ips = ["127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5"]
    engines = {ip: _engine(ip, port) for ip in ips}
    procs: list[subprocess.Popen[bytes]] = [dns_server.proc, *engines.values()]
    try:
        for ip in ips:
            wait_http(f"http://{ip}:{port}/v1/models", 60)
        dns_server.serve(ips[:2])
        t0 = time.monotonic()
        while dns_server.answers() != ips[:2]:
            assert time.monotonic() - t0 < 20, "dnsmasq did not come up"
            time.sleep(0.1)
        cfg = tmp_path / "gw.yaml"
        cfg.write_text(f"backends: [{{url: 'dns+http://{NAME}:{port}', models: [{MODEL}], budget: 6}}]\n"
                       f"discovery: {{interval_s: 1, nameservers: ['127.0.0.1:{dns_server.port}']}}\n"
                       f"health_interval_s: 0.5\nmax_queue: 5000\n"
                       # 10 streams on one replica's 6 slots after the scale-down wait a stream's life: past
                       # the built-in default's 1 s first token, where overload refuses them (429; tested in
                       # test_policies.py). This test is about discovery and draining: a patient default.
                       "slo: {default: {ttft_ms: 30000}}\n"
                       f"auth: {{admin_sha256: {hashlib.sha256(ADMIN.encode()).hexdigest()}}}\n")
        gp = free_port()
        gw = f"http://127.0.0.1:{gp}"
        procs.append(slogate("serve", "--config", str(cfg), "--port", str(gp), "--log-level", "info", quiet=False))
        wait_http(f"{gw}/health", 60)
        assert sorted(r["url"] for r in _replicas(gw)) == [f"http://{ip}:{port}" for ip in ips[:2]]

        async def scenario() -> tuple[list[int], list[str], float, list[float]]:
            done: list[int] = []
            errors: list[str] = []
            load = asyncio.create_task(_streams(gw, 200, 10, done, errors))
            await asyncio.sleep(3)
            dns_server.serve(ips)  # scale 2 -> 4
            t_up = time.monotonic()
            while not all([await asyncio.to_thread(_started, ip, port) > 0 for ip in ips[2:]]):
                assert time.monotonic() - t_up < 10, f"new replicas got no traffic within 10 s: {_replicas(gw)}"
                await asyncio.sleep(0.2)
            took = time.monotonic() - t_up
            await asyncio.sleep(2)
            dns_server.serve(ips[:1])  # scale 4 -> 1: three replicas drain and leave mid-stream
            t_down = time.monotonic()
            while len(await asyncio.to_thread(_replicas, gw)) > 1:
                assert time.monotonic() - t_down < 30, f"removed replicas never left: {_replicas(gw)}"
                await asyncio.sleep(0.2)
            # They have left: nothing may reach them any more, though the load goes on.
            after = [await asyncio.to_thread(metric, f"http://{ip}:{port}", "slogate_sim_finished_total") for ip in ips[1:]]
            assert not load.done(), "the load ended before the scale-down: the test proves nothing about draining"
            await load
            final = [metric(f"http://{ip}:{port}", "slogate_sim_finished_total") for ip in ips[1:]]
            assert final == after, "a replica that left still got requests"
            return done, errors, took, final

        done, errors, took, removed_served = asyncio.run(scenario())
        assert errors == [], errors[:5]
        assert len(done) == 200
        assert all(n > 0 for n in removed_served)  # the removed replicas did serve streams, and every one completed
        assert [r["url"] for r in _replicas(gw)] == [f"http://{ips[0]}:{port}"]
        changes = {c: metric(gw, "slogate_replica_changes_total", change=c) for c in ("joined", "draining", "left")}
        assert changes == {"joined": 4, "draining": 3, "left": 3}, changes  # 2 at startup, 2 scaled up
        print(f"new replicas took traffic {took:.1f} s after the DNS change")
    finally:
        stop(procs)
