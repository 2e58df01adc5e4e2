"""A mixed run through `slogate serve` (embedded default: gateway + 4 simulated engines).

N requests with Poisson arrivals, sent with the real OpenAI SDK (AsyncOpenAI): latency streams,
deadline requests, best effort and agent-workflow calls, chat / completions / responses. Checks
that every request completed or got a clear OpenAI-shaped error, and that the gateway's
`/metrics` token goodput matches goodput recomputed from the client's own token timestamps.

    python bench/mixed_run.py --requests 2000 --rate 40 --out bench/results/mixed_run.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
import openai

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from slogate.testing import prom
from slogate.testing.ports import free_port

MODEL = "sim-model"


def scrape(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for lab, v in prom.samples(prom.scrape(url), "slogate_token_goodput_total"):
        out[lab["slo_class"]] = out.get(lab["slo_class"], 0.0) + v
    return out


async def one(c: openai.AsyncOpenAI, i: int, rng: random.Random, wf_start: dict[str, float]) -> dict:
    kind = rng.choices(["latency", "deadline", "best_effort", "compound"], [4, 3, 1, 2])[0]
    n_out = int(min(max(rng.lognormvariate(4.3, 0.7), 4), 400))
    msgs = [{"role": "user", "content": f"request {i}: " + "words " * rng.randint(5, 200)}]
    t0 = time.monotonic()
    rec: dict = {"i": i, "kind": kind, "t0": t0}
    try:
        if kind == "latency":
            ttft, tbt = rng.choice([(1.0, 0.05), (2.0, 0.1)])
            rec.update(ttft=ttft, tbt=tbt)
            stream = await c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=n_out, stream=True,
                                                     stream_options={"include_usage": True},
                                                     extra_body={"ignore_eos": True, "slo": {"ttft_ms": ttft * 1e3, "tbt_ms": tbt * 1e3}})
            times = []
            async for ch in stream:
                if ch.choices and ch.choices[0].delta.content:
                    times.append(time.monotonic())
            rec.update(token_times=times, ok=True)
        elif kind == "deadline":
            d = rng.choice([10.0, 20.0])
            api = rng.choice(["chat", "completions", "responses"])
            extra = {"ignore_eos": True, "slo": {"deadline_ms": d * 1e3}}
            if api == "chat":
                r = await c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=n_out, extra_body=extra)
                usage = (r.usage.prompt_tokens, r.usage.completion_tokens)
            elif api == "completions":
                r = await c.completions.create(model=MODEL, prompt=msgs[0]["content"], max_tokens=n_out, extra_body=extra)
                usage = (r.usage.prompt_tokens, r.usage.completion_tokens)
            else:
                r = await c.responses.create(model=MODEL, input=msgs[0]["content"], max_output_tokens=n_out, extra_body=extra)
                usage = (r.usage.input_tokens, r.usage.output_tokens)
            rec.update(deadline=d, t_end=time.monotonic(), usage=usage, ok=True)
        elif kind == "best_effort":
            r = await c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=n_out,
                                                extra_body={"ignore_eos": True, "slo": {"kind": "best_effort"}})
            rec.update(deadline=600.0, t_end=time.monotonic(), usage=(r.usage.prompt_tokens, r.usage.completion_tokens), ok=True)
        else:
            wf = f"wf-{i // 3}"
            wf_start.setdefault(wf, t0)
            r = await c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=n_out,
                                                extra_body={"ignore_eos": True, "workflow": {"id": wf, "stage": i % 3, "deadline_ms": 60_000}})
            rec.update(deadline_at=wf_start[wf] + 60.0, t_end=time.monotonic(), usage=(r.usage.prompt_tokens, r.usage.completion_tokens), ok=True)
    except openai.APIStatusError as e:
        rec.update(ok=False, status=e.status_code, error=(e.body or {}).get("message") if isinstance(e.body, dict) else str(e.body))
    except openai.APIError as e:
        rec.update(ok=False, status=None, error=str(e))
    return rec


def client_goodput(recs: list[dict]) -> dict[str, float]:
    g: dict[str, float] = Counter()
    for r in recs:
        if not r.get("ok"):
            continue
        if r["kind"] == "latency":
            g["latency"] += sum(1 for k, t in enumerate(r["token_times"]) if t <= r["t0"] + r["ttft"] + k * r["tbt"])
        elif r["kind"] == "compound":
            g["compound"] += sum(r["usage"]) if r["t_end"] <= r["deadline_at"] else 0
        else:
            g[r["kind"]] += sum(r["usage"]) if r["t_end"] <= r["t0"] + r["deadline"] else 0
    return dict(g)


async def drive(url: str, n: int, rate: float, seed: int) -> list[dict]:
    rng = random.Random(seed)
    c = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300,
                           http_client=openai.DefaultAsyncHttpxClient(limits=httpx.Limits(max_connections=2000, max_keepalive_connections=200)))
    wf_start: dict[str, float] = {}
    tasks = []
    for i in range(n):
        tasks.append(asyncio.create_task(one(c, i, random.Random(rng.random()), wf_start)))
        await asyncio.sleep(rng.expovariate(rate))
    return list(await asyncio.gather(*tasks))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--rate", type=float, default=40.0, help="arrivals per second (Poisson)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    port = free_port()
    log = os.environ.get("BENCH_GATEWAY_LOG")  # e.g. "debug:/tmp/gw.log": the learner's decisions, to a file
    level, _, path = (log or "warning").partition(":")
    err = open(path, "w") if path else None  # noqa: SIM115 (closed once the gateway has exited)
    gw = subprocess.Popen(["slogate", "serve", "--port", str(port), "--log-level", level], stdout=subprocess.DEVNULL,
                          stderr=err or subprocess.PIPE, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(200):
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        t0 = time.monotonic()
        recs = asyncio.run(drive(url, a.requests, a.rate, a.seed))
        wall = time.monotonic() - t0
        time.sleep(0.5)
        server = scrape(url)
        client = client_goodput(recs)
        outcomes = Counter("completed" if r["ok"] else f"error {r.get('status')}" for r in recs)
        unclear = [r for r in recs if not r["ok"] and not r.get("error")]
        tot_s, tot_c = sum(server.values()), sum(client.values())
        errors = Counter(f"{r.get('status')}: {str(r.get('error'))[:120]}" for r in recs if not r["ok"])
        summary = {"requests": len(recs), "wall_s": round(wall, 1), "outcomes": dict(outcomes), "unclear_errors": len(unclear),
                   "errors": dict(errors.most_common(5)),
                   "server_goodput": {k: round(v) for k, v in server.items()}, "client_goodput": {k: round(v) for k, v in client.items()},
                   "total_server": round(tot_s), "total_client": round(tot_c),
                   "relative_difference": round(abs(tot_s - tot_c) / max(tot_c, 1.0), 4)}
        print(json.dumps(summary, indent=1))
        if a.out:
            a.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(a).items()}, "summary": summary}, indent=1))
    finally:
        os.killpg(gw.pid, signal.SIGTERM)
        gw.wait(timeout=15)
        if err is not None:
            err.close()


if __name__ == "__main__":
    main()
