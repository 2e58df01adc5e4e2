"""Agent workflows as the gateway sees them: one deadline per workflow id, and each call's stage
sub-deadline from the pattern graphs of finished workflows (JITServe §4.1, the simulator's
`stage_estimate: pattern`).

A call names its workflow, its stage and optionally a label (phase / tool / kind). At the first
call of stage s the stages before it are known (their calls, input and output tokens, and the
non-LLM time before each call: the gap since the previous stage ended), of stage s its calls
and inputs. `PatternStore.match` turns that into φ̂(s), the share of the workflow's time
through stage s, and the call's deadline is started + φ̂(s)·(deadline − started). Sub-deadlines
never move backwards, and where nothing matches (no history yet) a call gets the whole
workflow deadline. The sub-deadline only orders work: shedding and attainment are judged by
the workflow deadline (router/policies/gmax.py keeps half the value of a call that misses its
stage share but fits the workflow).

Finished workflows (a call marked `final` ended, or `idle_s` after the deadline) are learned:
their graph joins the store, compiled off the event loop and swapped in whole.
"""

from __future__ import annotations

import asyncio
import copy
import logging
from dataclasses import dataclass, field

from slogate.gateway.config import WorkflowsConfig
from slogate.predictors.pattern_graph import PatternStore, StageNode, load_workflow_calls, stage_summary, workflow_graph
from slogate.router.request import Workflow

log = logging.getLogger("slogate.workflows")

MAX_WORKFLOWS = 10_000  # live ids kept at most; beyond, finished ones are dropped early
MAX_CALLS = 1_000  # calls recorded per workflow (a runaway loop must not grow without bound)


@dataclass(slots=True)
class LiveCall:
    """One call of a live workflow, in the shape `pattern_graph` reads (`CallLike`)."""

    call_id: int
    stage: int
    input_tokens: int
    label: str
    gap_s: float  # non-LLM time before it: since the previous stage's last call ended
    deadline_at: float  # its stage sub-deadline (absolute, monotonic clock)
    final: bool = False
    output_tokens: int = 1
    ended_at: float | None = None
    parents: list[int] = field(default_factory=list)
    workflow: LiveWorkflow | None = field(default=None, repr=False)

    def ended(self, output_tokens: int, now: float) -> None:
        """The call's answer is complete (or given up): its output counts in the graph."""
        if self.ended_at is not None:
            return
        self.output_tokens = max(output_tokens, 1)
        self.ended_at = now
        wf = self.workflow
        if wf is not None:
            wf.core.tokens_done += self.input_tokens + output_tokens
            wf.core.calls_done += 1
            if self.final:
                wf.finished = True


@dataclass
class LiveWorkflow:
    core: Workflow
    calls: list[LiveCall] = field(default_factory=list)
    phi: dict[int, float] = field(default_factory=dict)  # stage → φ̂ fixed at its first call
    finished: bool = False
    learned: bool = False

    def stages_before(self, stage: int) -> list[StageNode]:
        return stage_summary(workflow_graph(c for c in self.calls if c.stage < stage and c.ended_at is not None))

    def gap_before(self, stage: int, now: float) -> float:
        """Time since the latest call of an earlier stage ended (the tool / think time before this one)."""
        ends = [c.ended_at for c in self.calls if c.stage < stage and c.ended_at is not None]
        return max(now - max(ends), 0.0) if ends else 0.0


