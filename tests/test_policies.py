import numpy as np
import pytest

from slogate.router.policies import EDF, FCFS, GMAX, LTR, PLAS, SJF, SimulatedAnnealing, SlideBatching, StrictPriority, WeightedVTC
from slogate.router.registry import ORDERING, make_ordering
from slogate.router.request import SLO, Tier, Workflow
from tests.helpers import req, view


def test_fcfs_head_of_line_blocking_and_gmax_avoiding_it():
    # A long answer that cannot make its 20 s deadline arrived first; a short one that can
    # arrived just after. With one free slot FCFS serves the hopeless one (HOL blocking).
    long = req(1, arrival=0.0, inp=500, bound=2000)
    short = req(2, arrival=0.1, inp=500, bound=50)
    reps = [view(budget=1)]
    assert FCFS().select(1.0, [long, short], 1, reps).dispatch == [long]
    g = GMAX(preempt=False)
    assert g.select(1.0, [long, short], 1, reps).dispatch == [short]


def test_gmax_priority_is_goodput_over_generation_time():
    g = GMAX(delta=0.0, preempt=False, jit=True)  # jit: every class has a finite slack
    r = req(1, inp=1000, bound=100)
    rep = view()
    prio, good, t_gen, expired, slack = g.estimate(0.0, [r], [rep])
    m = rep.model
    v = rep.token_time()
    expect_t_gen = m.prefill_time(1000) + m.t_c + 100 * v
    assert t_gen[0] == pytest.approx(expect_t_gen)
    assert good[0] == pytest.approx(1000 + 100)  # feasible: input + output tokens
    assert prio[0] == pytest.approx(1100 / expect_t_gen)
    assert not expired[0] and slack[0] == pytest.approx(20.0 - expect_t_gen)
    assert GMAX(delta=0.0, preempt=False).estimate(0.0, [r], [rep])[4][0] == np.inf  # only best effort can be urgent


def test_gmax_infeasible_deadline_gets_zero_goodput_and_expired_is_shed():
    g = GMAX(delta=0.0, preempt=False)
    hopeless = req(1, inp=100, bound=5000)  # 5000 tokens cannot decode within 20 s
    _, good, _, expired, _ = g.estimate(0.0, [hopeless], [view()])
    assert good[0] == 0 and not expired[0]
    gone = req(2, arrival=0.0, inp=100, bound=10)
    sel = g.select(25.0, [gone], 1, [view()])
    assert sel.shed == [(gone, "slo_unattainable")] and sel.dispatch == []


def test_gmax_cutoff_and_sliding_window_prefer_length_homogeneous_groups():
    g = GMAX(preempt=False)
    g.arm = g.cutoffs.index(0.95)
    reqs = [req(i, inp=n) for i, n in enumerate([100, 5000, 120, 110])]
    prio = np.array([10.0, 9.0, 8.9, 1.0])
    # cutoff 0.95·(2nd best = 9) keeps {10, 9, 8.9}; sorted by input length the windows of
    # two are (100,120) = 18.9 and (120,5000) = 17.9, so the homogeneous pair wins over the
    # top-2 by priority (10, 9).
    picked = g._group(np.arange(4), prio, reqs, 2)
    assert sorted(reqs[i].input_tokens for i in picked) == [100, 120]


def test_gmax_delta_ends_starvation_of_a_low_density_best_effort_request():
    be = req(1, arrival=0.0, inp=100, slo=SLO.best_effort(3600.0), bound=1500)
    reps = [view(budget=1)]

    def newcomer(now):
        return req(2, arrival=now, inp=1000, bound=20)

    # Without JIT urgency only δ can lift the best-effort request over dense newcomers (with
    # best effort ranked by density, the paper's rule; by default it goes last, below).
    starving = GMAX(delta=0.0, preempt=False, jit=False, best_effort_last=False)
    assert all(starving.select(t, [be, newcomer(t)], 1, reps).dispatch[0].rid == 2 for t in (1.0, 600.0, 3000.0))
    lifted = GMAX(delta=50.0, preempt=False, jit=False, best_effort_last=False)
    assert lifted.select(1.0, [be, newcomer(1.0)], 1, reps).dispatch[0].rid == 2
    assert lifted.select(600.0, [be, newcomer(600.0)], 1, reps).dispatch[0].rid == 1


