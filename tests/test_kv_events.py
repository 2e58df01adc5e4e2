"""Precise prefix caches from the engines' KV-cache events (gateway/kv_events.py): the engine's
blocks re-hashed into the gateway's chain, and the live gateway placing by what an engine
reports it holds, through real ZMQ and real HTTP (the openai SDK → slogate → simulated engines;
the events come from a PUB socket publishing vLLM's wire format)."""

from __future__ import annotations

import itertools
import json
import random
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import msgspec
import openai
import pytest
import zmq
from servers import ServerThread
from test_gateway import MODEL, gateway_cfg

from slogate.gateway.app import create_app
from slogate.gateway.kv_events import EngineBlocks, endpoint_for
from slogate.gateway.tokenizer import PromptTokenizer
from slogate.router.prefix import PrefixCache, token_block_hashes
from slogate.sim.server import create_engine_app
from slogate.testing.ports import free_port
from slogate.testing.prom import metric

WORDS = [f"w{i}" for i in range(300)]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A word-level tokenizer with a BOS and a chat template, saved as Hugging Face saves one."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "user", "assistant", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<s>", "</s>", "<|im_start|>", "<|im_end|>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    d = tmp_path_factory.mktemp("tok")
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>",
        "chat_template": "{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
                         "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"}))
    return d


def _prompt(seed: int, n: int = 200) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n))


def test_the_tokenizer_cuts_prompts_as_the_engine_does(tokenizer_dir: Path) -> None:
    t = PromptTokenizer(tokenizer_dir)
    ids = t.ids({"prompt": "w3 w4 w5"})
    assert ids == [1, 10, 11, 12]  # BOS, then the words: a completions prompt gets the special tokens
    chat = t.ids({"messages": [{"role": "user", "content": "w3 w4"}]})
    assert chat == [3, 5, 10, 11, 4, 3, 6]  # the template writes the markers; no BOS added on top
    assert t.ids({"prompt": [5, 6, 7]}) == [5, 6, 7]
    assert t.ids({"prompt": ["a", "b"]}) is None  # a batch: no single prompt to place


def test_engine_blocks_become_the_gateway_hashes_of_the_same_tokens() -> None:
    ids = list(range(100, 100 + 130))  # 4 engine blocks of 32, 2 tokens left over
    want = token_block_hashes(ids, 16)[0]  # what a prompt with these tokens looks up
    assert len(want) == 8
    cache = PrefixCache(1000)
    eb = EngineBlocks(cache, 16)
    # Two events, the second continuing from the first's last block, as vLLM reports a prefill in two steps.
    assert eb.stored([b"e0", b"e1"], None, ids[:64], 32) is None
    assert eb.stored([b"e2", b"e3"], b"e1", ids[64:128], 32) is None
    assert cache.match(want) == 8
    eb.removed([b"e3"])  # the engine evicted the tail block: the two gateway blocks in it go
    assert cache.match(want) == 6
    assert eb.stored([b"x"], b"unknown", ids[:32], 32) == "unknown_parent"
    assert eb.stored([b"y"], None, ids[:24], 24) == "misaligned"
    eb.apply([{"type": "AllBlocksCleared"}])
    assert cache.match(want) == 0 and not eb.chains
    got = eb.apply([{"type": "BlockStored", "block_hashes": [b"e0"], "parent_block_hash": None, "token_ids": ids[:32], "block_size": 32,
                     "lora_id": None, "medium": "GPU", "lora_name": None},
                    {"type": "BlockStored", "block_hashes": [b"g"], "parent_block_hash": None, "token_ids": ids[:32], "block_size": 32,
                     "group_idx": 1}])  # another KV-cache group: not counted
    assert got == {"stored": 1} and cache.match(want) == 2
    assert endpoint_for("tcp://{host}:5557", "http://10.1.2.3:8000") == "tcp://10.1.2.3:5557"


class Publisher:
    """An engine's KV-event publisher: vLLM's frames (topic, seq, msgpack [ts, events, rank])."""

    def __init__(self) -> None:
        self.port = free_port()
        self.sock = zmq.Context.instance().socket(zmq.PUB)
        self.sock.bind(f"tcp://127.0.0.1:{self.port}")
        self.seq = itertools.count()
        self.names = (f"h{i}".encode() for i in itertools.count())

    def send(self, events: list[dict]) -> None:
        payload = msgspec.msgpack.encode([time.time(), events, None])
        self.sock.send_multipart((b"", next(self.seq).to_bytes(8, "big"), payload))

    def store(self, ids: list[int], block: int = 32) -> None:
        n = len(ids) // block
        self.send([{"type": "BlockStored", "block_hashes": [next(self.names) for _ in range(n)], "parent_block_hash": None,
                    "token_ids": ids[:n * block], "block_size": block, "lora_id": None, "medium": "GPU", "lora_name": None}])


@pytest.fixture
def publishers() -> Iterator[list[Publisher]]:
    pubs = [Publisher(), Publisher()]
    yield pubs
    for p in pubs:
        p.sock.close(linger=0)


