import pytest

from slogate.router.latency import DEFAULT_PROFILE, PROFILES, BatchLatencyModel, LatencyCoeffs


def test_batch_time_is_eq7_sum_of_prefill_and_decode_terms():
    c = LatencyCoeffs(a_p=1e-6, b_p=2e-6, c_p=1e-3, a_d=1e-5, b_d=1e-3, t_c=0.01)
    m = BatchLatencyModel(c)
    t = m.batch_time([(100, 50)], [1000, 2000])
    prefill = 1e-6 * 100**2 + 2e-6 * 100 * 50 + 1e-3 * 100
    decode = (1e-5 * 1000 + 1e-3) + (1e-5 * 2000 + 1e-3)
    assert t == pytest.approx(0.01 + prefill + decode)


def test_profile_matches_its_documented_anchors():
    m = BatchLatencyModel(PROFILES["llama3.1-8b@a100-80g"])
    assert 0.08 < m.batch_time([(1000, 0)], []) < 0.11  # 1k-token prefill
    assert 0.010 < m.decode_step_time(1, 1000) < 0.013  # batch-1 decode
    assert 0.018 < m.decode_step_time(64, 64 * 1500) < 0.026  # batch-64 decode at 1.5k


def test_online_beta_tracks_a_slower_replica_with_momentum():
    m = BatchLatencyModel(PROFILES["llama3.1-8b@a100-80g"], theta=0.8, window=8, update_every=4)
    est = m.raw_batch_time([], [1000] * 8)
    for _ in range(400):
        m.observe(2.0 * est, est)
    assert m.beta == pytest.approx(2.0, rel=1e-3)
    assert m.decode_step_time(8, 8000) == pytest.approx(2.0 * est, rel=1e-3)


def test_beta_ignores_garbage_observations():
    m = BatchLatencyModel(PROFILES["llama3.1-8b@a100-80g"], update_every=1)
    m.observe(0.0, 1.0)
    m.observe(1.0, 0.0)
    assert m.beta == 1.0


def test_prefill_has_its_own_correction_learned_from_first_tokens() -> None:
    """A CPU engine prefills ~4× slower (relative to its decode) than the profile: first tokens
    of requests dispatched to an empty prefill queue teach the prefill estimate that, without
    touching the decode correction; a request that queued behind another teaches nothing."""
    from slogate.router.request import SLO, Request
    from slogate.router.view import ReplicaView

    m = BatchLatencyModel(PROFILES[DEFAULT_PROFILE])
    v = ReplicaView(0, m, budget=8)
    raw = m.raw_prefill(1000) + m.coeffs.t_c
    assert m.prefill_time(1000) == pytest.approx(m.raw_prefill(1000))  # β_p follows β until observed
    t = 0.0
    for i in range(5):
        r = Request(i, t, 1000, SLO.latency(1.0, 0.05))
        v.claim(r, t)
        if i == 4:  # one more arrives while it prefills: it queues behind
            behind = Request(99, t, 1000, SLO.latency(1.0, 0.05))
            v.claim(behind, t)
        v.first_token(r, t + 4 * raw)
        t += 10.0
    assert m.beta_p == pytest.approx(4.0)
    assert m.prefill_time(1000) == pytest.approx(4.0 * m.raw_prefill(1000))
    assert m.beta == 1.0
    v.first_token(behind, t + 40 * raw)  # it waited behind another prefill: not a clean sample
    assert m.beta_p == pytest.approx(4.0)