def test_gmax_best_effort_becomes_urgent_near_its_default_deadline_and_is_never_shed():
    be = req(1, arrival=0.0, inp=100, slo=SLO.best_effort(600.0), bound=1500)
    reps = [view(budget=1)]
    g = GMAX(delta=0.0, preempt=False)
    assert g.select(10.0, [be, req(2, arrival=10.0, inp=1000, bound=20)], 1, reps).dispatch[0].rid == 2
    late = g.select(590.0, [be, req(3, arrival=590.0, inp=1000, bound=20)], 1, reps)
    assert late.dispatch[0].rid == 1
    assert g.select(5000.0, [be], 1, reps).shed == []


def test_gmax_gives_a_slot_to_best_effort_only_when_no_request_with_an_slo_waits():
    # A long best-effort answer half done: by goodput density (all its tokens for the rest of its
    # run) it outranks a fresh deadline request that has time to spare, and a latency one.
    be = req(1, arrival=0.0, inp=100, slo=SLO.best_effort(600.0), bound=300)  # 300 more to go
    be.generated = 1200
    dl = req(2, arrival=5.0, inp=100, bound=300)
    lat = req(3, arrival=5.0, inp=100, slo=SLO.latency(1.0, 0.05), bound=150)
    reps = [view(budget=1)]
    assert GMAX(preempt=False, best_effort_last=False).select(5.0, [be, dl, lat], 1, reps).dispatch == [be]
    g = GMAX(preempt=False)  # the default: best effort last
    assert g.select(5.0, [be, dl, lat], 1, reps).dispatch[0].rid != 1
    assert [r.rid for r in g.select(5.0, [be, dl, lat], 3, [view(budget=3)]).dispatch][-1] == 1  # spare slots still go to it
    assert g.select(5.0, [be], 1, reps).dispatch == [be]
    # Near its default deadline it is urgent and goes first: best effort is never starved.
    assert g.select(599.0, [be, req(4, arrival=599.0, inp=100, bound=300)], 1, reps).dispatch == [be]


def test_gmax_jit_serves_the_request_that_must_start_now_before_a_denser_one_with_slack():
    lat = req(1, arrival=0.0, inp=100, slo=SLO.latency(2.0, 0.1), bound=200)
    dl = req(2, arrival=0.0, inp=3000, bound=50)  # denser, 20 s deadline: lots of slack
    reps = [view(budget=1)]
    # The default is the paper's pure goodput/t_gen order: the denser deadline request first.
    assert GMAX(preempt=False).select(0.5, [lat, dl], 1, reps).dispatch == [dl]
    assert GMAX(jit=True, preempt=False).select(0.5, [lat, dl], 1, reps).dispatch == [lat]


def test_gmax_fairness_blend_lifts_the_tenant_that_got_least():
    g = GMAX(fairness=0.9, preempt=False, jit=False)
    a, b = req(1, tenant="a", bound=100), req(2, tenant="b", inp=80, bound=100)
    g.on_service(a, 10_000, 0.0)
    g.on_service(b, 10, 0.0)
    assert g.select(0.0, [a, b], 1, [view()]).dispatch == [b]
    assert GMAX(fairness=0.0, preempt=False, jit=False).select(0.0, [a, b], 1, [view()]).dispatch == [a]


def test_gmax_preempts_a_hopeless_running_request_only_when_the_gain_beats_the_stall():
    rep = view(budget=1)
    running = req(9, arrival=0.0, inp=200, bound=4000)  # cannot make its deadline any more
    rep.claim(running, 0.0)
    rep.first_token(running, 0.5)
    running.generated = 10
    waiting = req(1, arrival=5.0, inp=2000, bound=50)
    assert GMAX().select(5.0, [waiting], 0, [rep]).preempt == []  # off by default: it cost goodput, measured
    g = GMAX(preempt=True)
    sel = g.select(5.0, [waiting], 0, [rep])
    assert sel.preempt == [running]
    # a healthy running request with similar priority is left alone
    rep2 = view(budget=1)
    ok = req(8, arrival=0.0, inp=2000, bound=50)
    rep2.claim(ok, 0.0)
    rep2.first_token(ok, 0.1)
    assert GMAX(preempt=True).select(5.0, [req(1, arrival=5.0, inp=2000, bound=50)], 0, [rep2]).preempt == []


