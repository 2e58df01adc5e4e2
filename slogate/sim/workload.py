"""Workloads for the simulator: arrival traces, agent workflows, an SLO mix and tiers.

A trace row (`arrival_s,input_tokens,output_tokens`) becomes one request whose SLO class
is drawn from the mix. Compound rows start a workflow from `workflows_*.jsonl` instead, but
only every k-th one (k = mean calls per workflow) so compound *calls* make up about their
share of the calls. Arrivals are compressed by `rate_scale`; workflow tool gaps are not
(tools do not get faster when traffic grows).
"""

from __future__ import annotations

import csv
import json
import random
from dataclasses import dataclass, field
from pathlib import Path

from slogate.predictors.pattern_graph import StageNode, call_label, stage_shares, stage_summary, workflow_graph
from slogate.router.request import SLO, SLOClass, Tier

# JITServe evaluation SLOs (P95 of 1k DeepSeek API calls): TTFT 2 s, TBT 100 ms,
# deadline 20 s, compound 20 s × number of stages. Best effort gets a long default deadline.
DEFAULT_TTFT_S, DEFAULT_TBT_S, DEFAULT_DEADLINE_S, STAGE_DEADLINE_S = 2.0, 0.1, 20.0, 20.0
BEST_EFFORT_DEADLINE_S = 600.0


@dataclass(slots=True)
class TraceRow:
    arrival: float
    input_tokens: int
    output_tokens: int
    prefix: tuple[int, ...] = ()  # chained block hashes of the prompt (prefix traces)


@dataclass(slots=True)
class Call:
    call_id: int
    stage: int
    input_tokens: int
    output_tokens: int
    parents: list[int]
    gap_s: float  # non-LLM time after the parents finish
    label: str = ""  # what the call is (phase / kind / the tool it reads), for pattern matching


@dataclass(slots=True)
class WorkflowSpec:
    workflow_id: str
    calls: list[Call]

    @property
    def n_stages(self) -> int:
        return len({c.stage for c in self.calls})

    def stages(self) -> list[StageNode]:
        """Stage super-nodes of this workflow's pattern graph."""
        return stage_summary(workflow_graph(self.calls))

    def stage_shares(self) -> dict[int, float]:
        """φ(s): cumulative share of the workflow's time up to the end of stage s."""
        st = self.stages()
        return {n.stage: float(v) for n, v in zip(st, stage_shares(st), strict=True)}


@dataclass(slots=True)
class Job:
    """One thing that arrives: a single request, or the start of a workflow."""

    arrival: float
    kind: SLOClass
    tier: Tier
    slo: SLO | None = None  # single requests
    input_tokens: int = 0
    output_tokens: int = 0
    prefix: tuple[int, ...] = ()
    workflow: WorkflowSpec | None = None
    wf_deadline_s: float = 0.0
    chosen: bool = True  # its client chose its SLO; false: it sent none and has the built-in default (live: `Resolved`)


@dataclass
class Workload:
    jobs: list[Job] = field(default_factory=list)
    span_s: float = 0.0
    output_lengths: list[int] = field(default_factory=list)  # for the trace-mean predictor
    median_stages: float = 1.0
    workflow_specs: list[WorkflowSpec] = field(default_factory=list)  # the history pattern matching draws on
    tokens_per_block: float = 0.0  # prompt tokens one prefix block stands for (prefix traces)
    workflow_prefix_tokens: int = 0  # >0: each workflow call resends the context so far, in blocks of this many tokens

    @property
    def n_requests(self) -> int:
        return sum(len(j.workflow.calls) if j.workflow else 1 for j in self.jobs)


MOONCAKE_BLOCK = 512  # tokens per hash id in trace_mooncake_conversation_prefix.jsonl


def load_trace(path: str | Path, tokens_per_id: int = MOONCAKE_BLOCK) -> list[TraceRow]:
    """A `trace_*.csv`, or a prefix trace (`*.jsonl`: timestamp ms, input_length, output_length,
    hash_ids of 512-token blocks) with each id scaled to `tokens_per_id` tokens, structure kept."""
    if str(path).endswith(".jsonl"):
        return load_prefix_trace(path, tokens_per_id)
    with open(path, newline="") as f:
        return [TraceRow(float(r["arrival_s"]), int(r["input_tokens"]), max(int(r["output_tokens"]), 1)) for r in csv.DictReader(f)]


def load_prefix_trace(path: str | Path, tokens_per_id: int = MOONCAKE_BLOCK) -> list[TraceRow]:
    scale = tokens_per_id / MOONCAKE_BLOCK
    out = []
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            ids = tuple(int(h) for h in r["hash_ids"])
            n_in = max(round(int(r["input_length"]) * scale), 1)
            out.append(TraceRow(float(r["timestamp"]) / 1000.0, n_in, max(int(r["output_length"]), 1), ids))
    out.sort(key=lambda row: row.arrival)
    return out


