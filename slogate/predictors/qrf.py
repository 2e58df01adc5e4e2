"""Quantile-regression-forest upper bound on a request's *remaining* output length.

Model (`LengthModel`):
1. a ridge regression on hashed word 1-2-grams of the prompt (+ a model-id token) predicts
   log length: one strong "what is asked" feature, computed in O(prompt) with no model call;
2. a smoothed per-model mean log length (target encoding of the model id);
3. the hand features of `predictors.features`;
4. the tokens generated so far, g.
A `quantile_forest.RandomForestQuantileRegressor` learns the q-quantile of the remaining
length L − g from rows replicated at g ∈ GEN_STEPS (only where L > g), so one model gives
the first bound and every refinement. Ridge and encoding are cross-fitted by prompt group
so the forest sees them with the error they have on unseen prompts. A split-conformal
factor per g band, measured on prompts held out of the forest's training, makes the
coverage match q (±) on new prompts.

Kept small on purpose: a forest of 300 deep trees was measured at 16 ms per prediction and
a 608 MB pickle. Here 48 trees on 35% bootstrap samples with a leaf-size floor are fitted by
quantile_forest and compiled to per-leaf quantile tables (`predictors.forest`): a few MB,
and one numpy walk of all trees per batch.
"""

from __future__ import annotations

import hashlib
import io
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import joblib
import numpy as np
from quantile_forest import RandomForestQuantileRegressor
from sklearn.linear_model import Ridge

from slogate.predictors.features import HAND_FEATURES, PromptInput, hand_matrix, hash_ngrams, hashed_doc
from slogate.predictors.forest import CompiledForest

GEN_STEPS = (0, 50, 100, 200, 400, 800)
FORMAT_VERSION = 1


