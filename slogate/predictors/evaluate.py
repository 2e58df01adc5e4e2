"""Training data loading, the prompt-level split, baselines and the evaluation report of the
length predictor (`slogate train-predictor` / `slogate eval-predictor`)."""

from __future__ import annotations

import json
import time
from bisect import bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from slogate.predictors.features import PromptInput
from slogate.predictors.qrf import LengthModel, is_heldout

EVAL_STEPS = (0, 50, 100, 200)


@dataclass(slots=True)
class PromptRow:
    prompt: PromptInput
    true_len: int
    prompt_tokens: int
    source: str  # the dataset (file) it came from
    subsource: str = ""


def load_prompt_rows(paths: Sequence[str | Path]) -> list[PromptRow]:
    """Rows of `prompts_*.jsonl` (fields prompt, response_len_tokens_cl100k,
    prompt_len_tokens_cl100k, source, model). Rows without a positive length are skipped."""
    out: list[PromptRow] = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for ln, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    r = json.loads(line)
                    n = int(r["response_len_tokens_cl100k"])
                    text = str(r["prompt"])
                except (ValueError, KeyError, TypeError) as e:
                    raise ValueError(f"{path}:{ln}: not a prompts row ({e})") from e
                if n <= 0:
                    continue
                n_msgs = max(text.count("\n\nHuman:"), 0) * 2 + 1 if "\n\nHuman:" in text else 1
                out.append(PromptRow(PromptInput(text, str(r.get("model", "")), n_msgs), n,
                                     int(r.get("prompt_len_tokens_cl100k") or len(text) // 4), Path(path).stem.removeprefix("prompts_"),
                                     str(r.get("source") or "")))
    return out


def split_rows(rows: Sequence[PromptRow], test_fraction: float, salt: str = "") -> tuple[list[PromptRow], list[PromptRow]]:
    """Train / held-out split by prompt text (every response to a prompt lands on one side)."""
    train, test = [], []
    for r in rows:
        (test if is_heldout(r.prompt.text, test_fraction, salt) else train).append(r)
    return train, test


# ------------------------------------------------------------------ baselines
class GlobalQuantile:
    """q-quantile of the remaining length given g tokens generated, over all training rows."""

    def __init__(self, lengths: Sequence[int], q: float) -> None:
        self.sorted = np.sort(np.asarray(lengths))
        self.q = q

    def bound(self, generated: int) -> float:
        i = bisect_right(self.sorted, generated)  # type: ignore[arg-type]
        tail = self.sorted[i:]
        if len(tail) == 0:
            return max(generated * 0.5, 16.0)
        return max(float(np.quantile(tail, self.q, method="higher")) - generated, 1.0)


class LengthBucketQuantile:
    """The same, per prompt-length decile (edges from the training prompts)."""

    def __init__(self, prompt_tokens: Sequence[int], lengths: Sequence[int], q: float, buckets: int = 10) -> None:
        pt = np.asarray(prompt_tokens, dtype=float)
        self.edges = np.unique(np.quantile(pt, np.linspace(0, 1, buckets + 1)[1:-1]))
        idx = np.searchsorted(self.edges, pt, side="right")
        ln = np.asarray(lengths)
        self.per = [GlobalQuantile(ln[idx == b], q) if (idx == b).any() else GlobalQuantile(ln, q) for b in range(len(self.edges) + 1)]

    def bound(self, prompt_tokens: int, generated: int) -> float:
        return self.per[int(np.searchsorted(self.edges, prompt_tokens, side="right"))].bound(generated)


# ------------------------------------------------------------------ metrics
def bound_metrics(true_len: np.ndarray, bounds: dict[int, np.ndarray], q: float) -> dict[str, float]:
    """coverage_at_k, mean/p50 ratio of bound to true remaining length, pinball loss; at each k
    only over requests still running after k tokens (true_len > k)."""
    out: dict[str, float] = {}
    for k in EVAL_STEPS:
        m = true_len > k
        if not m.any():
            continue
        rem = true_len[m] - k
        b = bounds[k][m]
        ratio = b / rem
        diff = rem - b
        out[f"n_at_{k}"] = int(m.sum())
        out[f"coverage_at_{k}"] = round(float(np.mean(rem <= b)), 4)
        out[f"mean_ratio_at_{k}"] = round(float(ratio.mean()), 3)
        out[f"p50_ratio_at_{k}"] = round(float(np.median(ratio)), 3)
        out[f"pinball_at_{k}"] = round(float(np.mean(np.maximum(q * diff, (q - 1) * diff))), 2)
        # Bound on the *total* length over the true total: how much over-reservation is left.
        out[f"mean_total_ratio_at_{k}"] = round(float(np.mean((k + b) / true_len[m])), 3)
    return out


def evaluate(model: LengthModel, train: Sequence[PromptRow], test: Sequence[PromptRow],
             progress: Callable[[str, float], None] | None = None) -> dict[str, Any]:
    """The report of `slogate eval-predictor`: the model and two baselines (fitted on `train`)
    on the held-out `test` prompts, overall and per source."""
    say = progress or (lambda _s, _f: None)
    if not test:
        raise ValueError("no held-out rows to evaluate")
    q = model.q
    y = np.asarray([r.true_len for r in test])
    say("featurizing", 0.05)
    base = model.featurize([r.prompt for r in test])
    model_b: dict[int, np.ndarray] = {}
    for i, k in enumerate(EVAL_STEPS):
        say(f"predicting at {k} generated tokens", 0.1 + 0.6 * i / len(EVAL_STEPS))
        model_b[k] = model.predict_remaining(base, np.full(len(test), k))
    say("baselines", 0.75)
    gq = GlobalQuantile([r.true_len for r in train], q) if train else None
    lb = LengthBucketQuantile([r.prompt_tokens for r in train], [r.true_len for r in train], q) if train else None
    gq_b = {k: np.full(len(test), gq.bound(k)) for k in EVAL_STEPS} if gq else {}
    lb_b = {k: np.asarray([lb.bound(r.prompt_tokens, k) for r in test]) for k in EVAL_STEPS} if lb else {}

    def block(mask: np.ndarray) -> dict[str, Any]:
        d: dict[str, Any] = {"n": int(mask.sum()), **bound_metrics(y[mask], {k: v[mask] for k, v in model_b.items()}, q)}
        d["baselines"] = {}
        if gq_b:
            d["baselines"]["global_quantile"] = bound_metrics(y[mask], {k: v[mask] for k, v in gq_b.items()}, q)
        if lb_b:
            d["baselines"]["length_bucket"] = bound_metrics(y[mask], {k: v[mask] for k, v in lb_b.items()}, q)
        return d

    allm = np.ones(len(test), dtype=bool)
    overall = block(allm)
    report: dict[str, Any] = {"quantile": q, "n": len(test), "n_train_rows": len(train),
                              "n_test_prompts": len({r.prompt.text for r in test}),
                              "model": {k: v for k, v in overall.items() if k != "baselines"},
                              "baselines": overall["baselines"], "by_source": {}}
    sources = np.asarray([r.source for r in test])
    for s in sorted(set(sources.tolist())):
        report["by_source"][s] = block(sources == s)
    say("timing", 0.9)
    report["speed"] = time_predictions(model, [r.prompt for r in test[:2000]])
    report["model_meta"] = model.meta
    return report


def time_predictions(model: LengthModel, prompts: Sequence[PromptInput], reps: int = 200) -> dict[str, float]:
    """p50 latency of featurize+predict for one request, and per request in batches of 100
    (featurize once at arrival; refinements re-predict only)."""
    if not prompts:
        return {}
    rng = np.random.default_rng(0)
    single, batch, refine = [], [], []
    for _ in range(reps):
        p = prompts[int(rng.integers(len(prompts)))]
        t = time.perf_counter()
        model.predict_remaining(model.featurize([p]), [0])
        single.append(time.perf_counter() - t)
    for _ in range(max(reps // 10, 5)):
        idx = rng.integers(len(prompts), size=100)
        ps = [prompts[int(i)] for i in idx]
        t = time.perf_counter()
        b = model.featurize(ps)
        model.predict_remaining(b, np.zeros(100))
        batch.append((time.perf_counter() - t) / 100)
        t = time.perf_counter()
        model.predict_remaining(b, np.full(100, 50))
        refine.append((time.perf_counter() - t) / 100)
    return {"single_p50_ms": round(float(np.median(single)) * 1e3, 3),
            "batch100_per_request_p50_us": round(float(np.median(batch)) * 1e6, 1),
            "refine_batch100_per_request_p50_us": round(float(np.median(refine)) * 1e6, 1)}
