"""Each replica's SLO-safe concurrency, learned from what the gateway measures.

vLLM admits everything it is sent: past saturation its batch grows and every stream misses its
time-between-tokens target at once. The gateway therefore keeps a replica's in-flight count at
the largest n whose inter-token time still meets the streams' TBT target, learned online:

- every measured token gap is an observation (n decoding sequences → seconds per token),
  averaged per n with exponential forgetting (the engine, its model and its neighbours change);
- a weighted least-squares line ITL(n) = a + b·n through those averages (the batch latency
  model's decode term, PROSERVE eq. 5, fitted to this replica instead of a profile) gives the
  budget: the largest n with a + b·n ≤ margin · target;
- until the line is trustworthy (three distinct n, a positive slope), and for n beyond what it
  has seen, the budget moves additively: +1 while the replica is full and fast, ×0.8 when the
  recent gaps exceed the target on average (AIMD), so it finds the knee even on an engine
  nobody profiled.

The SLOs are cumulative (token i is due by TTFT + i·TBT), so what must hold is the average pace,
not every gap: a step that carries another request's prefill stalls every stream in it for a
moment, and on a CPU engine those stalls are several times the target. Reacting to the tail of
the gaps (as a first version did) read every arrival as overload, shrank the budget far below
the knee and queued requests the replica could have served on time.

The configured budget stays an upper bound. Pure: time is an argument.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class _Bin:
    mean: float = 0.0
    weight: float = 0.0


@dataclass
class CapacityLearner:
    cap: int  # the configured budget: never exceeded
    start: int | None = None  # None: start at the cap (a fixed budget until the replica shows it is slow)
    margin: float = 0.85  # aim below the target: a gap's spread and the next arrival's prefill
    forget: float = 0.02  # weight a bin's average loses per new observation in it (recency)
    decay: float = 0.1  # weight every bin loses per update: what was seen a minute ago hardly counts
    min_weight: float = 5.0  # observations before a bin counts in the fit
    budget: int = 0
    bins: dict[int, _Bin] = field(default_factory=dict)
    recent: list[float] = field(default_factory=list)  # gaps since the last update (seconds per token)
    recent_n: list[int] = field(default_factory=list)
    last_update: float = -math.inf
    fit: tuple[float, float] | None = None  # (a, b) of ITL(n) = a + b·n

    def __post_init__(self) -> None:
        self.budget = max(1, min(self.cap if self.start is None else self.start, self.cap))

    def observe(self, n: int, gap_s: float) -> None:
        """One inter-token gap (seconds per token) measured while `n` sequences were decoding."""
        if n <= 0 or not (0 < gap_s < 60):
            return
        b = self.bins.setdefault(n, _Bin())
        b.weight = b.weight * (1 - self.forget) + 1
        b.mean += (gap_s - b.mean) / b.weight
        self.recent.append(gap_s)
        self.recent_n.append(n)

    def _line(self) -> tuple[float, float] | None:
        pts = [(n, b.mean, b.weight) for n, b in self.bins.items() if b.weight >= self.min_weight]
        if len(pts) < 3 or max(p[0] for p in pts) - min(p[0] for p in pts) < 2:
            return None
        sw = sum(w for _, _, w in pts)
        mx = sum(n * w for n, _, w in pts) / sw
        my = sum(y * w for _, y, w in pts) / sw
        sxx = sum(w * (n - mx) ** 2 for n, _, w in pts)
        if sxx <= 0:
            return None
        slope = sum(w * (n - mx) * (y - my) for n, y, w in pts) / sxx
        if slope <= 0:
            return None  # no visible cost of batching yet: the data do not locate the knee
        return my - slope * mx, slope

    def update(self, now: float, target_s: float | None, inflight: int, period_s: float = 1.0) -> int:
        """Re-decide the budget (at most once per `period_s`) for streams that need `target_s`
        per token (None: no stream in flight has a TBT target); `inflight`: what the replica holds."""
        if now - self.last_update < period_s:
            return self.budget
        self.last_update = now
        if target_s is None:
            self.recent, self.recent_n = [], []
            if inflight >= self.budget:
                self.budget = min(self.cap, self.budget + 1)
            return self.budget
        goal = self.margin * target_s
        for n in list(self.bins):
            self.bins[n].weight *= 1 - self.decay
            if self.bins[n].weight < 0.5:
                del self.bins[n]
        recent, self.recent, self.recent_n = self.recent, [], []
        line = self._line()
        if line is not None:
            self.fit = line  # otherwise keep the last one: at a steady budget only one n is seen
        if self.fit is not None:
            a, b = self.fit
            by_fit = int((goal - a) / b) if goal > a else 1
            seen = max(self.bins, default=1)
            # Trust the line where it has data; beyond it, probe a step at a time.
            self.budget = max(1, min(by_fit, seen + max(1, seen // 8), self.cap))
        slow = sum(recent) / len(recent) if len(recent) >= 10 else None  # the pace streams get (see above)
        if slow is not None and slow > target_s:
            self.budget = max(1, min(self.budget, int(inflight * 0.8)))  # multiplicative decrease
        elif self.fit is None and inflight >= self.budget and (slow is None or slow < goal):
            self.budget = min(self.cap, self.budget + 1)  # additive increase while full and fast
        return self.budget
