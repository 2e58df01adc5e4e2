"""Prefix-cache awareness in the decision core: the index, the latency estimate, the placements
and the simulated engine's cache."""

import pytest

from slogate.router.latency import PROFILES, BatchLatencyModel
from slogate.router.placement import CacheAware, GoRouting, PrefixScore, SessionHash
from slogate.router.policies import GMAX
from slogate.router.prefix import PrefixCache, hit_tokens, rendezvous, text_block_hashes
from slogate.router.request import SLO, Request
from slogate.sim.engine import EngineSim, Seq
from tests.helpers import req, view

TPB = 512.0  # tokens per block in these tests (Mooncake's)


def preq(rid: int, blocks: tuple[int, ...], inp: int | None = None, slo: SLO | None = None) -> Request:
    r = req(rid, inp=inp or int(len(blocks) * TPB), slo=slo or SLO.latency(2.0, 0.1))
    r.prefix, r.tokens_per_block = blocks, TPB
    return r


def cached_view(rid: int, blocks: int = 1000, budget: int = 16):
    v = view(rid, budget=budget)
    v.cache = PrefixCache(blocks)
    return v


def test_text_hashes_are_chained_stable_and_full_blocks_only():
    a = text_block_hashes("x" * 300 + "tail", 128)
    assert len(a) == 2  # 304 chars: two full blocks of 128, the partial third left out
    assert a == text_block_hashes("x" * 300 + "tail", 128)  # deterministic (shared across gateways)
    b = text_block_hashes("y" + "x" * 299, 128)
    assert a[1] != b[1] and a[0] != b[0]  # a block's hash covers everything before it
    c = text_block_hashes("x" * 256 + "different ending here", 128)
    assert c[:2] == a[:2]  # same first 256 chars: same first two hashes


def test_index_finds_hits_after_a_dispatch_and_evicts_least_recent_first():
    v = cached_view(0, blocks=6)
    first = preq(1, (1, 2, 3, 4))
    assert v.cached_tokens(first) == 0
    v.claim(first, 0.0)
    follow = preq(2, (1, 2, 3, 4, 5))
    assert v.cached_tokens(follow) == 4 * 512  # the whole earlier prompt
    v.claim(follow, 0.1)
    other = preq(3, (7, 8, 9))  # 5 + 3 blocks > capacity 6: the oldest tail goes first
    v.claim(other, 0.2)
    assert len(v.cache) == 6
    assert v.cache.match((1, 2, 3, 4, 5)) == 3  # the head of the conversation outlives its tail
    assert v.cache.match((7, 8, 9)) == 3


def test_hit_never_covers_the_last_prompt_token():
    assert hit_tokens(4, 512.0, 2048) == 2047
    assert hit_tokens(0, 512.0, 2048) == 0


def test_cached_request_predicted_faster_and_queued_work_counts_only_the_uncached_part():
    holder, cold = cached_view(0), cached_view(1)
    holder.cache.insert(tuple(range(16)))
    r = preq(1, (*tuple(range(16)), 99))
    assert holder.prefill_cost(r) < 0.5 * cold.prefill_cost(r)
    assert holder.estimate_exec(0.0, r) < cold.estimate_exec(0.0, r)
    holder.claim(r, 0.0)
    cold.claim(preq(2, tuple(range(100, 117))), 0.0)
    assert holder.prefill_raw < 0.5 * cold.prefill_raw
    holder.first_token(r, 0.05)
    assert holder.prefill_raw == 0.0


def test_gorouting_prefers_the_cache_holder_until_its_queue_would_break_the_slo():
    conv = tuple(range(12))
    holder, other = cached_view(0), cached_view(1)
    holder.cache.insert(conv)
    gr = GoRouting()
    # Both idle: the holder, though the other replica is just as free.
    assert gr.place(0.0, preq(1, (*conv, 50)), [other, holder]) is holder
    # A little queued work on the holder: still the holder (it still meets the 2 s TTFT).
    holder.claim(preq(2, (200, 201, 202)), 0.0)
    assert gr.place(0.0, preq(3, (*conv, 51)), [other, holder]) is holder
    # Enough queued on the holder that the request (or those queued) would miss their TTFT:
    # the other replica, cache or not.
    for k in range(8):
        holder.claim(preq(10 + k, tuple(range(300 + 20 * k, 320 + 20 * k))), 0.0)
    assert gr.place(0.0, preq(4, (*conv, 52)), [other, holder]) is other


