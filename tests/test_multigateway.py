"""Several gateway processes sharing Redis act as one: no replica ever gets more than its budget
(checked on the engines' side), and load spreads over the replicas. Then Redis dies mid-run."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from slogate.testing.ports import free_port
from slogate.testing.procs import slogate, stop, wait_http
from slogate.testing.procs import start_redis as spawn_redis
from slogate.testing.prom import gauge

MODEL = "sim-model"
BUDGET = 4


def start_redis(port: int, d: Path) -> subprocess.Popen[bytes]:
    try:
        return spawn_redis(port, d)
    except FileNotFoundError:
        pytest.skip("redis-server is not installed")


@pytest.fixture
def own_redis(tmp_path: Path):
    """A redis-server this test may kill and restart on the same port."""
    port = free_port()
    holder = {"proc": start_redis(port, tmp_path), "port": port}
    yield holder
    holder["proc"].terminate()
    holder["proc"].wait(timeout=10)


@pytest.fixture
def cluster(request, tmp_path: Path, redis_url: str):
    if "own_redis" in request.fixturenames:
        redis_url = f"redis://127.0.0.1:{request.getfixturevalue('own_redis')['port']}/0"
    procs: list[subprocess.Popen[bytes]] = []
    engines, gateways = [], []
    try:
        for _ in range(2):
            p = free_port()
            procs.append(slogate("engine", "--port", str(p), "--model", MODEL, "--fixed-ttft-ms", "20", "--fixed-itl-ms", "10"))
            engines.append(f"http://127.0.0.1:{p}")
        cfg = tmp_path / "gw.yaml"
        prefix = f"mg{os.getpid()}{time.monotonic_ns()}"
        cfg.write_text("backends:\n" + "".join(f"  - {{url: {u}, models: [{MODEL}], budget: {BUDGET}}}\n" for u in engines)
                       + f"state: {{kind: redis, url: '{redis_url}', prefix: {prefix}, sync_s: 0.05, lease_s: 5}}\n"
                       + "health_interval_s: 0.5\n")
        for _ in range(3):
            p = free_port()
            procs.append(slogate("serve", "--config", str(cfg), "--port", str(p), "--log-level", "warning"))
            gateways.append(f"http://127.0.0.1:{p}")
        for u in engines + gateways:
            wait_http(f"{u}/health", 30)
        yield engines, gateways
    finally:
        stop(procs, grace=15)  # a process that ignores SIGTERM is reported (the reliability suite) and killed


async def drive(gateways: list[str], n: int, concurrency: int) -> dict[int, int]:
    codes: dict[int, int] = {}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "ignore_eos": True,
            "slo": {"deadline_ms": 120000, "waiting_ms": 120000}}
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=concurrency + 10)) as c:
        async def one(i: int) -> None:
            async with sem:
                try:
                    r = await c.post(f"{gateways[i % len(gateways)]}/v1/chat/completions", json=body)
                    codes[r.status_code] = codes.get(r.status_code, 0) + 1
                except httpx.HTTPError as e:
                    codes[-1] = codes.get(-1, 0) + 1
                    print("client error:", type(e).__name__, e)
        await asyncio.gather(*(one(i) for i in range(n)))
    return codes


def test_three_gateways_never_exceed_any_budget(cluster) -> None:
    engines, gateways = cluster
    codes = asyncio.run(drive(gateways, 5000, 48))
    assert codes == {200: 5000}
    peaks = [gauge(e, "slogate_sim_peak_requests") for e in engines]
    assert max(peaks) <= BUDGET, peaks  # 48 clients, 3 gateways, yet never more than 4 on a replica
    assert min(peaks) == BUDGET  # and the budgets were used
    done = [gauge(e, "slogate_sim_finished_total") for e in engines]
    assert sum(done) >= 5000 and min(done) >= 0.35 * sum(done), done  # load spread as one gateway would
    assert all(gauge(g, "slogate_gateways") == 3 for g in gateways)


def test_redis_dies_mid_run_and_comes_back(own_redis, cluster, tmp_path: Path) -> None:
    engines, gateways = cluster

    async def scenario() -> tuple[dict[int, int], float]:
        run = asyncio.create_task(drive(gateways, 3000, 48))
        await asyncio.sleep(2.0)
        own_redis["proc"].kill()  # Redis dies under load
        own_redis["proc"].wait()
        await asyncio.sleep(3.0)
        degraded = [gauge(g, "slogate_state_degraded") for g in gateways]
        assert degraded == [1.0, 1.0, 1.0]
        own_redis["proc"] = start_redis(own_redis["port"], tmp_path)  # ... and comes back
        t_back = time.monotonic()
        while any(gauge(g, "slogate_state_degraded") for g in gateways):
            assert time.monotonic() - t_back < 10, "gateways did not recover within 10 s"
            await asyncio.sleep(0.1)
        recovered = time.monotonic() - t_back
        return await run, recovered

    codes, recovered = asyncio.run(scenario())
    assert codes == {200: 3000}, codes  # nothing lost: every request completed
    assert recovered < 10
    peaks = [gauge(e, "slogate_sim_peak_requests") for e in engines]
    # Known gap (noted on issue 5): in about one run in six a replica is seen with one request over
    # its budget somewhere across the outage and recovery; the local-share fallback bounds it at one.
    assert max(peaks) <= BUDGET + 1, peaks


def test_sigterm_to_one_gateway_loses_nothing_and_releases_its_claims(tmp_path: Path, redis_url: str) -> None:
    """Two gateways share Redis under streaming load; one gets SIGTERM (a rolling update). Its
    streams finish, its claims go back at once, and the other gateway takes the traffic (the
    client moves on after a refused connection, as a load balancer does)."""
    import openai
    import redis

    procs: list[subprocess.Popen[bytes]] = []
    try:
        engines = []
        for _ in range(2):
            p = free_port()
            procs.append(slogate("engine", "--port", str(p), "--model", MODEL, "--fixed-ttft-ms", "20", "--fixed-itl-ms", "20"))
            engines.append(f"http://127.0.0.1:{p}")
        prefix = f"term{os.getpid()}{time.monotonic_ns()}"
        cfg = tmp_path / "gw.yaml"
        cfg.write_text("backends:\n" + "".join(f"  - {{url: {u}, models: [{MODEL}], budget: {BUDGET}}}\n" for u in engines)
                       + f"state: {{kind: redis, url: '{redis_url}', prefix: {prefix}, sync_s: 0.05, lease_s: 30}}\n"
                       + "health_interval_s: 0.5\nmax_queue: 5000\n"
                       # 12 closed-loop streams on 8 slots shared by two gateways: on the default SLO's
                       # 1 s first token, a stream that waits too long for a slot is rightly refused
                       # (429); this test is about a rolling update losing nothing, so its load is patient.
                       + "slo: {default: {ttft_ms: 30000}}\n")
        gws, urls = [], []
        for _ in range(2):
            p = free_port()
            gws.append(slogate("serve", "--config", str(cfg), "--port", str(p), "--log-level", "warning"))
            urls.append(f"http://127.0.0.1:{p}")
        procs += gws
        for u in engines + urls:
            wait_http(f"{u}/health", 30)
        r = redis.Redis.from_url(redis_url)

        async def scenario() -> tuple[list[str], int, int, float]:
            clients = [openai.AsyncOpenAI(base_url=f"{u}/v1", api_key="x", max_retries=0, timeout=120) for u in urls]
            errors: list[str] = []
            moved = 0
            sem = asyncio.Semaphore(12)

            async def one(i: int) -> None:
                nonlocal moved
                async with sem:
                    for c in (clients[i % 2], clients[1]):
                        try:
                            s = await c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"q{i}"}], stream=True,
                                                                max_tokens=40, extra_body={"ignore_eos": True})
                        except openai.APIConnectionError:
                            moved += 1  # the gateway is gone: next one (nothing was sent to an engine)
                            continue
                        try:
                            text = "".join([ch.choices[0].delta.content or "" async for ch in s if ch.choices])
                            if len(text.split()) != 40:
                                errors.append(f"{i}: {len(text.split())} tokens")
                        except Exception as e:  # a stream cut mid-answer is a lost request
                            errors.append(f"{i}: {type(e).__name__}: {e}")
                        return
                    errors.append(f"{i}: no gateway took it")

            load = asyncio.gather(*(one(i) for i in range(300)))
            await asyncio.sleep(3)
            held = sum(r.hlen(f"{prefix}:inflight:{u}") for u in engines)
            before = {m.decode() for m in r.zrange(f"{prefix}:gateways", 0, -1)}
            gws[0].send_signal(signal.SIGTERM)
            await asyncio.to_thread(gws[0].wait, 30)
            # Right after it exits: none of its claims is left (the lease is 30 s), and it left the set
            # of gateways, so the survivor's share of each budget is whole again.
            after = {m.decode() for m in r.zrange(f"{prefix}:gateways", 0, -1)}
            assert len(before) == 2 and len(after) == 1, "the stopped gateway is still counted"
            (gone,) = before - after
            left_claims = sum(1 for u in engines for k in r.hkeys(f"{prefix}:inflight:{u}") if k.decode().startswith(gone + ":"))
            await load
            for c in clients:
                await c.close()
            return errors, moved, held, left_claims

        errors, moved, held, left_claims = asyncio.run(scenario())
        assert gws[0].returncode in (0, -signal.SIGTERM)  # uvicorn re-raises the signal after a graceful shutdown
        assert errors == [], errors[:5]
        assert held > 0 and moved > 0  # it was busy when told to stop, and traffic did move
        assert left_claims == 0
        assert sum(r.hlen(f"{prefix}:inflight:{u}") for u in engines) == 0  # and the survivor's are back too, at the end
    finally:
        stop(procs)
