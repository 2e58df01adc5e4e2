"""The QRF predictor inside the simulator, fed with real prompts.

Trace files carry token counts but no text. Each simulated request is paired with a real
held-out prompt (one the model never trained on) whose true response length is close to the
request's, and the real model bounds it from that prompt and refines it as simulated tokens
are generated — so the simulator sees the model's real errors, not invented noise.
Predictions are queued and answered in one batch per scheduling decision (`flush`), as the
gateway does per frame.
"""

from __future__ import annotations

import random
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Sequence
from pathlib import Path

from slogate.predictors.evaluate import PromptRow, load_prompt_rows, split_rows
from slogate.predictors.length import LengthEstimator
from slogate.predictors.online import OnlineLengthPredictor, Track
from slogate.predictors.qrf import LengthModel
from slogate.router.request import Request


class PromptPool:
    """Held-out prompts sorted by true response length, for pairing."""

    def __init__(self, rows: Sequence[PromptRow], seed: int = 0) -> None:
        if not rows:
            raise ValueError("the prompt pool is empty")
        self.rows = sorted(rows, key=lambda r: r.true_len)
        self.lens = [r.true_len for r in self.rows]
        self.rng = random.Random(seed)

    @classmethod
    def from_files(cls, paths: Sequence[str | Path], heldout_fraction: float, salt: str = "", seed: int = 0) -> PromptPool:
        rows = load_prompt_rows(paths)
        if heldout_fraction > 0:
            _, rows = split_rows(rows, heldout_fraction, salt)
        return cls(rows, seed)

    def reseeded(self, seed: int) -> PromptPool:
        """The same prompts with a fresh random stream (one per simulation run)."""
        p = PromptPool.__new__(PromptPool)
        p.rows, p.lens, p.rng = self.rows, self.lens, random.Random(seed)
        return p

    def pick(self, true_len: int, tolerance: float = 0.1) -> PromptRow:
        """A random prompt whose response length is within ±tolerance (±2 tokens at least)
        of `true_len`; the nearest ones when none is."""
        w = max(true_len * tolerance, 2.0)
        lo, hi = bisect_left(self.lens, true_len - w), bisect_right(self.lens, true_len + w)
        if hi <= lo:
            i = min(bisect_left(self.lens, true_len), len(self.lens) - 1)
            lo, hi = max(i - 5, 0), min(i + 5, len(self.lens))
        return self.rows[self.rng.randrange(lo, hi)]


class PairedQRF(LengthEstimator):
    name = "qrf"

    @staticmethod
    def factory(model_path: str, prompt_files: Sequence[str | Path]) -> Callable[[int], PairedQRF]:
        """Load the model and the held-out prompt pool once; build a fresh estimator per run."""
        model = LengthModel.load(model_path)
        pool = PromptPool.from_files(prompt_files, float(model.meta.get("heldout_fraction", 0.0)), str(model.meta.get("split_salt", "")))
        return lambda seed: PairedQRF(OnlineLengthPredictor(model), pool.reseeded(seed))

    def __init__(self, predictor: OnlineLengthPredictor, pool: PromptPool, refine_every: int = 50) -> None:
        self.pred = predictor
        self.pool = pool
        self.refine_every = refine_every
        self.tracks: dict[int, Track] = {}
        self.queue: dict[int, Request] = {}
        self.predictions = 0
        self.batches = 0
        self.first_bound: dict[int, float] = {}
        self.covered = 0
        self.judged = 0
        self.ratio_sum = 0.0

    def annotate(self, req: Request, true_len: int) -> None:
        if req.rid not in self.tracks:
            row = self.pool.pick(true_len)
            self.tracks[req.rid] = self.pred.track(row.prompt)
        self.queue[req.rid] = req

    def refine(self, req: Request, true_len: int) -> None:
        self.queue[req.rid] = req

    def flush(self) -> None:
        if not self.queue:
            return
        reqs = [r for r in self.queue.values() if r.finished_at is None]
        self.queue.clear()
        if not reqs:
            return
        bound, med = self.pred.predict([self.tracks[r.rid] for r in reqs], [r.generated for r in reqs],
                                       [r.max_tokens for r in reqs])
        for r, b, m in zip(reqs, bound.tolist(), med.tolist(), strict=True):
            r.len_bound = float(b)
            if r.generated == 0:
                self.first_bound.setdefault(r.rid, float(b))
            r.len_mean = float(r.generated + m)
        self.predictions += len(reqs)
        self.batches += 1

    def done(self, req: Request) -> None:
        self.tracks.pop(req.rid, None)
        self.queue.pop(req.rid, None)
        b = self.first_bound.pop(req.rid, None)
        if b is not None and req.finished_at is not None and req.generated > 0:
            self.judged += 1
            self.covered += req.generated <= b
            self.ratio_sum += b / req.generated

    def summary(self) -> dict[str, float]:
        """How the first bounds fared on the requests that finished."""
        if not self.judged:
            return {}
        return {"predictor_coverage_at_0": round(self.covered / self.judged, 4),
                "predictor_mean_ratio_at_0": round(self.ratio_sum / self.judged, 3),
                "predictor_batches": self.batches, "predictor_predictions": self.predictions}
