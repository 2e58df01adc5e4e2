"""Live workflow sub-deadlines: the gateway's default (`workflows.stage_deadlines: true`, with a
history of finished workflows) vs every call getting the whole workflow deadline
(`stage_deadlines: false`), on the same arrivals (docs/benchmarks.md, issue 19).

Workflows come from a shared workflow file (default ChatDev): the even-numbered ones are the
history the gateway starts with (`workflows.history`, written scaled to a temporary file), the
odd-numbered ones are replayed, so no workflow is matched against itself. Tokens are divided by
`--token-scale`, non-LLM gaps by `--gap-scale` (both the history and the replay). A workflow
issues its stages in order, a stage's calls side by side after the stage's gap, each call a
chat stream with `max_tokens` = its output, `ignore_eos`, and `workflow: {id, stage,
deadline_ms, label, final}`. Its deadline is `--deadline-factor` × its unloaded time (gaps +
TTFT + output × ITL per stage). Beside them: latency streams (TTFT 1 s, TBT 50 ms; met when the
whole stream came with TTFT and mean TPOT within them) and deadline answers. A workflow meets
its SLO when every call completed and the last ended by its deadline; token goodput counts
output tokens of requests (and whole workflows) that met their SLO, per second of the window.

    python bench/workflows_live.py --scales 1,1.5 --repeats 3 --out bench/results/workflows_live.json
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
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from slogate.predictors.pattern_graph import call_label
from slogate.testing.fleet import MODEL
from slogate.testing.loadgen import stream_once
from slogate.testing.ports import free_port
from slogate.testing.procs import slogate, stop, wait_http

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def load(path: Path, tscale: float, gscale: float) -> list[dict]:
    """Workflows with scaled calls: [{id, calls: [{stage, in, out, gap, label, ...original keys}]}]."""
    out = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        w = json.loads(line)
        by_id = {int(c["call_id"]): c for c in w["calls"]}
        calls = []
        for c in w["calls"]:
            calls.append({"call_id": int(c["call_id"]), "stage": int(c["stage"]), "label": call_label(c, by_id),
                          "input_tokens": max(int(int(c["input_tokens"]) / tscale), 1),
                          "output_tokens": max(int(int(c["output_tokens"]) / tscale), 1),
                          "gap_before_s": min(float(c.get("gap_before_s") or c.get("tool_time_s") or 0.0) / gscale, 20.0)})
        out.append({"id": str(w["workflow_id"]), "calls": calls})
    return out


def write_history(wfs: list[dict], path: Path) -> None:
    with path.open("w") as f:
        for w in wfs:
            f.write(json.dumps({"workflow_id": w["id"], "calls": [{**c, "phase": c["label"]} for c in w["calls"]]}) + "\n")


def stages(w: dict) -> list[list[dict]]:
    by: dict[int, list[dict]] = {}
    for c in w["calls"]:
        by.setdefault(c["stage"], []).append(c)
    return [by[s] for s in sorted(by)]


def ideal_s(w: dict, a: argparse.Namespace) -> float:
    return sum(max(c["gap_before_s"] for c in st) + a.ttft_ms / 1000 + max(c["output_tokens"] for c in st) * a.itl_ms / 1000
               for st in stages(w))


def arrivals(pool: list[dict], scale: float, a: argparse.Namespace, seed: int) -> list[tuple[float, str, dict | None]]:
    rng = random.Random(seed)
    out: list[tuple[float, str, dict | None]] = []
    for kind, rate in (("workflow", a.wf_rate * scale), ("latency", a.lat_rate * scale), ("deadline", a.dl_rate * scale)):
        t = rng.expovariate(rate)
        while t < a.duration:
            out.append((t, kind, rng.choice(pool) if kind == "workflow" else None))
            t += rng.expovariate(rate)
    return sorted(out, key=lambda x: x[0])


def text(n_tokens: int, tag: str) -> str:
    return (tag + " " + "lorem " * n_tokens)[: 4 * n_tokens]  # the gateway estimates 4 characters per token


async def replay(url: str, arr: list, a: argparse.Namespace) -> list[dict]:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        chat = f"{url}/v1/chat/completions"

        async def workflow(i: int, w: dict) -> dict:
            deadline = a.deadline_factor * ideal_s(w, a)
            start = loop.time()
            st = stages(w)
            tokens, ok, why = 0, True, ""
            for k, calls in enumerate(st):
                await asyncio.sleep(max(c["gap_before_s"] for c in calls))
                bodies = [{"model": MODEL, "messages": [{"role": "user", "content": text(c["input_tokens"], f"wf{i}-{c['call_id']}")}],
                           "max_tokens": c["output_tokens"], "ignore_eos": True, "stream": True,
                           "workflow": {"id": f"wf{i}", "stage": c["stage"], "deadline_ms": deadline * 1000, "label": c["label"],
                                        "final": k == len(st) - 1}} for c in calls]
                rs = await asyncio.gather(*(stream_once(s, chat, b, 600) for b in bodies))
                tokens += sum(r.tokens for r in rs)
                bad = [(r, b) for r, b in zip(rs, bodies, strict=True) if not (r.complete and r.tokens == b["max_tokens"])]
                if bad:
                    r, b = bad[0]
                    ok, why = False, f"stage {k}: status {r.status}, {r.tokens}/{b['max_tokens']} tokens {r.error}"[:200]
                    break
            e2e = loop.time() - start
            return {"kind": "workflow", "tokens": tokens, "ok": ok and e2e <= deadline, "complete": ok, "e2e": e2e, "deadline": deadline, "why": why}

        async def single(kind: str, i: int) -> dict:
            n = a.lat_tokens if kind == "latency" else a.dl_tokens
            slo = {"ttft_ms": 1000, "tbt_ms": 50} if kind == "latency" else {"deadline_ms": a.dl_deadline_s * 1000}
            body = {"model": MODEL, "messages": [{"role": "user", "content": text(200, f"{kind}{i}")}], "max_tokens": n,
                    "ignore_eos": True, "stream": True, "slo": slo}
            r = await stream_once(s, chat, body, 600)
            done = r.complete and r.tokens == n
            if kind == "latency":
                ttft = (r.first_token or r.ended) - r.started
                tpot = (r.ended - (r.first_token or r.ended)) / max(r.tokens - 1, 1)
                ok = done and ttft <= 1.0 and tpot <= 0.05
            else:
                ok = done and r.ended - r.started <= a.dl_deadline_s
            return {"kind": kind, "tokens": r.tokens, "ok": ok, "complete": done, "status": r.status}

        async def one(i: int, at: float, kind: str, w: dict | None) -> dict:
            await asyncio.sleep(max(0.0, t0 + at - loop.time()))
            return await (workflow(i, w) if w is not None else single(kind, i))

        return await asyncio.gather(*(one(i, at, k, w) for i, (at, k, w) in enumerate(arr)))


def summarize(res: list[dict], a: argparse.Namespace) -> dict:
    row: dict = {"goodput": round(sum(r["tokens"] for r in res if r["ok"]) / a.duration, 1)}
    for kind in ("workflow", "latency", "deadline"):
        rs = [r for r in res if r["kind"] == kind]
        row[f"{kind}_n"] = len(rs)
        row[f"{kind}_attainment"] = round(sum(r["ok"] for r in rs) / max(len(rs), 1), 3)
        row[f"{kind}_goodput"] = round(sum(r["tokens"] for r in rs if r["ok"]) / a.duration, 1)
    row["workflows_incomplete"] = sum(not r["complete"] for r in res if r["kind"] == "workflow")
    row["why"] = sorted({r["why"] for r in res if r.get("why")})[:3]
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workflows", type=Path, default=DATA / "workflows_chatdev.jsonl")
    ap.add_argument("--scales", default="1,1.5")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--duration", type=float, default=90.0)
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--budget", type=int, default=4)
    ap.add_argument("--ttft-ms", type=float, default=30.0)
    ap.add_argument("--itl-ms", type=float, default=10.0)
    ap.add_argument("--token-scale", type=float, default=8.0)
    ap.add_argument("--gap-scale", type=float, default=10.0)
    ap.add_argument("--deadline-factor", type=float, default=2.0)
    ap.add_argument("--wf-rate", type=float, default=0.2)
    ap.add_argument("--lat-rate", type=float, default=2.0)
    ap.add_argument("--lat-tokens", type=int, default=150)
    ap.add_argument("--dl-rate", type=float, default=1.0)
    ap.add_argument("--dl-tokens", type=int, default=200)
    ap.add_argument("--dl-deadline-s", type=float, default=10.0)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    wfs = load(a.workflows, a.token_scale, a.gap_scale)
    history, pool = wfs[0::2], wfs[1::2]
    tmp = Path(tempfile.mkdtemp())
    hist = tmp / "history.jsonl"
    write_history(history, hist)
    cfgs = {"stage": {"workflows": {"history": str(hist)}}, "whole": {"workflows": {"stage_deadlines": False}}}
    for name, c in cfgs.items():
        (tmp / f"{name}.yaml").write_text(yaml.safe_dump(c))
    procs, urls = [], []
    for _ in range(a.engines):
        p = free_port()
        procs.append(slogate("engine", "--port", str(p), "--model", MODEL, "--fixed-ttft-ms", str(a.ttft_ms), "--fixed-itl-ms", str(a.itl_ms),
                             "--max-num-seqs", "256"))
        urls.append(f"http://127.0.0.1:{p}")
    for u in urls:
        wait_http(f"{u}/v1/models")
    rows = []
    try:
        for scale in [float(x) for x in a.scales.split(",")]:
            for rep in range(a.repeats):
                arr = arrivals(pool, scale, a, rep)
                for system in (["stage", "whole"] if rep % 2 == 0 else ["whole", "stage"]):
                    port = free_port()
                    gw = slogate("serve", "--port", str(port), "--log-level", "warning", "--budget", str(a.budget),
                                 "--config", str(tmp / f"{system}.yaml"), *[x for u in urls for x in ("--backend", u)])
                    url = f"http://127.0.0.1:{port}"
                    try:
                        wait_http(f"{url}/health")
                        res = asyncio.run(replay(url, arr, a))
                    finally:
                        stop([gw])
                    row = {"scale": scale, "repeat": rep, "system": system, **summarize(res, a)}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    if a.out:
                        a.out.write_text(json.dumps({"config": {k: str(v) for k, v in vars(a).items()}, "rows": rows}, indent=2))
    finally:
        stop(procs)
    print("\n| scale | system | workflow attainment per repeat | latency att. | deadline att. | token goodput per repeat | median goodput |")
    print("|---:|---|---|---|---|---|---:|")
    for scale in sorted({r["scale"] for r in rows}):
        for system in ("stage", "whole"):
            rs = [r for r in rows if r["scale"] == scale and r["system"] == system]
            if not rs:
                continue
            cells = [", ".join(f"{r[k]:.0%}" for r in rs) for k in ("workflow_attainment", "latency_attainment", "deadline_attainment")]
            good = ", ".join(f"{r['goodput']:g}" for r in rs)
            print(f"| {scale:g} | {system} | {' | '.join(cells)} | {good} | {statistics.median(r['goodput'] for r in rs):g} |")

if __name__ == "__main__":
    main()
