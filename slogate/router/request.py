"""Request, SLO and tier model shared by the live gateway and the simulator.

Times are plain floats in seconds on whatever clock the driver uses (wall clock in the
gateway, simulated time in `sim/`); nothing here reads a clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum


class SLOClass(StrEnum):
    LATENCY = "latency"  # streaming pace: TTFT + time between tokens
    DEADLINE = "deadline"  # whole answer by an end-to-end deadline
    COMPOUND = "compound"  # one call of a multi-call workflow with a workflow deadline
    BEST_EFFORT = "best_effort"  # no SLO; gets a default deadline so it is never starved


# How long a paused answer's reader (preempted, or its replica lost) waits for its next token
# before the answer takes the next free slot ahead of everything else (router/scheduler.py).
RESUME_WITHIN_S = 10.0

# Numeric class codes in `Request.static`, for vectorised policies.
LATENCY_CODE, DEADLINE_CODE, BEST_EFFORT_CODE = 0.0, 1.0, 2.0
# Request.static: kind code, TTFT, TBT, deadline, workflow deadline, tier weight, max_tokens, waiting_s.
N_STATIC = 8
_KIND_CODE = {SLOClass.LATENCY: LATENCY_CODE, SLOClass.DEADLINE: DEADLINE_CODE, SLOClass.COMPOUND: DEADLINE_CODE, SLOClass.BEST_EFFORT: BEST_EFFORT_CODE}


@dataclass(frozen=True, slots=True)
class Tier:
    name: str = "default"
    weight: float = 1.0


@dataclass(frozen=True, slots=True)
class SLO:
    """A request's service-level objective; durations are relative to arrival."""

    kind: SLOClass
    ttft_s: float | None = None
    tbt_s: float | None = None
    deadline_s: float | None = None
    waiting_s: float | None = None  # refuse if not dispatched within this long

    def __post_init__(self) -> None:
        for name in ("ttft_s", "tbt_s", "deadline_s", "waiting_s"):
            v = getattr(self, name)
            if v is not None and (not math.isfinite(v) or v <= 0):
                raise ValueError(f"{name} must be a positive finite number, got {v!r}")
        if self.kind is SLOClass.LATENCY and (self.ttft_s is None or self.tbt_s is None):
            raise ValueError("a latency SLO needs ttft_s and tbt_s")
        if self.kind is not SLOClass.LATENCY and self.deadline_s is None:
            raise ValueError(f"a {self.kind} SLO needs deadline_s")

    @classmethod
    def latency(cls, ttft_s: float, tbt_s: float, waiting_s: float | None = None) -> SLO:
        return cls(SLOClass.LATENCY, ttft_s=ttft_s, tbt_s=tbt_s, waiting_s=waiting_s)

    @classmethod
    def deadline(cls, deadline_s: float, waiting_s: float | None = None) -> SLO:
        return cls(SLOClass.DEADLINE, deadline_s=deadline_s, waiting_s=waiting_s)

    @classmethod
    def compound(cls, deadline_s: float) -> SLO:
        """`deadline_s` is this call's stage sub-deadline, relative to the call's arrival."""
        return cls(SLOClass.COMPOUND, deadline_s=deadline_s)

    @classmethod
    def best_effort(cls, default_deadline_s: float = 600.0) -> SLO:
        return cls(SLOClass.BEST_EFFORT, deadline_s=default_deadline_s)


@dataclass(slots=True)
class Workflow:
    """Shared state of one compound request (an agent workflow) across its calls."""

    workflow_id: str
    started_at: float
    deadline_at: float  # absolute deadline of the whole workflow
    tokens_done: int = 0  # input+output tokens of calls finished so far
    calls_done: int = 0
    failed: bool = False