def test_gmax_preempts_a_latency_stream_only_while_it_is_ahead_of_its_timeline():
    """Slack-aware preemption: a stream far ahead of its reader yields its slot to a request that
    cannot wait; one at its timeline is never paused; lead_factor=0 (the default) turns it off."""

    def full(generated: int) -> tuple:
        rep = view(budget=1)
        s = req(9, arrival=0.0, inp=200, slo=SLO.latency(1.0, 0.1), bound=300)
        rep.claim(s, 0.0)
        rep.first_token(s, 0.2)
        s.generated = generated
        return rep, s

    urgent = req(1, arrival=4.9, inp=200, slo=SLO.deadline(2.0), bound=50)  # 2 s: cannot wait for 300 more tokens
    rep, ahead = full(generated=200)  # token 200 is due at 1 + 200 × 0.1 = 21 s: 16 s ahead at t = 5
    assert GMAX(lead_factor=3).select(5.0, [urgent], 0, [rep]).preempt == [ahead]
    assert GMAX().select(5.0, [urgent], 0, [full(200)[0]]).preempt == []
    rep, _ = full(generated=40)  # token 40 due at 5 s: no lead at all
    assert GMAX(lead_factor=3).select(5.0, [urgent], 0, [rep]).preempt == []
    rep, _ = full(generated=42)  # 0.2 s ahead: less than 3 × (recompute + a frame)
    assert GMAX(lead_factor=3).select(5.0, [urgent], 0, [rep]).preempt == []
    patient = req(2, arrival=4.9, inp=200, slo=SLO.deadline(30.0), bound=50)  # can wait for a slot to free
    assert GMAX(lead_factor=3).select(5.0, [patient], 0, [full(200)[0]]).preempt == []


def test_gmax_yield_slack_pauses_best_effort_for_urgent_work_and_gives_it_the_slot():
    """`yield_slack`: a best-effort answer that still ends by its deadline after the waiting
    request's whole run yields its slot to a request that must start now, and that request gets
    the freed slot first; off (the default), nothing is preempted."""

    def full() -> tuple:
        rep = view(budget=1)
        be = req(9, arrival=0.0, inp=200, slo=SLO.best_effort(600.0), bound=1500)
        rep.claim(be, 0.0)
        rep.first_token(be, 0.2)
        be.generated = 100
        return rep, be

    urgent = req(1, arrival=4.9, inp=200, slo=SLO.deadline(2.0), bound=50)
    other = req(2, arrival=0.0, inp=200, slo=SLO.deadline(300.0), bound=50)  # waited longer, no hurry
    g = GMAX(yield_slack=True)
    rep, be = full()
    assert g.select(5.0, [other, urgent], 0, [rep]).preempt == [be]
    rep.release(be, 5.0)
    assert g.select(5.1, [other, urgent, be], 1, [rep]).dispatch == [urgent]  # the slot it freed
    assert GMAX().select(5.0, [other, urgent], 0, [full()[0]]).preempt == []
    rep, _ = full()
    rep.decoding[9].slo = SLO.best_effort(20.0)  # 1,400 tokens left: it would miss its own deadline after the pause
    assert GMAX(yield_slack=True).select(5.0, [urgent], 0, [rep]).preempt == []


def test_gmax_yield_slack_pauses_a_deadline_answer_only_while_it_keeps_its_deadline():
    """A long deadline answer due far ahead yields to a request that must start now, as a
    best-effort one does; one whose deadline would not survive the waiting request's run does not."""

    def full(deadline_s: float) -> tuple:
        rep = view(budget=1)
        long = req(9, arrival=0.0, inp=200, slo=SLO.deadline(deadline_s), bound=1500)
        rep.claim(long, 0.0)
        rep.first_token(long, 0.2)
        long.generated = 100
        return rep, long

    urgent = req(1, arrival=4.9, inp=200, slo=SLO.deadline(2.0), bound=50)
    rep, long = full(600.0)
    assert GMAX(yield_slack=True).select(5.0, [urgent], 0, [rep]).preempt == [long]
    rep, _ = full(22.3)  # its 1,400 tokens left end by 21.9 s at its bound, by 22.8 s after the pause: no time to lend
    assert GMAX(yield_slack=True).select(5.0, [urgent], 0, [rep]).preempt == []


