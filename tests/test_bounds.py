"""The isolation bound (sim/bounds.py): hand-checked cases, and no policy ever exceeds it."""

import pytest

from slogate.router.latency import BatchLatencyModel, LatencyCoeffs
from slogate.router.request import SLO, SLOClass, Tier
from slogate.sim.bounds import isolation_goodput, token_times
from slogate.sim.runner import Experiment, SimConfig
from slogate.sim.workload import Call, Job, WorkflowSpec, Workload

# Round numbers: a prefill chunk costs 1 s + 0.01 s/token, a decode step 0.5 s.
C = LatencyCoeffs(a_p=0.0, b_p=0.0, c_p=0.01, a_d=0.0, b_d=0.0, t_c=0.5)
T = Tier("t", 1.0)


def test_token_times_chunk_the_prefill_then_decode_one_token_per_step():
    # 150 input tokens in chunks of 100: (0.5 + 1.0) + (0.5 + 0.5) = 2.5 s to the first token.
    assert list(token_times(BatchLatencyModel(C), 150, 3, chunk=100)) == pytest.approx([2.5, 3.0, 3.5])


def test_latency_tokens_count_only_when_they_would_be_on_their_timeline_alone():
    # Tokens alone at 2.5, 3.0, 3.5, 4.0 s. TTFT 3 s, TBT 0.4 s: due 3.0, 3.4, 3.8, 4.2, all 4 on
    # time; TBT 0.3 s: due 3.0, 3.3, 3.6, 3.9, the last one is late.
    wl = Workload([Job(0.0, SLOClass.LATENCY, T, slo=SLO.latency(3.0, 0.4), input_tokens=150, output_tokens=4)], span_s=10.0)
    assert isolation_goodput(wl, C, chunk=100)["latency"] == pytest.approx(0.4)
    wl.jobs[0].slo = SLO.latency(3.0, 0.3)
    assert isolation_goodput(wl, C, chunk=100)["latency"] == pytest.approx(0.3)


def test_a_deadline_request_counts_input_and_output_only_if_it_fits_alone():
    ok = Job(0.0, SLOClass.DEADLINE, T, slo=SLO.deadline(4.0), input_tokens=150, output_tokens=3)  # done at 3.5 s
    late = Job(1.0, SLOClass.DEADLINE, T, slo=SLO.deadline(3.0), input_tokens=150, output_tokens=3)
    g = isolation_goodput(Workload([ok, late], span_s=10.0), C, chunk=100)
    assert g["deadline"] == pytest.approx(153 / 10.0) and g["all"] == pytest.approx(153 / 10.0)


def test_a_workflow_counts_if_its_critical_path_of_gaps_and_calls_fits():
    # a (2 s alone) → 5 s tool gap → b (2 s): critical path 9 s; c runs beside them.
    calls = [Call(0, 0, 100, 2, [], 0.0), Call(1, 1, 100, 2, [0], 5.0), Call(2, 0, 100, 2, [], 0.0)]
    spec = WorkflowSpec("w", calls)
    fits = Job(0.0, SLOClass.COMPOUND, T, workflow=spec, wf_deadline_s=9.0)
    misses = Job(0.0, SLOClass.COMPOUND, T, workflow=spec, wf_deadline_s=8.9)
    assert isolation_goodput(Workload([fits], span_s=1.0), C, chunk=100)["compound"] == pytest.approx(306)
    assert "compound" not in isolation_goodput(Workload([misses], span_s=1.0), C, chunk=100)


def test_no_policy_earns_more_than_the_bound(synthetic_trace):
    cfg = SimConfig(trace=str(synthetic_trace), mix="latency=1,deadline=1", replicas=1, rate_scale=3.0, budget=24, predictor="oracle")
    exp = Experiment(cfg)
    for combo in ("fcfs+least-load", "gmax+gorouting", "edf+least-load"):
        row = exp.run(combo)
        assert 0 < row["token_goodput"] <= row["ideal_token_goodput"], combo
    light = Experiment(SimConfig(trace=str(synthetic_trace), mix="latency=1,deadline=1", replicas=4, rate_scale=0.2)).run("fcfs+least-load")
    # With no contention every request runs as if alone: the bound is met exactly.
    assert light["token_goodput"] == pytest.approx(light["ideal_token_goodput"], rel=0.02)


def test_token_times_are_what_the_engine_model_does_for_one_request_alone():
    from slogate.router.latency import DEFAULT_PROFILE, PROFILES
    from slogate.router.request import Request
    from slogate.sim.engine import EngineSim, Seq

    model = BatchLatencyModel(PROFILES[DEFAULT_PROFILE])
    eng = EngineSim(0, model, max_batched_tokens=512)
    req = Request(0, 0.0, 1300, SLO.deadline(20.0))
    seq = Seq(req, 5)
    eng.add(seq)
    t, times = 0.0, []
    while req.generated < 5:
        t += eng.start_step(t)  # type: ignore[operator]
        for s in eng.finish_step():
            s.req.generated += 1
            times.append(t)
    assert times == pytest.approx(list(token_times(model, 1300, 5, chunk=512)), rel=1e-12)