def load_workflows(path: str | Path) -> list[WorkflowSpec]:
    out = []
    with open(path) as f:
        for line in f:
            w = json.loads(line)
            by_id = {int(c["call_id"]): c for c in w["calls"]}
            calls = [
                Call(
                    call_id=int(c["call_id"]),
                    stage=int(c["stage"]),
                    input_tokens=max(int(c["input_tokens"]), 1),
                    output_tokens=max(int(c["output_tokens"]), 1),
                    parents=[int(p) for p in c.get("parent_ids") or []],
                    gap_s=float(c.get("gap_before_s") or c.get("tool_time_s") or 0.0),
                    label=call_label(c, by_id),
                )
                for c in w["calls"]
            ]
            out.append(WorkflowSpec(str(w["workflow_id"]), calls))
    return out


def parse_weights(spec: str) -> dict[str, float]:
    """'latency=1,deadline=1,compound=0' -> {'latency': 1.0, 'deadline': 1.0}: a class with
    weight 0 is left out, as if it were not named."""
    out: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        k, _, v = part.partition("=")
        try:
            w = float(v)
        except ValueError:
            raise ValueError(f"mix entry {part!r}: expected class=weight with a number, e.g. latency=1") from None
        if w < 0:
            raise ValueError(f"mix entry {part!r}: a weight cannot be negative")
        if w > 0:
            out[k.strip()] = w
    if spec.strip() and not out:
        raise ValueError(f"mix {spec!r}: every class has weight 0")
    return out


def parse_tiers(spec: str) -> list[tuple[Tier, float]]:
    """'high=2:0.5,low=1:0.5' -> [(Tier('high', 2), 0.5), (Tier('low', 1), 0.5)]."""
    out = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, _, rest = part.partition("=")
        weight, _, share = rest.partition(":")
        out.append((Tier(name.strip(), float(weight)), float(share or 1.0)))
    return out


def build_workload(
    trace: list[TraceRow],
    mix: dict[str, float],
    tiers: list[tuple[Tier, float]],
    workflows: list[WorkflowSpec] | None = None,
    slo_scale: float = 1.0,
    rate_scale: float = 1.0,
    duration_s: float | None = None,
    max_requests: int | None = None,
    seed: int = 0,
    tokens_per_block: float = 0.0,
) -> Workload:
    rng = random.Random(seed)
    kinds = [SLOClass(k) for k, w in mix.items() if w > 0]
    weights = [mix[k.value] for k in kinds]
    if SLOClass.COMPOUND in kinds and not workflows:
        raise ValueError("the mix has compound requests but no --workflows file was given")
    tier_list, tier_w = [t for t, _ in tiers], [s for _, s in tiers]
    calls_per_wf = sum(len(w.calls) for w in workflows) / len(workflows) if workflows else 1.0
    wl = Workload(tokens_per_block=tokens_per_block)
    if workflows:
        stages = sorted(w.n_stages for w in workflows)
        wl.median_stages = float(stages[len(stages) // 2])
        wl.workflow_specs = list(workflows)
    t0 = trace[0].arrival if trace else 0.0
    compound_rows = 0
    n_calls = 0
    for row in trace:
        at = (row.arrival - t0) / rate_scale
        if duration_s is not None and at > duration_s:
            break
        if max_requests is not None and n_calls >= max_requests:
            break
        kind = rng.choices(kinds, weights)[0]
        tier = rng.choices(tier_list, tier_w)[0]
        wl.output_lengths.append(row.output_tokens)
        if kind is SLOClass.COMPOUND:
            compound_rows += 1
            if compound_rows % max(round(calls_per_wf), 1) != 1 and calls_per_wf > 1:
                continue
            spec = rng.choice(workflows)  # type: ignore[arg-type]
            d = STAGE_DEADLINE_S * spec.n_stages * slo_scale
            wl.jobs.append(Job(at, kind, tier, workflow=spec, wf_deadline_s=d))
            n_calls += len(spec.calls)
            continue
        if kind is SLOClass.LATENCY:
            slo = SLO.latency(DEFAULT_TTFT_S * slo_scale, DEFAULT_TBT_S * slo_scale)
        elif kind is SLOClass.DEADLINE:
            slo = SLO.deadline(DEFAULT_DEADLINE_S * slo_scale)
        else:
            slo = SLO.best_effort(BEST_EFFORT_DEADLINE_S)
        wl.jobs.append(Job(at, kind, tier, slo=slo, input_tokens=row.input_tokens, output_tokens=row.output_tokens, prefix=row.prefix))
        n_calls += 1
    wl.span_s = max((j.arrival for j in wl.jobs), default=0.0)
    return wl