def test_gmax_prices_a_cached_conversation_as_cheap():
    conv = tuple(range(60))  # a 30k-token conversation
    v = cached_view(0)
    g = GMAX(seed=0)
    r = preq(1, (*conv, 999), slo=SLO.deadline(3.0))
    _, _good_cold, t_cold, expired_cold, _ = g.estimate(0.0, [r], [v])
    assert expired_cold[0]  # its full prefill alone (about 4 s) misses a 3 s deadline
    v.cache.insert(conv)
    r.best_cached_at = float("-inf")
    _, good, t_gen, expired, _ = g.estimate(0.0, [r], [v])
    assert not expired[0] and good[0] > 0 and t_gen[0] < 0.3 * t_cold[0]


def test_cache_aware_follows_its_record_until_the_fleet_is_imbalanced():
    a, b = cached_view(0, budget=200), cached_view(1, budget=200)
    ca = CacheAware(seed=0)
    conv = tuple(range(10))
    first = ca.place(0.0, preq(1, conv), [a, b])
    assert first is not None
    for k in range(5):
        assert ca.place(0.0, preq(2 + k, (*conv, 100 + k)), [a, b]) is first
    # The holder has 70 more in flight than the other, 1.5x as many: least load wins.
    for k in range(70):
        first.claim(preq(1000 + k, (5000 + k,)), 0.0)
    assert ca.place(0.0, preq(9, (*conv, 200)), [a, b]) is not first


def test_cache_aware_sends_a_new_prompt_to_the_smallest_record():
    a, b = cached_view(0), cached_view(1)
    ca = CacheAware(seed=0)
    ca.record(a).insert(tuple(range(1000, 1050)))
    assert ca.place(0.0, preq(1, (1, 2, 3)), [a, b]) is b


def test_prefix_score_weighs_match_against_queue():
    a, b = cached_view(0), cached_view(1)
    ps = PrefixScore(seed=0)
    conv = tuple(range(8))
    ps.record(a).insert(conv)
    assert ps.place(0.0, preq(1, (*conv, 9)), [a, b]) is a
    for k in range(6):  # a deep queue on a: its queue score drops to 0, b's prefix score is 0
        a.claim(preq(100 + k, (7000 + k,)), 0.0)
    ps2 = PrefixScore(w_prefix=1.0, seed=0)
    ps2.record(a).insert(conv)
    assert ps2.place(0.0, preq(2, (*conv, 10)), [a, b]) is b


