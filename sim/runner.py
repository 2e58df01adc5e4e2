"""Run one workload under several policy combinations (the engine of `slogate simulate`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from predictors.length import make_estimator
from router.latency import DEFAULT_PROFILE, PROFILES
from router.registry import parse_combo
from router.scheduler import Scheduler
from sim.cluster import ClusterSim, EngineConfig
from sim.report import result_row
from sim.workload import build_workload, load_trace, load_workflows, parse_tiers, parse_weights


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
    max_batched_tokens: int = 512
    frame_s: float = 0.3

    def describe(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["trace"] = Path(self.trace).name
        d["workflows"] = Path(self.workflows).name if self.workflows else None
        return d


class Experiment:
    """Loads the trace once; each `run(combo)` builds a fresh workload copy and simulator."""

    def __init__(self, cfg: SimConfig) -> None:
        if cfg.profile not in PROFILES:
            raise ValueError(f"unknown profile {cfg.profile!r}; known: {', '.join(PROFILES)}")
        self.cfg = cfg
        self.rows = load_trace(cfg.trace)
        self.workflows = load_workflows(cfg.workflows) if cfg.workflows else None
        self.mix = parse_weights(cfg.mix)
        self.tiers = parse_tiers(cfg.tiers)
        make_estimator(cfg.predictor, [1], cfg.seed)  # validate the name early

    def workload(self):  # type: ignore[no-untyped-def]
        c = self.cfg
        return build_workload(self.rows, self.mix, self.tiers, self.workflows, c.slo_scale, c.rate_scale, c.duration_s, c.max_requests, c.seed)

    def run(self, combo: str) -> dict[str, Any]:
        parse_combo(combo)
        c = self.cfg
        wl = self.workload()
        est = make_estimator(c.predictor, wl.output_lengths, c.seed)
        engine = EngineConfig(PROFILES[c.profile], budget=c.budget, max_batched_tokens=c.max_batched_tokens)
        sim = ClusterSim(wl, Scheduler.from_combo(combo, seed=c.seed), est, engine, n_replicas=c.replicas, frame_s=c.frame_s,
                         stage_estimate="oracle" if c.predictor == "oracle" else "uniform")
        row = result_row(sim.run())
        row["requests"] = wl.n_requests
        return row