def test_gmax_adapts_cutoff_toward_the_arm_with_more_goodput():
    g = GMAX(frame_s=1.0, explore=0.0)
    good_arm = g.cutoffs.index(0.7)
    t = 0.0
    g.select(t, [], 0, [view()])
    for _ in range(60):
        g.frame_reward = 100.0 if g.arm == good_arm else 1.0
        t += 1.0
        g._new_frame(t)
        if g.arm != good_arm and g.arm_pulls[g.arm] > 3:
            g.arm = good_arm  # force one visit, as exploration would
    assert max(range(len(g.cutoffs)), key=lambda i: g.arm_value[i]) == good_arm


def test_edf_sjf_ltr_priority():
    a = req(1, arrival=0.0, slo=SLO.deadline(30.0), bound=10, mean=300)
    b = req(2, arrival=1.0, slo=SLO.deadline(5.0), bound=10, mean=20)
    reps = [view()]
    assert EDF().select(2.0, [a, b], 1, reps).dispatch == [b]
    assert SJF().select(2.0, [a, b], 1, reps).dispatch == [b]
    assert LTR(starvation_s=10.0).select(2.0, [a, b], 1, reps).dispatch == [b]
    assert LTR(starvation_s=10.0).select(12.0, [a, b], 1, reps).dispatch == [a]  # starved: jumps ahead
    hi = req(3, arrival=5.0, tier=Tier("high", 2.0))
    assert StrictPriority().select(6.0, [a, hi], 1, reps).dispatch == [hi]


def test_plas_serves_the_program_with_least_attained_service():
    p = PLAS()
    wf_big = Workflow("big", 0.0, 100.0)
    heavy = req(1, arrival=0.0)
    heavy.workflow = wf_big
    light = req(2, arrival=1.0)
    p.on_service(heavy, 5000, 0.5)
    assert p.select(2.0, [heavy, light], 1, [view()]).dispatch == [light]


def test_vtc_serves_the_tenant_with_the_smallest_weighted_counter():
    v = WeightedVTC()
    a1, a2 = req(1, tenant="a", arrival=0.0), req(2, tenant="a", arrival=0.1)
    b1 = req(3, tenant="b", arrival=0.2)
    v.on_service(a1, 1000, 0.0)
    v.on_service(b1, 100, 0.0)
    assert v.select(1.0, [a1, a2, b1], 1, [view()]).dispatch == [b1]
    # with weight 10, tenant a's counter grows 10× slower
    heavy_w = req(4, tenant="c", arrival=0.0, tier=Tier("gold", 10.0))
    v2 = WeightedVTC()
    v2.on_service(heavy_w, 1000, 0.0)
    v2.on_service(b1, 200, 0.0)
    assert v2.select(1.0, [heavy_w, b1], 1, [view()]).dispatch == [heavy_w]


def test_slide_puts_urgent_requests_first_by_density():
    s = SlideBatching(gamma=1.0)
    urgent_small = req(1, arrival=0.0, inp=200, slo=SLO.latency(0.3, 0.1))
    urgent_big = req(2, arrival=0.0, inp=4000, slo=SLO.latency(0.3, 0.1))
    relaxed = req(3, arrival=0.0, inp=100, slo=SLO.latency(30.0, 0.1))
    out = s.select(0.0, [relaxed, urgent_big, urgent_small], 3, [view()]).dispatch
    assert out == [urgent_small, urgent_big, relaxed]


