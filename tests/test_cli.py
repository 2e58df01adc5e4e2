import json

from typer.testing import CliRunner

from slogate.cli import app

runner = CliRunner()


def test_simulate_writes_the_documented_json(tmp_path, synthetic_trace):
    out, png = tmp_path / "r.json", tmp_path / "g.png"
    res = runner.invoke(app, ["simulate", "--trace", str(synthetic_trace), "--mix", "latency=1,deadline=1", "--replicas", "2",
                              "--rate-scale", "1,2", "--policies", "gmax+gorouting,fcfs+least-load", "--out", str(out), "--plot", str(png)])
    assert res.exit_code == 0, res.output
    doc = json.loads(out.read_text())
    assert doc["config"]["requests"] == 600
    assert len(doc["results"]) == 4
    for row in doc["results"]:
        for key in ("name", "token_goodput", "request_goodput", "tdg_ratio", "ttft_p50", "ttft_p95", "tbt_p95", "e2e_p50",
                    "throughput_tokens", "shed", "preempted", "resume_gap_mean", "resume_gap_max"):
            assert key in row
        assert set(row["slo_attainment"]) >= {"latency", "deadline", "all"}
        assert 0 <= row["tdg_ratio"] <= 1
    assert png.stat().st_size > 1000


def test_simulate_on_real_data(data_dir, tmp_path):
    out = tmp_path / "r.json"
    res = runner.invoke(app, ["simulate", "--trace", str(data_dir / "trace_azure2023_conv.csv"), "--workflows",
                              str(data_dir / "workflows_chatdev.jsonl"), "--max-requests", "400", "--rate-scale", "10",
                              "--policies", "gmax+gorouting,slide+gorouting", "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert {r["name"] for r in json.loads(out.read_text())["results"]} == {"gmax+gorouting", "slide+gorouting"}


def test_bad_policy_and_missing_workflows_are_clear_errors(synthetic_trace):
    res = runner.invoke(app, ["simulate", "--trace", str(synthetic_trace), "--policies", "gmax+nowhere"])
    assert res.exit_code != 0 and "unknown placement policy" in res.output
    res = runner.invoke(app, ["simulate", "--trace", str(synthetic_trace), "--mix", "compound=1"])
    assert res.exit_code != 0 and "workflows" in res.output
    res = runner.invoke(app, ["simulate", "--trace", str(synthetic_trace), "--predictor", "qrf"])
    assert res.exit_code != 0 and "qrf" in res.output


def test_a_class_with_weight_zero_is_left_out_of_the_mix(tmp_path, synthetic_trace):
    # compound=0 needs no --workflows file: weight 0 means the class is not in the mix at all.
    out = tmp_path / "r.json"
    res = runner.invoke(app, ["simulate", "--trace", str(synthetic_trace), "--mix", "latency=1,deadline=1,compound=0", "--replicas", "2",
                              "--policies", "fcfs+least-load", "--out", str(out)])
    assert res.exit_code == 0, res.output
    att = json.loads(out.read_text())["results"][0]["slo_attainment"]
    assert {"latency", "deadline"} <= set(att) and "compound" not in att, att
    for bad, msg in (("latency=0,deadline=0", "weight 0"), ("latency=-1,deadline=1", "negative"), ("latency=x", "number")):
        res = runner.invoke(app, ["simulate", "--trace", str(synthetic_trace), "--mix", bad])
        assert res.exit_code != 0 and msg in res.output, (bad, res.output)