def test_session_hash_is_sticky_and_moves_little_when_a_replica_leaves():
    views = [cached_view(i) for i in range(4)]
    sh = SessionHash()
    keys = [(k, 10_000 + k, 3) for k in range(200)]
    before = {k: sh.place(0.0, preq(k[1], k), views).rid for k in keys}
    assert before == {k: sh.place(0.0, preq(k[1], k), views).rid for k in keys}
    assert len(set(before.values())) == 4
    views[2].healthy = False
    after = {k: sh.place(0.0, preq(k[1], k), views).rid for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert moved and all(before[k] == 2 for k in moved)  # only the departed replica's sessions move
    assert rendezvous(5, [1, 2, 3]) == rendezvous(5, [3, 2, 1])


@pytest.mark.parametrize("reuse", [True, False])
def test_simulated_engine_skips_the_cached_prefill(reuse):
    model = BatchLatencyModel(PROFILES["llama3.1-8b@a100-80g"])
    eng = EngineSim(0, model, max_batched_tokens=100_000)
    conv = tuple(range(20))

    def run(r: Request) -> float:
        eng.add(Seq(r, 2))
        return eng.start_step(0.0) or 0.0

    t_first = run(preq(1, conv))
    eng.finish_step()
    t_second = run(preq(2, (*conv, 77) if reuse else tuple(range(500, 521))))
    if reuse:
        assert t_second < 0.5 * t_first
        assert eng.prefix_hits == 20 * 512  # the whole first prompt, counted as vLLM counts it
    else:
        assert t_second > 0.9 * t_first and eng.prefix_hits == 0
    assert eng.prefix_queries == 20 * 512 + 21 * 512


def test_hits_round_down_to_the_engines_kv_block():
    v = cached_view(0)
    v.cache.insert((1, 2, 3, 4, 5))
    r = preq(1, (1, 2, 3, 4, 5, 6))
    r.tokens_per_block = 32.0  # text blocks of ~32 tokens; the engine caches 128-token blocks
    assert v.cached_tokens(r) == 160
    v.kv_block = 128
    assert v.cached_tokens(r) == 128


def test_engine_gauges_read_vllms_cache_config():
    from slogate.gateway.fleet import engine_gauges as _engine_gauges

    text = ('vllm:num_requests_running{model_name="m"} 3.0\nvllm:num_requests_waiting{model_name="m"} 1.0\n'
            'vllm:kv_cache_usage_perc{model_name="m"} 0.25\n'
            'vllm:cache_config_info{block_size="128",cache_dtype="auto",enable_prefix_caching="True",num_gpu_blocks="682"} 1.0\n')
    assert _engine_gauges(text) == (4.0, 0.25, (682 * 128, 128))


def test_a_turn_waits_for_its_busy_holder_and_the_free_slot_goes_to_another():
    from slogate.router.policies import FCFS
    from slogate.router.scheduler import Scheduler

    conv = tuple(range(40))  # a 20k-token history, held by `holder`
    holder, other = cached_view(0, budget=1), cached_view(1, budget=1)
    holder.cache.insert(conv)
    running = preq(50, (900,), slo=SLO.deadline(60.0))
    holder.claim(running, 0.0)
    holder.first_token(running, 0.1)  # decoding: the holder is full until it ends
    running.len_bound = 10
    turn = preq(1, (*conv, 41), slo=SLO.deadline(30.0))  # plenty of slack: worth waiting
    fresh = preq(2, (700, 701), slo=SLO.deadline(30.0))
    sched = Scheduler(FCFS(), GoRouting())
    d = sched.schedule(0.2, [turn, fresh], [holder, other])
    assert [(r.rid, rid) for r, rid in d.dispatch] == [(2, 1)]  # FCFS picked the turn first; it waits, the slot goes to the next
    # Without slack the turn takes the free replica, cache or not (its TTFT the gateway's default:
    # a first token its client chose, late everywhere, would wait instead, GoRouting's `hold_late`).
    urgent = preq(3, (*conv, 42), slo=SLO.latency(0.05, 0.1))
    urgent.ttft_chosen = False
    other.release(fresh, 0.3)
    d = sched.schedule(0.3, [urgent], [holder, other])
    assert [(r.rid, rid) for r, rid in d.dispatch] == [(3, 1)]


@pytest.mark.parametrize("block", [64, 0])
def test_workflow_calls_resend_their_context_and_hit_it(block):
    from slogate.predictors.length import OracleLength
    from slogate.router.request import SLOClass, Tier
    from slogate.router.scheduler import Scheduler
    from slogate.sim.cluster import ClusterSim, EngineConfig
    from slogate.sim.workload import Call, Job, WorkflowSpec, Workload

    # Three sequential agent calls whose prompts grow: each resends the context so far.
    calls = [Call(0, 0, 2000, 200, [], 0.0), Call(1, 1, 2600, 200, [0], 0.0), Call(2, 2, 3200, 100, [1], 0.0)]
    wl = Workload([Job(0.0, SLOClass.COMPOUND, Tier(), workflow=WorkflowSpec("w", calls), wf_deadline_s=60.0)], span_s=1.0,
                  workflow_prefix_tokens=block)
    sim = ClusterSim(wl, Scheduler.from_combo("gmax+gorouting"), OracleLength(), EngineConfig(PROFILES["llama3.1-8b@a100-80g"]),
                     n_replicas=2)
    res = sim.run()
    assert res.prefix_queries == (7800 if block else 0)
    if block:
        # Call 1 finds call 0's prompt (31 whole blocks = 1984 tokens), call 2 call 1's (40 blocks =
        # 2560): each on the replica that holds it. (The simulated engine caches prompt blocks; the
        # answer's blocks are new to it.)
        assert res.prefix_hits == 1984 + 2560
    else:
        assert res.prefix_hits == 0


def test_gmax_prices_a_turn_by_what_the_free_replicas_cache():
    """`cache_where_room` (default on): with only some replicas free, a turn whose history sits on a full
    replica is priced at the prefill it would pay in a free slot, not as the cheap hit it would be
    on its holder (which ranked it first, to be placed where it misses)."""
    conv = tuple(range(40))
    holder, other = cached_view(0, budget=1), cached_view(1, budget=1)
    holder.cache.insert(conv)
    holder.claim(preq(50, (900,), slo=SLO.deadline(60.0)), 0.0)  # the holder is full
    turn = preq(1, (*conv, 41), slo=SLO.deadline(30.0))
    _, _, t_best, _, _ = GMAX(seed=0, cache_where_room=False).estimate(0.0, [turn], [holder, other])
    _, _, t_room, _, _ = GMAX(seed=0).estimate(0.0, [turn], [holder, other])
    assert t_room[0] > 3 * t_best[0]
    other.cache.insert(conv)  # the free replica holds it too: cheap again (once the kept hit is refreshed, as each frame does)
    turn.room_cached = None
    _, _, t_both, _, _ = GMAX(seed=0).estimate(0.0, [turn], [holder, other])
    assert t_both[0] == pytest.approx(t_best[0])


def test_a_preempted_answer_is_priced_and_placed_where_its_engine_cached_it():
    from slogate.router.lifecycle import Lifecycle
    from slogate.router.policies import FCFS

    a, b = cached_view(0), cached_view(1)
    life = Lifecycle(FCFS(), [a, b])
    r = preq(1, tuple(range(4)), slo=SLO.deadline(60.0))  # a 2,048-token prompt
    a.claim(r, 0.0)
    life.tokens(r, 1, 0.5)
    life.tokens(r, 1999, 20.0)  # 2,000 answer tokens out, then cut
    life.preempted(r, 20.0)
    assert r.ran_on == 0 and r.replica is None and r.context_tokens == 4048
    b.cache.insert(r.prefix)  # another replica holds the prompt too, but not the answer
    assert a.cached_tokens(r) == 4047  # prompt and answer: only the last token is computed again
    assert b.cached_tokens(r) == 2047
    assert a.prefill_cost(r) < 0.2 * b.prefill_cost(r)
    assert GoRouting().place(20.0, r, [b, a]) is a  # it continues where its answer is
    a.kv_block = 128
    assert a.cached_tokens(r) == 3968  # whole engine blocks only
    r2 = preq(2, tuple(range(4)))
    r2.generated, r2.ran_on = 500, 0
    a.cache.clear()  # the engine's cache was emptied: no prompt, so no answer either
    assert a.cached_tokens(r2) == 0


def test_simulated_engine_finds_an_aborted_answer_cached():
    model = BatchLatencyModel(PROFILES["llama3.1-8b@a100-80g"])
    eng = EngineSim(0, model, max_batched_tokens=100_000)
    r = preq(1, tuple(range(4)))
    eng.add(Seq(r, 3000))
    eng.start_step(0.0)
    eng.finish_step()
    for _ in range(1000):  # 1,000 answer tokens, one step each
        r.generated += 1
        eng.start_step(0.0)
        eng.finish_step()
    assert eng.abort(1) is not None
    cold = preq(2, tuple(range(100, 104)))
    cold.generated = 1000  # the same context, nothing of it cached
    eng.add(Seq(cold, 3000))
    t_cold = eng.start_step(0.0) or 0.0
    eng.finish_step()
    eng.abort(2)
    eng.add(Seq(r, 3000))
    t_resume = eng.start_step(0.0) or 0.0
    assert t_resume < 0.2 * t_cold  # only the tail past the last whole block is prefilled again
    assert eng.prefix_hits >= 2048 + 992


def test_a_preempted_answer_with_a_short_prompt_waits_for_the_replica_holding_it():
    from slogate.router.lifecycle import Lifecycle
    from slogate.router.policies import FCFS

    a, b = cached_view(0, budget=1), cached_view(1, budget=1)
    life = Lifecycle(FCFS(), [a, b])
    r = req(1, inp=12, slo=SLO.best_effort(600.0))  # shorter than a block: no prefix hashes at all
    a.claim(r, 0.0)
    life.tokens(r, 1, 0.2)
    life.tokens(r, 1499, 30.0)
    life.preempted(r, 30.0)
    assert a.cached_tokens(r) == 1511 and b.cached_tokens(r) == 0
    other = req(2, inp=12)
    a.claim(other, 30.0)  # the slot it gave up is taken; b is free
    gr = GoRouting()
    assert gr.place(30.0, r, [a, b]) is None  # it waits for a rather than re-prefill 1,512 tokens on b
    life.tokens(other, 1, 30.1)
    life.finished(other, 31.0, 0.0)
    assert gr.place(31.0, r, [a, b]) is a


def test_gmax_charges_a_victim_only_the_tail_it_re_prefills_where_its_context_is_cached():
    r = preq(1, tuple(range(4)))
    here = cached_view(0)
    here.claim(r, 0.0)  # running here: its prompt is in the picture
    r.generated = 1500  # a 3,548-token context
    g = GMAX(seed=0)
    assert g._resume_prefill(here, r) < 0.1 * g._resume_prefill(view(1), r)  # no picture: all of it


def test_a_paused_answer_takes_the_next_free_slot_once_its_reader_has_waited_resume_within_s():
    """A paused answer waits for the replica holding its context, and behind fresh work the ordering
    prefers, only until its client has waited `resume_within_s` for the next token: then it takes
    the next free slot anywhere, before anything else, even once its deadline is lost (the client
    is still reading it)."""
    from slogate.router.lifecycle import Lifecycle
    from slogate.router.scheduler import Scheduler

    a, b = cached_view(0, budget=1), cached_view(1, budget=1)
    g = GMAX(seed=0)
    sched = Scheduler(g, GoRouting(), resume_within_s=10.0)
    life = Lifecycle(g, [a, b])
    r = req(1, inp=12, slo=SLO.deadline(8.0), bound=300)  # 300 tokens due at 8 s
    a.claim(r, 0.0)
    life.tokens(r, 1, 0.2)
    life.tokens(r, 99, 2.0)
    life.preempted(r, 2.0)  # paused at 2 s with 100 tokens out
    other = req(2, inp=12, slo=SLO.deadline(600.0), bound=1000)
    a.claim(other, 2.0)
    fresh = req(3, arrival=11.0, inp=12, slo=SLO.deadline(20.0), bound=100)
    d = sched.schedule(11.0, [r, fresh], [a, b])  # its deadline is lost; paused 9 s: the fresh request goes first
    assert [(x.rid, rid) for x, rid in d.dispatch] == [(3, 1)]
    b.release(fresh, 11.5)
    fresh2 = req(4, arrival=12.0, inp=12, slo=SLO.deadline(20.0), bound=100)
    d = sched.schedule(12.1, [r, fresh2], [a, b])  # paused 10.1 s: it takes the free slot, off its holder
    assert [(x.rid, rid) for x, rid in d.dispatch] == [(1, 1)]
    # Without the bound the same answer, worth nothing now, waits behind the fresh request.
    b.release(r, 12.2)
    unbounded = Scheduler(GMAX(seed=0), GoRouting(), resume_within_s=1e9)
    r.replica = None
    d = unbounded.schedule(12.3, [r, fresh2], [a, b])
    assert [(x.rid, rid) for x, rid in d.dispatch] == [(4, 1)]
