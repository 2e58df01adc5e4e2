"""The live gateway places conversations where their prefix is cached: the real openai SDK →
slogate → simulated engines with vLLM-style prefix caching, over HTTP on 127.0.0.1."""

from __future__ import annotations

import random
from contextlib import ExitStack

import openai
import pytest
from servers import ServerThread
from test_gateway import MODEL, gateway_cfg

from slogate.gateway.app import create_app
from slogate.sim.server import create_engine_app
from slogate.testing.prom import metric

SYSTEM = "You are a careful assistant. " * 24  # ~700 characters every conversation shares


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel")) + str(rng.randrange(1000))
                    for _ in range(n))


def _conversations(gw_url: str, n_conv: int = 5, turns: int = 4) -> None:
    c = openai.OpenAI(base_url=f"{gw_url}/v1", api_key="unused", max_retries=0)
    rng = random.Random(7)
    history = [[{"role": "system", "content": SYSTEM}] for _ in range(n_conv)]
    for _ in range(turns):
        for h in history:  # interleaved, as real sessions are
            h.append({"role": "user", "content": _words(rng, 150)})
            r = c.chat.completions.create(model=MODEL, messages=h, max_tokens=8)
            h.append({"role": "assistant", "content": r.choices[0].message.content or "ok"})


def _hit_rate(engines: list[ServerThread]) -> float:
    hits = sum(metric(e.url, "vllm:prefix_cache_hits_total") for e in engines)
    queries = sum(metric(e.url, "vllm:prefix_cache_queries_total") for e in engines)
    assert queries > 0
    return hits / queries


@pytest.mark.parametrize("indexed", [True, False])
def test_conversations_return_to_the_replica_holding_their_history(indexed: bool) -> None:
    with ExitStack() as st:
        engines = [st.enter_context(ServerThread(create_engine_app(MODEL))) for _ in range(3)]
        cfg = gateway_cfg([e.url for e in engines], prefix={"enabled": indexed},
                          policies={"frame_s": 0.05, "placement": "gorouting" if indexed else "round-robin"})
        gw = st.enter_context(ServerThread(create_app(cfg)))
        _conversations(gw.url)
        rate = _hit_rate(engines)
        cached = metric(gw.url, "slogate_prefix_cached_tokens_total")
        prompt = metric(gw.url, "slogate_prompt_tokens_total")
    if indexed:
        # Turns 2–4 of each conversation find its history: most of every later prompt.
        assert rate > 0.5, rate
        assert 0.4 < cached / prompt < 0.95, (cached, prompt)
    else:
        # Round robin over 3 replicas with 5 interleaved conversations (coprime: each turn moves): a turn lands where the
        # conversation's previous turn was only by chance; the shared system prompt still hits.
        assert rate < 0.35, rate
        assert cached == 0


def test_a_long_context_is_indexed_too() -> None:
    """A prompt long enough to be hashed off the event loop still lands where it is cached."""
    with ExitStack() as st:
        engines = [st.enter_context(ServerThread(create_engine_app(MODEL))) for _ in range(2)]
        gw = st.enter_context(ServerThread(create_app(gateway_cfg([e.url for e in engines], policies={"frame_s": 0.05}))))
        c = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0)
        history = _words(random.Random(3), 14_000)  # ~100k characters
        assert len(history) > 64 * 1024
        for q in ("first question", "second question"):
            c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": history}, {"role": "user", "content": q}],
                                      max_tokens=2)
        cached = metric(gw.url, "slogate_prefix_cached_tokens_total")
        prompt = metric(gw.url, "slogate_prompt_tokens_total")
        hits = sum(metric(e.url, "vllm:prefix_cache_hits_total") for e in engines)
    assert cached > 0.4 * prompt  # the second request: nearly all of its prompt
    assert hits > 0.9 * cached  # and the engine found it where the gateway expected it


