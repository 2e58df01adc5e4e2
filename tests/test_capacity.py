"""The learned SLO-safe budget on synthetic replicas whose inter-token time grows with the batch."""

from __future__ import annotations

import math
import random

from helpers import req, view

from slogate.router.capacity import ANCHOR_S, CapacityLearner


def drive(learner: CapacityLearner, itl, seconds: int, target: float, offered: int = 10_000, rng: random.Random | None = None) -> list[int]:
    """Each second the replica holds min(budget, offered) sequences and reports 50 token gaps; the
    rest of what is offered waits for it (the demand `demand_margin` reads)."""
    rng = rng or random.Random(0)
    budgets = []
    t0 = learner.last_update + 1 if learner.last_update > -1e9 else 0.0
    for t in (t0 + i for i in range(seconds)):
        n = min(learner.budget, offered)
        for _ in range(50):
            learner.observe(n, itl(n) * rng.uniform(0.9, 1.1))
        budgets.append(learner.update(float(t), target, n, queued=offered - n))
    return budgets


def test_finds_the_knee_of_a_replica_it_never_saw() -> None:
    # ITL = 5 ms + 2 ms per sequence; target 50 ms, margin 0.85 → 42.5 ms → 18 sequences.
    lr = CapacityLearner(cap=64, start=4)
    b = drive(lr, lambda n: 0.005 + 0.002 * n, 60, 0.050)
    assert 16 <= b[-1] <= 19, b[-10:]
    assert max(b[30:]) <= 21  # it does not keep overshooting once it knows
    a, slope = lr.fit  # type: ignore[misc]
    # Near the knee the line is right (its intercept, extrapolated from the n it saw, is looser).
    assert abs(a + slope * 18 - 0.041) < 0.002 and abs(slope - 0.002) < 0.0006, (a, slope)


def test_starting_at_the_cap_it_backs_off_an_overloaded_replica() -> None:
    lr = CapacityLearner(cap=64, slow_start=False)  # a fixed budget of 64 until the replica shows it is slow
    b = drive(lr, lambda n: 0.005 + 0.002 * n, 40, 0.050)
    assert b[0] < 64 and b[-1] <= 19, b[:10]
    assert sum(x > 25 for x in b[10:]) == 0, b


def test_slow_start_doubles_on_a_fast_pace_and_never_floods_a_slow_replica() -> None:
    fast = CapacityLearner(cap=64)  # knee far above the cap: 8, then doubling each second it is full and fast
    assert drive(fast, lambda n: 0.001 + 0.0002 * n, 5, 0.050) == [16, 32, 64, 64, 64]
    # Knee 18 (5 ms + 2 ms a sequence, goal 42.5 ms): slow start overshoots once, to 32, and is
    # cut; started at the cap the replica held 64 first. Neither goes on doubling after a cut.
    lr = CapacityLearner(cap=64)
    b = drive(lr, lambda n: 0.005 + 0.002 * n, 40, 0.050)
    assert max(b) == 32 and 16 <= b[-1] <= 19, b
    assert not lr._growing
    idle = CapacityLearner(cap=64)  # no load: no growth, and none on a pace not measured yet
    assert drive(idle, lambda n: 0.01, 5, 0.050, offered=3) == [8] * 5
    assert idle.update(10.0, 0.050, 8) == 8  # full, but no gaps measured this second
    deadline = CapacityLearner(cap=64)  # no stream with a pace to keep: full is the only signal, doubling
    assert [deadline.update(float(t), None, deadline.budget) for t in range(4)] == [16, 32, 64, 64]


def test_never_above_the_cap_and_a_cut_never_below_the_floor() -> None:
    lr = CapacityLearner(cap=10, start=4)
    assert max(drive(lr, lambda n: 0.001 * n, 40, 0.5)) == 10  # a fast replica: up to the cap, no further
    # Too slow for the target even alone: cut to the floor, no further (at 0.2 s a token every
    # stream misses its 50 ms anyway; fewer at a time would only queue the rest).
    slow = CapacityLearner(cap=10, start=8)
    b = drive(slow, lambda n: 0.2 + 0.01 * n, 20, 0.05)
    assert b[0] < 8 and b[-1] == 4, b
    tiny = CapacityLearner(cap=2)
    assert drive(tiny, lambda n: 0.2 + 0.01 * n, 20, 0.05)[-1] == 2  # the floor never lifts a budget above the cap


def test_a_cold_replica_holding_two_is_not_cut_to_one() -> None:
    """Two streams and a slow mean pace (the first prefills stall every step): the cut stops at
    the floor, so placement keeps this replica beside a peer still at its cap."""
    lr = CapacityLearner(cap=48)
    assert drive(lr, lambda n: 0.15, 5, 0.1, offered=2)[-1] == 4