def test_sa_is_seeded_and_returns_distinct_waiting_requests():
    reqs = [req(i, arrival=0.1 * i, inp=100 * (i + 1), slo=SLO.deadline(2.0 + i), mean=20 * (5 - i)) for i in range(5)]
    a = SimulatedAnnealing(seed=3).select(1.0, reqs, 3, [view()]).dispatch
    b = SimulatedAnnealing(seed=3).select(1.0, reqs, 3, [view()]).dispatch
    assert a == b and len({r.rid for r in a}) == 3


@pytest.mark.parametrize("name", sorted(ORDERING))
def test_every_policy_respects_the_slot_count_and_only_returns_waiting_requests(name):
    reqs = [req(i, arrival=0.1 * i, inp=100 + 50 * i, bound=30 + i) for i in range(12)]
    pol = make_ordering(name)
    for slots in (0, 1, 5, 20):
        sel = pol.select(2.0, reqs, slots, [view(budget=8)])
        assert len(sel.dispatch) <= slots
        assert {r.rid for r in sel.dispatch} <= {r.rid for r in reqs}
        assert len({r.rid for r in sel.dispatch}) == len(sel.dispatch)


def test_gmax_sheds_a_request_that_waited_past_its_waiting_time_before_any_dispatch():
    slo = SLO.latency(5.0, 0.1, waiting_s=1.0)
    fresh, old, requeued = req(1, arrival=1.0, slo=slo), req(2, arrival=0.0, slo=slo), req(3, arrival=0.0, slo=slo)
    requeued.dispatched_at = 0.2  # it was served once (then preempted): its wait is over
    sel = GMAX(preempt=False).select(1.5, [fresh, old, requeued], 0, [view()])
    assert sel.shed == [(old, "waiting_time_exceeded")]
    assert GMAX(preempt=False).select(0.9, [old], 0, [view()]).shed == []


def test_gmax_refuses_a_request_on_the_default_slo_only_for_want_of_room():
    """A stream that named no SLO and can no longer be on time (its default TTFT passed, the
    engine slower than its default TBT) is served while a slot would stay empty; under load it
    is refused (429), oldest served first. One whose TTFT someone chose is refused either way."""
    slo = SLO.latency(1.0, 0.05)

    def late(rid: int, arrival: float, chosen: bool) -> object:
        r = req(rid, arrival=arrival, inp=100, slo=slo, bound=10)
        r.ttft_chosen = r.tbt_chosen = chosen
        return r

    g = GMAX(preempt=False)
    now = 30.0
    old, older = late(1, 20.0, False), late(2, 10.0, False)
    chosen = late(3, 20.0, True)
    assert g.estimate(now, [old, older, chosen], [view()])[3].all()  # all three past hope by the numbers
    sel = g.select(now, [old, older, chosen], 2, [view()])
    assert {r.rid for r in sel.dispatch} == {1, 2} and sel.shed == [(chosen, "slo_unattainable")]
    sel = g.select(now, [old, older], 1, [view()])  # one slot: the oldest gets it, the other is refused
    assert [r.rid for r in sel.dispatch] == [2] and sel.shed == [(old, "slo_unattainable")]
    assert {r.rid for r, _ in g.select(now, [old, older], 0, [view()]).shed} == {1, 2}  # no room: both refused


# ------------------------------------------------------------------ the registry
def test_every_plugin_lives_in_the_module_named_for_its_key_and_old_keys_still_work() -> None:
    import inspect

    from slogate.router.registry import PLACEMENT, check_policy

    for reg in (ORDERING, PLACEMENT):
        for key in reg:
            cls = reg.classes[key]
            assert inspect.getmodule(cls).__name__.rsplit(".", 1)[1] == key.replace("-", "_"), (key, cls)
    assert check_policy("ordering", "sa") == "simulated-annealing"
    assert (check_policy("placement", "pok"), check_policy("placement", "p2c")) == ("power-of-k", "power-of-two")


