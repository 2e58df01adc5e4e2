"""Live workflow sub-deadlines (gateway/workflows.py): each call gets its stage's share of the
workflow deadline, matched against finished workflows; the gateway learns from live ones."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest

from slogate.gateway.config import WorkflowsConfig
from slogate.gateway.workflows import WorkflowBook


def _history(path: Path, n: int = 6) -> Path:
    """Workflows of three stages: a long planning answer, a short tool call, a medium summary.
    Modelled stage times ≈ 0.025 s/token: 800 → 20 s, 40 → 1 s (+ 5 s tool time), 200 → 5 s:
    φ ≈ 0.65, 0.84, 1.0."""
    with path.open("w") as f:
        for i in range(n):
            calls = [{"call_id": 0, "stage": 0, "input_tokens": 300 + i, "output_tokens": 800 + 10 * i, "phase": "plan"},
                     {"call_id": 1, "stage": 1, "input_tokens": 1200, "output_tokens": 40, "gap_before_s": 5.0, "phase": "tool"},
                     {"call_id": 2, "stage": 2, "input_tokens": 1300, "output_tokens": 200, "phase": "summary"}]
            f.write(json.dumps({"workflow_id": f"h{i}", "calls": calls}) + "\n")
    return path


def _run(book: WorkflowBook, wf_id: str, t0: float, deadline_ms: float = 100_000, outs: tuple[int, ...] = (800, 40, 200)) -> list[float]:
    """Issue the three calls one after the other (each 1 s after the previous ended); their sub-deadlines, s from the start."""
    got, now = [], t0
    for stage, (label, n_in, n_out) in enumerate(zip(("plan", "tool", "summary"), (300, 1200, 1300), outs, strict=True)):
        wf = book.get(wf_id, now, deadline_ms)
        call = book.issue(wf, stage, n_in, label, stage == 2, now)
        got.append(call.deadline_at - wf.started_at)
        now += n_out * 0.01
        call.ended(n_out, now)
        now += 1.0
    return got


def test_without_history_every_call_gets_the_whole_deadline() -> None:
    assert _run(WorkflowBook(WorkflowsConfig()), "w", 0.0) == pytest.approx([100.0, 100.0, 100.0])


def test_history_splits_the_deadline_by_stage(tmp_path: Path) -> None:
    book = WorkflowBook(WorkflowsConfig(history=_history(tmp_path / "h.jsonl")))
    d = _run(book, "w", 0.0)
    assert d[0] == pytest.approx(65.0, abs=5.0) and d[1] == pytest.approx(84.0, abs=5.0) and d[2] == pytest.approx(100.0, abs=1.0)
    assert d[0] < d[1] < d[2]
    desc = book.describe("w")
    assert desc is not None and [c["stage"] for c in desc["calls"]] == [0, 1, 2] and desc["calls_done"] == 3
    assert desc["tokens_done"] == 300 + 800 + 1200 + 40 + 1300 + 200


def test_stage_deadlines_off_keeps_the_whole_deadline(tmp_path: Path) -> None:
    book = WorkflowBook(WorkflowsConfig(history=_history(tmp_path / "h.jsonl"), stage_deadlines=False))
    assert _run(book, "w", 0.0) == pytest.approx([100.0, 100.0, 100.0]) and book.patterns == 0


def test_calls_of_one_stage_share_its_sub_deadline(tmp_path: Path) -> None:
    book = WorkflowBook(WorkflowsConfig(history=_history(tmp_path / "h.jsonl")))
    wf = book.get("w", 0.0, 100_000)
    a = book.issue(wf, 0, 300, "plan", False, 0.0)
    b = book.issue(wf, 0, 300, "plan", False, 3.0)  # a sibling issued later: the same stage deadline
    assert a.deadline_at == b.deadline_at < 100.0


def test_live_workflows_are_learned_when_they_finish() -> None:
    book = WorkflowBook(WorkflowsConfig(idle_s=5.0))
    for i in range(4):  # each ended by its `final` call
        _run(book, f"w{i}", 10.0 * i)
    assert book.patterns == 0  # learned by the health loop's step, not on the request path
    asyncio.run(book.expire(50.0))
    assert book.patterns == 4 and book.learned == 4
    d = _run(book, "next", 60.0)
    assert d[0] < 90.0 and d[0] < d[1] < d[2] == pytest.approx(100.0)
    # One without a final call is learned `idle_s` after its deadline, not before.
    wf = book.get("open", 100.0, 10_000)
    book.issue(wf, 0, 300, "plan", False, 100.0).ended(800, 108.0)
    asyncio.run(book.expire(112.0))
    assert book.patterns == 5  # "next" (final) learned; "open" still within deadline + idle_s
    asyncio.run(book.expire(116.0))
    assert book.patterns == 6


def test_sub_deadlines_never_move_backwards(tmp_path: Path) -> None:
    book = WorkflowBook(WorkflowsConfig(history=_history(tmp_path / "h.jsonl")))
    # Stage 0 took far longer than any history's: stage 1's estimate may not fall below stage 0's.
    d = _run(book, "w", 0.0, outs=(4000, 40, 200))
    assert d[0] <= d[1] <= d[2]


def test_gateway_gives_each_stage_its_share_and_learns(tmp_path: Path) -> None:
    """The real OpenAI SDK → gateway → simulated engine: the calls of a workflow get their stage
    sub-deadlines (seen through /admin/workflows), and the workflow is learned when its final call ends."""
    import hashlib
    from contextlib import ExitStack

    import httpx
    import openai
    from servers import ServerThread

    from slogate.gateway.app import create_app
    from slogate.gateway.config import GatewayConfig
    from slogate.sim.server import create_engine_app

    admin = {"authorization": "Bearer adm"}
    with ExitStack() as st:
        eng = st.enter_context(ServerThread(create_engine_app("m")))
        cfg = GatewayConfig.model_validate({
            "backends": [{"url": eng.url, "models": ["m"], "budget": 8}], "health_interval_s": 0.2,
            "auth": {"admin_sha256": hashlib.sha256(b"adm").hexdigest()},
            "workflows": {"history": str(_history(tmp_path / "h.jsonl")), "idle_s": 1.0}})
        gw = st.enter_context(ServerThread(create_app(cfg)))
        client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="x", max_retries=0)
        for stage, (label, n_out) in enumerate((("plan", 30), ("tool", 3), ("summary", 10))):
            r = client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "x" * 4 * (300 + 900 * (stage > 0))}], max_tokens=n_out,
                extra_body={"ignore_eos": True, "workflow": {"id": "run-1", "stage": stage, "deadline_ms": 100_000, "label": label,
                                                              "final": stage == 2}})
            assert r.usage is not None and r.usage.completion_tokens == n_out
        d = httpx.get(f"{gw.url}/admin/workflows/run-1", headers=admin).json()
        dl = [c["deadline_s"] for c in d["calls"]]
        assert dl[0] == pytest.approx(65.0, abs=6.0) and dl[0] < dl[1] < dl[2] == pytest.approx(100.0, abs=0.5), d
        assert [c["output_tokens"] for c in d["calls"]] == [30, 3, 10] and d["finished"]
        assert httpx.get(f"{gw.url}/admin/workflows/nope", headers=admin).status_code == 404
        t0 = time.monotonic()
        while httpx.get(f"{gw.url}/admin/state", headers=admin).json()["workflows_learned"] < 1:
            assert time.monotonic() - t0 < 10, "the finished workflow was never learned"
            time.sleep(0.1)
        assert httpx.get(f"{gw.url}/admin/state", headers=admin).json()["workflow_patterns"] == 7
