"""Discrete-event simulation of N engine replicas behind one slogate gateway queue.

The gateway side is exactly the live decision core: `router.Scheduler` is called on
arrivals and completions (when a slot is free) and on every frame tick Δ, and its
decisions are carried out here — dispatch to an engine, shed (a 429 in the live gateway),
or preempt (abort upstream and requeue; generated tokens are kept and re-prefilled).
The gateway only sees what a real gateway sees: token arrival times per request.
"""

from __future__ import annotations

import heapq
import itertools
from array import array
from dataclasses import dataclass, field

from slogate.predictors.length import LengthEstimator
from slogate.predictors.pattern_graph import PatternStore, StageNode
from slogate.router.capacity import LearnerKnobs, learned_budget, waiting_demand
from slogate.router.goodput import GoodputAccount, RequestLedger, WorkflowLedger
from slogate.router.latency import BatchLatencyModel, LatencyCoeffs
from slogate.router.lifecycle import Lifecycle, call_goodput
from slogate.router.prefix import PrefixCache
from slogate.router.request import SLO, Request, Tier, Workflow
from slogate.router.scheduler import Scheduler
from slogate.router.view import ReplicaView
from slogate.sim.engine import EngineSim, Seq
from slogate.sim.workload import Call, Job, WorkflowSpec, Workload

ARRIVE, STEP, TICK = 0, 1, 2


@dataclass
class EngineConfig:
    coeffs: LatencyCoeffs
    max_num_seqs: int = 256
    max_batched_tokens: int = 512
    kv_capacity_tokens: int = 400_000
    budget: int = 48  # gateway's per-replica concurrency budget
    speed_factors: list[float] | None = None  # per-replica slowdown (heterogeneous fleet)
    learn_budget: bool = False  # the live gateway's learned budgets (router/capacity.py), `budget` the cap
    capacity: LearnerKnobs = field(default_factory=LearnerKnobs)  # the gateway's `capacity:` knobs, as it runs them
    prefix_index: bool = True  # the gateway tracks where each replica's prefix cache is (prefix workloads)


@dataclass
class _WfRun:
    spec: WorkflowSpec
    wf: Workflow
    ledger: WorkflowLedger
    tier: Tier
    phi: dict[int, float]
    done: set[int] = field(default_factory=set)
    issued: set[int] = field(default_factory=set)
    finish_at: dict[int, float] = field(default_factory=dict)
    ideal_tdg: float = 0.0
    context: tuple[int, ...] = ()  # block ids of the context so far (workflow prefix caching)


@dataclass
class SimResult:
    name: str
    account: GoodputAccount
    span_s: float
    ttft: array
    tbt: array
    e2e: array
    tokens_processed: int
    shed: int
    preempted: int
    engine_preemptions: int
    decisions: int
    horizon_hit: bool
    budget_samples: list[int] = field(default_factory=list)  # the fleet's learned budget, once per update
    prefix_hits: int = 0  # prompt tokens the engines found in their prefix caches
    prefix_queries: int = 0
    # Each single request that finished: (arrival, first token, finish, tokens), for users' tools' rules
    finished: list[tuple[float, float, float, int]] = field(default_factory=list)
    # The pause each preempted answer's reader saw: its last token before, its first after
    resume_gaps: array = field(default_factory=lambda: array("d"))


