"""Leave-one-out evaluation of stage time-share estimates (`slogate eval-graphs`)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

from slogate.predictors.pattern_graph import (
    Estimate,
    JITServeCodeMatcher,
    PatternStore,
    StageNode,
    load_workflow_calls,
    stage_shares,
    stage_summary,
    workflow_graph,
)

BUCKETS = ((0, 0), (1, 1), (2, 2), (3, 4), (5, 9), (10, 10**9))


def _bucket(s: int) -> str:
    for lo, hi in BUCKETS:
        if lo <= s <= hi:
            return str(lo) if lo == hi else (f"{lo}-{hi}" if hi < 10**9 else f"{lo}+")
    return "?"


def _uniform(s: int, n_typical: float) -> Estimate:
    return Estimate(min((s + 1) / n_typical, 1.0), 1.0 / n_typical if s + 1 <= n_typical else 0.0, max(n_typical - s - 1, 0.0), 0)


def evaluate_file(path: str | Path, sigma: float = 0.5, top_k: int = 20) -> dict[str, Any]:
    """For every workflow (left out of the store) and every stage s, as stages reveal: error of
    φ̂(s) and of the stage's own time share, for pattern matching, a uniform split over the
    typical stage count, and the JITServe-code matcher."""
    wfs = load_workflow_calls(path)
    store = PatternStore(sigma=sigma, capacity=max(len(wfs), 1), top_k=top_k)
    summaries: dict[str, list[StageNode]] = {}
    for key, calls in wfs:
        store.add(key, calls)
        summaries[key] = stage_summary(workflow_graph(calls))
    jit = JITServeCodeMatcher(store.patterns)
    counts = np.array([len(v) for v in summaries.values()])
    errs: dict[str, dict[str, list[tuple[float, float]]]] = {m: {} for m in ("pattern", "uniform", "jitserve_code")}
    match_s: list[float] = []
    for key, st in summaries.items():
        phi = stage_shares(st)
        share = np.diff(np.concatenate([[0.0], phi]))
        n_typical = float(np.median(counts[[k != key for k in summaries]])) if len(counts) > 1 else float(len(st))
        for s in range(len(st)):
            t0 = time.perf_counter()
            est = store.match(st[:s], st[s], exclude=key)
            match_s.append(time.perf_counter() - t0)
            ests = {"pattern": est or _uniform(s, n_typical), "uniform": _uniform(s, n_typical),
                    "jitserve_code": jit.match(st[:s], st[s], exclude=key) or _uniform(s, n_typical)}
            for m, e in ests.items():
                errs[m].setdefault(_bucket(s), []).append((abs(e.phi - phi[s]), abs(e.share - share[s])))

    def summarise(rows: list[tuple[float, float]]) -> dict[str, float]:
        a = np.asarray(rows)
        return {"n": len(a), "phi_mae": round(float(a[:, 0].mean()), 4), "share_mae": round(float(a[:, 1].mean()), 4)}

    out: dict[str, Any] = {"file": Path(path).name, "workflows": len(wfs), "stages_p50": float(np.median(counts))}
    for m, by in errs.items():
        allrows = [r for v in by.values() for r in v]
        out[m] = {"all": summarise(allrows), "by_revealed_stages": {b: summarise(v) for b, v in sorted(by.items(), key=lambda kv: _order(kv[0]))}}
    out["match_ms_p50"] = round(float(np.median(match_s)) * 1e3, 3)
    return out


def _order(bucket: str) -> int:
    return int(bucket.split("-")[0].rstrip("+"))


def match_latency(paths: list[str | Path], n_graphs: int = 500, queries: int = 300, seed: int = 0) -> dict[str, float]:
    """Matching time with `n_graphs` stored graphs (mixed from the files)."""
    wfs = [w for p in paths for w in load_workflow_calls(p)]
    rng = np.random.default_rng(seed)
    picks = rng.choice(len(wfs), size=min(n_graphs, len(wfs)), replace=False)
    store = PatternStore(capacity=n_graphs)
    for i in picks:
        store.add(*wfs[int(i)])
    qs = [stage_summary(workflow_graph(wfs[int(i)][1])) for i in rng.integers(len(wfs), size=queries)]
    store.match(qs[0][:0], qs[0][0])  # compile once
    ts = []
    for st in qs:
        s = int(rng.integers(len(st)))
        t0 = time.perf_counter()
        store.match(st[:s], st[s])
        ts.append(time.perf_counter() - t0)
    return {"graphs": len(store.patterns), "p50_ms": round(float(np.median(ts)) * 1e3, 3), "p99_ms": round(float(np.quantile(ts, 0.99)) * 1e3, 3)}
