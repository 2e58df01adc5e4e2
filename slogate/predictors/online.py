"""Serving-side length predictor: batched bounds, refinement, online learning.

- `track(prompt)` registers a request; `predict(tracks, generated, max_tokens)` bounds a batch
  of them (one forest walk for a frame's arrivals and refinements). Features are computed once
  per request and model version.
- `observe(track, true_len)` adds a finished request to a rolling buffer; every
  `retrain_every` new rows a new model is fitted on the buffer in a worker *process* (the GIL
  would otherwise stall the event loop during fitting), checked against the current model on
  the newest rows it did not train on, and swapped in atomically only if it is no worse.
- With no model (cold start) the bound is conservative: the q-quantile of lengths seen so
  far (conditional on what was generated) once `min_history` are known, else `max_tokens`
  or `cold_bound`.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import threading
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Executor, Future, ProcessPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from slogate.predictors.evaluate import GlobalQuantile
from slogate.predictors.features import PromptInput
from slogate.predictors.qrf import LengthModel

log = logging.getLogger("slogate.predictor")


@dataclass(slots=True)
class Track:
    """A request as the predictor knows it: its prompt and its cached features."""

    prompt: PromptInput
    version: int = -1
    base: np.ndarray | None = None


MIN_DISTINCT_PROMPTS = 50


@dataclass
class OnlineStats:
    retrains: int = 0
    swaps: int = 0
    rejected: int = 0
    failures: int = 0
    skipped: int = 0  # retrains not started: too few distinct prompts
    last_holdout: dict[str, float] = field(default_factory=dict)


def _fit_and_check(rows: list[tuple[PromptInput, int]], current: LengthModel | None, q: float, seed: int) -> tuple[LengthModel, dict[str, float]]:
    """Worker: fit on the older 90% of the buffer, compare with `current` on the newest 10%."""
    n_hold = max(len(rows) // 10, 1)
    train, hold = rows[:-n_hold], rows[-n_hold:]
    m = LengthModel(q=q).fit([p for p, _ in train], [n for _, n in train], [p.text for p, _ in train], seed=seed)
    y = np.asarray([n for _, n in hold], dtype=float)

    def loss(model: LengthModel) -> float:
        b = model.predict_remaining(model.featurize([p for p, _ in hold]), np.zeros(len(hold)))
        d = y - b
        return float(np.mean(np.maximum(q * d, (q - 1) * d)))

    res = {"new_pinball": loss(m), "holdout": float(len(hold))}
    if current is not None:
        res["old_pinball"] = loss(current)
    return m, res


class OnlineLengthPredictor:
    def __init__(self, model: LengthModel | None = None, q: float | None = None, buffer_size: int = 20_000,
                 retrain_every: int = 2_000, min_train_rows: int = 500, min_history: int = 20,
                 cold_bound: int = 2048, executor: Executor | None = None, seed: int = 0) -> None:
        self._current: tuple[LengthModel | None, int] = (model, 0)  # swapped as one reference
        self.q = q if q is not None else (model.q if model else 0.9)
        self.buffer: deque[tuple[PromptInput, int]] = deque(maxlen=buffer_size)
        self.lengths: deque[int] = deque(maxlen=buffer_size)
        self.retrain_every = retrain_every
        self.min_train_rows = min_train_rows
        self.min_history = min_history
        self.cold_bound = cold_bound
        self.seed = seed
        self.stats = OnlineStats()
        self._since_fit = 0
        self._observed = 0
        self._empirical: GlobalQuantile | None = None
        self._executor = executor
        self._pending: Future[tuple[LengthModel, dict[str, float]]] | None = None
        self._lock = threading.Lock()

    @property
    def model(self) -> LengthModel | None:
        return self._current[0]

    @property
    def version(self) -> int:
        return self._current[1]

    # ------------------------------------------------------------------ prediction
    def track(self, prompt: PromptInput) -> Track:
        return Track(prompt)

    def predict(self, tracks: Sequence[Track], generated: Sequence[int], max_tokens: Sequence[int | None] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(bound, median) of the remaining length of each tracked request, batched."""
        n = len(tracks)
        mts = list(max_tokens) if max_tokens is not None else [t.prompt.max_tokens for t in tracks]
        gen = np.asarray(generated, dtype=np.float64)
        model, version = self._current  # one consistent snapshot even if a swap lands now
        if model is None:
            return self._cold(gen, mts)
        stale = [i for i, t in enumerate(tracks) if t.version != version or t.base is None]
        if stale:
            feats = model.featurize([tracks[i].prompt for i in stale])
            for j, i in enumerate(stale):
                tracks[i].base, tracks[i].version = feats[j], version
        base = np.vstack([t.base for t in tracks]) if n else np.zeros((0, 0))  # type: ignore[misc]
        return model.predict(base, gen, mts)

    def _cold(self, gen: np.ndarray, mts: Sequence[int | None]) -> tuple[np.ndarray, np.ndarray]:
        if len(self.lengths) >= self.min_history:
            if self._empirical is None or self._observed < 64:
                self._empirical = GlobalQuantile(list(self.lengths), self.q)
            bound = np.asarray([self._empirical.bound(int(g)) for g in gen])
        else:
            bound = np.full(len(gen), float(self.cold_bound))
        cap = np.asarray([m - g if m else np.inf for m, g in zip(mts, gen, strict=True)])
        bound = np.maximum(np.minimum(bound, cap), 1.0)
        return bound, np.maximum(bound / 2, 1.0)

    # ------------------------------------------------------------------ learning
    def observe(self, track: Track | PromptInput, true_len: int) -> None:
        """A request finished with `true_len` output tokens."""
        p = track.prompt if isinstance(track, Track) else track
        if true_len <= 0:
            return
        self.buffer.append((p, int(true_len)))
        self.lengths.append(int(true_len))
        self._observed += 1
        if self._observed % 64 == 0:
            self._empirical = None  # refreshed every 64 observations: re-sorting per request would cost ms at 20k
        self._since_fit += 1
        if self._since_fit >= self.retrain_every and len(self.buffer) >= self.min_train_rows:
            # Too few distinct prompts (a benchmark repeating one, a single system prompt) leave the
            # cross-fitting folds empty and teach nothing: wait for more variety.
            if len({p.text for p, _ in self.buffer}) < MIN_DISTINCT_PROMPTS:
                self._since_fit = 0
                self.stats.skipped += 1
                return
            self.retrain()

    def retrain(self) -> bool:
        """Start a background fit on the buffer unless one is running; True if started."""
        with self._lock:
            if self._pending is not None and not self._pending.done():
                return False
            if self._executor is None:
                self._executor = ProcessPoolExecutor(1, mp_context=mp.get_context("spawn"))
            self._since_fit = 0
            self.stats.retrains += 1
            fut = self._executor.submit(_fit_and_check, list(self.buffer), self.model, self.q, self.seed + self.stats.retrains)
            self._pending = fut
        fut.add_done_callback(self._landed)
        return True

    def _landed(self, fut: Future[tuple[LengthModel, dict[str, float]]]) -> None:
        try:
            model, res = fut.result()
        except Exception:
            self.stats.failures += 1
            log.exception("length-model retraining failed; keeping the current model")
            return
        self.stats.last_holdout = res
        if "old_pinball" in res and res["new_pinball"] > res["old_pinball"] * 1.02:
            self.stats.rejected += 1
            log.info("retrained length model rejected: holdout pinball %.1f vs current %.1f", res["new_pinball"], res["old_pinball"])
            return
        self._current = (model, self.version + 1)  # atomic: readers see the old pair or the new one
        self.stats.swaps += 1
        log.info("length model v%d swapped in (holdout pinball %.1f)", self.version, res["new_pinball"])

    def wait_idle(self, timeout: float | None = None) -> None:
        """Block until a running retrain has landed (tests, shutdown)."""
        fut = self._pending
        if fut is not None:
            fut.result(timeout=timeout)
            # the done-callback runs in the executor's thread right after; let it finish
            for _ in range(100):
                if self.stats.swaps + self.stats.rejected + self.stats.failures >= self.stats.retrains:
                    break
                threading.Event().wait(0.01)

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
