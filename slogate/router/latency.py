"""Batch latency model (PROSERVE §4.1, eq. 4–7) with online β correction.

    T(B) = t_c + Σ_prefill (a_p·l_q² + b_p·l_q·l_kv + c_p·l_q) + Σ_decode (a_d·l_kv + b_d)

l_q is the number of tokens a request processes in this forward pass and l_kv the KV
tokens it already holds. β scales the whole estimate and tracks measured/estimated with
momentum θ: β ← θ·β + (1−θ)·mean(T_real / T_est) over a sliding window.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from dataclasses import dataclass, replace


@dataclass(frozen=True, slots=True)
class LatencyCoeffs:
    a_p: float  # s per l_q² (causal self-attention of the new tokens)
    b_p: float  # s per l_q·l_kv (attention of new tokens over cached context)
    c_p: float  # s per l_q (linear layers, compute bound)
    a_d: float  # s per KV token read by one decode
    b_d: float  # s per decode sequence (linear layers at small batch)
    t_c: float  # constant per step: weight streaming, launch, sampling

    def scaled(self, factor: float) -> LatencyCoeffs:
        """A replica `factor` times slower (heterogeneous fleets)."""
        return replace(self, **{k: getattr(self, k) * factor for k in ("a_p", "b_p", "c_p", "a_d", "b_d", "t_c")})


# Llama-3.1-8B (32 layers, d=4096, GQA 8 KV heads × 128, bf16) on one A100-80GB SXM.
# Derived from a roofline of the public specs (312 TFLOP/s bf16 dense, 2.0 TB/s HBM)
# with the efficiencies that public profiles (Vidur's A100 traces, vLLM benchmarks)
# report for this class of model: ~60% MFU for prefill GEMMs, ~50% for attention,
# ~80% of HBM bandwidth for decode. Sanity anchors: a 1k-token prefill ≈ 95 ms, a
# batch-1 decode step ≈ 11 ms, a batch-64 decode step at 1.5k context ≈ 22 ms.
#   c_p = 2·8.0e9 FLOP/token / (0.6·312e12)                 = 8.5e-5 s/token
#   b_p = 4·d·layers FLOP per (q, kv) pair / (0.5·312e12)    = 3.4e-9 s
#   a_p = b_p / 2 (causal mask over the chunk itself)        = 1.7e-9 s
#   a_d = 2·layers·8·128·2 B per KV token / (0.8·2.0e12 B/s) = 8.2e-8 s
#   b_d = per-sequence GEMV/GEMM and sampling work           ≈ 5.0e-5 s
#   t_c = 16 GB of weights / (0.8·2.0e12 B/s) + ~1 ms launch  ≈ 1.1e-2 s
PROFILES: dict[str, LatencyCoeffs] = {
    "llama3.1-8b@a100-80g": LatencyCoeffs(a_p=1.7e-9, b_p=3.4e-9, c_p=8.5e-5, a_d=8.2e-8, b_d=5.0e-5, t_c=1.1e-2),
}
DEFAULT_PROFILE = "llama3.1-8b@a100-80g"
# First tokens a replica's own prefill figure needs before it stands alone; until then the
# fleet's pooled figure prices it (`BatchLatencyModel.set_prior`).
PRIOR_FIRST_TOKENS = 8


_STAMPS = itertools.count(1)  # `BatchLatencyModel.prefill_version`


def prefill_figures(ratios: list[float]) -> tuple[float, float]:
    """(median (high), 10th percentile) of sorted prefill corrections: what estimates use, and
    the fastest lately, what a refusal holds against. One definition for a replica's own window
    and the fleet's pool."""
    return ratios[len(ratios) // 2], ratios[len(ratios) // 10]


class BatchLatencyModel:
    """Per-replica latency estimator; pure, so both drivers can feed it observations."""

    __slots__ = ("_p_window", "_since_update", "_window", "beta", "beta_p_fast_learned", "beta_p_learned", "coeffs", "prefill_seen_at",
                 "prefill_version", "prior_p", "theta", "update_every")

    def __init__(self, coeffs: LatencyCoeffs, theta: float = 0.8, window: int = 32, update_every: int = 8) -> None:
        self.coeffs = coeffs
        self.beta = 1.0
        # Prefill has its own correction: a profile's prefill/decode ratio need not hold on the
        # engine at hand (a CPU engine prefills ~4× slower, relative to its decode, than an A100).
        # None until a first token has been timed: prefills follow β until then.
        self.beta_p_learned: float | None = None
        # The window's 10th percentile: the prefill at its fastest lately, what a refusal holds
        # against (a first token timed beside other work comes late, never early; see beta_p_fast).
        self.beta_p_fast_learned: float | None = None
        self.prefill_seen_at = -math.inf  # when a first token last taught the prefill correction (`view.refresh_prefill`)
        # The fleet's pooled figures (`view.FleetPrefill`): the price while this replica's window
        # holds fewer than PRIOR_FIRST_TOKENS, so a few noisy first tokens do not set it alone.
        self.prior_p: tuple[float, float] | None = None
        # Stamped anew (unique across models) whenever the prefill window changes: the fleet's pool
        # is pooled again only then (`view.FleetPrefill`). 0: never timed.
        self.prefill_version = 0
        self.theta = theta
        self._window: deque[float] = deque(maxlen=window)
        self._p_window: deque[float] = deque(maxlen=window)
        self._since_update = 0
        self.update_every = update_every

    @property
    def beta_p(self) -> float:
        """The correction prefill estimates use."""
        return self.beta if self.beta_p_learned is None else self.beta_p_learned

    @property
    def beta_p_fast(self) -> float:
        """The prefill correction at the fastest first tokens lately: what a refusal ("its first
        token cannot be on time") must hold against, so that a 429 is right. The median, which
        estimates, counts first tokens timed on replicas also busy decoding; on real vLLM it
        refused 1,000–1,200-token prompts on a fleet with room that round robin served in 0.5–0.6 s
        (docs/benchmarks.md, "Sitting AG")."""
        return self.beta_p if self.beta_p_fast_learned is None else self.beta_p_fast_learned

    @classmethod
    def named(cls, profile: str = DEFAULT_PROFILE) -> BatchLatencyModel:
        return cls(PROFILES[profile])

    # -- raw (uncorrected) terms --------------------------------------------------------
    def _prefill(self, l_q: float, l_kv: float) -> float:
        c = self.coeffs
        return c.a_p * l_q * l_q + c.b_p * l_q * l_kv + c.c_p * l_q

    def raw_prefill(self, tokens: float, cached: float = 0.0) -> float:
        """Uncorrected prefill compute time (for callers that apply β themselves)."""
        return self._prefill(tokens, cached)

    def _decode(self, l_kv: float) -> float:
        c = self.coeffs
        return c.a_d * l_kv + c.b_d

    def raw_batch_time(self, prefills: list[tuple[int, int]], decode_kv: list[int]) -> float:
        """Eq. 7 without β: `prefills` are (l_q, l_kv) chunks, `decode_kv` the KV of each decode."""
        c = self.coeffs
        t = c.t_c + c.b_d * len(decode_kv) + c.a_d * sum(decode_kv)
        for l_q, l_kv in prefills:
            t += self._prefill(l_q, l_kv)
        return t

    # -- corrected estimates used by policies -------------------------------------------
    def batch_time(self, prefills: list[tuple[int, int]], decode_kv: list[int]) -> float:
        return self.beta * self.raw_batch_time(prefills, decode_kv)

    def prefill_time(self, tokens: float, cached: float = 0.0) -> float:
        """Core compute time to prefill `tokens` new tokens over `cached` ones (no t_c)."""
        return self.beta_p * self._prefill(tokens, cached)

    def raw_decode_step_time(self, n_seqs: int, kv_tokens: float) -> float:
        """Uncorrected time of one decode-only step of `n_seqs` sequences, `kv_tokens` KV in all."""
        c = self.coeffs
        return c.t_c + c.b_d * n_seqs + c.a_d * kv_tokens

    def decode_step_time(self, n_seqs: int, kv_tokens: float) -> float:
        """One decode step of `n_seqs` sequences holding `kv_tokens` KV tokens in total."""
        return self.beta * self.raw_decode_step_time(n_seqs, kv_tokens)

    @property
    def t_c(self) -> float:
        return self.beta * self.coeffs.t_c

    @property
    def b_d(self) -> float:
        """Average decode cost of one sequence at a typical 1k context (GoRouting's b_d)."""
        return self.beta * self._decode(1024)

    # -- online correction ----------------------------------------------------------------
    def observe_prefill(self, real_s: float, tokens: float, cached: float = 0.0, *, now: float) -> None:
        """A request dispatched to an otherwise prefill-free replica had its first token after
        `real_s` (at `now`): its prefill of `tokens` over `cached` ones (and the step it shared)
        against the profile's estimate. A median over the window: one first token held up by the
        client or the network is noise."""
        est = self._prefill(tokens, cached) + self.coeffs.t_c
        if est <= 0 or real_s <= 0:
            return
        self.prefill_seen_at = now
        self._p_window.append(real_s / est)
        self.prefill_version = next(_STAMPS)
        self._price_prefill()

    def _price_prefill(self) -> None:
        """The window's median (high) and 10th percentile; while it holds fewer than
        PRIOR_FIRST_TOKENS first tokens, the fleet's pooled figures (its own among them: `prior_p`)
        where the scheduler has told it them. One first token on real vLLM ranged 0.2–0.66 s for
        the same prompt on an idle replica: two of them priced a replica at 3× its twin for 15 s,
        and the twin held 7 streams against its 2 (guidellm, docs/benchmarks.md G34)."""
        if len(self._p_window) < PRIOR_FIRST_TOKENS and self.prior_p is not None:
            self.beta_p_learned, self.beta_p_fast_learned = self.prior_p
            return
        if self._p_window:
            self.beta_p_learned, self.beta_p_fast_learned = prefill_figures(sorted(self._p_window))

    def set_prior(self, pooled: tuple[float, float] | None) -> None:
        """The (median, 10th percentile) of the fleet's recent first tokens, pooled: this
        replica's price while its own window is short (a replica never timed takes it too)."""
        if pooled == self.prior_p:
            return
        self.prior_p = pooled
        # A window just cleared for the fleet's figure (`adopt_prefill`) keeps it until timed again.
        if len(self._p_window) < PRIOR_FIRST_TOKENS and (self._p_window or self.beta_p_learned is None):
            self._price_prefill()

    @property
    def prefill_evidence(self) -> int:
        """First tokens in this replica's window."""
        return len(self._p_window)

    def recent_prefill(self, k: int) -> list[float]:
        """The last `k` first tokens' corrections (what it adds to the fleet's pool)."""
        return list(self._p_window)[-k:]

    def adopt_prefill(self, beta_p: float, beta_p_fast: float) -> None:
        """Forget this replica's prefill evidence for the given corrections (the fleet's: see
        `view.refresh_prefill`); the next first token timed here starts the window afresh."""
        self._p_window.clear()
        self.prefill_version = next(_STAMPS)
        self.beta_p_learned, self.beta_p_fast_learned = beta_p, min(beta_p_fast, beta_p)

    def observe(self, real_s: float, estimated_raw_s: float) -> None:
        """Feed one measured batch (or token interval) against its uncorrected estimate."""
        if estimated_raw_s <= 0 or real_s <= 0:
            return
        self._window.append(real_s / estimated_raw_s)
        self._since_update += 1
        if self._since_update >= self.update_every:
            self._since_update = 0
            mean_ratio = sum(self._window) / len(self._window)
            self.beta = self.theta * self.beta + (1 - self.theta) * mean_ratio
