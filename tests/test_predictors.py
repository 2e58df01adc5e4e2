from __future__ import annotations

import json
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from conftest import synthetic_prompt_rows
from typer.testing import CliRunner

from slogate.predictors.evaluate import GlobalQuantile, PromptRow, bound_metrics, evaluate, load_prompt_rows, split_rows
from slogate.predictors.features import HAND_FEATURES, PromptInput, asked_tokens, hand_features, hash_ngrams, prompt_from_body
from slogate.predictors.forest import CompiledForest
from slogate.predictors.online import OnlineLengthPredictor
from slogate.predictors.paired import PromptPool
from slogate.predictors.qrf import ForestParams, LengthModel, band_of, is_heldout

SMALL = ForestParams(n_estimators=16, min_samples_leaf=8, max_samples=0.5)


def _rows(n: int = 3000, seed: int = 0) -> list[PromptRow]:
    return [PromptRow(PromptInput(r["prompt"], r["model"]), r["response_len_tokens_cl100k"], r["prompt_len_tokens_cl100k"], "synthetic")
            for r in synthetic_prompt_rows(n, seed)]


@pytest.fixture(scope="module")
def trained() -> tuple[LengthModel, list[PromptRow], list[PromptRow]]:
    rows = _rows()
    train, test = split_rows(rows, 0.25)
    m = LengthModel(q=0.9, n_hash=2**14, forest_params=SMALL)
    m.fit([r.prompt for r in train], [r.true_len for r in train], [r.prompt.text for r in train])
    return m, train, test


# ------------------------------------------------------------------ features
def test_cues_and_explicit_limits_are_read_from_the_text() -> None:
    f = dict(zip(HAND_FEATURES, hand_features(PromptInput("Write a Python function; explain step by step. Keep it under 100 words.")), strict=True))
    assert f["cue_code"] == 1 and f["cue_step_by_step"] == 1 and f["cue_translate"] == 0
    assert asked_tokens("answer in 100 words") == pytest.approx(130)
    assert asked_tokens("write three paragraphs") == pytest.approx(330)
    assert asked_tokens("no limit here") == 0
    assert dict(zip(HAND_FEATURES, hand_features(PromptInput("What is 2+2?")), strict=True))["cue_question"] == 1