def test_no_growth_without_load_and_recovery_when_the_engine_slows_down() -> None:
    lr = CapacityLearner(cap=64, start=4)
    assert drive(lr, lambda n: 0.005 + 0.002 * n, 20, 0.05, offered=3)[-1] <= 5  # never full: no reason to grow
    lr = CapacityLearner(cap=64, start=4)
    drive(lr, lambda n: 0.005 + 0.002 * n, 60, 0.05)
    before = lr.budget
    after = drive(lr, lambda n: 0.010 + 0.004 * n, 30, 0.05)  # a neighbour took half the machine
    assert after[-1] <= before // 2 + 2, (before, after[-5:])


def test_an_engine_slower_than_the_tbt_at_every_batch_seen_is_not_cut_but_filled() -> None:
    """A fixed 50 ms a token whatever the batch (a large model; here the overhead bench's engine)
    under a 50 ms TBT: fewer streams ran no faster, so a cut only refuses. It doubles while full,
    as with no target. Where fewer streams did run faster, the same slow second still cuts."""

    def ramp(itl) -> CapacityLearner:  # the first second of a fresh gateway: the replica went 1 → 8
        lr = CapacityLearner(cap=256)
        for n in range(1, 9):
            for _ in range(6):
                lr.observe(n, itl(n))
        return lr

    flat = ramp(lambda n: 0.050)
    budgets = [flat.update(0.0, 0.050, 8)]
    for t in range(1, 5):
        for _ in range(40):
            flat.observe(flat.budget, 0.050)
        budgets.append(flat.update(float(t), 0.050, flat.budget))
    assert budgets == [16, 32, 64, 128, 256], budgets
    assert flat.beyond_reach(0.050, 0.85 * 0.050) and flat.overdraft == flat.burst == 0
    steep = ramp(lambda n: 0.005 + 0.006 * n)  # 53 ms at 8, 41 ms at 6: a batch too large
    assert steep.update(0.0, 0.050, 8) < 8
    assert not steep.beyond_reach(0.053, 0.85 * 0.050)
    unseen = CapacityLearner(cap=256)  # no gaps measured at fewer streams: no evidence, the cut stands
    for _ in range(40):
        unseen.observe(8, 0.050)
    assert unseen.update(0.0, 0.050, 8) < 8


def test_out_of_reach_is_judged_by_decode_alone_and_a_first_cut_probes_it() -> None:
    """An engine kept busy prefilling what it is sent is slow at every n (the simulator under
    overload), but its steps with no prefill are fast: a cut helps there, so it is not out of
    reach. A replica only ever seen full is cut once, and that cut shows whether fewer run faster."""
    busy = CapacityLearner(cap=256)
    for n in (8, 16, 32):
        for _ in range(20):
            busy.observe(n, 0.056, decode_only=False)  # steps shared with prefills
        for _ in range(5):
            busy.observe(n, 0.004 + 0.0005 * n)  # decode alone
    assert not busy.beyond_reach(0.056, 0.85 * 0.050)
    assert busy.update(0.0, 0.050, 32) < 32
    probe = CapacityLearner(cap=256)  # a fixed 50 ms a token, only ever seen full at 8
    for _ in range(40):
        probe.observe(8, 0.050)
    assert probe.update(0.0, 0.050, 8) == 6
    for _ in range(40):
        probe.observe(6, 0.050)
    assert probe.update(1.0, 0.050, 6) == 12 and probe.out_of_reach


def test_after_a_probing_cut_out_of_reach_is_found_and_doubled_between_updates() -> None:
    """The driver calls often after a cut (`quick`): the probe's verdict and each doubling come a
    tenth of a second apart, not a second (at one a second a fresh gateway in front of engines
    slower than the TBT refused 194 first tokens, docs/benchmarks.md)."""
    lr = CapacityLearner(cap=256)
    for _ in range(40):
        lr.observe(8, 0.050)
    assert lr.update(0.0, 0.050, 8) == 6 and not lr.growing and lr.quick  # the cut is the probe
    t, held = 0.0, 8
    for _ in range(8):  # within the second after the cut
        t += 0.1
        held = min(held, lr.budget) if lr.budget < held else lr.budget  # drained to the cut, then filled
        for _ in range(12):
            lr.observe(held, 0.050)
        lr.update(t, 0.050, held)
    assert lr.out_of_reach and lr.quick and lr.budget >= 48
    calm = CapacityLearner(cap=256, start=16)
    for k in range(8):  # fast and steady: no cut, so once a second is enough
        for _ in range(20):
            calm.observe(16, 0.020)
        calm.update(float(k), 0.050, 16)
    assert not calm.quick


