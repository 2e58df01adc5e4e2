"""First tokens that cannot wait for a slot take the replicas' overdraft slots (scheduler.py)."""

from __future__ import annotations

from slogate.router.request import SLO
from slogate.router.scheduler import AT_RISK_S, Scheduler
from tests.helpers import req, view


def _full(rid: int, overdraft: int, now: float):
    v = view(rid, budget=2)
    v.overdraft = overdraft
    for k in range(2):  # two long streams decoding: the budget is used up
        r = req(1000 * (rid + 1) + k, arrival=now - 5, slo=SLO.latency(1.0, 0.05), bound=400)
        v.claim(r, now - 5)
        v.first_token(r, now - 4.9)
    return v


def test_a_first_token_about_to_be_lost_takes_an_overdraft_slot_others_wait() -> None:
    now = 100.0
    views = [_full(0, 1, now), _full(1, 1, now)]
    s = Scheduler.from_combo("gmax+gorouting")
    urgent = req(1, arrival=now - 0.8, inp=200, slo=SLO.latency(1.0, 0.05))  # due in 0.2 s: cannot wait a stream's life
    fresh = req(2, arrival=now, inp=200, slo=SLO.latency(10.0, 0.05))  # 10 s to its first token: it can wait
    deadline = req(3, arrival=now - 0.8, inp=200, slo=SLO.deadline(1.5))  # no first token to save
    late = req(4, arrival=now - 1.5, inp=200, slo=SLO.latency(1.0, 0.05))  # already past its TTFT: lending buys nothing
    # As urgent, on the built-in default SLO: lent a slot too (the default is an interactive pace a
    # user's tool judges by; docs/benchmarks.md, "An interactive default SLO").
    unasked = req(5, arrival=now - 0.8, inp=200, slo=SLO.latency(1.0, 0.05))
    unasked.tbt_chosen = unasked.ttft_chosen = False
    d = s.schedule(now, [fresh, deadline, late, unasked, urgent], views)
    assert sorted(r.rid for r, _ in d.dispatch) == [1, 5]
    assert sum(v.inflight for v in views) == 6 and all(v.inflight <= v.budget + v.overdraft for v in views)
    assert all(v.budget == 2 for v in views)  # the lent slots were for that pass only


def test_no_overdraft_no_lending_and_lent_slots_run_out() -> None:
    now = 100.0
    s = Scheduler.from_combo("gmax+gorouting")
    urgent = [req(i, arrival=now - 1.0 + AT_RISK_S / 2, inp=100, slo=SLO.latency(1.0, 0.05)) for i in range(1, 5)]
    assert s.schedule(now, urgent, [_full(0, 0, now), _full(1, 0, now)]).dispatch == []
    views = [_full(0, 1, now), _full(1, 0, now)]
    d = s.schedule(now, urgent, views)
    assert len(d.dispatch) == 1 and d.dispatch[0][1] == 0 and views[0].inflight == 3


def test_how_soon_a_first_token_may_borrow_is_the_schedulers_setting() -> None:
    """`capacity.overdraft_within_s` (the scheduler's `at_risk_s`): a request with 2 s to spare
    before its first token waits for a slot under the default, and borrows one when the operator
    lets first tokens borrow within 5 s (measured on real vLLM: wins the quiet rate, loses the knee)."""
    now = 100.0
    spare = req(1, arrival=now - 0.5, inp=200, slo=SLO.latency(3.0, 0.05))  # due in 2.5 s, its prefill well under that
    s = Scheduler.from_combo("gmax+gorouting")
    assert s.at_risk_s == AT_RISK_S < 2.0
    assert s.schedule(now, [spare], [_full(0, 1, now), _full(1, 1, now)]).dispatch == []
    s.at_risk_s = 5.0
    views = [_full(0, 1, now), _full(1, 1, now)]
    d = s.schedule(now, [spare], views)
    assert [r.rid for r, _ in d.dispatch] == [1] and sum(v.inflight for v in views) == 5


