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
