"""The token cache (gateway/token_cache.py): a conversation resent with a turn more is tokenized
only where it grew, and the ids are exactly what tokenizing it whole gives."""

from __future__ import annotations

import json
import random
from contextlib import ExitStack
from pathlib import Path

import openai
import pytest
from servers import ServerThread
from test_gateway import MODEL, gateway_cfg

from slogate.gateway.app import create_app
from slogate.gateway.token_cache import TokenCache
from slogate.gateway.tokenizer import PromptTokenizer
from slogate.sim.server import create_engine_app
from slogate.testing.prom import metric

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
WORDS = ["the", "of", "and", "to", "in", "is", "was", "for", "on", "that", "with", "as", "by", "it", "at", "from", "his", "an", "were", "are", "which", "this", "be", "other", "there"]


def _text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _save(tok: object, d: Path) -> Path:
    tok.save(str(d / "tokenizer.json"))  # type: ignore[attr-defined]
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>", "chat_template": CHATML}))
    return d


def _train(tok: object) -> None:
    from tokenizers import trainers

    rng = random.Random(0)
    tok.train_from_iterator([_text(rng, 40) for _ in range(300)],  # type: ignore[attr-defined]
                            trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS, show_progress=False))


@pytest.fixture(scope="module")
def byte_level(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A byte-level BPE with ChatML markers (as Qwen's and Llama 3's tokenizers are)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    _train(tok)
    return _save(tok, tmp_path_factory.mktemp("bytelevel"))


@pytest.fixture(scope="module")
def metaspace_first(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A SentencePiece-style BPE that marks only the text's start (`prepend_scheme: first`, as
    Llama 2's): text after a special token, tokenized on its own, would read as a start."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    _train(tok)
    return _save(tok, tmp_path_factory.mktemp("metaspace"))


def _conversation(seed: int, turns: int) -> list[list[dict[str, str]]]:
    """What an agent loop sends: each call the whole conversation so far, a turn longer."""
    rng = random.Random(seed)
    msgs = [{"role": "system", "content": _text(rng, 60)}]
    calls = []
    for _ in range(turns):
        msgs.append({"role": "user", "content": _text(rng, rng.randint(5, 80))})
        calls.append(list(msgs))
        msgs.append({"role": "assistant", "content": _text(rng, rng.randint(5, 120))})
    return calls


@pytest.mark.parametrize("which", ["byte_level", "metaspace_first"])
def test_a_growing_conversation_is_tokenized_where_it_grew_and_nothing_else_changes(which: str, request: pytest.FixtureRequest) -> None:
    d = request.getfixturevalue(which)
    cached, whole = PromptTokenizer(d, cache_tokens=100_000), PromptTokenizer(d)
    assert cached.cache is not None and whole.cache is None
    calls = _conversation(1, 20)
    for msgs in calls:
        assert cached.ids({"messages": msgs}) == whole.ids({"messages": msgs})
    c = cached.cache
    assert c.hits == len(calls) - 1  # every call after the first reused the one before
    assert c.reused > 3 * c.tokenized  # most of a long conversation is what it already was
    assert len(c._entries) == 1  # each call took over the one before: one conversation, one entry
    assert c.held == len(whole.ids({"messages": calls[-1]}))


def test_the_rest_is_tokenized_after_its_special_token_not_as_a_text_start(metaspace_first: Path) -> None:
    """Why the cache tokenizes the rest behind the boundary's marker: begun on its own it differs."""
    t = PromptTokenizer(metaspace_first)
    text = "<|im_start|>user\nthe other<|im_end|>\n<|im_start|>assistant\n"
    whole = t.tok.encode(text, add_special_tokens=False).ids
    cut = text.index("<|im_end|>") + len("<|im_end|>")
    alone = t.tok.encode(text[:cut], add_special_tokens=False).ids + t.tok.encode(text[cut:], add_special_tokens=False).ids
    assert alone != whole  # the precondition: a naive split would be wrong here
    cache = TokenCache(t.tok)
    assert cache.encode(text[:cut] + "x") == t.tok.encode(text[:cut] + "x", add_special_tokens=False).ids
    assert cache.encode(text) == whole and cache.hits == 1


def test_conversations_share_their_common_part_and_the_bound_holds(byte_level: Path) -> None:
    t = PromptTokenizer(byte_level)
    cache = TokenCache(t.tok, max_tokens=3_000)
    system = "<|im_start|>system\n" + _text(random.Random(5), 200) + "<|im_end|>\n"
    a = system + "<|im_start|>user\nthe of and<|im_end|>\n"
    b = system + "<|im_start|>user\nwas for on<|im_end|>\n"
    cache.encode(a)
    assert cache.encode(b) == t.tok.encode(b, add_special_tokens=False).ids
    assert cache.hits == 1  # another conversation with the same system prompt
    for s in range(40):  # many distinct long prompts: the least recent go, the bound holds
        p = "<|im_start|>user\n" + _text(random.Random(100 + s), 150) + "<|im_end|>\n"
        assert cache.encode(p) == t.tok.encode(p, add_special_tokens=False).ids
        assert cache.held <= 3_000
    before = cache.reused
    cache.encode(a)
    assert cache.reused - before <= 1  # evicted long ago: at most the opening marker all prompts share


def test_ids_that_do_not_add_up_are_never_used_and_turn_the_cache_off(byte_level: Path, metaspace_first: Path) -> None:
    """The check on the first reuses: here the cached head comes from another tokenizer (the same
    special tokens, other pieces), as a tokenizer the boundary reasoning does not fit would give."""
    a, b = PromptTokenizer(byte_level), PromptTokenizer(metaspace_first)
    cache = TokenCache(a.tok)
    head = "<|im_start|>user\nthe other there<|im_end|>\n"
    cache.encode(head)
    cache.tok = b.tok
    text = head + "<|im_start|>assistant\nwas for<|im_end|>\n"
    assert cache.encode(text) == b.tok.encode(text, add_special_tokens=False).ids  # checked, and given whole
    assert not cache.enabled and cache.hits == 0
    assert cache.encode(text) == b.tok.encode(text, add_special_tokens=False).ids and cache.hits == 0  # off for good


def test_a_boundary_that_merges_with_what_follows_is_not_reused(byte_level: Path) -> None:
    """A marker that is no special token in the text that follows (here a word read as one, and
    " the" followed by "re" is " there"): the rest does not begin with it, so nothing is reused."""
    import re

    t = PromptTokenizer(byte_level)
    cache = TokenCache(t.tok)
    cache._re, cache.boundary_ids = re.compile(" the"), frozenset({t.tok.token_to_id("Ġthe")})
    cache.encode("and the")
    assert cache.encode("and there") == t.tok.encode("and there", add_special_tokens=False).ids
    assert cache.hits == 0 and cache.enabled


def test_the_gateway_counts_reused_and_tokenized_ids(byte_level: Path) -> None:
    with ExitStack() as st:
        engine = st.enter_context(ServerThread(create_engine_app(MODEL)))
        gw = st.enter_context(ServerThread(create_app(gateway_cfg([engine.url], prefix={"tokenizer": str(byte_level)}))))
        c = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0)
        whole = PromptTokenizer(byte_level)
        calls = _conversation(2, 4)
        for msgs in calls:
            c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2)  # type: ignore[arg-type]
        sizes = [len(whole.ids({"messages": m}) or []) for m in calls]
        done = metric(gw.url, "slogate_tokenizer_tokens_total", how="tokenized")
        kept = metric(gw.url, "slogate_tokenizer_tokens_total", how="reused")
        assert done + kept == sum(sizes)
        assert kept > sum(sizes) / 2  # later calls mostly reuse the earlier ones