def test_the_gateway_hands_its_setting_to_the_scheduler() -> None:
    from contextlib import ExitStack

    import openai
    from servers import ServerThread

    from slogate.gateway.app import create_app
    from slogate.gateway.config import GatewayConfig
    from slogate.sim.server import create_engine_app

    model = "sim-model"
    with ExitStack() as st:
        eng = st.enter_context(ServerThread(create_engine_app(model)))
        app = create_app(GatewayConfig.model_validate({"backends": [{"url": eng.url, "models": [model]}],
                                                       "capacity": {"overdraft_within_s": 3}}))
        gw = st.enter_context(ServerThread(app))
        c = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="x", max_retries=0)
        assert c.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2).usage.completion_tokens == 2
        assert app.state.gateway.groups[model].scheduler.at_risk_s == 3


def test_a_replica_far_below_its_pace_goal_lends_at_once_to_requests_that_could_wait() -> None:
    """`lend_now` slots (the learner's, while the pace stays well below the goal) go to latency
    requests with time to spare as well; the rest of the overdraft stays for first tokens about to be lost."""
    now = 100.0
    s = Scheduler.from_combo("gmax+gorouting")
    spare = [req(i, arrival=now, inp=200, slo=SLO.latency(3.0, 0.05)) for i in (1, 2, 3)]  # 3 s to their first tokens
    views = [_full(0, 2, now), _full(1, 2, now)]
    assert s.schedule(now, spare, views).dispatch == []  # no lend_now: they wait for a slot
    views[0].lend_now = 1
    d = s.schedule(now, spare, views)
    assert len(d.dispatch) == 1 and d.dispatch[0][1] == 0 and views[0].inflight == 3 and views[1].inflight == 2
    urgent = req(9, arrival=now - 0.8, inp=200, slo=SLO.latency(1.0, 0.05))  # the overdraft beyond lend_now is still its
    d = s.schedule(now, [spare[1], urgent], views)
    assert [r.rid for r, _ in d.dispatch] == [9]
    assert all(v.budget == 2 for v in views)


def test_the_learner_lends_at_once_only_far_below_the_goal() -> None:
    """The learner's `lend_now`: slots that keep the measured pace below `lend_now_below` × the
    target, never more than the overdraft; none with the setting off (the default) or near the goal."""
    from slogate.router.capacity import CapacityLearner

    def learned(below: float, slow: float) -> CapacityLearner:
        lr = CapacityLearner(48, start=10, lend_now_below=below, lend_in_bursts=False)  # lending at once alone
        for n in range(4, 13):  # a decode step of 10 + 2n ms, then `slow` ms more per gap (stalls)
            for _ in range(10):
                lr.observe(n, 0.010 + 0.002 * n + slow)
        lr.update(1.0, 0.05, inflight=10)
        return lr

    fast = learned(0.7, 0.0)  # pace 26 ms: the lend-now goal (35 ms) is 4 streams away, the overdraft's (42.5) 8
    assert fast.fit is not None and 0 < fast.lend_now < fast.overdraft
    assert learned(0.0, 0.0).lend_now == 0 and learned(0.0, 0.0).overdraft == fast.overdraft
    near = learned(0.7, 0.010)  # 10 ms of stalls a gap: 36 ms, past the lend-now goal, below the overdraft's
    assert near.lend_now == 0 and near.overdraft > 0