def test_slow_start_doubles_short_of_the_goal_where_more_streams_did_not_slow_them() -> None:
    """Between the goal (0.85 × TBT) and the TBT, slow start neither doubled nor cut: in front of
    engines making 48 ms a token at any batch under a 50 ms TBT a fresh gateway held 8 streams a
    replica while its queue refused first tokens: a ramp's gaps all share prefills, so
    `beyond_reach` (decode alone) had nothing to judge. Flat medians over n let it double; a
    batch that costs (faster at fewer streams) still holds."""
    flat = CapacityLearner(cap=256)
    for n, gap in ((1, 0.047), (8, 0.048)):
        for _ in range(5 if n == 1 else 40):
            flat.observe(n, gap, decode_only=False)
    assert flat.update(0.0, 0.050, 8) == 16 and flat.growing and not flat.out_of_reach
    costly = CapacityLearner(cap=256)
    for n, gap in ((1, 0.030), (8, 0.048)):
        for _ in range(5 if n == 1 else 40):
            costly.observe(n, gap, decode_only=False)
    assert costly.update(0.0, 0.050, 8) == 8 and costly.growing  # at its goal's edge: held, as before
    between = CapacityLearner(cap=256)  # the same between updates, on the gaps since the last doubling
    for n, gap in ((1, 0.047), (8, 0.048)):
        for _ in range(5 if n == 1 else 40):
            between.observe(n, gap, decode_only=False)
    between.last_update = 0.0
    assert between.update(0.2, 0.050, 8) == 16


def test_a_line_that_no_batch_meets_the_goal_by_does_not_put_the_replica_at_the_floor() -> None:
    """A line whose intercept is above the goal (an engine at ~50 ms a token at any batch under a
    50 ms TBT: 48 ms + 0.16 ms a stream) locates no knee; taken at its word it cut a replica
    holding 16 to the floor, and its queue waited for 12 streams to drain."""
    lr = CapacityLearner(cap=256, start=16)
    for n in range(11, 17):
        for _ in range(8):
            lr.observe(n, 0.048 + 0.00016 * n, decode_only=False)
    assert lr.update(0.0, 0.050, 16) >= 16
    assert lr.fit is not None and lr.fit[0] > 0.0425  # the line was fitted, and says no n meets the goal
    fast = CapacityLearner(cap=256, start=16)  # a line that does locate one still limits
    for n in range(11, 17):
        for _ in range(8):
            fast.observe(n, 0.010 + 0.003 * n, decode_only=False)
    assert fast.update(0.0, 0.050, 16) == 10


def test_an_out_of_reach_verdict_outlives_its_faded_bin_until_the_engine_changes() -> None:
    """Held at 48 by the load, a replica sees no smaller n after its probe: the probe's decode is
    remembered, compared with the largest n's as it is renewed, and forgotten when they differ."""
    lr = CapacityLearner(cap=256)
    for n in (6, 8):
        for _ in range(10):
            lr.observe(n, 0.050)
    assert lr.beyond_reach(0.050, 0.0425, now=0.0)
    lr.bins.clear()
    for _ in range(10):
        lr.observe(48, 0.051)
    assert lr.beyond_reach(0.051, 0.0425, now=60.0)  # n = 6 has faded; its memory compares
    assert not lr.beyond_reach(0.051, 0.0425, now=60.0 + ANCHOR_S)  # too old: a cut probes again
    lr.bins.clear()
    for n in (6, 8):
        for _ in range(10):
            lr.observe(n, 0.050)
    assert lr.beyond_reach(0.050, 0.0425, now=1.0)  # probed afresh: remembered anew
    lr.bins.clear()
    for _ in range(10):
        lr.observe(48, 0.080)  # the engine now slows with its batch
    assert not lr.beyond_reach(0.080, 0.0425, now=2.0) and lr._anchor is None


def test_a_gap_is_decode_only_when_no_prefill_shared_it() -> None:
    v = view()
    r = req(1)
    v.claim(r, 0.0)
    assert not v.decode_only(0.02, 0.02)  # waiting for its first token: its prefill runs now
    v.first_token(r, 0.05)
    assert not v.decode_only(0.08, 0.05)  # the gap that ended at 0.08 began at 0.03, before that prefill ended
    assert v.decode_only(0.11, 0.05)


def test_without_a_tbt_target_it_fills_up_to_the_cap_when_full() -> None:
    lr = CapacityLearner(cap=8, start=2)
    for t in range(10):
        lr.update(float(t), None, lr.budget)
    assert lr.budget == 8


def test_prefill_stalls_in_the_tail_do_not_read_as_overload() -> None:
    # One gap in ten carries another request's prefill and is 4× long: the p90 gap is far past
    # the target at any n ≥ 4, but the pace streams get (the mean, 1.3 × ITL) only past n ≈ 13.
    rng = random.Random(1)

    def spiky(n: int) -> float:
        return (0.005 + 0.002 * n) * (4.0 if rng.random() < 0.1 else 1.0)

    lr = CapacityLearner(cap=64)
    b = drive(lr, spiky, 60, 0.050)
    assert 11 <= b[-1] <= 15, b[-10:]
    assert min(b[20:]) >= 9, b  # no collapse towards one-at-a-time