def test_policy_parameters_are_checked_when_the_config_loads() -> None:
    from pydantic import ValidationError

    from slogate.gateway.config import GatewayConfig

    base = {"backends": [{"url": "http://127.0.0.1:9"}]}
    ok = GatewayConfig.model_validate(base | {"policies": {"ordering": "sa", "params": {"iters": "50"},
                                                           "placement": "gorouting", "placement_params": {"alpha": 0.9}}})
    assert ok.policies.ordering == "simulated-annealing" and ok.policies.params == {"iters": 50}
    assert ok.policies.placement_params == {"alpha": 0.9}
    with pytest.raises(ValidationError, match=r"fairnes: Extra inputs are not permitted.*its parameters: .*fairness"):
        GatewayConfig.model_validate(base | {"policies": {"params": {"fairnes": 0.2}}})
    with pytest.raises(ValidationError, match="alpha: Input should be a valid number"):
        GatewayConfig.model_validate(base | {"policies": {"placement_params": {"alpha": "high"}}})
    with pytest.raises(ValueError, match="starvation_s"):
        make_ordering("ltr", starvation=3)


def test_scheduler_never_sheds_a_stream_its_client_is_reading():
    """A request that has streamed tokens (preempted, or resumed after a replica failed) is past
    hope but is finished late in the room left, never cut; one that streamed nothing is shed.
    The rule lives in the core, so the simulator and the gateway both follow it."""
    from slogate.router.placement import LeastLoad
    from slogate.router.scheduler import Scheduler

    def hopeless(rid: int, generated: int):  # type: ignore[no-untyped-def]
        r = req(rid, arrival=0.0, inp=200, slo=SLO.latency(0.5, 0.05), bound=100)
        r.generated = generated
        return r

    reading, fresh = hopeless(1, generated=30), hopeless(2, generated=0)
    rep = view(budget=4)
    d = Scheduler(GMAX(preempt=False), LeastLoad()).schedule(100.0, [reading, fresh], [rep])
    assert [r for r, _ in d.shed] == [fresh]
    assert [r for r, _ in d.dispatch] == [reading] and reading.replica == rep.rid
    full = view(budget=1)
    full.claim(req(9), 0.0)
    d = Scheduler(GMAX(preempt=False), LeastLoad()).schedule(100.0, [hopeless(3, 30)], [full])
    assert d.shed == [] and d.dispatch == []  # no room: it waits, still not shed


def test_gmax_strict_ttft_by_default_sheds_a_first_token_that_can_only_be_late_catch_up_keeps_it() -> None:
    # Its first token is due at 1 s; at 1.2 s it has not started. JITServe's ledger still credits
    # the tokens that catch up with the timeline; users' tools fail it whatever follows.
    late = req(1, arrival=0.0, inp=100, slo=SLO.latency(1.0, 0.05), bound=200)
    on_time = req(2, arrival=1.0, inp=100, slo=SLO.latency(1.0, 0.05), bound=200)
    started = req(3, arrival=0.0, inp=100, slo=SLO.latency(1.0, 0.05), bound=200)
    started.generated = 5  # a stream being read (resumed): always the catch-up rule
    reps = [view(budget=4)]
    sel = GMAX(preempt=False, strict_ttft=False).select(1.2, [late, on_time, started], 4, reps)
    assert sel.shed == [] and len(sel.dispatch) == 3
    sel = GMAX(preempt=False).select(1.2, [late, on_time, started], 4, reps)
    assert sel.shed == [(late, "slo_unattainable")] and {r.rid for r in sel.dispatch} == {2, 3}
    late.ttft_chosen = False  # on the built-in default TTFT: a client that asked for none gets it late
    assert GMAX(preempt=False, strict_ttft=True).select(1.2, [late], 4, [view(budget=4)]).shed == []


