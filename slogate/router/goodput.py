"""Goodput accounting, incremental from token timestamps.

Definitions (JITServe §3, PROSERVE eq. 3, Tempo eq. 1–3):
- latency: output token i (0-based) counts if delivered by arrival + TTFT + i·TBT;
- deadline / best effort: input + output tokens count if the answer completes by the deadline;
- compound: all input + output tokens of every call count if the workflow's last call
  completes by the workflow deadline (settled per workflow, see `WorkflowLedger`);
- TDG: Σ_i w_r(i)·1[t_i ≤ deadline_i], w_r(1) = w_p·w_tier, w_r(i>1) = w_d·w_tier, with
  deadline_i = TTFT + (i−1)·TBT for latency requests and the request deadline otherwise;
- soft (Tempo): gain decays as min(1, (SLO/actual)^α) instead of dropping to zero.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from slogate.router.request import Request, SLOClass, Workflow

W_INPUT, W_OUTPUT = 1.0, 2.0  # Tempo's input:output weights (1:2, as in common pricing)


def soft_decay(slo: float, actual: float, alpha: float = 1.0) -> float:
    """Tempo's divisive decay: 1 while on time, (slo/actual)^α after."""
    if actual <= slo:
        return 1.0
    return (slo / actual) ** alpha


@dataclass(frozen=True, slots=True)
class GoodputWeights:
    w_p: float = 1.0  # TDG weight of the first token
    w_d: float = 1.0  # TDG weight of every later token
    soft_alpha: float = 1.0


@dataclass(slots=True)
class RequestLedger:
    """Per-request counters, updated once per delivered token."""

    req: Request
    weights: GoodputWeights = field(default_factory=GoodputWeights)
    tokens: int = 0
    on_time: int = 0  # latency: tokens on their timeline
    tdg: float = 0.0
    soft: float = 0.0
    first_at: float | None = None
    last_at: float | None = None

    def on_token(self, t: float) -> None:
        r, i = self.req, self.tokens
        tier_w = r.tier.weight
        if i == 0:
            self.first_at = t
        self.last_at = t
        self.tokens = i + 1
        if r.slo.kind is SLOClass.LATENCY:
            due = r.token_deadline(i)
            w = (self.weights.w_p if i == 0 else self.weights.w_d) * tier_w
            if t <= due:
                self.on_time += 1
                self.tdg += w
                self.soft += W_OUTPUT
            else:
                self.soft += W_OUTPUT * soft_decay(due - r.arrival, t - r.arrival, self.weights.soft_alpha)

    # -- settled values, valid once the request has finished ---------------------------
    def met_deadline(self) -> bool:
        return self.last_at is not None and self.last_at <= self.req.deadline_at

    def token_goodput(self) -> float:
        r = self.req
        if r.slo.kind is SLOClass.LATENCY:
            return float(self.on_time)
        if r.slo.kind is SLOClass.COMPOUND:
            return 0.0  # settled per workflow
        return float(r.input_tokens + self.tokens) if self.met_deadline() else 0.0

    def attained(self) -> bool:
        """Request-level SLO attainment: every token on its timeline / done by deadline."""
        if self.tokens == 0:
            return False
        if self.req.slo.kind is SLOClass.LATENCY:
            return self.on_time == self.tokens
        return self.met_deadline()

    def tdg_value(self) -> float:
        r = self.req
        if r.slo.kind is SLOClass.LATENCY:
            return self.tdg
        if r.slo.kind is SLOClass.COMPOUND:
            return 0.0
        return self.tdg_ideal() if self.met_deadline() else 0.0

    def tdg_ideal(self, n_tokens: int | None = None) -> float:
        n = self.tokens if n_tokens is None else n_tokens
        if n <= 0:
            return 0.0
        return self.req.tier.weight * (self.weights.w_p + self.weights.w_d * (n - 1))

    def soft_value(self) -> float:
        r = self.req
        if r.slo.kind is SLOClass.LATENCY:
            if self.first_at is None:
                return 0.0
            ttft = self.first_at - r.arrival
            return W_INPUT * r.input_tokens * soft_decay(r.slo.ttft_s, ttft, self.weights.soft_alpha) + self.soft  # type: ignore[arg-type]
        if self.last_at is None or r.slo.kind is SLOClass.COMPOUND:
            return 0.0
        gain = W_INPUT * r.input_tokens + W_OUTPUT * self.tokens
        return gain * soft_decay(r.slo.deadline_s, self.last_at - r.arrival, self.weights.soft_alpha)  # type: ignore[arg-type]


@dataclass(slots=True)
class WorkflowLedger:
    """Compound goodput: all tokens of all calls if the last call meets the workflow deadline."""

    wf: Workflow
    weight: float = 1.0
    tokens: int = 0
    last_at: float | None = None
    complete: bool = False

    def on_call_done(self, input_tokens: int, output_tokens: int, t: float) -> None:
        self.tokens += input_tokens + output_tokens
        self.last_at = t

    def attained(self) -> bool:
        return self.complete and not self.wf.failed and self.last_at is not None and self.last_at <= self.wf.deadline_at

    def token_goodput(self) -> float:
        return float(self.tokens) if self.attained() else 0.0


@dataclass(slots=True)
class ClassTotals:
    units: int = 0  # requests, or workflows for the compound class
    attained: int = 0
    attained_output: int = 0  # output tokens of the requests that attained: users' tools' token goodput
    token_goodput: float = 0.0
    tdg: float = 0.0
    tdg_ideal: float = 0.0
    soft: float = 0.0


@dataclass
class GoodputAccount:
    """Aggregates settled ledgers per SLO class and per tier."""

    by_class: dict[str, ClassTotals] = field(default_factory=dict)
    by_tier: dict[str, ClassTotals] = field(default_factory=dict)

    def _bins(self, kind: str, tier: str) -> tuple[ClassTotals, ClassTotals]:
        return self.by_class.setdefault(kind, ClassTotals()), self.by_tier.setdefault(tier, ClassTotals())

    def settle_request(self, led: RequestLedger, ideal_tokens: int | None = None) -> None:
        """Settle a finished (or shed: `ideal_tokens` = what it would have produced) request."""
        r = led.req
        if r.slo.kind is SLOClass.COMPOUND:
            return
        ideal = led.tdg_ideal(ideal_tokens)
        for b in self._bins(r.slo.kind.value, r.tier.name):
            b.units += 1
            b.attained += int(led.attained())
            b.attained_output += led.tokens if led.attained() else 0
            b.token_goodput += led.token_goodput()
            b.tdg += led.tdg_value()
            b.tdg_ideal += ideal
            b.soft += led.soft_value()

    def settle_workflow(self, wl: WorkflowLedger, tier: str, ideal_tdg: float) -> None:
        for b in self._bins(SLOClass.COMPOUND.value, tier):
            b.units += 1
            b.attained += int(wl.attained())
            g = wl.token_goodput()
            b.token_goodput += g
            b.tdg += ideal_tdg if wl.attained() else 0.0
            b.tdg_ideal += ideal_tdg
            b.soft += g

    def total(self) -> ClassTotals:
        t = ClassTotals()
        for b in self.by_class.values():
            t.units += b.units
            t.attained += b.attained
            t.attained_output += b.attained_output
            t.token_goodput += b.token_goodput
            t.tdg += b.tdg
            t.tdg_ideal += b.tdg_ideal
            t.soft += b.soft
        return t
