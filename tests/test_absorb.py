"""A first token about to be lost goes beyond the budget where the streams running can absorb it
(`capacity.absorb`: ReplicaView.absorbs, Scheduler.absorbed)."""

from __future__ import annotations

import asyncio

from slogate.gateway.admission import Admission, AdmissionHooks
from slogate.router.request import SLO, Request
from slogate.router.scheduler import Scheduler
from slogate.router.view import ReplicaView
from tests.helpers import req, view

TBT = 0.05


def _stream(rid: int, now: float, pace: float, generated: int = 100, left: float = 200, slo: SLO | None = None) -> Request:
    """A stream whose `generated`-th token came just now, at `pace` s each since its first, 0.2 s after it arrived."""
    first = now - (generated - 1) * pace
    r = req(rid, arrival=first - 0.2, slo=slo or SLO.latency(1.0, TBT), bound=generated + left)
    r.first_token_at, r.last_token_at, r.generated = first, now, generated
    return r


def _full(rid: int, now: float, pace: float, n: int = 2, **kw: object) -> ReplicaView:
    v = view(rid, budget=n)
    for k in range(n):
        r = _stream(1000 * (rid + 1) + k, now, pace, **kw)  # type: ignore[arg-type]
        v.claim(r, r.arrival)
        v.first_token(r, r.first_token_at)  # type: ignore[arg-type]
    v.model = view().model  # the profile's prefill speed, not one learned from these made-up first tokens
    return v


def _at_risk(rid: int, now: float) -> Request:
    return req(rid, arrival=now - 0.6, inp=200, slo=SLO.latency(1.0, TBT), bound=200)  # first token due in 0.4 s


def test_streams_with_slack_absorb_a_first_token_streams_near_their_pace_do_not() -> None:
    now = 100.0
    new = _at_risk(1, now)
    assert _full(0, now, pace=0.025).absorbs(now, new, cost=0.004)  # 25 ms a token against 50: seconds of slack each
    assert not _full(0, now, pace=0.048).absorbs(now, new, cost=0.004)  # 48 ms: the newcomer's step cost alone breaks them
    # With the measured cost tiny, its prefill stall still counts: 0.18 s for a 2,000-token prompt
    # breaks the mean TPOT of a stream 0.05 s inside it; a 200-token one (0.02 s) does not.
    near = _full(0, now, pace=0.0495, left=3)  # (99 + 3) × 49.5 ms against 50 ms: 0.05 s to spare
    long_prompt = req(2, arrival=now - 0.2, inp=2000, slo=SLO.latency(1.0, TBT), bound=200)
    assert near.absorbs(now, new, cost=0.0001) and not near.absorbs(now, long_prompt, cost=0.0001)
    # A stream already late is lost whatever happens: it does not stand in the way.
    v = _full(0, now, pace=0.025)
    late = _stream(99, now, pace=0.07)
    v.claim(late, late.arrival)
    v.first_token(late, late.first_token_at)  # type: ignore[arg-type]
    assert v.absorbs(now, new, cost=0.004)
    # The newcomer's own pace counts: where streams get 49 ms a token it would get more than 50.
    assert not _full(0, now, pace=0.049, left=5000).absorbs(now, new, cost=0.002)
    # Without a measured line, the cost of a stream is bounded by the pace over the streams held:
    # two at 34 ms a token put a third at 34 + 17 > 50 ms.
    assert _full(0, now, pace=0.02).absorbs(now, new) and not _full(0, now, pace=0.034).absorbs(now, new)
    # An answer with a deadline it only just makes is not slowed past it.
    d = _full(0, now, pace=0.025)
    tight = req(98, arrival=now - 5, slo=SLO.deadline(5 + 200 * 0.025 + 0.05), bound=300)
    tight.first_token_at, tight.last_token_at, tight.generated = now - 4, now, 100
    d.claim(tight, tight.arrival)
    d.first_token(tight, tight.first_token_at)
    assert not d.absorbs(now, new, cost=0.004)
    assert not view(0).absorbs(now, new)  # nothing running: nothing measured (and a free slot would serve it anyway)