def test_gmax_refuses_a_first_token_only_when_even_the_fastest_recent_prefill_would_be_late() -> None:
    """A 429 must be right: the estimate (the median of the measured first tokens, most of them
    timed on replicas also decoding) prices a prefill at 4× what the fastest recent ones took;
    a request on time at that fastest pace is kept (and dispatched where there is room), one late
    even then is shed."""
    rep = view(budget=4)
    m = rep.model
    est = m.raw_prefill(1000) + m.coeffs.t_c
    for ratio in [10.0] * 4 + [40.0] * 28:
        m.observe_prefill(ratio * est, 1000, now=0.0)
    assert m.beta_p == 40.0 and m.beta_p_fast == 10.0
    maybe = req(1, arrival=0.0, inp=1000, slo=SLO.latency(1.0, 0.05), bound=50)  # ~3.5 s by the median, ~0.9 s at the fastest
    never = req(2, arrival=0.0, inp=1000, slo=SLO.latency(0.5, 0.05), bound=50)
    sel = GMAX(preempt=False).select(0.0, [maybe, never], 4, [rep])
    assert sel.shed == [(never, "slo_unattainable")]
    assert [r.rid for r in sel.dispatch] == [1]
    # Deadline answers too: refused only when even the fastest prefill misses the deadline.
    tight = req(3, arrival=0.0, inp=1000, slo=SLO.deadline(0.8), bound=1)
    ok = req(4, arrival=0.0, inp=1000, slo=SLO.deadline(1.5), bound=1)
    assert GMAX(preempt=False).select(0.0, [tight, ok], 4, [rep]).shed == [(tight, "slo_unattainable")]


def test_no_new_preemption_while_a_paused_answer_is_overdue():
    """With yield_slack a best-effort answer yields to a request that must start now; while some
    paused answer's reader has already waited `resume_within_s`, nothing more is paused."""
    from slogate.router.placement.gorouting import GoRouting
    from slogate.router.scheduler import Scheduler

    def decide(paused_for: float) -> list:
        rep = view(budget=1)
        be = req(9, arrival=0.0, inp=200, slo=SLO.best_effort(600.0), bound=1500)
        rep.claim(be, 0.0)
        rep.first_token(be, 0.2)
        be.generated = 100
        urgent = req(1, arrival=4.9, inp=200, slo=SLO.deadline(2.0), bound=50)
        paused = req(3, arrival=0.0, inp=200, slo=SLO.best_effort(600.0), bound=500)
        paused.generated, paused.last_token_at = 50, 5.0 - paused_for
        sched = Scheduler(GMAX(yield_slack=True), GoRouting(), resume_within_s=10.0)
        return [r.rid for r in sched.schedule(5.0, [urgent, paused], [rep]).preempt]

    assert decide(paused_for=3.0) == [9]
    assert decide(paused_for=11.0) == []


def test_a_replica_priced_slow_by_stale_first_tokens_gets_the_next_request() -> None:
    """G32 (guidellm on real vLLM): after a burst one replica's prefill correction, timed beside
    9 streams, was 2.2× the other's; both nearly idle, GoRouting put every request on the other
    one (its exec 0.26 s against 0.57), so no first token ever corrected it. With no first token
    timed there for 10 s and none waiting, it takes the fleet's fresh figure, the next request
    goes there, and that request's first token starts its window afresh."""
    from slogate.router.placement.gorouting import GoRouting
    from slogate.router.scheduler import Scheduler

    busy, idle = view(rid=0, budget=8), view(rid=1, budget=8)
    est = busy.model.raw_prefill(250) + busy.model.coeffs.t_c
    running = req(9, arrival=50.0, inp=250, slo=SLO.latency(1.0, 0.05), bound=215)
    busy.claim(running, 50.0)
    busy.first_token(running, 50.0 + 10.0 * est)
    for i in range(8):  # both timed their first tokens; the idle one's last 35 s ago, beside a burst
        busy.model.observe_prefill(10.0 * est, 250, now=55.0 + i)
        idle.model.observe_prefill((2.0 if i == 0 else 22.0) * est, 250, now=20.0 + i)
    new = req(1, arrival=63.0, inp=250, slo=SLO.latency(1.0, 0.05), bound=215)
    assert idle.estimate_exec(63.0, new) > busy.estimate_exec(63.0, new)  # as the stale figures price them
    sched = Scheduler(GMAX(preempt=False), GoRouting())
    assert sched.schedule(63.0, [new], [busy, idle]).dispatch == [(new, 1)]
    assert idle.model.beta_p == busy.model.beta_p == 10.0
    assert idle.model.beta_p_fast == 2.0  # only ever down: its own fastest first token was faster than the fleet's
    idle.first_token(new, 63.0 + 4.0 * est)  # timed alone there: the window holds this first token only
    assert idle.model.beta_p == idle.model.beta_p_fast == pytest.approx(4.0) and idle.model.prefill_seen_at == 63.0 + 4.0 * est
    # Fresh evidence is kept, slower or not: a replica whose first tokens are timed is priced by them.
    for i in range(8):
        idle.model.observe_prefill(30.0 * est, 250, now=63.5 + i)
    Scheduler(GMAX(preempt=False), GoRouting()).schedule(72.0, [], [busy, idle])
    assert idle.model.beta_p == 30.0


