"""Run one workload under several policy combinations (the engine of `slogate simulate`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slogate.predictors.length import LengthEstimator, make_estimator
from slogate.router.latency import DEFAULT_PROFILE, PROFILES
from slogate.router.registry import parse_combo
from slogate.router.scheduler import Scheduler
from slogate.sim.bounds import isolation_goodput
from slogate.sim.cluster import ClusterSim, EngineConfig
from slogate.sim.report import result_row
from slogate.sim.workload import build_workload, load_trace, load_workflows, parse_tiers, parse_weights


@dataclass
class SimConfig:
    trace: str
    workflows: str | None = None
    mix: str = "latency=1,deadline=1,compound=1"
    tiers: str = "high=2:0.5,low=1:0.5"
    slo_scale: float = 1.0
    replicas: int = 8
    rate_scale: float = 1.0
    duration_s: float | None = None
    max_requests: int | None = None
    predictor: str = "mean"
    seed: int = 0
    profile: str = DEFAULT_PROFILE
    budget: int = 48
    learn_budget: bool = False  # learned per-replica budgets, as `slogate serve` runs them (budget: the cap)
    max_batched_tokens: int = 512
    frame_s: float = 0.3
    predictor_model: str | None = None  # for predictor "qrf": a `slogate train-predictor` file
    prompts: str | None = None  # for "qrf": comma-separated prompts_*.jsonl to pair requests with
    stage_estimate: str | None = None  # whole | uniform | pattern | oracle; default: oracle with the oracle predictor, else pattern
    tokens_per_id: int = 512  # prefix traces: prompt tokens per block hash id
    prefix_index: bool = True  # the gateway's prefix index (prefix traces)
    kv_capacity_tokens: int = 400_000  # each engine's KV cache (and so its prefix cache)
    workflow_prefix_tokens: int = 0  # >0: workflow calls resend the context so far (prefix caching), blocks of this many tokens

    def prompt_files(self) -> list[str]:
        """Explicit --prompts, else every prompts_*.jsonl beside the trace."""
        if self.prompts:
            return [p.strip() for p in self.prompts.split(",") if p.strip()]
        return sorted(str(p) for p in Path(self.trace).parent.glob("prompts_*.jsonl"))

    def describe(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["trace"] = Path(self.trace).name
        d["workflows"] = Path(self.workflows).name if self.workflows else None
        d["predictor_model"] = Path(self.predictor_model).name if self.predictor_model else None
        d["prompts"] = ",".join(Path(p).name for p in self.prompt_files()) if self.predictor == "qrf" else None
        return d


class Experiment:
    """Loads the trace once; each `run(combo)` builds a fresh workload copy and simulator."""

    def __init__(self, cfg: SimConfig) -> None:
        if cfg.profile not in PROFILES:
            raise ValueError(f"unknown profile {cfg.profile!r}; known: {', '.join(PROFILES)}")
        self.cfg = cfg
        self.rows = load_trace(cfg.trace, cfg.tokens_per_id)
        self.tokens_per_block = float(cfg.tokens_per_id) if any(r.prefix for r in self.rows[:100]) else 0.0
        self.workflows = load_workflows(cfg.workflows) if cfg.workflows else None
        self.mix = parse_weights(cfg.mix)
        self.tiers = parse_tiers(cfg.tiers)
        self._qrf: Callable[[int], LengthEstimator] | None = None
        self._bound: dict[tuple[object, ...], dict[str, float]] = {}
        if cfg.predictor == "qrf":  # load the model and prompt pool once for all runs
            if not cfg.predictor_model:
                raise ValueError("--predictor qrf needs a model file (--predictor-model), made by `slogate train-predictor`")
            if not cfg.prompt_files():
                raise ValueError(f"--predictor qrf: no prompts_*.jsonl beside {cfg.trace}; pass --prompts")
            from slogate.predictors.paired import PairedQRF

            self._qrf = PairedQRF.factory(cfg.predictor_model, cfg.prompt_files())  # type: ignore[arg-type]
        else:
            make_estimator(cfg.predictor, [1], cfg.seed)  # validate the name early

    def workload(self):  # type: ignore[no-untyped-def]
        c = self.cfg
        wl = build_workload(self.rows, self.mix, self.tiers, self.workflows, c.slo_scale, c.rate_scale, c.duration_s, c.max_requests, c.seed,
                            tokens_per_block=self.tokens_per_block)
        wl.workflow_prefix_tokens = c.workflow_prefix_tokens
        return wl

    def run(self, combo: str) -> dict[str, Any]:
        """`combo` is ORDERING+PLACEMENT, optionally with `@BUDGET` (e.g. `fcfs+cache-aware@256`: a
        peer router that forwards everything, so only the engines queue), `-noindex` on the
        placement (the gateway without its prefix index) and the ordering's parameters
        (`gmax?lead_factor=0+gorouting`)."""
        c = self.cfg
        asked = combo
        combo, _, b = combo.partition("@")
        index = c.prefix_index and not combo.endswith("-noindex")
        combo = combo.removesuffix("-noindex")
        parse_combo(combo)
        wl = self.workload()
        est = self._qrf(c.seed) if self._qrf else make_estimator(c.predictor, wl.output_lengths, c.seed)
        engine = EngineConfig(PROFILES[c.profile], budget=int(b) if b else c.budget, max_batched_tokens=c.max_batched_tokens,
                              learn_budget=c.learn_budget, prefix_index=index, kv_capacity_tokens=c.kv_capacity_tokens)
        sim = ClusterSim(wl, Scheduler.from_combo(combo, seed=c.seed), est, engine, n_replicas=c.replicas, frame_s=c.frame_s,
                         stage_estimate=c.stage_estimate or ("oracle" if c.predictor == "oracle" else "pattern"))
        row = result_row(sim.run())
        if b or not index:
            row["name"] = f"{row['name']}{'-noindex' if not index else ''}{'@' + b if b else ''}"
        if "?" in asked:  # ordering parameters: the name says which
            row["name"] = asked
        row["requests"] = wl.n_requests
        key = (c.rate_scale, c.slo_scale, c.duration_s, c.max_requests)  # the workload's, not the policy's
        if key not in self._bound:
            self._bound[key] = isolation_goodput(wl, PROFILES[c.profile], c.max_batched_tokens)
        row["ideal_token_goodput"] = self._bound[key]["all"]
        row["ideal_by_class"] = self._bound[key]
        row.update(est.summary())
        return row