def test_slow_start_on_a_second_of_stalls_keeps_the_budget_and_ends() -> None:
    """A second measured on real vLLM (guidellm at 1.5 req/s, a fresh gateway): 3 streams, median
    gap 6.5 ms, two gaps of 1.8 s when the host stalled the engine once; mean 93 ms. The rule
    before (`on_stalls="cut"`) cut on it as on any slow second; now slow start keeps the budget
    and ends (no more doubling), and still cuts at once on a second whose batch itself is slow."""
    measured = [1.3, 1.4, 1.8, 1.9, 3.3, 3.3, 3.5, 3.5, 4.3, 4.3, 4.3, 4.4, 5.3, 5.4, 6.1, 6.1, 6.2, 6.2, 6.3, 6.3, 6.5,
                6.5, 6.5, 6.5, 7.5, 7.6, 8.4, 8.4, 8.5, 8.5, 9.3, 9.3, 9.8, 9.9, 12.0, 12.1, 18.6, 18.6, 48.2, 48.4, 1781.1, 1782.7]

    def second(lr: CapacityLearner, t: float, gaps: list[float], n: int = 8) -> int:
        for g in gaps:
            lr.observe(n, g / 1000)
        return lr.update(t, 0.050, n)

    cut = CapacityLearner(cap=64, on_stalls="cut")
    assert second(cut, 0.0, measured, 3) == 4 and not cut.growing
    end = CapacityLearner(cap=64)
    assert second(end, 0.0, measured, 3) == 8 and not end.growing
    assert [second(end, float(t), [9.0] * 40, end.budget) for t in (1, 2)] == [9, 10]  # then +1 a second while full and fast
    slow = CapacityLearner(cap=64)
    assert second(slow, 0.0, [55, 60, 58, 62, 57, 59, 61, 56, 60, 58, 300], 6) == 4 and not slow.growing
    # A second from a fresh gateway's log at the knee (real vLLM, 1.8 req/s): 6 streams, 32 gaps,
    # median 24.3 ms (0.57 of the 42.5 ms goal), mean 109 ms from arrivals' prefills of ~0.7 s.
    knee = [24.3] * 28 + [700.0] * 4
    assert second(CapacityLearner(cap=64), 0.0, knee, 6) == 4  # only below half the goal is it a stall
    wider = CapacityLearner(cap=64, stalls_below=1.0)
    assert second(wider, 0.0, knee, 6) == 8 and not wider.growing


def test_after_slow_start_a_second_of_stalls_without_a_line_is_no_cut() -> None:
    """Seconds from a fresh gateway's log (real vLLM, guidellm at 0.5 req/s): slow start ended on
    stalls, then a replica holding 2 streams had a second of 62 gaps at a median of 20.6 ms, mean
    72 ms from one prefill of 1.28 s. It was cut from 8 to the floor, and bursts waited for slots.
    Now, with no line yet, such a second keeps the budget; a second whose batch is slow still cuts."""
    def second(lr: CapacityLearner, t: float, gaps: list[float], n: int) -> int:
        for g in gaps:
            lr.observe(n, g / 1000)
        return lr.update(t, 0.050, n)

    stalls = [20.6] * 58 + [1282.0] * 3
    lr = CapacityLearner(cap=64)
    assert second(lr, 0.0, [19.0] * 18 + [1500.0], 2) == 8 and not lr.growing  # slow start ends on stalls
    assert second(lr, 1.0, stalls, 2) == 8  # was 4
    assert lr.fit is None
    assert second(lr, 2.0, [30.0] * 40 + [200.0], 6) == 8  # this second met the target; its smoothed pace (68 ms) did not: held, was cut to 4
    batch = CapacityLearner(cap=64)
    second(batch, 0.0, [19.0] * 18 + [1500.0], 2)
    assert second(batch, 1.0, [60.0] * 40, 8) == 6  # the batch itself slow: cut to 0.8 × 8
    few = CapacityLearner(cap=64)  # 3 streams, median 26.5 ms (above half the goal), mean 88 ms: the floor's streams
    second(few, 0.0, [19.0] * 18 + [1500.0], 2)
    assert second(few, 1.0, [26.5] * 15 + [543.0] * 2, 3) == 8
    cut = CapacityLearner(cap=64, on_stalls="cut")  # the rule before, kept as a knob
    second(cut, 0.0, [19.0] * 18 + [1500.0], 2)
    assert cut.budget == 4