def test_a_replica_never_timed_takes_the_fleets_prefill_price_and_a_shared_prefill_times_nothing() -> None:
    """G34 (guidellm on real vLLM, both replicas idle at the start): the replica not yet timed kept
    the profile's prefill price (7x too fast on CPU engines) and drew the next two requests; the
    first of them, joined by the second before its first token, came 2.4x slower than a prefill
    alone, and that one figure priced the replica out for 15 s (7 streams against 2). A first
    token whose prefill another one joined teaches nothing, and until a replica has
    PRIOR_FIRST_TOKENS first tokens of its own it is priced by the fleet's, pooled (a replica
    never timed too): not by the other's alone, which swapped twins' noisy first figures."""
    from slogate.router.latency import PRIOR_FIRST_TOKENS
    from slogate.router.placement.gorouting import GoRouting
    from slogate.router.scheduler import Scheduler

    timed, cold = view(rid=0, budget=8), view(rid=1, budget=8)
    est = timed.model.raw_prefill(250) + timed.model.coeffs.t_c
    first = req(1, arrival=0.0, inp=250, slo=SLO.latency(1.0, 0.05), bound=215)
    timed.claim(first, 0.0)
    timed.first_token(first, 7.0 * est)
    assert timed.model.beta_p == pytest.approx(7.0) and cold.model.beta_p_learned is None
    new = req(2, arrival=1.0, inp=250, slo=SLO.latency(1.0, 0.05), bound=215)
    Scheduler(GMAX(preempt=False), GoRouting()).schedule(1.0, [], [timed, cold])
    assert cold.model.beta_p == pytest.approx(7.0)  # up, not only down: no evidence of its own
    assert cold.estimate_exec(1.0, new) == pytest.approx(timed.estimate_exec(1.0, new) - timed.n_decode * timed.model.b_d)
    # Two prefills sharing steps: neither first token times the replica's prefill.
    a, b = (req(i, arrival=2.0, inp=250, slo=SLO.latency(1.0, 0.05), bound=215) for i in (3, 4))
    cold.claim(a, 2.0)
    cold.claim(b, 2.1)
    cold.first_token(a, 2.0 + 17.0 * est)
    cold.first_token(b, 2.1 + 17.0 * est)
    assert cold.model.beta_p == pytest.approx(7.0)
    sched = Scheduler(GMAX(preempt=False), GoRouting())
    for i in range(PRIOR_FIRST_TOKENS):  # alone again (the others decode): each first token times it
        c = req(5 + i, arrival=5.0 + i, inp=250, slo=SLO.latency(1.0, 0.05), bound=215)
        cold.claim(c, 5.0 + i)
        cold.first_token(c, 5.0 + i + 3.0 * est)
        sched.schedule(5.5 + i, [], [timed, cold])
        # The pool's median: the other's 7 and its own 3s (the high median of [3, 7] is 7).
        assert cold.model.beta_p == pytest.approx(7.0 if i == 0 else 3.0)
        assert timed.model.beta_p == cold.model.beta_p  # twins priced alike while either is new
    assert cold.model.prefill_evidence == PRIOR_FIRST_TOKENS and cold.model.prior_p is not None
    for i in range(PRIOR_FIRST_TOKENS):  # the timed one times slow first tokens: its own figure only once it has 8
        d = req(20 + i, arrival=20.0 + i, inp=250, slo=SLO.latency(1.0, 0.05), bound=215)
        timed.claim(d, 20.0 + i)
        timed.first_token(d, 20.0 + i + 9.0 * est)
        sched.schedule(20.5 + i, [], [timed, cold])
    assert timed.model.beta_p == pytest.approx(9.0) and cold.model.beta_p == pytest.approx(3.0)