def test_prompt_from_body_reads_chat_completions_and_responses_shapes() -> None:
    chat = prompt_from_body({"model": "m", "max_tokens": 64, "messages": [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hi there"}]}]})
    assert chat.text == "be brief\n\nhi there" and chat.n_messages == 2 and chat.max_tokens == 64 and chat.model == "m"
    assert prompt_from_body({"prompt": "complete me"}).text == "complete me"
    resp = prompt_from_body({"input": "respond", "max_output_tokens": 10})
    assert resp.text == "respond" and resp.max_tokens == 10
    assert prompt_from_body({"messages": [{"role": "user"}], "max_tokens": -3}).max_tokens is None


def test_hashed_ngrams_are_stable_and_normalised() -> None:
    a = hash_ngrams(["the cat sat", "the cat sat", ""], 2**10)
    assert (a[0] != a[1]).nnz == 0
    assert np.allclose(np.sqrt(a.multiply(a).sum(axis=1)).A.ravel(), [1, 1, 0], atol=1e-6)
    with pytest.raises(ValueError):
        hash_ngrams(["x"], 1000)


# ------------------------------------------------------------------ compiled forest
def test_compiled_forest_matches_sklearn_leaves_and_leaf_quantiles() -> None:
    from quantile_forest import RandomForestQuantileRegressor

    rng = np.random.default_rng(1)
    X = rng.normal(size=(800, 5)).astype(np.float32)
    y = np.exp(X[:, 0] + 0.3 * rng.normal(size=800)) * 50
    qrf = RandomForestQuantileRegressor(n_estimators=8, min_samples_leaf=10, random_state=0).fit(X, y)
    cf = CompiledForest.from_estimators(qrf.estimators_, X, y, [0.5, 0.9])
    Xt = rng.normal(size=(200, 5)).astype(np.float32)
    leaves = cf.apply(Xt)
    offsets = np.cumsum([0] + [e.tree_.node_count for e in qrf.estimators_])[:-1]
    for t, est in enumerate(qrf.estimators_):
        assert np.array_equal(leaves[:, t] - offsets[t], est.apply(Xt))
    # a leaf's value is the quantile of the training targets that reach it
    train_leaf = qrf.estimators_[3].apply(X)
    leaf = train_leaf[0]
    assert cf.values[0.9][leaf + offsets[3]] == pytest.approx(np.quantile(y[train_leaf == leaf], 0.9), rel=1e-5)
    assert np.allclose(cf.predict(Xt, 0.9), cf.values[0.9][leaves].mean(axis=1))
    with pytest.raises(KeyError):
        cf.predict(Xt, 0.7)


# ------------------------------------------------------------------ the model
def test_bound_covers_q_and_beats_a_global_quantile(trained) -> None:
    m, train, test = trained
    y = np.asarray([r.true_len for r in test])
    b = m.predict_remaining(m.featurize([r.prompt for r in test]), np.zeros(len(test)))
    cov = float(np.mean(y <= b))
    assert 0.84 <= cov <= 0.97
    g = GlobalQuantile([r.true_len for r in train], 0.9).bound(0)
    assert np.mean(b / y) < 0.5 * np.mean(g / y)  # the prompt says how long the answer will be


def test_bound_respects_generated_and_max_tokens(trained) -> None:
    m, _, test = trained
    base = m.featurize([r.prompt for r in test[:50]])
    gen = np.arange(50) * 10
    b, med = m.predict(base, gen, [300] * 50)
    assert (b >= 1).all() and (med <= b).all()
    assert (gen + b <= np.maximum(300, gen + 1)).all()  # never past max_tokens, never below 1 token
    unc = m.predict_remaining(base, gen)
    assert (unc >= b).all()


def test_refinement_relaxes_the_bound_for_answers_that_outlive_it(trained) -> None:
    m, _, test = trained
    base = m.featurize([r.prompt for r in test])
    y = np.asarray([r.true_len for r in test])
    at0 = m.predict_remaining(base, np.zeros(len(test)))
    missed = (y > at0) & (y > 100)  # the first bound was too low and the answer is still running at 100
    assert missed.sum() >= 10
    at100 = m.predict_remaining(base[missed], np.full(int(missed.sum()), 100))
    assert (100 + at100 > at0[missed]).all()  # the refined total bound grew past the first one
    assert np.mean(100 + at100 >= y[missed]) >= 0.5  # and now covers most of them


def test_save_load_round_trip(tmp_path: Path, trained) -> None:
    m, _, test = trained
    p = tmp_path / "m.model"
    size = m.save(p)
    assert size < 50e6
    m2 = LengthModel.load(p)
    base = m.featurize([r.prompt for r in test[:20]])
    assert np.array_equal(m.predict_remaining(base, np.zeros(20)), m2.predict_remaining(m2.featurize([r.prompt for r in test[:20]]), np.zeros(20)))
    bad = tmp_path / "bad.model"
    import joblib

    joblib.dump({"not": "a model"}, bad)
    with pytest.raises(ValueError, match="does not hold"):
        LengthModel.load(bad)


def test_training_refuses_too_little_data() -> None:
    with pytest.raises(ValueError, match="at least"):
        LengthModel().fit([PromptInput("x")] * 10, [5] * 10, ["x"] * 10)


def test_split_is_by_prompt_and_deterministic() -> None:
    rows = _rows(600)
    a_train, a_test = split_rows(rows, 0.2)
    _b_train, b_test = split_rows(rows, 0.2)
    assert [r.prompt.text for r in a_test] == [r.prompt.text for r in b_test]
    assert not {r.prompt.text for r in a_train} & {r.prompt.text for r in a_test}
    assert 0.1 < len(a_test) / len(rows) < 0.3
    assert is_heldout("same text", 0.2) == is_heldout("same text", 0.2)
    assert band_of(0) == 0 and band_of(149) == 100 and band_of(5000) == 800


def test_metrics_count_only_requests_still_running() -> None:
    y = np.asarray([10, 60, 120, 300])
    b = {k: np.full(4, 100.0) for k in (0, 50, 100, 200)}
    m = bound_metrics(y, b, 0.9)
    assert m["n_at_0"] == 4 and m["n_at_100"] == 2 and m["n_at_200"] == 1
    assert m["coverage_at_0"] == 0.5  # 120 and 300 exceed 100
    assert m["coverage_at_100"] == 0.5  # remaining 20 ≤ 100, 200 > 100


# ------------------------------------------------------------------ online learning
def test_cold_start_is_conservative_then_learns_from_history() -> None:
    p = OnlineLengthPredictor(model=None, min_history=20, cold_bound=2048, retrain_every=10**9)
    t = p.track(PromptInput("hello"))
    b, _ = p.predict([t, t], [0, 0], [None, 100])
    assert b.tolist() == [2048, 100]
    for n in range(1, 41):
        p.observe(t, n * 5)
    b, _ = p.predict([t], [0])
    assert 150 <= b[0] <= 200  # the 0.9-quantile of 5..200


def test_online_retraining_runs_in_the_background_and_swaps_atomically() -> None:
    rows = _rows(1500, seed=3)
    ex = ThreadPoolExecutor(1)
    p = OnlineLengthPredictor(model=None, retrain_every=1200, min_train_rows=1000, executor=ex)
    t = p.track(PromptInput("Write a detailed essay about jazz 3."))
    cold, _ = p.predict([t], [0])
    started = time.perf_counter()
    for r in rows[:1200]:
        p.observe(r.prompt, r.true_len)  # the 1200th call starts a retrain
    assert time.perf_counter() - started < 1.0  # observing never waits for training
    assert p.stats.retrains == 1 and p.version == 0
    p.wait_idle(timeout=120)
    assert p.version == 1 and p.model is not None and p.stats.swaps == 1
    warm, _ = p.predict([t], [0])
    assert t.version == 1 and warm[0] != cold[0]
    assert not p.retrain() or p.stats.retrains == 2
    p.wait_idle(timeout=120)
    p.close()


def test_retraining_waits_for_distinct_prompts() -> None:
    """One prompt repeated (a benchmark, a fixed system prompt) cannot be cross-fitted: no retrain
    is started (it used to fail in the worker with an empty fold, every time)."""
    p = OnlineLengthPredictor(model=None, retrain_every=100, min_train_rows=100, executor=ThreadPoolExecutor(1))
    for i in range(300):
        p.observe(PromptInput("the same prompt"), 10 + i % 50)
    assert p.stats.retrains == 0 and p.stats.skipped >= 2
    for i in range(100):
        p.observe(PromptInput(f"prompt number {i} about topic {i % 7}"), 10 + i % 50)
    assert p.stats.retrains == 1
    p.wait_idle(timeout=120)
    assert p.stats.failures == 0
    p.close()


def test_a_worse_retrained_model_is_rejected(trained) -> None:
    m, _, _ = trained
    p = OnlineLengthPredictor(model=m)
    p.stats.retrains = 1
    fut: Future = Future()
    fut.set_result((LengthModel(), {"new_pinball": 50.0, "old_pinball": 10.0}))
    p._landed(fut)
    assert p.model is m and p.version == 0 and p.stats.rejected == 1


def test_retraining_in_a_worker_process(tmp_path: Path) -> None:
    rows = _rows(700, seed=5)
    p = OnlineLengthPredictor(model=None, retrain_every=600, min_train_rows=600)
    for r in rows[:600]:
        p.observe(r.prompt, r.true_len)
    p.wait_idle(timeout=240)
    p.close()
    assert p.version == 1 and isinstance(p.model, LengthModel)


# ------------------------------------------------------------------ evaluation report and CLI
def test_train_and_eval_cli_write_the_documented_report(tmp_path: Path, synthetic_prompts: Path) -> None:
    from slogate.cli import app

    model, report = tmp_path / "len.model", tmp_path / "report.json"
    r = CliRunner().invoke(app, ["train-predictor", "--data", str(synthetic_prompts), "--out", str(model)])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(app, ["eval-predictor", "--model", str(model), "--data", str(synthetic_prompts), "--out", str(report)])
    assert r.exit_code == 0, r.output
    rep = json.loads(report.read_text())
    keys = {"coverage_at_0", "coverage_at_50", "coverage_at_100", "coverage_at_200", "mean_ratio_at_0", "p50_ratio_at_0", "mean_ratio_at_100", "pinball_at_0"}
    assert rep["quantile"] == 0.9 and rep["n"] > 300
    assert keys <= rep["model"].keys()
    assert keys <= rep["baselines"]["global_quantile"].keys() and keys <= rep["baselines"]["length_bucket"].keys()
    assert keys <= rep["by_source"]["synthetic"].keys()
    assert rep["model"]["mean_ratio_at_0"] < 0.6 * rep["baselines"]["global_quantile"]["mean_ratio_at_0"]
    r = CliRunner().invoke(app, ["train-predictor", "--data", str(tmp_path / "missing.jsonl"), "--out", str(model)])
    assert r.exit_code != 0 and "no such file" in r.output


def test_load_prompt_rows_reports_bad_lines(tmp_path: Path) -> None:
    p = tmp_path / "prompts_bad.jsonl"
    p.write_text('{"prompt": "a", "response_len_tokens_cl100k": 3}\n{"prompt": "b"}\n')
    with pytest.raises(ValueError, match=r"prompts_bad\.jsonl:2"):
        load_prompt_rows([p])


def test_prompt_pool_pairs_by_length() -> None:
    pool = PromptPool(_rows(600))
    for n in (50, 120, 200, 400):
        assert abs(pool.pick(n).true_len - n) <= 0.1 * n
    assert pool.pick(10**6).true_len >= sorted(pool.lens)[-10]  # past the longest: the nearest ones


def test_evaluate_on_real_prompts(data_dir: Path) -> None:
    """The acceptance split on a subsample of the real data (the full run is in docs/benchmarks.md)."""
    rows = load_prompt_rows([data_dir / f"prompts_{s}.jsonl" for s in ("gpteacher", "gsm8k", "hhrlhf")])[::3]
    train, test = split_rows(rows, 0.2)
    m = LengthModel(forest_params=ForestParams(n_estimators=24)).fit([r.prompt for r in train], [r.true_len for r in train],
                                                                     [r.prompt.text for r in train])
    rep = evaluate(m, train, test)
    assert abs(rep["model"]["coverage_at_0"] - 0.9) <= 0.05
    assert rep["model"]["mean_ratio_at_0"] <= 0.75 * rep["baselines"]["global_quantile"]["mean_ratio_at_0"]