def test_the_pace_streams_can_afford_follows_their_slack() -> None:
    from slogate.router.capacity import affordable_pace
    from slogate.router.request import SLO, Request

    def stream(arrival: float, generated: int, left: float, tbt: float = 0.05) -> Request:
        r = Request(0, arrival, 100, SLO.latency(1.0, tbt))
        r.generated, r.len_bound = generated, left
        return r

    assert affordable_pace(10.0, []) is None
    assert affordable_pace(10.0, [Request(0, 0.0, 10, SLO.deadline(5.0))]) is None  # no TBT target in flight
    # On schedule: 100 tokens in 1 + 100 × 50 ms = 6 s, 100 left → exactly 50 ms per token.
    assert abs(affordable_pace(6.0, [stream(0.0, 100, 100)]) - 0.05) < 1e-9  # type: ignore[operator]
    # Far ahead (100 tokens after 3 s): 4 s of slack over 100 tokens → 90 ms, but by default never
    # above the TBT (a mean TPOT above it fails guidellm's rule); with headroom 1.5, 75 ms.
    assert abs(affordable_pace(3.0, [stream(0.0, 100, 100)]) - 0.05) < 1e-9  # type: ignore[operator]
    assert abs(affordable_pace(3.0, [stream(0.0, 100, 100)], headroom=1.5) - 0.075) < 1e-9  # type: ignore[operator]
    # A little ahead: 0.5 s of slack over 100 tokens → 55 ms.
    assert abs(affordable_pace(5.5, [stream(0.0, 100, 100)], headroom=1.5) - 0.055) < 1e-9  # type: ignore[operator]
    # Behind schedule never asks for more than the TBT; a lost stream does not drag the rest.
    assert affordable_pace(9.0, [stream(0.0, 100, 100)]) == 0.05
    assert abs(affordable_pace(5.5, [stream(0.0, 100, 100), stream(-100.0, 10, 100)], headroom=1.5) - 0.055) < 1e-9  # type: ignore[operator]
    # The tightest streams set it: the 10th percentile over the replica's streams.
    many = [stream(0.0, 100, 100)] * 9 + [stream(0.0, 100, 100, tbt=0.04)]
    assert affordable_pace(6.0, many) == 0.04  # type: ignore[comparison-overlap]


def test_a_line_the_replica_no_longer_bears_out_is_dropped_and_the_budget_grows_again() -> None:
    # A burst of arrivals (every stream prefilling at once) makes the first line steep: ~11
    # sequences fit a 75 ms target. Then the burst is over and the replica is fast: 10 ms +
    # 0.2 ms per sequence, so ~270 would fit. Holding 11, it only ever sees n = 11: the old
    # line cannot be refitted, and must not pin the budget for good.
    lr = CapacityLearner(cap=64, start=4)
    drive(lr, lambda n: 0.002 + 0.006 * n, 20, 0.075)
    stuck = lr.budget
    assert stuck <= 12, stuck
    b = drive(lr, lambda n: 0.010 + 0.0002 * n, 40, 0.075)
    assert b[-1] >= 4 * stuck, b
    assert b[-1] == 64 or lr.fit is not None  # the knee of the new line, or the cap


def test_a_line_whose_evidence_has_faded_stops_pinning_the_budget() -> None:
    # Fitted on a burst, then the replica runs only non-streamed answers: no gaps to measure.
    lr = CapacityLearner(cap=64, start=4)
    drive(lr, lambda n: 0.002 + 0.006 * n, 20, 0.075)
    stuck = lr.budget
    b = [lr.update(100.0 + t, 0.075, lr.budget) for t in range(90)]  # full, and silent
    assert lr.fit is None and b[-1] >= stuck + 20, (stuck, b[-5:])


def test_a_line_through_a_negative_intercept_is_not_trusted() -> None:
    """Gaps at n = 1..4 clean (20 ms), at n = 6..8 inflated by a burst of prefills: a straight
    line through them has a negative intercept and a steep slope, which would set the budget
    to 1. It is not a model of the engine: no line, and the budget stays where the replica is."""
    lr = CapacityLearner(48, start=8)
    for n, gap in ((1, 0.005), (2, 0.006), (6, 0.06), (7, 0.075), (8, 0.09)):
        for _ in range(20):
            lr.observe(n, gap)
    assert lr._line() is None
    assert lr.update(10.0, 0.05, 8) >= 6


def test_it_lends_what_the_measured_pace_can_take_and_nothing_at_its_goal() -> None:
    # ITL = 5 ms + 2 ms per sequence: the budget aims at 42.5 ms (18), the target itself is 50 ms (22).
    # (The pace-based overdraft alone: slots a burst may take come on top, test_overdraft.py.)
    lr = CapacityLearner(cap=64, start=4, lend_in_bursts=False)
    drive(lr, lambda n: 0.005 + 0.002 * n, 60, 0.050, offered=12)  # held at 12: 29 ms, 13.5 ms below the goal
    assert lr.fit is not None and lr.budget < 18
    # 13.5 ms of room at 2 ms a stream: six more than the 12 held, as far as the goal (not the target's 22).
    assert lr.budget + lr.overdraft in (17, 18, 19), (lr.budget, lr.overdraft)
    drive(lr, lambda n: 0.005 + 0.002 * n + 0.03, 5, 0.050, offered=12)  # the engine slowed past the goal: nothing lent
    assert lr.overdraft == 0
    full = CapacityLearner(cap=64, start=4)
    drive(full, lambda n: 0.005 + 0.002 * n, 60, 0.050)  # always full: held at its budget, at its goal
    assert full.budget >= 16 and full.overdraft <= 1, (full.budget, full.overdraft)
    off = CapacityLearner(cap=64, start=4, overdraft_on=False)
    drive(off, lambda n: 0.005 + 0.002 * n, 60, 0.050, offered=12)
    assert off.fit is not None and off.overdraft == 0


