import pytest

from router.latency import PROFILES, BatchLatencyModel, LatencyCoeffs


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