class WorkflowBook:
    def __init__(self, cfg: WorkflowsConfig, ttl_s: float = 3600.0) -> None:
        self.cfg = cfg
        self.ttl_s = ttl_s
        self._wf: dict[str, LiveWorkflow] = {}
        self.store: PatternStore | None = None
        self.learned = 0
        if cfg.stage_deadlines:
            self.store = PatternStore(capacity=cfg.capacity)
            if cfg.history is not None:
                for key, calls in load_workflow_calls(cfg.history):
                    self.store.add(key, calls)
                self.store._compile()
                log.info("workflow patterns: %d from %s", len(self.store.patterns), cfg.history)

    def get(self, wf_id: str, now: float, deadline_ms: float) -> Workflow:
        lw = self._wf.get(wf_id)
        if lw is None:
            if len(self._wf) >= MAX_WORKFLOWS:
                self._drop(now, force=True)
            lw = self._wf[wf_id] = LiveWorkflow(Workflow(wf_id, now, now + deadline_ms / 1000))
        return lw.core

    def issue(self, wf: Workflow, stage: int, input_tokens: int, label: str, final: bool, now: float) -> LiveCall:
        """Record a call of `wf` at `stage` and give it its stage sub-deadline."""
        lw = self._wf.get(wf.workflow_id)
        if lw is None or lw.core is not wf:  # dropped meanwhile: it still gets its workflow deadline
            return LiveCall(0, stage, input_tokens, label, 0.0, wf.deadline_at, final)
        gap = lw.gap_before(stage, now)
        phi = lw.phi.get(stage)
        if phi is None:
            phi = self._match(lw, stage, input_tokens, label, gap)
            lw.phi[stage] = phi
        call = LiveCall(len(lw.calls), stage, max(input_tokens, 1), label, gap,
                        wf.started_at + phi * (wf.deadline_at - wf.started_at), final, workflow=lw)
        if len(lw.calls) < MAX_CALLS:
            lw.calls.append(call)
        return call

    def _match(self, lw: LiveWorkflow, stage: int, input_tokens: int, label: str, gap: float) -> float:
        if self.store is None or not self.store.patterns:
            return 1.0
        revealed = lw.stages_before(stage)
        current = StageNode(stage, label, 1 + sum(c.stage == stage for c in lw.calls), input_tokens, 0, gap, 0.0)
        est = self.store.match(revealed, current)
        prev = max((v for s, v in lw.phi.items() if s < stage), default=0.0)
        return 1.0 if est is None else min(max(est.phi, prev), 1.0)

    @property
    def patterns(self) -> int:
        return len(self.store.patterns) if self.store is not None else 0

    def describe(self, wf_id: str) -> dict | None:
        """What the gateway knows of one workflow (`GET /admin/workflows/{id}`); times in s from its start."""
        lw = self._wf.get(wf_id)
        if lw is None:
            return None
        w = lw.core
        return {"id": wf_id, "deadline_s": round(w.deadline_at - w.started_at, 3), "calls_done": w.calls_done,
                "tokens_done": w.tokens_done, "finished": lw.finished, "learned": lw.learned,
                "stage_shares": {str(k): round(v, 4) for k, v in sorted(lw.phi.items())},
                "calls": [{"stage": c.stage, "label": c.label, "input_tokens": c.input_tokens, "gap_s": round(c.gap_s, 3),
                           "deadline_s": round(c.deadline_at - w.started_at, 3),
                           "output_tokens": c.output_tokens if c.ended_at is not None else None} for c in lw.calls]}

    def _done(self, lw: LiveWorkflow, now: float) -> bool:
        return lw.finished or now > lw.core.deadline_at + self.cfg.idle_s

    def _drop(self, now: float, force: bool = False) -> None:
        for k in [k for k, w in self._wf.items() if w.core.deadline_at + self.ttl_s < now or (force and self._done(w, now))]:
            del self._wf[k]

    async def expire(self, now: float) -> None:
        """Learn the workflows that finished, forget the long past ones (the health loop's step)."""
        if self.store is not None and self.cfg.learn:
            done = [w for w in self._wf.values() if not w.learned and self._done(w, now) and any(c.ended_at is not None for c in w.calls)]
            if done:
                for w in done:
                    w.learned = True
                graphs = [(w.core.workflow_id, [copy.copy(c) for c in w.calls if c.ended_at is not None]) for w in done]
                self.store = await asyncio.to_thread(_with, self.store, graphs)
                self.learned += len(done)
        self._drop(now)


def _with(store: PatternStore, graphs: list[tuple[str, list[LiveCall]]]) -> PatternStore:
    """A copy of `store` with `graphs` added and compiled (runs in a worker thread: the running
    store keeps answering matches meanwhile)."""
    new = PatternStore(store.sigma, store.capacity, store.decay_per_hour, store.top_k, list(store.patterns), dict(store._labels))
    for key, calls in graphs:
        for c in calls:
            c.workflow = None
        new.add(key, calls)
    new._compile()
    return new