def test_each_learning_step_gives_placement_the_measured_cost_of_a_stream() -> None:
    """`learned_budget` (gateway and simulator alike) hands the replica view the line's slope:
    GoRouting weighs a replica's batch at it (router/view.py `decode_delay`)."""
    from slogate.router.capacity import learned_budget
    from tests.helpers import view

    lr = CapacityLearner(cap=64, start=4)
    v = view(0)
    learned_budget(lr, v, 0.0)
    assert lr.fit is None and v.stream_cost is None
    drive(lr, lambda n: 0.005 + 0.002 * n, 60, 0.050)
    learned_budget(lr, v, 61.0)
    assert lr.fit is not None and v.stream_cost == lr.fit[1] and abs(v.stream_cost - 0.002) < 0.0006


def test_slow_start_doubles_between_updates_on_fresh_gaps_only() -> None:
    """Slow start re-decides every `grow_every_s` (0.1 s), not once a second: a burst on a fresh
    gateway waits for 8 → 64 slots a few tenths of a second, not three seconds. Each doubling
    needs 10 gaps measured since the last one, fast; a replica busy with prefills shows none."""
    def fine(lr: CapacityLearner, itl, steps: int, gaps_per_step: int = 10) -> list[int]:
        out = []
        for k in range(steps):
            n = lr.budget
            for _ in range(gaps_per_step):
                lr.observe(n, itl(n))
            out.append(lr.update(0.1 * k, 0.050, n))
        return out

    fast = CapacityLearner(cap=64)
    b = fine(fast, lambda n: 0.001 + 0.0002 * n, 10)
    assert b.index(64) <= 4, b  # at the cap within half a second (one doubling a second took three)
    knee = CapacityLearner(cap=64)  # the knee at 18: the gaps at 32 are slow, so no doubling to 64 ...
    b = fine(knee, lambda n: 0.005 + 0.002 * n, 30)
    assert max(b) == 32 and b[-1] <= 19, b  # ... and the full update cuts it
    stalled = CapacityLearner(cap=64)  # a few gaps a step (its new prompts' prefills stall the batch)
    assert fine(stalled, lambda n: 0.002, 9, gaps_per_step=1) == [8] * 9  # fast, but never 10 fresh gaps between updates


def test_the_gateway_and_the_simulator_build_the_same_learner_from_the_same_knobs() -> None:
    """One set of knobs: `capacity:` in the gateway's config and the simulator's EngineConfig both
    go through LearnerKnobs, so a knob added to one reaches the other (the simulator once lacked
    `lend_to` and `overdraft_within_s`)."""
    from dataclasses import fields

    from slogate.gateway.config import CapacityConfig
    from slogate.router.capacity import LearnerKnobs
    from slogate.router.latency import PROFILES
    from slogate.router.scheduler import Scheduler
    from slogate.sim.cluster import ClusterSim, EngineConfig
    from slogate.sim.workload import Workload

    assert CapacityConfig().knobs() == LearnerKnobs()  # the same defaults
    assert {f.name for f in fields(LearnerKnobs)} <= set(CapacityConfig.model_fields)
    set_ = CapacityConfig(margin=0.7, slow_start_budget=4, on_stalls="cut", stalls_below=0.8, overdraft=False, overdraft_within_s=2.0,
                          lend_to=0.8, lend_now_below=0.5, absorb=True, absorb_by="tpot", absorb_beside_deadlines=True).knobs()
    live = set_.learner(48)
    assert (live.margin, live.budget, live.on_stalls, live.overdraft_on, live.lend_to, live.lend_now_below) == (0.7, 4, "cut", False, 0.8, 0.5)
    assert live.stalls_below == 0.8
    assert set_.learner(48, slow_start=False).budget == 48  # shared state: no slow start
    assert set_.learner(48, start=20).budget == 20  # joining a running fleet
    sched = Scheduler.from_combo("gmax+gorouting")
    sim = ClusterSim(Workload(jobs=[], span_s=1.0), sched, None, EngineConfig(PROFILES["llama3.1-8b@a100-80g"], learn_budget=True, capacity=set_),
                     n_replicas=2)
    assert sim.learners is not None
    assert [(lr.budget, lr.margin, lr.lend_to, lr.on_stalls) for lr in sim.learners] == [(4, 0.7, 0.8, "cut")] * 2
    assert sched.at_risk_s == 2.0 and sched.absorb is True and sched.absorb_by == "tpot" and sched.absorb_beside_deadlines is True