def test_the_learner_lends_in_a_burst_but_not_under_sustained_load() -> None:
    """`lend_in_bursts`: a full replica whose load over ~10 s is below the line's n at the goal
    admits beyond its budget as many as keep the pace a stream admitted now sees over its life
    (the average load plus BURST_SHARE of the excess) below the goal; one held at that n for long
    (overload) admits no more than its budget; with the setting off, nothing changes."""
    from slogate.router.capacity import BURST_SHARE, CapacityLearner, _Bin, learned_budget

    def learner(on: bool) -> CapacityLearner:
        lr = CapacityLearner(48, start=8, lend_in_bursts=on)
        lr.fit, lr.pace = (0.012, 0.0034), 0.040  # the knee's line: 12 ms + 3.4 ms a stream; pace near the goal (42.5 ms)
        lr.bins = {n: _Bin(weight=10.0) for n in range(4, 12)}  # the line has seen up to 11 streams
        lr._line = lambda: lr.fit  # type: ignore[method-assign]  # keep the line fixed: this test is about lending
        return lr

    def feed(lr: CapacityLearner, held: list[int]) -> CapacityLearner:
        for t, n in enumerate(held):
            lr.update(float(t + 1), 0.05, inflight=n)
        return lr

    burst = feed(learner(True), [5, 6, 5, 6, 7, 5, 6, 8, 8])  # ~6 on average, now full: a burst
    n_goal = (0.0425 - 0.012) / 0.0034  # 8.97: the budget is 8
    assert burst.budget == 8 and burst.load is not None and 5.5 < burst.load < 6.5
    assert burst.burst == int(burst.load + (n_goal - burst.load) / BURST_SHARE) - 8 >= 2
    assert burst.burst + burst.budget + burst.overdraft <= int((0.05 - 0.012) / 0.0034)  # never past the target's n (11)
    # Held at the budget, then past it on the burst's slots for long: the average reaches the
    # goal's n, where the replica admits its budget only.
    sustained = feed(learner(True), [8] * 5 + [9] * 20 + [10] * 5)
    assert sustained.load is not None and sustained.load > n_goal and sustained.burst == 0
    off = feed(learner(False), [5, 6, 5, 6, 7, 5, 6, 8, 8])
    assert off.burst == 0 and off.budget == 8
    slow = learner(True)
    slow.pace = 0.055  # the measured pace already past the target: no burst slots
    assert feed(slow, [5, 6, 5, 6, 7, 5, 6, 8, 8]).burst == 0

    # What a replica admits, in the gateway and the simulator: the budget plus the burst's slots.
    from slogate.router.request import SLO
    from tests.helpers import req, view

    lr, v = learner(True), view(0, budget=8)
    for i in range(8):
        v.claim(req(i, arrival=0.0, slo=SLO.latency(1.0, 0.05), bound=200), 0.0)
    feed(lr, [5, 6, 5, 6, 7, 5, 6])
    assert learned_budget(lr, v, 8.0) == lr.budget + lr.burst > lr.budget


def test_the_margin_moves_by_the_mean_tpot_of_the_streams_a_replica_finished() -> None:
    """`margin_from_streams`: the streams a replica finished, judged by mean TPOT against their
    TBT as users' tools judge them, move the margin the line is aimed at: up while the replica is
    full and they ran well inside their TBT (the budget follows), down while about one in ten came
    near a miss, within [margin, 0.95]; not up while the replica is not full or in overload (its
    load over ~10 s past the goal's n); off: fixed."""
    from slogate.router.capacity import MARGIN_MOST, CapacityLearner, _Bin

    def learner(on: bool = True) -> CapacityLearner:
        # demand_margin off: a replica held full with nothing waiting would hold what it holds
        lr = CapacityLearner(48, start=8, lend_in_bursts=False, overdraft_on=False, margin_from_streams=on, demand_margin=0.0)
        lr.fit = (0.012, 0.0034)  # the knee's line: 12 ms + 3.4 ms a stream
        lr.bins = {n: _Bin(weight=10.0) for n in range(4, 14)}
        lr._line = lambda: lr.fit  # type: ignore[method-assign]
        return lr

    def feed(lr: CapacityLearner, ratio: float, seconds: int, full: bool = True, queued: float = 0.0) -> CapacityLearner:
        for t in range(seconds):
            for _ in range(2):
                lr.judge(ratio)
            lr.update(float(t + 1), 0.05, inflight=lr.budget if full else 3, queued=queued)
        return lr

    fixed = feed(learner(False), 0.7, 30)
    assert fixed.budget == 8 and fixed.margin_now == 0.85  # (0.0425 − 0.012) / 0.0034 = 8.97
    fast = feed(learner(), 0.7, 30)
    assert fast.margin_now == MARGIN_MOST  # 0.85 → 0.95 in steps of 0.01 a second
    assert fast.budget == int((MARGIN_MOST * 0.05 - 0.012) / 0.0034) == 10
    overload = feed(learner(), 0.7, 30, queued=6)  # full with a queue: load 14 > the goal's n (9), overload, not a burst
    assert overload.margin_now == 0.85 and overload.budget == 8
    idle = feed(learner(), 0.7, 30, full=False)
    assert idle.margin_now == 0.85 and idle.budget == 8  # streams on a replica not full say nothing of its budget
    near = feed(learner(), 0.99, 30)
    assert near.margin_now == 0.85 and near.budget == 8  # never below the configured margin
    back = feed(feed(learner(), 0.7, 8), 0.99, 30)  # up to 0.93 in 8 s, then streams near a miss: down two steps a second
    assert back.margin_now == 0.85 and back.budget == 8
    few = learner()
    few.judge(0.5)
    feed(few, 0.5, 1)  # 3 streams judged: not enough to move anything
    assert few.margin_now == 0.85