def test_the_scheduler_absorbs_only_first_tokens_about_to_be_lost_and_only_when_on() -> None:
    now = 100.0
    urgent = _at_risk(1, now)
    spare = req(2, arrival=now, inp=200, slo=SLO.latency(3.0, TBT))  # 3 s to its first token: it waits for a slot
    lost = req(3, arrival=now - 1.5, inp=200, slo=SLO.latency(1.0, TBT))  # its first token is already late
    deadline = req(4, arrival=now - 0.6, inp=200, slo=SLO.deadline(1.5))
    off = Scheduler.from_combo("gmax+gorouting")
    assert off.schedule(now, [urgent, spare, lost, deadline], [_full(0, now, 0.025), _full(1, now, 0.048)]).dispatch == []
    on = Scheduler.from_combo("gmax+gorouting")
    on.absorb = True
    views = [_full(0, now, 0.048), _full(1, now, 0.025)]
    d = on.schedule(now, [urgent, spare, lost], views)
    assert [(r.rid, rid) for r, rid in d.dispatch] == [(1, 1)] and d.absorbed == 1  # to the replica whose streams have the slack
    assert views[1].inflight == 3 and views[1].budget == 2 and views[0].inflight == 2
    # An answer with a deadline waits for a slot too: the ordering decides who gets the next one,
    # and a stream slipped past it would take that answer's time (in simulation deadline
    # attainment fell 94% → 77% past the knee before this rule).
    views = [_full(0, now, 0.048), _full(1, now, 0.025)]
    assert on.schedule(now, [_at_risk(6, now), deadline], views).dispatch == []
    # `absorb_beside_deadlines`: it is absorbed all the same; the answer with a deadline still
    # waits for a slot (it is no first token about to be lost).
    beside = Scheduler.from_combo("gmax+gorouting")
    beside.absorb = beside.absorb_beside_deadlines = True
    views = [_full(0, now, 0.048), _full(1, now, 0.025)]
    assert [(r.rid, rid) for r, rid in beside.schedule(now, [_at_risk(6, now), deadline], views).dispatch] == [(6, 1)]
    # Nowhere with slack: it waits (and GMAX refuses it once its first token is lost).
    assert on.schedule(now, [_at_risk(5, now)], [_full(0, now, 0.048), _full(1, now, 0.049)]).dispatch == []
    # "slack": beside an answer that could wait out the absorbed stream's expected life (200
    # tokens at ~25 ms: ~5 s) and still end by its deadline, not beside one that could not.
    slack = Scheduler.from_combo("gmax+gorouting")
    slack.absorb, slack.absorb_beside_deadlines = True, "slack"
    roomy = req(7, arrival=now - 0.6, inp=200, slo=SLO.deadline(60.0), bound=400, mean=200)
    views = [_full(0, now, 0.048), _full(1, now, 0.025)]
    assert [(r.rid, rid) for r, rid in slack.schedule(now, [_at_risk(6, now), roomy], views).dispatch] == [(6, 1)]
    pressed = req(8, arrival=now - 0.6, inp=200, slo=SLO.deadline(8.0), bound=400, mean=200)  # ~5 s of tokens, 7.4 s left
    views = [_full(0, now, 0.048), _full(1, now, 0.025)]
    assert slack.schedule(now, [_at_risk(6, now), pressed], views).dispatch == []


def test_full_replicas_are_reconsidered_each_frame_when_absorbing() -> None:
    """The gateway's queue decides on a frame with every replica full only where something can
    change: a preemption, or (on) a first token the streams can absorb."""
    class Count(AdmissionHooks):
        n = 0

        def absorbed(self, n: int) -> None:  # the gateway's slogate_absorbed_total
            Count.n += n

    async def run(absorb: bool) -> int | None:
        now = [100.0]
        views = [_full(0, now[0], 0.025)]
        s = Scheduler.from_combo("gmax+gorouting")
        s.absorb = absorb
        adm = Admission(s, views, hooks=Count(), frame_s=0.01, clock=lambda: now[0])
        adm.start()
        r = req(7, arrival=now[0], inp=200, slo=SLO.latency(1.0, TBT), bound=200)
        task = asyncio.ensure_future(adm.acquire(r, waiting_s=30))
        await asyncio.sleep(0.05)
        assert not task.done()  # 1 s to its first token: it waits for a slot
        now[0] += 0.6  # now its first token is due within `at_risk_s`
        await asyncio.sleep(0.05)
        rid = task.result().replica if task.done() else None
        task.cancel()
        await adm.stop()
        return rid

    assert asyncio.run(run(True)) == 0 and Count.n == 1
    assert asyncio.run(run(False)) is None and Count.n == 1


