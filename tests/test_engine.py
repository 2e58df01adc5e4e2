import pytest

from slogate.router.latency import BatchLatencyModel
from slogate.router.request import SLO, Request
from slogate.sim.engine import EngineSim, Seq
from tests.helpers import PROFILE


def _seq(rid, inp, out):
    return Seq(Request(rid, 0.0, inp, SLO.deadline(100.0)), out)


def _run(eng, seqs, limit=10_000):
    """Drive the engine alone; return {rid: [token times]}."""
    now, times = 0.0, {s.req.rid: [] for s in seqs}
    for s in seqs:
        eng.add(s)
    for _ in range(limit):
        dt = eng.start_step(now)
        if dt is None:
            break
        now += dt
        for s in eng.finish_step():
            times[s.req.rid].append(now)
            s.req.generated += 1
            if s.req.generated >= s.true_len:
                eng.remove(s)
    return times


def test_chunked_prefill_takes_ceil_input_over_budget_steps_before_the_first_token():
    m = BatchLatencyModel(PROFILE)
    eng = EngineSim(0, m, max_batched_tokens=512)
    s = _seq(1, 1200, 3)
    times = _run(eng, [s])[1]
    # 512 + 512 + 176 prefill chunks, then two decode steps
    first = m.raw_batch_time([(512, 0)], []) + m.raw_batch_time([(512, 512)], []) + m.raw_batch_time([(176, 1024)], [])
    assert times[0] == pytest.approx(first)
    assert times[1] - times[0] == pytest.approx(m.raw_batch_time([], [1200]))  # l_kv = cached tokens
    assert len(times) == 3


def test_max_num_seqs_caps_the_running_batch():
    eng = EngineSim(0, BatchLatencyModel(PROFILE), max_num_seqs=2)
    for i in range(5):
        eng.add(_seq(i, 10, 50))
    eng.start_step(0.0)
    assert len(eng.running) == 2 and len(eng.waiting) == 3


def test_kv_exhaustion_preempts_and_recomputes_but_every_request_completes():
    eng = EngineSim(0, BatchLatencyModel(PROFILE), kv_capacity_tokens=16 * 12)
    seqs = [_seq(i, 40, 60) for i in range(3)]
    times = _run(eng, seqs)
    assert eng.preemptions > 0
    assert all(len(times[s.req.rid]) == 60 for s in seqs)
    assert eng.free_blocks == eng.total_blocks


def test_abort_frees_kv_and_a_step_in_flight_skips_the_aborted_sequence():
    eng = EngineSim(0, BatchLatencyModel(PROFILE))
    a, b = _seq(1, 100, 10), _seq(2, 100, 10)
    eng.add(a)
    eng.add(b)
    eng.start_step(0.0)
    assert eng.abort(1) is a
    emitted = eng.finish_step()
    assert emitted == [b]
    assert eng.free_blocks == eng.total_blocks - b.blocks
