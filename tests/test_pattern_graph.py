from __future__ import annotations

import json
from pathlib import Path

import networkx as nx
import numpy as np
import pytest
from typer.testing import CliRunner

from slogate.predictors.pattern_eval import evaluate_file, match_latency
from slogate.predictors.pattern_graph import JITServeCodeMatcher, PatternStore, WfCall, stage_shares, stage_summary, workflow_graph


def chain(key_out: list[int], labels: list[str] | None = None, gap: float = 0.0) -> list[WfCall]:
    """A sequential workflow: stage i has one call with the given output tokens."""
    labels = labels or ["llm"] * len(key_out)
    return [WfCall(i, i, 100, o, [i - 1] if i else [], gap if i else 0.0, labels[i]) for i, o in enumerate(key_out)]


def test_graph_has_llm_and_tool_nodes_and_stage_super_nodes() -> None:
    calls = [WfCall(0, 0, 100, 40, [], 0.0, "plan"), WfCall(1, 1, 200, 80, [0], 2.0, "act"), WfCall(2, 1, 210, 20, [0], 0.0, "act"),
             WfCall(3, 2, 300, 10, [1, 2], 0.0, "answer")]
    g = workflow_graph(calls)
    assert nx.is_directed_acyclic_graph(g)
    assert g.nodes[("gap", 1)]["kind"] == "tool" and g.has_edge(0, ("gap", 1)) and g.has_edge(("gap", 1), 1)
    st = stage_summary(g)
    assert [s.stage for s in st] == [0, 1, 2]
    assert st[1].calls == 2 and st[1].input_tokens == 410 and st[1].output_tokens == 100 and st[1].tool_s == 2.0
    assert st[1].time_s == pytest.approx(2.0 + 200e-4 + 80 * 0.025)  # side-by-side calls: the slowest
    phi = stage_shares(st)
    assert phi[-1] == pytest.approx(1.0) and np.all(np.diff(phi) > 0)


def test_matching_prefers_the_same_shape_and_prunes_diverging_labels() -> None:
    store = PatternStore(top_k=1)
    store.add("short-first", chain([10, 400, 400, 400]))
    store.add("long-first", chain([400, 10, 10, 10]))
    store.add("other-tool", chain([10, 400, 400, 400], ["llm", "search", "llm", "llm"]))
    probe = stage_summary(workflow_graph(chain([12, 390, 420, 380])))
    est = store.match(probe[:1], probe[1])
    assert est is not None and est.phi == pytest.approx(stage_shares(stage_summary(workflow_graph(chain([10, 400, 400, 400]))))[1])
    # a workflow whose stage 1 calls the search tool only matches the graph that did the same
    probe2 = stage_summary(workflow_graph(chain([400, 10, 10, 10], ["llm", "search", "llm", "llm"])))
    est2 = store.match(probe2[:1], probe2[1])
    assert est2 is not None and est2.matched == 1
    # no history as long as the workflow: nothing to say
    assert store.match(probe[:3], probe[3]) is not None and store.match(probe * 2, probe[0]) is None


def test_leave_one_out_excludes_the_workflow_itself() -> None:
    store = PatternStore(top_k=1)
    store.add("a", chain([10, 400, 10]))
    store.add("b", chain([400, 10, 400]))
    probe = stage_summary(workflow_graph(chain([10, 400, 10])))
    assert store.match(probe[:1], probe[1]).phi > 0.9
    assert store.match(probe[:1], probe[1], exclude="a").phi < 0.6


def test_eviction_keeps_the_reused_patterns() -> None:
    store = PatternStore(capacity=3, top_k=1)
    for i, outs in enumerate([[10, 400], [400, 10], [200, 200]]):
        store.add(f"w{i}", chain(outs), now_h=0.0)
    probe = stage_summary(workflow_graph(chain([400, 10])))
    for _ in range(3):
        store.match(probe[:1], probe[1], now_h=1.0)  # w1 gets reused
    store.add("w3", chain([50, 50]), now_h=2.0)
    assert "w1" in [p.key for p in store.patterns] and len(store.patterns) == 3
    # reuse decays by 0.9 per hour
    p = next(p for p in store.patterns if p.key == "w1")
    assert store._score(p, p.reuse_at + 10) == pytest.approx(p.reuse * 0.9**10)


def test_k_medoids_compaction_keeps_one_per_cluster() -> None:
    store = PatternStore()
    for i in range(10):
        store.add(f"short{i}", chain([10 + i, 400 - i]))
        store.add(f"long{i}", chain([400 + i, 10 + i, 10, 10, 10]))
    store.compact(2)
    assert len(store.patterns) == 2
    assert {p.key[:4] for p in store.patterns} == {"shor", "long"}
    assert sorted(p.weight for p in store.patterns) == [10.0, 10.0]


def test_jitserve_code_matcher_is_fooled_by_raw_token_scales() -> None:
    store = PatternStore()
    store.add("a", chain([10, 400, 400]))
    store.add("b", chain([10, 420, 400, 400, 400, 400]))
    jit = JITServeCodeMatcher(store.patterns)
    probe = stage_summary(workflow_graph(chain([10, 410, 400, 400, 400, 400])))
    # without prefix matching, the shorter graph looks closer while the future stages are zeros
    assert jit.match(probe[:1], probe[1]).stages_left == 1.0


def _write_workflows(path: Path, n: int) -> Path:
    rng = np.random.default_rng(0)
    lines = []
    for i in range(n):
        kind = i % 2
        outs = [20, 600, 30] if kind == 0 else [600, 20, 20, 20, 20]
        calls = [{"call_id": j, "stage": j, "input_tokens": 100, "output_tokens": int(o * rng.uniform(0.8, 1.2)),
                  "parent_ids": [j - 1] if j else [], "phase": f"p{kind}{j}"} for j, o in enumerate(outs)]
        lines.append(json.dumps({"workflow_id": f"w{i}", "calls": calls}))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_leave_one_out_evaluation_beats_uniform_on_structured_workflows(tmp_path: Path) -> None:
    r = evaluate_file(_write_workflows(tmp_path / "workflows_x.jsonl", 40))
    assert r["pattern"]["all"]["phi_mae"] < 0.5 * r["uniform"]["all"]["phi_mae"]
    assert r["pattern"]["all"]["n"] == 20 * 3 + 20 * 5
    assert match_latency([tmp_path / "workflows_x.jsonl"], n_graphs=40, queries=20)["graphs"] == 40


def test_eval_graphs_cli(tmp_path: Path) -> None:
    from slogate.cli import app

    f = _write_workflows(tmp_path / "workflows_y.jsonl", 20)
    out = tmp_path / "g.json"
    r = CliRunner().invoke(app, ["eval-graphs", "--workflows", str(f), "--out", str(out)])
    assert r.exit_code == 0, r.output
    rep = json.loads(out.read_text())
    assert set(rep["files"]["workflows_y.jsonl"]) >= {"pattern", "uniform", "jitserve_code", "match_ms_p50"}


def test_real_workflows_pattern_beats_uniform(data_dir: Path) -> None:
    r = evaluate_file(data_dir / "workflows_chatdev.jsonl")
    assert r["pattern"]["all"]["phi_mae"] < r["uniform"]["all"]["phi_mae"]
    assert r["pattern"]["all"]["phi_mae"] < r["jitserve_code"]["all"]["phi_mae"]
