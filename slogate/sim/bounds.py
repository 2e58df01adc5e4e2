"""An upper bound on token goodput: every request served alone on an idle replica.

No policy can beat it, so it tells a goodput ratio that is unreachable apart from one the
scheduler failed to reach: if the bound is B and a baseline earns G, no policy can earn
more than B/G times the baseline. Each call is timed in isolation (chunked prefill, then
one decode per token); a latency token counts if it would be on its timeline, a deadline
request if it would finish by its deadline, a workflow if its critical path of tool gaps
and isolated calls fits its deadline. Contention is ignored, so the bound is loose at
high load: it shows where a target is out of reach, never that one is in reach.
"""

from __future__ import annotations

from collections.abc import Iterator

from slogate.router.latency import BatchLatencyModel, LatencyCoeffs
from slogate.router.request import SLOClass
from slogate.sim.workload import Workload


def token_times(model: BatchLatencyModel, input_tokens: int, output_tokens: int, chunk: int) -> Iterator[float]:
    """Delivery time of each output token of a call running alone, from its arrival: the steps
    `sim.engine.EngineSim` would run for it (prefill chunks, then one decode per token)."""
    t, done = 0.0, 0
    while done < input_tokens:
        n = min(chunk, input_tokens - done)
        t += model.raw_batch_time([(n, done)], [])
        done += n
    yield t
    for i in range(1, output_tokens):
        t += model.raw_batch_time([], [input_tokens + i - 1])  # the KV computed before this token
        yield t


def _alone_s(model: BatchLatencyModel, input_tokens: int, output_tokens: int, chunk: int) -> float:
    return max(token_times(model, input_tokens, output_tokens, chunk))  # times only grow: the last one


def isolation_goodput(wl: Workload, c: LatencyCoeffs, chunk: int = 512) -> dict[str, float]:
    """Token goodput (tokens/s over the workload's span, per class and "all") if every call
    ran alone the moment it arrived."""
    model = BatchLatencyModel(c)
    out = {k.value: 0.0 for k in SLOClass}
    for job in wl.jobs:
        if job.workflow is not None:
            calls = {x.call_id: x for x in job.workflow.calls}
            finish: dict[int, float] = {}
            for call in sorted(calls.values(), key=lambda x: (x.stage, x.call_id)):
                ready = max((finish[p] for p in call.parents if p in finish), default=0.0)
                finish[call.call_id] = ready + call.gap_s + _alone_s(model, call.input_tokens, call.output_tokens, chunk)
            if max(finish.values(), default=0.0) <= job.wf_deadline_s:
                out[SLOClass.COMPOUND.value] += sum(x.input_tokens + x.output_tokens for x in calls.values())
            continue
        slo = job.slo
        assert slo is not None
        if slo.kind is SLOClass.LATENCY:
            ttft, tbt = slo.ttft_s or 0.0, slo.tbt_s or 0.0
            out[slo.kind.value] += sum(
                t <= ttft + i * tbt for i, t in enumerate(token_times(model, job.input_tokens, job.output_tokens, chunk))
            )
        else:
            if _alone_s(model, job.input_tokens, job.output_tokens, chunk) <= (slo.deadline_s or 0.0):
                out[slo.kind.value] += job.input_tokens + job.output_tokens
    span = max(wl.span_s, 1e-9)
    per_s = {k: v / span for k, v in out.items() if v}
    per_s["all"] = sum(out.values()) / span
    return per_s
