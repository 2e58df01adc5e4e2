"""Turn a simulation result into the `results.json` row and the table on stdout."""

from __future__ import annotations

from array import array
from typing import Any

import numpy as np

from slogate.sim.cluster import SimResult


def _pct(a: Any, q: float) -> float | None:
    return float(np.percentile(np.frombuffer(a, dtype=np.float64), q)) if len(a) else None


def result_row(res: SimResult) -> dict[str, Any]:
    acc = res.account
    tot = acc.total()
    att = {k: (b.attained / b.units if b.units else None) for k, b in sorted(acc.by_class.items())}
    att["all"] = tot.attained / tot.units if tot.units else None
    return {
        "name": res.name,
        "token_goodput": tot.token_goodput / res.span_s,
        "request_goodput": tot.attained / res.span_s,
        "attained_output_per_s": tot.attained_output / res.span_s,  # output tokens of requests that met their SLO (users' tools)
        "tdg_ratio": tot.tdg / tot.tdg_ideal if tot.tdg_ideal else None,
        "soft_gain": tot.soft / res.span_s,
        "slo_attainment": att,
        "units": {k: b.units for k, b in sorted(acc.by_class.items())},
        "token_goodput_by_class": {k: b.token_goodput / res.span_s for k, b in sorted(acc.by_class.items())},
        "ttft_p50": _pct(res.ttft, 50),
        "ttft_p95": _pct(res.ttft, 95),
        "tbt_p95": _pct(res.tbt, 95),
        "e2e_p50": _pct(res.e2e, 50),
        "throughput_tokens": res.tokens_processed / res.span_s,
        "shed": res.shed,
        "preempted": res.preempted,
        "resume_gap_mean": sum(res.resume_gaps) / len(res.resume_gaps) if res.resume_gaps else None,
        "resume_gap_max": max(res.resume_gaps) if res.resume_gaps else None,
        "engine_preemptions": res.engine_preemptions,
        "by_tier": {k: {"attained": b.attained / b.units if b.units else None, "token_goodput": b.token_goodput / res.span_s} for k, b in sorted(acc.by_tier.items())},
        "horizon_hit": res.horizon_hit,
        "prefix_hit_rate": res.prefix_hits / res.prefix_queries if res.prefix_queries else None,
        "budget_p50": _pct(array("d", res.budget_samples), 50) if res.budget_samples else None,  # learned budgets only
    }
