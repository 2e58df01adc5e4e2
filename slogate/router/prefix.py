"""Where each replica's prefix cache is: chained block hashes in LRU order, bounded by capacity.

An engine with automatic prefix caching (vLLM, SGLang) keeps the KV of full prompt blocks after a
request ends and reuses it for any later prompt that starts with the same blocks; it evicts the
least recently used first, a sequence's tail blocks before its head. `PrefixCache` is the
gateway's picture of one replica's cache, learned from what was dispatched there: a block hash
covers the block *and everything before it* (a chain), so "block k is cached" means "the first
k+1 blocks are", and a lookup walks the prompt's hashes until the first miss.

Prompts are cut into blocks of text, not tokens: the gateway has no tokenizer for every model it
fronts, and a prefix of text is a prefix of tokens but for the token that straddles the cut. A
block of `BLOCK_CHARS` characters is about 32 tokens of English (4 characters a token); the
tokens a hit saves are the request's tokens per block of its own text times the blocks hit.
Traces that come with block hashes (Mooncake) feed their ids in directly. Where the gateway has
the model's tokenizer (`prefix.tokenizer`) it cuts the token ids instead (`token_block_hashes`):
blocks then line up with the engine's, and the engine's own KV-cache events can say which are
cached (gateway/kv_events.py).
"""

from __future__ import annotations

import hashlib
import zlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence

BLOCK_CHARS = 128


def text_block_hashes(text: str, block_chars: int = BLOCK_CHARS) -> tuple[int, ...]:
    """Chained 64-bit hashes of `text`'s full blocks: running CRC-32 and Adler-32 of the text so
    far (each block's value covers its whole prefix; stable across processes and machines, so
    gateways agree on them; 20 µs for 64 blocks, a keyed BLAKE2 chain costs 45). A partial last
    block is left out: engines cache full blocks only."""
    data = memoryview(text.encode("utf-8", "surrogatepass"))
    end = len(data) // block_chars * block_chars
    out = []
    crc, adler = 0, 1
    for i in range(0, end, block_chars):
        chunk = data[i:i + block_chars]
        crc, adler = zlib.crc32(chunk, crc), zlib.adler32(chunk, adler)
        out.append(crc << 32 | adler)
    return tuple(out)


ROOT = (0, 1)  # the chain's state before the first block (CRC-32, Adler-32 of nothing)


def token_block_hashes(ids: Sequence[int], block_tokens: int, state: tuple[int, int] = ROOT) -> tuple[tuple[int, ...], tuple[int, int]]:
    """Chained 64-bit hashes of the full blocks of `block_tokens` token ids (the same chain as
    `text_block_hashes`, over the ids as 32-bit words), continued from `state`, and the chain's
    state after them: a block's hash covers every token before it, so the engine's blocks,
    reported one event at a time, continue the chain where their parent ended."""
    data = memoryview(array("I", ids).tobytes())
    step = block_tokens * 4
    end = len(data) // step * step
    out = []
    crc, adler = state
    for i in range(0, end, step):
        chunk = data[i:i + step]
        crc, adler = zlib.crc32(chunk, crc), zlib.adler32(chunk, adler)
        out.append(crc << 32 | adler)
    return tuple(out), (crc, adler)


class PrefixCache:
    """One replica's prefix cache as the gateway pictures it: at most `capacity` blocks, LRU."""

    __slots__ = ("blocks", "capacity")

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"a prefix cache holds at least one block, got capacity {capacity}")
        self.capacity = capacity
        self.blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self.blocks)

    def match(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of `hashes` are cached here."""
        blocks = self.blocks
        n = 0
        for h in hashes:
            if h not in blocks:
                break
            n += 1
        return n

    def insert(self, hashes: Sequence[int]) -> None:
        """`hashes` were just computed here: touch them, the head most recently (as vLLM frees a
        sequence's blocks tail first, so a prefix outlives its continuations), and evict the
        least recently used beyond capacity."""
        blocks = self.blocks
        for h in reversed(hashes):
            if h in blocks:
                blocks.move_to_end(h)
            else:
                blocks[h] = None
        while len(blocks) > self.capacity:
            blocks.popitem(last=False)

    def remove(self, hashes: Iterable[int]) -> None:
        """The engine freed these blocks (its KV-cache events say so)."""
        for h in hashes:
            self.blocks.pop(h, None)

    def clear(self) -> None:
        self.blocks.clear()


def hit_tokens(hit_blocks: int, tokens_per_block: float, input_tokens: int) -> int:
    """Prompt tokens a hit of `hit_blocks` saves: the engine always computes the last token."""
    if hit_blocks <= 0:
        return 0
    return max(min(int(hit_blocks * tokens_per_block), input_tokens - 1), 0)


def rendezvous(key: int, ids: Iterable[int]) -> list[int]:
    """`ids` in rendezvous (highest-random-weight) order for `key`: consistent hashing that moves
    only the keys of a replica that joins or leaves."""
    def weight(i: int) -> bytes:
        return hashlib.blake2b(key.to_bytes(8, "little", signed=False) + i.to_bytes(4, "little"), digest_size=8).digest()
    return sorted(ids, key=weight, reverse=True)