class ClusterSim:
    def __init__(
        self,
        workload: Workload,
        scheduler: Scheduler,
        estimator: LengthEstimator,
        engine: EngineConfig,
        n_replicas: int = 8,
        frame_s: float = 0.3,
        stage_estimate: str = "uniform",
        drain_s: float = 600.0,
    ) -> None:
        self.wl = workload
        self.sched = scheduler
        self.est = estimator
        self.frame_s = frame_s
        if stage_estimate not in ("whole", "uniform", "pattern", "oracle"):
            raise ValueError(f"unknown stage estimate {stage_estimate!r}; known: whole, uniform, pattern, oracle")
        self.stage_estimate = stage_estimate
        self.patterns: PatternStore | None = None
        self._stages: dict[str, list[StageNode]] = {}
        self.horizon = workload.span_s + drain_s
        factors = engine.speed_factors or [1.0] * n_replicas
        self.engines = [
            EngineSim(i, BatchLatencyModel(engine.coeffs.scaled(factors[i % len(factors)])), engine.max_num_seqs, engine.max_batched_tokens, engine.kv_capacity_tokens)
            for i in range(n_replicas)
        ]
        # The gateway's estimator starts from the nominal profile and learns β online.
        self.views = [ReplicaView(i, BatchLatencyModel(engine.coeffs), budget=engine.budget) for i in range(n_replicas)]
        self.lifecycle = Lifecycle(scheduler.ordering, self.views)  # the same steps the live gateway takes
        per_block = workload.tokens_per_block or workload.workflow_prefix_tokens
        if engine.prefix_index and per_block:
            blocks = max(int(engine.kv_capacity_tokens // per_block), 1)
            for v in self.views:
                v.cache = PrefixCache(blocks)
        # Learned budgets as the live gateway runs them: per-token gaps charged to everything the
        # replica holds, re-decided once a second against the streams' affordable pace.
        self.learners = None
        if engine.learn_budget:
            self.learners = [engine.capacity.learner(engine.budget) for _ in range(n_replicas)]
            scheduler.at_risk_s = engine.capacity.overdraft_within_s  # the gateway's side of lending (Scheduler's at_risk_s)
            scheduler.absorb, scheduler.absorb_by = engine.capacity.absorb, engine.capacity.absorb_by
            scheduler.absorb_beside_deadlines = engine.capacity.absorb_beside_deadlines
        for v, lr in zip(self.views, self.learners or (), strict=False):
            v.budget = lr.budget
        self.budget_samples: list[int] = []
        self.account = GoodputAccount()
        self.waiting: dict[int, Request] = {}
        self.seqs: dict[int, Seq] = {}
        self.ledgers: dict[int, RequestLedger] = {}
        self.true_len: dict[int, int] = {}
        self.wf_of: dict[int, tuple[_WfRun, Call]] = {}
        self.runs: list[_WfRun] = []
        self.events: list[tuple[float, int, int, object]] = []
        self._seq = itertools.count()
        self._rid = itertools.count()
        self._block = itertools.count(1 << 40)  # block ids of workflow contexts (apart from any trace's)
        self.ttft, self.tbt, self.e2e = array("d"), array("d"), array("d")
        self.resume_gaps = array("d")
        self.finished: list[tuple[float, float, float, int]] = []
        self.tokens_processed = 0
        self.shed = 0
        self._shed_seen = 0  # of `shed`, what the learners were told (`_update_budgets`)
        self._claims_seen = 0  # of the requests placed (the views' claims), the same
        self.preempted = 0
        self.decisions = 0
        self.now = 0.0

    # -- event plumbing ------------------------------------------------------------------------
    def _push(self, t: float, kind: int, payload: object) -> None:
        heapq.heappush(self.events, (t, next(self._seq), kind, payload))

    def run(self) -> SimResult:
        for job in self.wl.jobs:
            self._push(job.arrival, ARRIVE, job)
        self._push(0.0, TICK, None)
        horizon_hit = False
        while self.events:
            t, _, kind, payload = heapq.heappop(self.events)
            if t > self.horizon:
                horizon_hit = True
                break
            self.now = t
            if kind == STEP:
                self._on_step(payload)  # type: ignore[arg-type]
                if self.learners is not None and any(lr.quick for lr in self.learners):
                    self._update_budgets(sample=False)  # slow start / out of reach may double between frames, as live (router/capacity.py)
            elif kind == ARRIVE:
                self._on_arrival(payload)  # type: ignore[arg-type]
            else:
                if self.learners is not None:
                    self._update_budgets()
                self._schedule()
                if self.waiting or any(e.busy for e in self.engines) or self.events:
                    self._push(t + self.frame_s, TICK, None)
        self._settle_leftovers()
        return SimResult(
            name=self.sched.name,
            account=self.account,
            span_s=max(self.wl.span_s, 1e-9),
            ttft=self.ttft,
            tbt=self.tbt,
            e2e=self.e2e,
            tokens_processed=self.tokens_processed,
            shed=self.shed,
            preempted=self.preempted,
            engine_preemptions=sum(e.preemptions for e in self.engines),
            decisions=self.decisions,
            horizon_hit=horizon_hit,
            budget_samples=self.budget_samples,
            prefix_hits=sum(e.prefix_hits for e in self.engines),
            prefix_queries=sum(e.prefix_queries for e in self.engines),
            finished=self.finished,
            resume_gaps=self.resume_gaps,
        )

    # -- arrivals --------------------------------------------------------------------------------
    def _on_arrival(self, item: Job | tuple[_WfRun, Call]) -> None:
        if isinstance(item, Job):
            if item.workflow is not None:
                self._start_workflow(item)
                return
            assert item.slo is not None
            req = Request(next(self._rid), self.now, item.input_tokens, item.slo, tier=item.tier, tenant=item.tier.name,
                          prefix=item.prefix, tokens_per_block=self.wl.tokens_per_block, tbt_chosen=item.chosen, ttft_chosen=item.chosen)
            self._admit(req, item.output_tokens)
        else:
            run, call = item
            if run.wf.failed:
                return
            self._issue_call(run, call)
        if any(v.room for v in self.views):
            self._schedule()

    def _admit(self, req: Request, true_len: int) -> None:
        self.true_len[req.rid] = true_len
        self.est.annotate(req, true_len)
        self.ledgers[req.rid] = RequestLedger(req)
        self.waiting[req.rid] = req

    def _start_workflow(self, job: Job) -> None:
        spec = job.workflow
        assert spec is not None
        wf = Workflow(f"{spec.workflow_id}#{next(self._seq)}", self.now, self.now + job.wf_deadline_s)
        if self.stage_estimate == "oracle":
            phi = spec.stage_shares()
        elif self.stage_estimate in ("pattern", "whole"):
            phi = {}  # pattern: matched stage by stage as the workflow reveals itself (_stage_phi); whole: every call gets the workflow deadline
        else:  # uniform split over the typical number of stages seen in history
            phi = self._uniform_phi(spec)
        run = _WfRun(spec, wf, WorkflowLedger(wf, job.tier.weight), job.tier, phi)
        run.ideal_tdg = job.tier.weight * sum(c.output_tokens for c in spec.calls)
        self.runs.append(run)
        for c in spec.calls:
            if not c.parents:
                self._push(self.now + c.gap_s, ARRIVE, (run, c))
                run.issued.add(c.call_id)

    def _uniform_phi(self, spec: WorkflowSpec) -> dict[int, float]:
        n = max(self.wl.median_stages, 1.0)
        return {s: min((k + 1) / n, 1.0) for k, s in enumerate(sorted({c.stage for c in spec.calls}))}

    def _stage_phi(self, run: _WfRun, stage: int) -> float:
        """φ̂(s) from the pattern store, at the first call of stage s: the earlier stages are
        done (their tokens are known), this one's calls and inputs are known, its outputs not.
        The store holds the other workflows of the file (leave-one-out)."""
        if stage not in run.phi:
            if self.patterns is None:
                self.patterns = PatternStore(capacity=max(len(self.wl.workflow_specs), 1))
                for sp in self.wl.workflow_specs:
                    self.patterns.add(sp.workflow_id, sp.calls)
            st = self._stages.get(run.spec.workflow_id)
            if st is None:
                st = self._stages[run.spec.workflow_id] = run.spec.stages()
            k = next((i for i, n in enumerate(st) if n.stage == stage), len(st) - 1)
            est = self.patterns.match(st[:k], st[k], exclude=run.spec.workflow_id)
            prev = max((v for s, v in run.phi.items() if s < stage), default=0.0)
            phi = est.phi if est is not None else self._uniform_phi(run.spec).get(stage, 1.0)
            run.phi[stage] = min(max(phi, prev), 1.0)  # sub-deadlines never move backwards
        return run.phi[stage]

    def _issue_call(self, run: _WfRun, call: Call) -> None:
        phi = self._stage_phi(run, call.stage) if self.stage_estimate == "pattern" else run.phi.get(call.stage, 1.0)
        sub_deadline = run.wf.started_at + phi * (run.wf.deadline_at - run.wf.started_at)
        slo = SLO.compound(max(sub_deadline - self.now, 0.05))
        req = Request(next(self._rid), self.now, call.input_tokens, slo, tier=run.tier, tenant=run.tier.name, workflow=run.wf, stage=call.stage)
        b = self.wl.workflow_prefix_tokens
        if b:  # the call resends the workflow's context so far, then what is new to it
            n = call.input_tokens // b
            keep = run.context[:n]
            req.prefix = keep + tuple(next(self._block) for _ in range(n - len(keep)))
            req.tokens_per_block = float(b)
            run.context = req.prefix + tuple(next(self._block) for _ in range(call.output_tokens // b))
        self.wf_of[req.rid] = (run, call)
        self._admit(req, call.output_tokens)

    # -- scheduling ----------------------------------------------------------------------------------
    def _schedule(self) -> None:
        self.decisions += 1
        self.est.flush()  # one batched prediction for the arrivals and refinements since the last decision
        d = self.sched.schedule(self.now, list(self.waiting.values()), self.views)
        for req, reason in d.shed:
            self._shed(req, reason)
        for req in d.preempt:
            self._preempt(req)
        for req, rid in d.dispatch:
            del self.waiting[req.rid]
            seq = self.seqs.get(req.rid) or Seq(req, self.true_len[req.rid])
            seq.active = True
            self.seqs[req.rid] = seq
            eng = self.engines[rid]
            eng.add(seq)
            self.lifecycle.dispatched(req, self.now)
            if not eng.busy:
                self._start(eng)

    def _update_budgets(self, sample: bool = True) -> None:
        assert self.learners is not None
        now = self.now
        total = 0
        queued = waiting_demand(self.waiting.values()) / len(self.views)
        refused, self._shed_seen = (self.shed - self._shed_seen) / len(self.views), self.shed
        claims = sum(v.claims for v in self.views)
        admitted, self._claims_seen = (claims - self._claims_seen) / len(self.views), claims
        for v, lr in zip(self.views, self.learners, strict=True):
            v.budget = max(1, learned_budget(lr, v, now, queued=queued, refused=refused, admitted=admitted))
            v.overdraft, v.lend_now = lr.overdraft, lr.lend_now
            total += v.budget
        if sample:
            self.budget_samples.append(total)

    def _start(self, eng: EngineSim) -> None:
        dt = eng.start_step(self.now)
        if dt is not None:
            self._push(self.now + dt, STEP, (eng, dt))

    def _shed(self, req: Request, reason: str) -> None:
        self.waiting.pop(req.rid, None)
        req.shed_reason = reason
        self.shed += 1
        self.est.done(req)
        led = self.ledgers.pop(req.rid)
        self.account.settle_request(led, ideal_tokens=self.true_len[req.rid])
        if req.workflow is not None:
            run, _ = self.wf_of.pop(req.rid)
            self._fail_workflow(run)

    def _preempt(self, req: Request) -> None:
        if req.replica is None:
            return
        self.engines[req.replica].abort(req.rid)
        self.lifecycle.preempted(req, self.now)
        self.preempted += 1
        self.waiting[req.rid] = req

    # -- engine steps -------------------------------------------------------------------------------
    def _on_step(self, payload: tuple[EngineSim, float]) -> None:
        eng, dt = payload
        view = self.views[eng.rid]
        n_dec, kv = view.n_decode, view.decode_kv
        emitted = eng.finish_step()
        now = self.now
        freed = False
        tokens = self.lifecycle.tokens
        learner = self.learners[eng.rid] if self.learners is not None else None
        for s in emitted:
            req = s.req
            led = self.ledgers[req.rid]
            led.on_token(now)
            last = req.last_token_at
            gap = tokens(req, 1, now)
            if gap is None:
                if last is not None:  # resumed after a preemption
                    self.resume_gaps.append(now - last)
                else:
                    self.ttft.append(now - req.arrival)
            else:
                self.tbt.append(gap)
                if learner is not None:
                    learner.observe(view.inflight, gap, view.decode_only(now, gap))
            true_len = s.true_len
            if req.generated >= true_len:
                eng.remove(s)
                self._finish(req, led)
                freed = True
            elif req.generated % self.est.refine_every == 0:
                self.est.refine(req, true_len)
        if n_dec:
            view.model.observe(dt, view.model.raw_decode_step_time(n_dec, kv // n_dec * n_dec))
        self._start(eng)
        if freed and self.waiting:
            self._schedule()

    def _finish(self, req: Request, led: RequestLedger) -> None:
        now = self.now
        req.finished_at = now
        self.lifecycle.finished(req, now, call_goodput(led))
        self.est.done(req)
        self.e2e.append(now - req.arrival)
        self.tokens_processed += req.input_tokens + req.generated
        self.seqs.pop(req.rid, None)
        del self.ledgers[req.rid]
        if req.workflow is None:
            self.finished.append((req.arrival, req.first_token_at if req.first_token_at is not None else now, now, req.generated))
            self.account.settle_request(led)
            return
        run, call = self.wf_of.pop(req.rid)
        run.ledger.on_call_done(req.input_tokens, req.generated, now)
        run.wf.tokens_done += req.input_tokens + req.generated
        run.wf.calls_done += 1
        run.done.add(call.call_id)
        run.finish_at[call.call_id] = now
        if len(run.done) == len(run.spec.calls):
            run.ledger.complete = True
            self.account.settle_workflow(run.ledger, run.tier.name, run.ideal_tdg)
            return
        for c in run.spec.calls:
            if c.call_id not in run.issued and all(p in run.done for p in c.parents):
                run.issued.add(c.call_id)
                ready = max((run.finish_at[p] for p in c.parents), default=now)
                self._push(max(ready + c.gap_s, now), ARRIVE, (run, c))

    def _fail_workflow(self, run: _WfRun) -> None:
        if run.wf.failed:
            return
        run.wf.failed = True
        self.account.settle_workflow(run.ledger, run.tier.name, run.ideal_tdg)

    def _settle_leftovers(self) -> None:
        """Requests and workflows still unfinished at the horizon count as missed."""
        for rid, led in list(self.ledgers.items()):
            if rid not in self.wf_of:
                self.account.settle_request(led, ideal_tokens=self.true_len[rid])
        for run in self.runs:
            if not run.ledger.complete:
                self._fail_workflow(run)