def test_the_gateway_hands_absorb_to_its_scheduler() -> None:
    """(The simulator's hand-off: tests/test_capacity.py, with the other knobs.)"""
    from contextlib import ExitStack

    import openai
    from servers import ServerThread

    from slogate.gateway.app import create_app
    from slogate.gateway.config import GatewayConfig
    from slogate.sim.server import create_engine_app

    model = "sim-model"
    with ExitStack() as st:
        eng = st.enter_context(ServerThread(create_engine_app(model)))
        app = create_app(GatewayConfig.model_validate({"backends": [{"url": eng.url, "models": [model]}], "capacity": {"absorb": False, "absorb_by": "tpot",
                                                                                                                               "absorb_beside_deadlines": True}}))
        gw = st.enter_context(ServerThread(app))
        c = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="x", max_retries=0)
        assert c.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2).usage.completion_tokens == 2
        sched = app.state.gateway.groups[model].scheduler
        assert sched.absorb is False and sched.absorb_by == "tpot" and sched.absorb_beside_deadlines is True
    assert GatewayConfig.model_validate({"backends": [{"url": "http://127.0.0.1:1"}]}).capacity.absorb is True  # the default


def test_absorbing_by_mean_tpot_alone_ignores_a_stream_that_only_the_timeline_would_break() -> None:
    """`capacity.absorb_by: tpot`: a stream with a slow first token (0.98 s) has 0.1 s of slack
    to its next token's timeline and seconds by mean TPOT; a 2,000-token prefill (0.18 s) breaks
    the first and not the second."""
    now = 100.0

    def replica() -> ReplicaView:
        v = view(0, budget=1)
        s = req(10, arrival=now - 0.01 - 0.98, slo=SLO.latency(1.0, TBT), bound=200)
        s.first_token_at, s.last_token_at, s.generated = now - 0.01, now, 2
        v.claim(s, s.arrival)
        v.first_token(s, s.first_token_at)
        v.model = view().model
        return v

    def newcomer() -> Request:
        return req(2, arrival=now - 0.2, inp=2000, slo=SLO.latency(1.0, TBT), bound=200)

    assert not replica().absorbs(now, newcomer(), cost=0.004) and replica().absorbs(now, newcomer(), cost=0.004, timeline=False)
    for by, placed in (("timeline", []), ("tpot", [(2, 0)])):
        sched = Scheduler.from_combo("gmax+gorouting")
        sched.absorb, sched.absorb_by, sched.at_risk_s = True, by, 5.0
        assert [(r.rid, rid) for r, rid in sched.schedule(now, [newcomer()], [replica()]).dispatch] == placed, by


def test_absorb_loss_counts_the_tokens_of_the_streams_put_late() -> None:
    now = 100.0
    new = _at_risk(1, now)
    assert _full(0, now, pace=0.025).absorb_loss(now, new, cost=0.004) == 0.0  # seconds of slack: nobody put late
    # Two streams 0.05 s inside their mean TPOT, 100 tokens out and 3 to come: a 2,000-token prompt's stall loses both.
    near = _full(0, now, pace=0.0495, left=3)
    long_prompt = req(2, arrival=now - 0.2, inp=2000, slo=SLO.latency(1.0, TBT), bound=200)
    assert near.absorb_loss(now, long_prompt, cost=0.0001) == 2 * 103
    # Where the newcomer itself would miss its TBT there is no trade to weigh.
    assert _full(0, now, pace=0.049, left=5000).absorb_loss(now, new, cost=0.002) is None
