"""What the prefix index costs the gateway per request, and its memory.

Per request the gateway hashes the prompt's text blocks once, looks its hashes up in every
replica's index (placement, and GMAX once a frame) and inserts them where it is dispatched; with
several gateways sharing state (`prefix.share`) it also encodes each dispatch for the Redis stream
and every other gateway decodes and inserts it (gateway/state/redis.py). This times those steps for a 64-block prompt (8,192 characters, ~2k tokens) over 8 replicas whose
indexes are full (LRU evicting on every insert), and measures an index's memory per block.

    python bench/prefix_index.py --out bench/results/prefix_index.json

With `--tokenizer DIR` (a Hugging Face tokenizer: precise mode, `prefix.tokenizer`) it also times
what that mode adds: the prompt tokenized as the engine does (completions, and a chat through the
template), its ids cut into 16-token blocks, and one engine's KV-cache events for it applied to an
index (`BlockStored` of its 128-token blocks re-hashed into the gateway's chain, then removed),
and a `--turns`-call conversation tokenized whole against through the token cache
(`prefix.token_cache`: each call has only what it added tokenized).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from slogate.gateway.state.redis import decode_hashes, encode_hashes
from slogate.router.latency import PROFILES, BatchLatencyModel
from slogate.router.prefix import BLOCK_CHARS, PrefixCache, text_block_hashes
from slogate.router.request import SLO, Request
from slogate.router.view import ReplicaView

WORDS = ["the", "of", "and", "to", "in", "is", "was", "for", "on", "that", "with", "as", "by", "at", "from", "model", "answer"]


def per_call_us(fn: Callable[[], object], n: int) -> float:
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1e6


def insert_next(cache: PrefixCache, prompts: Iterator[tuple[int, ...]]) -> None:
    cache.insert(next(prompts))


def apply_next(cache: PrefixCache, wire: Iterator[str]) -> None:
    cache.insert(decode_hashes(next(wire)))


def precise_mode(tokenizer: Path, prompt: str, repeats: int) -> dict:
    """Per request: tokenizing (completions, chat) and cutting the ids; per engine event batch:
    a prefill's blocks stored and then removed."""
    from slogate.gateway.kv_events import EngineBlocks
    from slogate.gateway.tokenizer import PromptTokenizer
    from slogate.router.prefix import token_block_hashes

    t = PromptTokenizer(tokenizer)
    ids = t.ids({"prompt": prompt}) or []
    chat = {"messages": [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": prompt}]}
    bs = 128
    n = len(ids) // bs
    events = [{"type": "BlockStored", "block_hashes": list(range(k * 1000, k * 1000 + n)), "parent_block_hash": None,
               "token_ids": ids[:n * bs], "block_size": bs} for k in range(2000)]
    removed = [{"type": "BlockRemoved", "block_hashes": e["block_hashes"]} for e in events]
    runs = []
    for _ in range(repeats):
        eb = EngineBlocks(PrefixCache(100_000 // 16), 16)
        it = iter(range(len(events)))
        store = per_call_us(lambda eb=eb, it=it: eb.apply([events[next(it)]]), len(events))
        it2 = iter(range(len(removed)))
        remove = per_call_us(lambda eb=eb, it2=it2: eb.apply([removed[next(it2)]]), len(removed))
        runs.append({"tokenize_completions_us": round(per_call_us(lambda: t.ids({"prompt": prompt}), 200), 1),
                     "tokenize_chat_us": round(per_call_us(lambda: t.ids(chat), 200), 1),
                     "token_blocks_us": round(per_call_us(lambda: token_block_hashes(ids, 16), 2000), 2),
                     "event_store_us": round(store, 2), "event_remove_us": round(remove, 2)})
    return {"tokens": len(ids), "engine_blocks": n, "runs": runs}


def conversation(tokenizer: Path, turns: int, repeats: int) -> dict:
    """An agent loop's calls (each the whole conversation so far, a turn longer) tokenized whole
    and through the token cache (`prefix.token_cache`), call by call as they arrive."""
    from slogate.gateway.tokenizer import PromptTokenizer

    rng = random.Random(1)

    def para(n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n))

    msgs = [{"role": "system", "content": para(100)}]
    calls = []
    for _ in range(turns):
        msgs.append({"role": "user", "content": para(120)})
        calls.append({"messages": list(msgs)})
        msgs.append({"role": "assistant", "content": para(150)})
    runs = []
    for _ in range(repeats):
        row: dict = {}
        for name, cache in (("whole", 0), ("cached", 1_000_000)):
            t = PromptTokenizer(tokenizer, cache)
            ms = []
            for body in calls:
                t0 = time.perf_counter()
                t.ids(body)
                ms.append(1000 * (time.perf_counter() - t0))
            row[name] = {"total_ms": round(sum(ms), 2), "last_call_ms": round(ms[-1], 3)}
            if t.cache is not None:
                row[name] |= {"reused": t.cache.reused, "tokenized": t.cache.tokenized, "held_tokens": t.cache.held}
        row["ratio_total"] = round(row["whole"]["total_ms"] / row["cached"]["total_ms"], 2)
        row["ratio_last_call"] = round(row["whole"]["last_call_ms"] / row["cached"]["last_call_ms"], 2)
        runs.append(row)
    last = PromptTokenizer(tokenizer).ids(calls[-1]) or []
    return {"turns": turns, "last_call_tokens": len(last), "runs": runs}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument("--replicas", type=int, default=8)
    ap.add_argument("--capacity", type=int, default=12_500, help="blocks per replica index (100k KV tokens at 32 tokens a block)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--tokenizer", type=Path, help="a tokenizer directory: also time precise mode's steps")
    ap.add_argument("--turns", type=int, default=30, help="with --tokenizer: the conversation's calls, tokenized whole and through the cache")
    a = ap.parse_args()
    rng = random.Random(0)

    def text(n_chars: int) -> str:
        s = " ".join(rng.choice(WORDS) for _ in range(n_chars // 3))
        return s[:n_chars]

    prompt = text(a.blocks * BLOCK_CHARS)
    views = [ReplicaView(i, BatchLatencyModel(PROFILES["llama3.1-8b@a100-80g"])) for i in range(a.replicas)]
    for v in views:  # full indexes: every insert below evicts
        v.cache = PrefixCache(a.capacity)
        for _ in range(a.capacity // a.blocks + 1):
            v.cache.insert(text_block_hashes(text(a.blocks * BLOCK_CHARS)))
    views[3].cache.insert(text_block_hashes(prompt))  # one replica holds it
    req = Request(0, 0.0, len(prompt) // 4, SLO.latency(2.0, 0.1), prefix=text_block_hashes(prompt), tokens_per_block=BLOCK_CHARS / 4)
    runs = []
    for _ in range(a.repeats):
        hashing = per_call_us(lambda: text_block_hashes(prompt), 2000)
        lookup = per_call_us(lambda: [v.cached_tokens(req) for v in views], 2000)
        fresh = [text_block_hashes(text(a.blocks * BLOCK_CHARS)) for _ in range(2000)]
        insert = per_call_us(partial(insert_next, views[0].cache, iter(fresh)), 2000)
        encode = per_call_us(lambda: encode_hashes(req.prefix), 2000)
        wire = [encode_hashes(f) for f in fresh]
        received = per_call_us(partial(apply_next, views[1].cache, iter(wire)), 2000)  # another gateway's dispatch, decoded and inserted
        runs.append({"hash_us": round(hashing, 2), "lookup_all_replicas_us": round(lookup, 2), "insert_evicting_us": round(insert, 2),
                     "total_us": round(hashing + lookup + insert, 2), "share_encode_us": round(encode, 2),
                     "share_receive_us": round(received, 2), "share_entry_bytes": len(wire[0])})
    precise = precise_mode(a.tokenizer, prompt, a.repeats) if a.tokenizer else None
    if a.tokenizer:
        precise["conversation"] = conversation(a.tokenizer, a.turns, a.repeats)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    c = PrefixCache(a.capacity)
    for _ in range(a.capacity // a.blocks + 1):
        c.insert(text_block_hashes(text(a.blocks * BLOCK_CHARS)))
    mem = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    doc = {"config": vars(a) | {"out": str(a.out), "tokenizer": str(a.tokenizer)}, "runs": runs,
           "median_total_us": statistics.median(r["total_us"] for r in runs),
           "index_bytes": mem, "bytes_per_block": round(mem / len(c), 1), "blocks": len(c), "precise_mode": precise}
    print(json.dumps(doc, indent=2))
    if a.out:
        a.out.write_text(json.dumps(doc, indent=2))


if __name__ == "__main__":
    main()