def test_a_finished_stream_is_judged_by_its_mean_tpot_and_the_learner_hears_of_it() -> None:
    """Lifecycle.finished hands the replica's learner each latency stream's mean TPOT / TBT
    (via the view, in the gateway and the simulator alike); streams that say nothing of the
    engine's pace are left out."""
    from slogate.router.capacity import CapacityLearner, learned_budget, stream_pace
    from slogate.router.lifecycle import Lifecycle
    from slogate.router.policies.fcfs import FCFS

    v = view(0, budget=8)
    life = Lifecycle(FCFS(), [v])

    def stream(rid: int, n: int, gap: float, slo: SLO, stall: float = 0.0, first: float = 0.3) -> object:
        r = req(rid, arrival=0.0, slo=slo, bound=n)
        v.claim(r, 0.0)
        r.replica = 0
        life.tokens(r, 1, first)
        for k in range(1, n):
            life.tokens(r, 1, first + k * gap + (stall if k >= 2 else 0.0))  # `stall` before the third token
        return r

    good = stream(1, 41, 0.030, SLO.latency(1.0, 0.05))
    assert stream_pace(good) is not None and abs(stream_pace(good) - 0.6) < 1e-9  # 30 ms a token against 50
    short = stream(2, 5, 0.030, SLO.latency(1.0, 0.05))
    batch = stream(3, 41, 0.030, SLO.deadline(20.0))
    resumed = stream(4, 41, 0.030, SLO.latency(1.0, 0.05))
    resumed.preemptions = 1
    assert stream_pace(short) is None and stream_pace(batch) is None and stream_pace(resumed) is None
    # A stall of 0.8 s before the third token: due by 1 + 2 × 0.05 s, it comes at 1.16 s. Its
    # mean TPOT (43.6 ms) meets the TBT; the per-token timeline does not: judged a miss (1).
    stalled = stream(5, 60, 0.030, SLO.latency(1.0, 0.05), stall=0.8)
    assert stalled.late_after_first and stream_pace(stalled) == 1.0
    # The same stall with a first token already late: the timeline was lost before the replica's
    # pace had a say, so only the mean TPOT counts.
    started_late = stream(6, 60, 0.030, SLO.latency(1.0, 0.05), stall=0.8, first=1.2)
    assert stream_pace(started_late) is not None and stream_pace(started_late) < 1.0
    for r in (good, short, batch, resumed, stalled):
        life.finished(r, 2.0, 0.0)
    assert list(v.finished_paces) == [stream_pace(good), 1.0]
    lr = CapacityLearner(48, start=8)
    learned_budget(lr, v, 3.0)
    assert list(lr.judged) == [stream_pace(good), 1.0] and not v.finished_paces