def test_the_bins_summary_shows_what_the_line_is_fitted_on() -> None:
    """The gateway's debug log prints each replica's bins (n -> median gap in ms, weight): how a
    learned budget at the knee was read against the engine's own step per n (docs/benchmarks.md,
    guidellm sitting AK). Medians, not means: one stall must not show as the batch's cost."""
    lr = CapacityLearner(cap=64)
    for n, gaps in ((2, [0.020, 0.021, 0.022, 0.9]), (5, [0.030, 0.031, 0.029])):
        for g in gaps:
            lr.observe(n, g)
    assert lr.bins_summary() == {2: (21.5, 4.0), 5: (30.0, 3.0)}
    for g in [0.040] * 5 + [0.2] * 6:  # most of n = 7's steps shared a prefill: the line (and the log) takes the others
        lr.observe(7, g, decode_only=g < 0.1)
    assert lr.bins_summary()[7] == (40.0, 11.0)


def test_prefills_priced_by_the_arrivals_where_the_demand_leaves_the_replica_not_full() -> None:
    """`price_by_arrivals`: the line of a replica at 0.25 req/s on real vLLM (15 ms + 4 ms a
    stream, prefills 2.3 ms a stream held, 2 streams on average) allows 4.4 streams priced per
    stream; past the demand a stream more costs the decode step alone (5.7 here, within the 6
    measured). A refusal in the last seconds, or a demand near the line's n, keeps the per-stream price."""
    def learner(**kw) -> CapacityLearner:
        lr = CapacityLearner(cap=48, **kw)
        lr.fit, lr.stall, lr.load = (0.015, 0.004), 0.0023, 2.0
        for n in range(1, 7):
            lr.observe(n, 0.015 + 0.004 * n)
        return lr

    per_stream = learner()._n_at(0.0425)
    assert abs(per_stream - 27.5 / 6.3) < 1e-6
    on = learner(price_by_arrivals=True)
    assert abs(on._n_at(0.0425) - (42.5 - 15 - 4.6) / 4) < 1e-6
    assert learner(price_by_arrivals=True)._n_at(0.05) == 6  # 7.6 by the arrivals, but never past the n measured
    full = learner(price_by_arrivals=True)
    full.load = 4.0  # the demand fills what the line allows: a replica kept full
    assert full._n_at(0.0425) == per_stream
    turned = learner(price_by_arrivals=True)
    turned.update(0.0, 0.05, 2, refused=2.0)  # two requests refused: demand the load does not show
    assert turned.refused > 0.05
    turned.fit, turned.stall, turned.load = (0.015, 0.004), 0.0023, 2.0
    assert turned._n_at(0.0425) == per_stream


def test_a_second_of_prefills_in_a_burst_is_no_cut() -> None:
    """A fresh gateway's first Poisson burst (G23): 5 prompts on a replica in a second, 8 streams,
    most steps shared with a prefill at 60–90 ms, the few without one at 30 ms. Labelled so by the
    driver, it reads as the prefills' (slow start ends, the budget stays); the same gaps with no
    label read as a batch too large and cut."""
    shared = [0.060, 0.070, 0.080, 0.090] * 6
    alone = [0.030] * 6

    def second(labelled: bool) -> CapacityLearner:
        lr = CapacityLearner(cap=64)
        for g in shared:
            lr.observe(8, g, decode_only=not labelled)
        for g in alone:
            lr.observe(8, g)
        lr.update(0.0, 0.050, 8)
        return lr

    kept, cut = second(True), second(False)
    assert kept.budget >= 8 and not kept.growing  # kept (then +1 while full: the pace is judged afresh)
    assert cut.budget < 8
    # Where the steps without a prefill are slow too, the batch is too large: a cut, labels or not.
    lr = CapacityLearner(cap=64)
    for g in shared:
        lr.observe(8, g, decode_only=False)
    for g in [0.060] * 12:
        lr.observe(8, g)
    assert lr.update(0.0, 0.050, 8) < 8