@dataclass(slots=True, eq=False)
class Request:
    """One LLM call as the decision core sees it.

    The true output length is deliberately absent: policies see only the predictor's
    estimates (`len_bound`, `len_mean`), exactly as in production.
    """

    rid: int
    arrival: float
    input_tokens: int
    slo: SLO
    tier: Tier = field(default_factory=Tier)
    tenant: str = "default"
    max_tokens: int | None = None
    workflow: Workflow | None = None
    stage: int = 0
    # Estimates written by predictors: upper bound on *remaining* output tokens, and a
    # point estimate of the *total* output length (for SJF-style baselines).
    len_bound: float = 256.0
    len_mean: float = 128.0
    # Progress, written by the driver.
    generated: int = 0
    first_token_at: float | None = None
    last_token_at: float | None = None
    dispatched_at: float | None = None
    finished_at: float | None = None
    replica: int | None = None
    # The replica it last left mid-answer (preempted): that engine cached its prompt and answer
    # blocks as it computed them, so a resume there re-prefills little (vLLM, measured).
    ran_on: int | None = None
    # A token after its first was later than arrival + TTFT + k·TBT (the per-token timeline), its
    # first being on time (router/lifecycle.py): the learner counts the stream as near a miss.
    late_after_first: bool = False
    preemptions: int = 0
    preemptible: bool = True  # the driver can stop it and continue it later (live: a resumable stream past its first token)
    # Someone chose its TBT (live: the request, its key, tier or model; not the built-in default).
    # Only such a request is paced, and with GoRouting's `pack: "chosen"` only such a request is
    # packed beside busier streams: one on the built-in default would be slowed for a pace no
    # client asked for (guidellm, measured). Any latency request may take a slot a replica lends
    # above its budget (scheduler.py; docs/benchmarks.md, "An interactive default SLO").
    tbt_chosen: bool = True
    # Its TTFT was chosen by someone (live: the request, its key, tier or model; not the built-in
    # default): only then does GMAX's `strict_ttft` shed it once its first token cannot be on time,
    # and only then is it refused (its SLO past hope) while a slot would otherwise stay empty.
    ttft_chosen: bool = True
    shed_reason: str | None = None
    # Prompt as chained block hashes (router/prefix.py) and the prompt tokens one block holds;
    # `cached` is the prefix hit (tokens) on the replica it was last dispatched to.
    prefix: tuple[int, ...] = ()
    tokens_per_block: float = 0.0
    cached: int = 0
    session: int = 0  # a client's session key (hashed), for sticky placements; 0: none
    best_cached: int = 0  # the largest prefix hit on any replica, as of `best_cached_at`
    best_cached_at: float = -math.inf
    # The same over the replicas with a free slot (GMAX's `cache_where_room`): (their rids, when, hit)
    room_cached: tuple[tuple[int, ...], float, int] | None = None
    # Static SLO features for vectorised policies, computed once (the SLO never changes).
    static: tuple[float, ...] = field(default=(), repr=False)

    def __post_init__(self) -> None:
        s = self.slo
        wf_dl = self.workflow.deadline_at if self.workflow is not None else 0.0
        dl = self.arrival + s.deadline_s if s.deadline_s is not None else 0.0
        cap = float(self.max_tokens) if self.max_tokens is not None else math.inf
        wait = s.waiting_s if s.waiting_s is not None else math.inf
        self.static = (_KIND_CODE[s.kind], s.ttft_s or 0.0, s.tbt_s or 0.0, dl, wf_dl, self.tier.weight, cap, wait)

    @property
    def kind(self) -> SLOClass:
        return self.slo.kind

    @property
    def first_token_pending(self) -> bool:
        """A latency request with a first token still to come (not a paused answer): what lending,
        absorbing and GoRouting's `hold_late` judge by its TTFT."""
        return self.slo.kind is SLOClass.LATENCY and not self.generated and self.slo.ttft_s is not None

    @property
    def ttft_deadline(self) -> float:
        """Absolute time the first token is due (for deadline classes: a derived budget)."""
        if self.slo.kind is SLOClass.LATENCY:
            return self.arrival + self.slo.ttft_s  # type: ignore[operator]
        return self.deadline_at

    @property
    def deadline_at(self) -> float:
        """Absolute time by which the whole answer is due.

        Latency requests have no end-to-end deadline; their last-token deadline depends
        on the (unknown) length, so we return the deadline of the bound's last token.
        """
        s = self.slo
        if s.kind is SLOClass.LATENCY:
            return self.arrival + s.ttft_s + max(self.generated + self.len_bound - 1, 0) * s.tbt_s  # type: ignore[operator]
        return self.arrival + s.deadline_s  # type: ignore[operator]

    def token_deadline(self, i: int) -> float:
        """Deadline of output token i (0-based) under the JITServe token timeline."""
        s = self.slo
        if s.kind is SLOClass.LATENCY:
            return self.arrival + s.ttft_s + i * s.tbt_s  # type: ignore[operator]
        return self.deadline_at

    @property
    def context_tokens(self) -> int:
        """Tokens whose KV a replica must hold (and recompute after a preemption)."""
        return self.input_tokens + self.generated

    @property
    def remaining_mean(self) -> float:
        """Tokens it is expected to generate still: the predictor's point estimate, not its bound."""
        return max(self.len_mean - self.generated, 1.0)

    @property
    def remaining_bound(self) -> float:
        """Upper bound on tokens still to generate, capped by max_tokens."""
        b = max(self.len_bound, 1.0)
        if self.max_tokens is not None:
            b = min(b, max(self.max_tokens - self.generated, 0))
        return b
