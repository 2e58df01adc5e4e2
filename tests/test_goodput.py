import math

import pytest

from slogate.router.goodput import GoodputAccount, GoodputWeights, RequestLedger, WorkflowLedger, soft_decay
from slogate.router.request import SLO, Request, SLOClass, Tier, Workflow


def lat_req(**kw):
    return Request(rid=1, arrival=0.0, input_tokens=50, slo=SLO.latency(ttft_s=1.0, tbt_s=0.1), **kw)


def test_latency_token_timeline_counts_each_token_against_its_own_deadline():
    led = RequestLedger(lat_req(tier=Tier("high", 2.0)), GoodputWeights(w_p=2.0, w_d=1.0))
    # deadlines: 1.0, 1.1, 1.2, 1.3
    for t in (0.5, 1.05, 1.3, 1.3):
        led.on_token(t)
    assert led.on_time == 3  # token 2 (due 1.2) is late; token 3 (due 1.3) catches up
    assert led.token_goodput() == 3.0
    assert not led.attained()
    # TDG: w_p·w_tier for the first, w_d·w_tier for later ones that are on time
    assert led.tdg_value() == pytest.approx(2 * 2 + 1 * 2 + 1 * 2)
    assert led.tdg_ideal() == pytest.approx(2 * (2 + 3 * 1))


def test_latency_all_on_time_is_attained():
    led = RequestLedger(lat_req())
    for i in range(5):
        led.on_token(0.9 + 0.1 * i)
    assert led.attained() and led.token_goodput() == 5


def test_deadline_is_all_or_nothing_on_input_plus_output():
    req = Request(2, 0.0, 100, SLO.deadline(20.0))
    led = RequestLedger(req)
    for i in range(10):
        led.on_token(1.0 + i)
    assert led.token_goodput() == 110 and led.attained()
    late = RequestLedger(Request(3, 0.0, 100, SLO.deadline(20.0)))
    for i in range(10):
        late.on_token(12.0 + i)  # last token at 21 s
    assert late.token_goodput() == 0 and not late.attained()


def test_compound_counts_every_call_only_if_the_last_one_meets_the_workflow_deadline():
    wf = Workflow("w", started_at=0.0, deadline_at=40.0)
    ok = WorkflowLedger(wf)
    ok.on_call_done(100, 20, 10.0)
    ok.on_call_done(300, 50, 39.0)
    ok.complete = True
    assert ok.token_goodput() == 470 and ok.attained()
    wf2 = Workflow("w2", started_at=0.0, deadline_at=40.0)
    bad = WorkflowLedger(wf2)
    bad.on_call_done(100, 20, 10.0)
    bad.on_call_done(300, 50, 41.0)
    bad.complete = True
    assert bad.token_goodput() == 0


def test_tempo_soft_decay():
    assert soft_decay(10, 5) == 1.0
    assert soft_decay(10, 20) == pytest.approx(0.5)
    assert soft_decay(10, 20, alpha=2) == pytest.approx(0.25)
    assert soft_decay(10, 20, alpha=60) < 1e-15  # α → ∞ is the all-or-nothing SLO goodput


def test_soft_gain_of_a_late_deadline_request_decays_instead_of_vanishing():
    req = Request(4, 0.0, 100, SLO.deadline(10.0))
    led = RequestLedger(req)
    for i in range(10):
        led.on_token(11.0 + i)  # TTLT 20 s = 2× the SLO
    assert led.token_goodput() == 0
    assert led.soft_value() == pytest.approx((1 * 100 + 2 * 10) * 0.5)


def test_account_aggregates_per_class_and_tier_with_shed_requests_in_the_denominator():
    acc = GoodputAccount()
    good = RequestLedger(Request(5, 0.0, 10, SLO.deadline(5.0), tier=Tier("high", 2.0)))
    good.on_token(1.0)
    acc.settle_request(good)
    shed = RequestLedger(Request(6, 0.0, 10, SLO.deadline(5.0), tier=Tier("low", 1.0)))
    acc.settle_request(shed, ideal_tokens=4)
    d = acc.by_class[SLOClass.DEADLINE.value]
    assert (d.units, d.attained, d.token_goodput) == (2, 1, 11.0)
    assert d.tdg_ideal == pytest.approx(2.0 * 1 + 1.0 * (1 + 3))
    assert acc.by_tier["low"].attained == 0
    assert math.isclose(acc.total().tdg / acc.total().tdg_ideal, 2.0 / 6.0)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_slo_rejects_non_positive_or_non_finite_values(bad):
    with pytest.raises(ValueError):
        SLO.latency(ttft_s=bad, tbt_s=0.1)
    with pytest.raises(ValueError):
        SLO.deadline(bad)
