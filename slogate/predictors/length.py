"""Output-length estimators with the interface the drivers use.

`annotate(req, true_len)` sets the first estimate when a request arrives and `refine(req,
true_len)` updates it as tokens are generated (every `refine_every` tokens). `true_len` is
passed only because the simulator knows it; only the oracle and the noisy oracle look at
it. The quantile-forest model plugs in behind the same interface (`predictors.paired`): it queues
annotations and answers them in one batch per decision (`flush`).
"""

from __future__ import annotations

import math
import random
from abc import ABC, abstractmethod
from bisect import bisect_right
from statistics import NormalDist

from slogate.router.request import Request


class LengthEstimator(ABC):
    name: str
    refine_every: int = 50

    @abstractmethod
    def annotate(self, req: Request, true_len: int) -> None: ...

    def refine(self, req: Request, true_len: int) -> None:
        self.annotate(req, true_len)

    def flush(self) -> None:  # noqa: B027 - optional hook
        """Answer queued annotations in one batch (drivers call it before every decision)."""

    def done(self, req: Request) -> None:  # noqa: B027 - optional hook
        """The request left the system (finished or shed); `req.generated` is final if finished."""

    def summary(self) -> dict[str, float]:
        return {}


class OracleLength(LengthEstimator):
    """Perfect knowledge: the bound is the exact remaining length."""

    name = "oracle"

    def annotate(self, req: Request, true_len: int) -> None:
        req.len_mean = float(true_len)
        req.len_bound = float(max(true_len - req.generated, 1))


class NoisyOracle(LengthEstimator):
    """True length × log-normal noise (σ), with the bound at the noise's q-quantile; the
    noise is drawn once per request, so refinements keep the same error."""

    name = "noisy"

    def __init__(self, sigma: float = 0.5, q: float = 0.9, seed: int = 0) -> None:
        self.sigma = sigma
        self.z = NormalDist().inv_cdf(q)
        self.rng = random.Random(seed)
        self._noise: dict[int, float] = {}

    def annotate(self, req: Request, true_len: int) -> None:
        e = self._noise.setdefault(req.rid, math.exp(self.rng.gauss(0.0, self.sigma)))
        mean = true_len * e
        bound = mean * math.exp(self.z * self.sigma)
        req.len_mean = mean
        req.len_bound = max(bound - req.generated, 0.25 * max(req.generated, 4.0), 1.0)


class EmpiricalQuantile(LengthEstimator):
    """Knows only the length distribution (e.g. the trace's): bound = q-quantile of the
    length conditional on having already generated `req.generated` tokens."""

    name = "mean"

    def __init__(self, lengths: list[int], q: float = 0.9) -> None:
        self.sorted = sorted(lengths) or [128]
        self.q = q
        self.mean = sum(self.sorted) / len(self.sorted)

    def conditional_quantile(self, generated: int) -> float:
        i = bisect_right(self.sorted, generated)
        n_tail = len(self.sorted) - i
        if n_tail <= 0:
            return generated * 1.5 + 16
        return float(self.sorted[i + min(int(self.q * n_tail), n_tail - 1)])

    def annotate(self, req: Request, true_len: int) -> None:
        req.len_mean = self.mean
        req.len_bound = max(self.conditional_quantile(req.generated) - req.generated, 1.0)


def make_estimator(name: str, lengths: list[int], seed: int = 0, model_path: str | None = None,
                   prompt_files: list[str] | None = None) -> LengthEstimator:
    if name == "oracle":
        return OracleLength()
    if name == "noisy":
        return NoisyOracle(seed=seed)
    if name == "mean":
        return EmpiricalQuantile(lengths)
    if name == "qrf":
        if not model_path:
            raise ValueError("--predictor qrf needs a model file (--predictor-model), made by `slogate train-predictor`")
        if not prompt_files:
            raise ValueError("--predictor qrf needs prompt files to pair simulated requests with (--prompts)")
        from slogate.predictors.paired import PairedQRF  # heavy imports only when asked for

        return PairedQRF.factory(model_path, prompt_files)(seed)
    raise ValueError(f"unknown predictor {name!r}; known: oracle, noisy, mean, qrf")