def test_a_loads_first_burst_does_not_price_prefills_for_the_replica_kept_full() -> None:
    """G31 on real vLLM (guidellm at the knee): the line appeared on the load's first burst, a
    second in which a replica went to 7 streams and prefilled most of them (125 gaps, median 23 ms,
    mean 65 ms). Priced on that second alone, prefills cost 4.7 ms a stream held and the budget
    went to the floor while the replica kept 7; a few seconds later the same replica's prefills
    cost ~1.5 ms. With `stall_prior_s` the first second is weighed against that many seconds of
    no excess: the budget stays, and once steady-state evidence has come, both price alike."""
    line = [0.0113 + 0.003 * n for n in range(8)]

    def learner(prior: float) -> CapacityLearner:
        lr = CapacityLearner(cap=64, stall_prior_s=prior)
        for n in (2, 3, 4, 5):  # the ramp: a span too short for a line
            for _ in range(10):
                lr.observe(n, line[n])
        lr.update(0.0, 0.050, 5)
        for _ in range(100):  # the burst: most steps clean, a quarter shared with the new streams' prefills
            lr.observe(7, line[7])
        for _ in range(25):
            lr.observe(7, 0.196, decode_only=False)
        lr.update(1.0, 0.050, 7)
        return lr

    bare, prior = learner(0.0), learner(10.0)
    assert bare.fit is not None and abs(bare.stall - 0.0047) < 0.0003, bare.stall
    assert bare.budget == 4  # the floor, holding 7
    assert prior.stall < 0.001 and prior.budget >= 7, (prior.stall, prior.budget)
    for lr in (bare, prior):  # steady state: 15 gaps in 125 carry a prefill, 1.5 ms a stream in all
        for t in range(2, 60):
            for _ in range(110):
                lr.observe(7, line[7])
            for _ in range(15):
                lr.observe(7, 0.1198, decode_only=False)
            lr.update(float(t), 0.050, 7)
    assert abs(bare.stall - 0.0015) < 0.0002 and abs(prior.stall - bare.stall) < 0.0002, (bare.stall, prior.stall)
    assert prior.budget == bare.budget


def test_the_decode_line_is_fitted_on_the_steps_no_prefill_shared() -> None:
    """A load's first burst: at each n newly reached most steps carry a new stream's prefill (on
    one core, half as long again as the decode step, or more). Their median is the prefills', and the line fitted
    through it is far too steep; fitted on the steps no prefill shared, it is the decode step
    (11.3 ms + 3.0 ms a stream here)."""
    def learner(**kw) -> CapacityLearner:
        lr = CapacityLearner(cap=64, **kw)
        for n in range(2, 10):
            share = 0.2 if n < 6 else 0.7  # past 5 streams, the burst: most steps prefill someone
            for i in range(40):
                shared = i < share * 40
                lr.observe(n, (0.0113 + 0.003 * n) * (1.5 if shared else 1.0), decode_only=not shared)
        lr.update(0.0, 0.050, 9)
        return lr

    steep, decode = learner(line_from_decode=False, stall_prior_s=0.0), learner(line_from_decode=True, stall_prior_s=0.0)
    assert steep.fit is not None and steep.fit[1] > 0.006, steep.fit
    assert decode.fit is not None and abs(decode.fit[1] - 0.003) < 1e-4 and abs(decode.fit[0] - 0.0113) < 1e-4, decode.fit
    # Alone, the decode line moves the burst's cost into the prefill price, measured above it on
    # this one second: the budget hardly moves (7 against 6). With the price's prior as well, the
    # second is weighed as one second, and the budget is the decode step's.
    assert decode.budget - steep.budget <= 1
    both = learner(line_from_decode=True, stall_prior_s=10.0)
    assert both._n_at(0.0425) > steep._n_at(0.0425) + 3 and both.budget >= 9, (both._n_at(0.0425), both.budget)


def test_a_demand_the_engine_carries_within_the_target_is_held_and_overload_is_not() -> None:
    """`demand_margin`: a replica whose line (20 ms + 2.8 ms a stream) allows 8 streams at the 0.85
    margin and 9.8 at 0.95 of a 50 ms TBT. Held full at 8 with a small queue while a seventh of
    what is offered is refused (S32's heavy but feasible load), the demand is ~9.4 streams: the
    budget rises to hold it. Refusing as much as it admits (overload), the demand is past 9.8 and
    the margin's budget stays; off, it stays too."""
    def run(demand_margin: float, refused: float) -> CapacityLearner:
        lr = CapacityLearner(cap=48, start=8, demand_margin=demand_margin)
        for n in range(4, 9):
            for _ in range(8):
                lr.observe(n, 0.020 + 0.0028 * n)
        for t in range(30):
            for _ in range(12):
                lr.observe(8, 0.020 + 0.0028 * 8)
            lr.update(float(t), 0.05, 8, queued=0.2, admitted=1.0, refused=refused)
        return lr

    held = run(0.95, 0.15)
    assert held.fit is not None and abs(held._n_at(0.0425) - 8.0) < 0.2
    assert 9.0 < held.demand < 9.8 and held.budget == math.ceil(held.demand) == 10
    assert run(0.0, 0.15).budget == 8  # off: the margin's budget
    over = run(0.95, 1.0)
    assert over.demand > 9.8 and over.budget == 8  # past the knee: refusing the excess keeps the rest on time