def _conversations_across(urls: list[str], n_conv: int = 6, turns: int = 4) -> None:
    """Each conversation's turns through the gateways in turn (a load balancer without session
    affinity), a round's turns sent together so placement has load to weigh, and a sync's worth of
    time between rounds so a dispatch has been shared."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    clients = [openai.OpenAI(base_url=f"{u}/v1", api_key="unused", max_retries=0) for u in urls]
    rng = random.Random(11)
    history: list[list[dict]] = [[] for _ in range(n_conv)]  # no shared system prompt: each history is its own

    def turn(c: openai.OpenAI, h: list[dict], delay: float) -> None:
        time.sleep(delay)
        r = c.chat.completions.create(model=MODEL, messages=h, max_tokens=8)
        h.append({"role": "assistant", "content": r.choices[0].message.content or "ok"})

    with ThreadPoolExecutor(n_conv) as pool:
        for k in range(turns):
            for h in history:
                h.append({"role": "user", "content": _words(rng, 150)})
            # Each round sends the conversations in another order (rotated by one), so a placement
            # by load alone puts most of them on another replica than their last turn's.
            list(pool.map(turn, [clients[(k + i) % len(clients)] for i in range(n_conv)], history,
                          [0.03 * ((i - k) % n_conv) for i in range(n_conv)]))
            time.sleep(0.3)


@pytest.mark.parametrize("share", [True, False])
def test_gateways_sharing_state_share_where_the_caches_are(redis_url: str, share: bool) -> None:
    """Two gateways on one Redis, each conversation's turns alternating between them: with the
    prefix index shared, a turn finds the replica holding its history whichever gateway sent the
    turn before; each learning only from its own dispatches, a turn finds only what the same
    gateway sent two turns earlier, where that gateway put it."""
    import uuid

    with ExitStack() as st:
        engines = [st.enter_context(ServerThread(create_engine_app(MODEL))) for _ in range(3)]
        state = {"kind": "redis", "url": redis_url, "prefix": f"share-{uuid.uuid4().hex[:8]}", "sync_s": 0.05}
        # Two slots a replica: a round's six turns spread over the three replicas.
        cfgs = [gateway_cfg([e.url for e in engines], budget=2, state=state, prefix={"share": share}) for _ in range(2)]
        gws = [st.enter_context(ServerThread(create_app(c))) for c in cfgs]
        _conversations_across([g.url for g in gws])
        rate = _hit_rate(engines)
        received = [metric(g.url, "slogate_prefix_shared_total", direction="received") for g in gws]
    if share:
        # Every later turn finds its whole history (0.579 of the prompt tokens here, the most there
        # is); each gateway learning from its own dispatches only got 0.28–0.48 in six runs.
        assert rate > 0.55, rate
        assert min(received) >= 8, received  # each gateway learned the other's turns (12 each)
    else:
        assert received == [0, 0]


def test_a_reset_prefix_cache_makes_the_same_prompt_miss_again() -> None:
    """`POST /reset_prefix_cache`, as vLLM's dev mode has it: a benchmark runs each system on cold
    caches (bench/real_engines.py --sim-engines), or a later system finds the blocks an earlier
    one's identical prompts left."""
    import httpx

    with ServerThread(create_engine_app(MODEL)) as e:
        c = openai.OpenAI(base_url=f"{e.url}/v1", api_key="unused", max_retries=0)
        ask = [{"role": "user", "content": SYSTEM}]
        c.chat.completions.create(model=MODEL, messages=ask, max_tokens=2)
        c.chat.completions.create(model=MODEL, messages=ask, max_tokens=2)
        warm = metric(e.url, "vllm:prefix_cache_hits_total")
        assert warm > 0
        assert httpx.post(f"{e.url}/reset_prefix_cache").status_code == 200
        c.chat.completions.create(model=MODEL, messages=ask, max_tokens=2)
        assert metric(e.url, "vllm:prefix_cache_hits_total") == warm  # nothing found after the reset


def test_the_simulated_engine_reports_vllms_latency_histograms() -> None:
    """`vllm:time_to_first_token_seconds` and `vllm:request_time_per_output_token_seconds` (sum
    and count), which bench/real_engines.py reads of vLLM for the engines' own side: a run on
    `--sim-engines` reports them too, so the two compare."""
    with ServerThread(create_engine_app(MODEL)) as e:
        c = openai.OpenAI(base_url=f"{e.url}/v1", api_key="unused", max_retries=0)
        for _ in range(3):
            c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": SYSTEM}], max_tokens=12,
                                      extra_body={"ignore_eos": True})
        assert metric(e.url, "vllm:time_to_first_token_seconds_count") == 3
        assert metric(e.url, "vllm:request_time_per_output_token_seconds_count") == 3
        ttft = metric(e.url, "vllm:time_to_first_token_seconds_sum") / 3
        tpot = metric(e.url, "vllm:request_time_per_output_token_seconds_sum") / 3
    assert 0 < ttft < 2.0 and 0 < tpot < 0.5, (ttft, tpot)