def _wait_for(cond, what: str, timeout: float = 10.0) -> None:
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_the_gateway_places_by_what_the_engines_report_they_hold(tokenizer_dir: Path, publishers: list[Publisher]) -> None:
    tok = PromptTokenizer(tokenizer_dir)
    with ExitStack() as st:
        engines = [st.enter_context(ServerThread(create_engine_app(MODEL))) for _ in range(2)]
        urls = [e.url for e in engines]
        cfg = gateway_cfg(urls, prefix={"tokenizer": str(tokenizer_dir), "block_tokens": 16})
        raw = cfg.model_dump()
        for b, p in zip(raw["backends"], publishers, strict=True):
            b["kv_events"] = f"tcp://{{host}}:{p.port}"
        gw = st.enter_context(ServerThread(create_app(type(cfg).model_validate(raw))))
        c = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0)

        def cached(i: int) -> float:
            return metric(gw.url, "slogate_prefix_cached_tokens_total", backend=urls[i])

        # Each engine reports holding a prompt the gateway never sent anywhere (another client's).
        prompts = [_prompt(1), _prompt(2)]
        for i, p in enumerate(prompts):
            ids = tok.ids({"prompt": p})
            assert ids is not None
            # ZMQ's subscriber joins in the background: publish until the gateway has it.
            _wait_for(lambda p=publishers[i], ids=ids, i=i: p.store(ids) or metric(gw.url, "slogate_kv_events_total", backend=urls[i],
                                                                                     kind="stored") > 0, f"engine {i}'s events")
        for i, p in enumerate(prompts):
            before = [cached(0), cached(1)]
            c.completions.create(model=MODEL, prompt=p, max_tokens=2)
            # It went to the engine holding it, expecting its whole blocks cached (6 of 32 tokens).
            assert cached(i) - before[i] == 192, (i, before, cached(0), cached(1))
            assert cached(1 - i) == before[1 - i]
        # Engine 0 clears its cache (`/reset_prefix_cache`, a restart): the gateway's picture follows,
        # though the gateway itself sent that prompt there a moment ago.
        before = cached(0) + cached(1)
        publishers[0].send([{"type": "AllBlocksCleared"}])
        _wait_for(lambda: metric(gw.url, "slogate_kv_events_total", backend=urls[0], kind="cleared") > 0, "the clear")
        c.completions.create(model=MODEL, prompt=prompts[0], max_tokens=2)
        assert cached(0) + cached(1) == before  # no replica is expected to hold it now


def test_sglang_events_array_like_are_applied_and_a_page_of_one_token_is_refused() -> None:
    """SGLang publishes the same events array-like (tag first, fields in order, trailing defaults
    left out), one page per `BlockStored`."""
    ids = list(range(500, 500 + 64))
    want = token_block_hashes(ids, 16)[0]
    cache = PrefixCache(1000)
    eb = EngineBlocks(cache, 16)
    # Two 16-token pages (`--page-size 16`), the second continuing the first; int64 hashes.
    got = eb.apply([["BlockStored", [-7], None, ids[:16], 16, None, "GPU"],
                    ["BlockStored", [42], -7, ids[16:32], 16]])  # lora_id and medium left out
    assert got == {"stored": 2} and cache.match(want) == 2
    assert eb.apply([["BlockRemoved", [42], "GPU"]]) == {"removed": 1} and cache.match(want) == 1
    assert eb.apply([["AllBlocksCleared"]]) == {"cleared": 1} and cache.match(want) == 0
    # SGLang's default page of one token: blocks smaller than the gateway's, not applied.
    assert eb.apply([["BlockStored", [1], None, ids[:1], 1]]) == {"misaligned": 1} and eb.misaligned == 1
    assert eb.apply([["Unknown", 1], 3, None]) == {}


def test_the_gateway_places_by_an_sglang_engines_events(tokenizer_dir: Path) -> None:
    tok = PromptTokenizer(tokenizer_dir)
    pub = Publisher()
    try:
        with ExitStack() as st:
            engines = [st.enter_context(ServerThread(create_engine_app(MODEL))) for _ in range(2)]
            urls = [e.url for e in engines]
            raw = gateway_cfg(urls, prefix={"tokenizer": str(tokenizer_dir), "block_tokens": 16}).model_dump()
            raw["backends"][1] |= {"kind": "sglang", "kv_events": f"tcp://{{host}}:{pub.port}"}
            gw = st.enter_context(ServerThread(create_app(type(gateway_cfg(urls)).model_validate(raw))))
            c = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0)
            prompt = _prompt(7)
            ids = tok.ids({"prompt": prompt})
            assert ids is not None
            pages = [ids[i:i + 32] for i in range(0, len(ids) // 32 * 32, 32)]

            def publish() -> None:  # SGLang's form: [ts, events], each event array-like, one page each
                events, parent = [], None
                for k, page in enumerate(pages):
                    events.append(["BlockStored", [1000 + k], parent, page, 32, None, "GPU"])
                    parent = 1000 + k
                pub.sock.send_multipart((b"", next(pub.seq).to_bytes(8, "big"), msgspec.msgpack.encode([time.time(), events])))

            _wait_for(lambda: publish() or metric(gw.url, "slogate_kv_events_total", backend=urls[1], kind="stored") > 0,
                      "the SGLang engine's events")
            before = metric(gw.url, "slogate_prefix_cached_tokens_total", backend=urls[1])
            c.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
            # It went to the engine that holds it, expecting its whole pages cached.
            assert metric(gw.url, "slogate_prefix_cached_tokens_total", backend=urls[1]) - before == 32 * len(pages)
            assert metric(gw.url, "slogate_kv_events_total", backend=urls[1], kind="undecodable") == 0
    finally:
        pub.sock.close(linger=0)