def group_key(text: str) -> int:
    """Stable 0..99 bucket of a prompt's text: splits are by prompt, never by row, and the
    training and evaluation commands agree on them without sharing a file."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8", "replace"), digest_size=4).digest(), "little") % 100


def is_heldout(text: str, fraction: float, salt: str = "") -> bool:
    return group_key(salt + text) < round(fraction * 100)


@dataclass
class ForestParams:
    n_estimators: int = 48
    min_samples_leaf: int = 12
    max_samples: float = 0.35  # bootstrap share per tree: smaller file, faster fit, little accuracy lost
    max_features: float = 0.6
    max_depth: int | None = 24


@dataclass
class LengthModel:
    q: float = 0.9
    n_hash: int = 2**18
    ridge_alpha: float = 1.0
    forest_params: ForestParams = field(default_factory=ForestParams)
    # learned
    ridge_coef: np.ndarray | None = None
    ridge_intercept: float = 0.0
    model_enc: dict[str, tuple[float, int]] = field(default_factory=dict)
    global_log_mean: float = 5.0
    forest: CompiledForest | None = None
    conformal: dict[int, float] = field(default_factory=dict)  # GEN_STEPS band → factor
    meta: dict[str, Any] = field(default_factory=dict)

    # ---------------------------------------------------------------- features
    def _hash(self, prompts: Sequence[PromptInput]) -> Any:
        return hash_ngrams([hashed_doc(p) for p in prompts], self.n_hash)

    def _model_feature(self, model: str) -> tuple[float, float]:
        mean, n = self.model_enc.get(model, (self.global_log_mean, 0))
        return mean, math.log1p(n)

    def featurize(self, prompts: Sequence[PromptInput]) -> np.ndarray:
        """Per-request features that do not change while it generates; computed once."""
        if self.ridge_coef is None:
            raise RuntimeError("model is not trained")
        x = self._hash(prompts)
        score = x @ self.ridge_coef + self.ridge_intercept
        enc = np.asarray([self._model_feature(p.model) for p in prompts], dtype=np.float32).reshape(len(prompts), 2)
        return np.column_stack([score.astype(np.float32), enc, hand_matrix(list(prompts))])

    @staticmethod
    def _with_generated(base: np.ndarray, generated: np.ndarray) -> np.ndarray:
        g = np.asarray(generated, dtype=np.float32).reshape(-1, 1)
        return np.hstack([base, np.log1p(g)])

    # ---------------------------------------------------------------- prediction
    def predict_remaining(self, base: np.ndarray, generated: Sequence[int] | np.ndarray,
                          max_tokens: Sequence[int | None] | None = None) -> np.ndarray:
        """Upper bound (quantile q) on tokens still to come, for rows of `featurize` output at
        `generated` tokens so far. Never below 1; never past `max_tokens` (total)."""
        return self.predict(base, generated, max_tokens)[0]

    def predict(self, base: np.ndarray, generated: Sequence[int] | np.ndarray,
                max_tokens: Sequence[int | None] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(bound, median) of the remaining length, from one walk of the forest."""
        if self.forest is None:
            raise RuntimeError("model is not trained")
        gen = np.asarray(generated, dtype=np.float64)
        raw, med = self.forest.predict_many(self._with_generated(base, gen), (self.q, 0.5))
        factor = np.asarray([self.conformal.get(band_of(g), 1.0) for g in gen])
        bound = np.maximum(np.ceil(raw.astype(np.float64) * factor), 1.0)
        med = np.maximum(med.astype(np.float64), 1.0)
        if max_tokens is not None:
            cap = np.maximum(np.asarray([m if m else np.inf for m in max_tokens], dtype=np.float64) - gen, 1.0)
            bound, med = np.minimum(bound, cap), np.minimum(med, cap)
        return bound, np.minimum(med, bound)

    # ---------------------------------------------------------------- training
    def fit(self, prompts: Sequence[PromptInput], lengths: Sequence[int], groups: Sequence[str],
            progress: Callable[[str, float], None] | None = None, calib_fraction: float = 0.15, folds: int = 5,
            seed: int = 0) -> LengthModel:
        """Train on (prompt, true output length); `groups` identify prompts (rows sharing a
        prompt never straddle a split)."""
        t0 = time.perf_counter()
        say = progress or (lambda _s, _f: None)
        n = len(prompts)
        if n < 50:
            raise ValueError(f"need at least 50 rows to train, got {n}")
        y = np.asarray(lengths, dtype=np.float64)
        ylog = np.log1p(y)
        gk = np.asarray([group_key(f"{seed}:{g}") for g in groups])
        say("hashing prompts", 0.02)
        x_text = self._hash(prompts)
        hand = hand_matrix(list(prompts))
        models = [p.model for p in prompts]
        self.global_log_mean = float(ylog.mean())

        # Cross-fitted text score and model encoding: each fold is predicted by models that never saw its prompts.
        oof_score = np.zeros(n)
        oof_enc = np.zeros((n, 2))
        fold_of = gk % folds
        for f in range(folds):
            say(f"cross-fitting text model {f + 1}/{folds}", 0.05 + 0.35 * f / folds)
            tr, te = fold_of != f, fold_of == f
            r = Ridge(alpha=self.ridge_alpha, solver="sparse_cg").fit(x_text[tr], ylog[tr])
            oof_score[te] = r.predict(x_text[te])
            enc = _encode_models([m for m, t in zip(models, tr, strict=True) if t], ylog[tr], self.global_log_mean)
            for i in np.flatnonzero(te):
                mean, cnt = enc.get(models[i], (self.global_log_mean, 0))
                oof_enc[i] = (mean, math.log1p(cnt))
        say("fitting text model", 0.42)
        r = Ridge(alpha=self.ridge_alpha, solver="sparse_cg").fit(x_text, ylog)
        self.ridge_coef = r.coef_.astype(np.float32)
        self.ridge_intercept = float(r.intercept_)
        self.model_enc = _encode_models(models, ylog, self.global_log_mean)
        base = np.column_stack([oof_score, oof_enc, hand]).astype(np.float32)

        # Rows replicated at each generated count still inside the answer; target = remaining.
        xs, ys, gs, is_cal = [], [], [], []
        calib = _calib_mask(gk, calib_fraction)
        for g in GEN_STEPS:
            m = y > g
            xs.append(self._with_generated(base[m], np.full(int(m.sum()), g)))
            ys.append(y[m] - g)
            gs.append(np.full(int(m.sum()), g))
            is_cal.append(calib[m])
        X, Y, G, C = np.vstack(xs), np.concatenate(ys), np.concatenate(gs), np.concatenate(is_cal)
        fp = self.forest_params
        say(f"fitting forest on {int((~C).sum()):,} rows", 0.5)
        qrf = RandomForestQuantileRegressor(
            n_estimators=fp.n_estimators, min_samples_leaf=fp.min_samples_leaf, max_samples=fp.max_samples,
            max_samples_leaf=1, max_features=fp.max_features, max_depth=fp.max_depth,
            n_jobs=-1, random_state=seed).fit(X[~C], Y[~C])
        say("compiling leaf quantiles", 0.85)
        self.forest = CompiledForest.from_estimators(qrf.estimators_, X[~C], Y[~C], sorted({self.q, 0.5}))
        say("calibrating", 0.9)
        self.conformal = {}
        raw = self.forest.predict(X[C], self.q)
        for g in GEN_STEPS:
            m = G[C] == g
            if m.sum() >= 30:
                ratio = np.sort(Y[C][m] / np.maximum(np.ceil(raw[m]), 1.0))
                k = min(math.ceil((len(ratio) + 1) * self.q) - 1, len(ratio) - 1)  # split-conformal rank
                self.conformal[g] = float(ratio[k])
        self.meta = {"rows": n, "forest_rows": int((~C).sum()), "calib_rows": int(C.sum()), "train_s": round(time.perf_counter() - t0, 2),
                     "features": ["text_score", "model_log_mean", "model_log_count", *HAND_FEATURES, "log_generated"],
                     "format": FORMAT_VERSION}
        say("done", 1.0)
        return self

    # ---------------------------------------------------------------- persistence
    def save(self, path: str | Path) -> int:
        buf = io.BytesIO()
        joblib.dump(self, buf, compress=("zlib", 3))
        Path(path).write_bytes(buf.getvalue())
        return len(buf.getvalue())

    @staticmethod
    def load(path: str | Path) -> LengthModel:
        m = joblib.load(path)
        if not isinstance(m, LengthModel):
            raise ValueError(f"{path} does not hold a slogate length model")
        if m.meta.get("format") != FORMAT_VERSION:
            raise ValueError(f"{path}: model format {m.meta.get('format')} != {FORMAT_VERSION}; retrain it")
        return m


def band_of(generated: float) -> int:
    """The GEN_STEPS band a generated count falls in (its calibration factor)."""
    b = 0
    for g in GEN_STEPS:
        if generated >= g:
            b = g
    return b


def _calib_mask(gk: np.ndarray, fraction: float) -> np.ndarray:
    # A second hash-derived draw, independent of the fold id (gk % folds).
    return ((gk * 37 + 11) % 100) < round(fraction * 100)


def _encode_models(models: Sequence[str], ylog: np.ndarray, prior: float, strength: float = 20.0) -> dict[str, tuple[float, int]]:
    """Mean log length per model, shrunk towards the global mean (m-estimate)."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for m, v in zip(models, ylog, strict=True):
        sums[m] = sums.get(m, 0.0) + float(v)
        counts[m] = counts.get(m, 0) + 1
    return {m: ((sums[m] + strength * prior) / (counts[m] + strength), counts[m]) for m in sums}
