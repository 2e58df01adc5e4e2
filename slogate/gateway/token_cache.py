"""Token ids of the prompts a gateway tokenized lately, found again by their text's prefix
(`prefix.tokenizer`'s cost on conversations and agent loops that resend their context).

A chat prompt grows by a turn each call, and tokenizing it whole costs ~2 ms per 1,000 tokens on
this host (18 ms for a 9,000-token agent context, before its first token can be placed). What
changed is only its tail. A special token (the template's `<|im_start|>`, `<|im_end|>`…: an added
token, matched literally, neither stripping nor normalized) is where the tokenizer splits the text
before anything else, so the ids up to one are the same in every text that shares the characters
up to it. The cache keys each such boundary by a chain of hashes of the text before it; a new
prompt reuses the ids up to the furthest boundary it shares with one seen, and tokenizes only the
rest. The rest is tokenized after its boundary's special token, dropped from the result: begun
at offset 0, a pre-tokenizer with `prepend_scheme: first` (Llama's Metaspace) would mark it as
the text's start, which it is not.

A wrong id costs only a prefix hit's estimate (the engine tokenizes its own prompt), but the
first `VERIFY` reuses are also tokenized whole and compared: one mismatch (a tokenizer this
reasoning does not fit) turns the cache off for good, with a warning.

Thread-safe: prompts are tokenized in worker threads. Bounded: at most `max_tokens` ids held,
least recently used prompts dropped first; a prompt whose every boundary a longer one took over
(the same conversation a turn later) is dropped at once.
"""

from __future__ import annotations

import logging
import re
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("slogate.gateway")

VERIFY = 8  # reuses checked against tokenizing the whole text, before the cache is trusted


@dataclass(eq=False)
class _Entry:
    ids: array  # the whole prompt's ids ('i': 4 bytes each; vocabularies are far below 2^31)
    ends: list[int]  # for each boundary, the number of ids up to and including its special token
    keys: list[int]  # each boundary's chain hash
    live: int = 0  # boundaries whose key still points here


@dataclass
class TokenCache:
    tok: Any  # a `tokenizers.Tokenizer`
    max_tokens: int = 1_000_000
    hits: int = 0  # prompts that reused ids
    reused: int = 0  # ids reused, in all
    tokenized: int = 0  # ids tokenized, in all
    enabled: bool = True
    on_encoded: Callable[[int, int], None] | None = None  # (ids tokenized, ids reused) per prompt: the gateway's metrics
    _verified: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _entries: OrderedDict[int, _Entry] = field(default_factory=OrderedDict)  # id(entry) -> entry, LRU first
    _at: dict[int, tuple[_Entry, int]] = field(default_factory=dict)  # chain hash -> (entry, boundary index)
    _held: int = 0

    def __post_init__(self) -> None:
        # Only special tokens that split the raw text exactly where they appear.
        cut = [t for t in self.tok.get_added_tokens_decoder().values()
               if t.special and not (t.lstrip or t.rstrip or t.single_word or t.normalized) and t.content]
        self.boundary_ids = frozenset(self.tok.token_to_id(t.content) for t in cut)
        contents = sorted({t.content for t in cut}, key=len, reverse=True)  # leftmost-longest, as the tokenizer matches
        self._re = re.compile("|".join(map(re.escape, contents))) if contents else None
        if self._re is None:
            self.enabled = False

    def encode(self, text: str) -> list[int]:
        """`text`'s ids without special tokens added (a rendered chat template writes its own)."""
        if not self.enabled or self._re is None:
            return self._whole(text)
        spans = [m.span() for m in self._re.finditer(text)]
        keys, h, last = [], 0, 0
        for _, end in spans:
            h = hash((h, text[last:end]))
            keys.append(h)
            last = end
        with self._lock:
            found = next(((i, hit) for i in range(len(keys) - 1, -1, -1) if (hit := self._at.get(keys[i])) is not None), None)
            if found is not None:
                i, (e, j) = found
                self._entries.move_to_end(id(e))
                head, prev_ends = e.ids[:e.ends[j]].tolist(), e.ends[:j + 1]
        tail: list[int] = []
        if found is not None:
            tail = self._encode(text[spans[i][0]:])  # from its boundary's special token on
        if tail and tail[0] == head[-1]:  # the boundary tokenized as itself: reuse up to it
            ids = head + tail[1:]
            ends = prev_ends + self._ends(ids, len(head))
            whole = self._unverified(text, ids)
            if whole is not None:
                return whole
            self.hits += 1
            self._count(len(tail) - 1, len(head))
        else:
            ids = self._whole(text)
            ends = self._ends(ids, 0)
        if len(ends) == len(keys):  # every boundary found in the ids, one for one: worth keeping
            self._keep(ids, ends, keys)
        return ids

    def _encode(self, text: str) -> list[int]:
        ids: list[int] = self.tok.encode_batch([text], add_special_tokens=False)[0].ids  # encode_batch releases the GIL
        return ids

    def _whole(self, text: str) -> list[int]:
        ids = self._encode(text)
        self._count(len(ids), 0)
        return ids

    def _count(self, tokenized: int, reused: int) -> None:
        self.tokenized += tokenized
        self.reused += reused
        if self.on_encoded is not None:
            self.on_encoded(tokenized, reused)

    def _ends(self, ids: list[int], frm: int) -> list[int]:
        """For each boundary token in ids[frm:], the count of ids up to and including it."""
        b = self.boundary_ids
        return [k + 1 for k in range(frm, len(ids)) if ids[k] in b]

    def _unverified(self, text: str, ids: list[int]) -> list[int] | None:
        """While the first VERIFY reuses are checked: `text` tokenized whole where that differs
        from `ids` (and the cache is then off for good); else None."""
        if self._verified >= VERIFY:
            return None
        whole = self._encode(text)  # the check's own tokenizing: not counted
        if whole == ids:
            self._verified += 1
            return None
        self._count(len(whole), 0)  # what the prompt needed after all
        self.enabled = False
        log.warning("prefix.tokenizer: reusing a prompt's ids up to a special token gave other ids than tokenizing it whole "
                    "(a tokenizer whose special tokens do not split the text); the token cache is off")
        return whole

    def _keep(self, ids: list[int], ends: list[int], keys: list[int]) -> None:
        e = _Entry(array("i", ids), ends, keys)
        with self._lock:
            for j, k in enumerate(keys):
                old = self._at.get(k)
                self._at[k] = (e, j)
                e.live += 1
                if old is not None and old[0] is not e:
                    o = old[0]
                    o.live -= 1
                    if o.live <= 0:
                        self._drop(o)
            self._entries[id(e)] = e
            self._held += len(e.ids)
            while self._held > self.max_tokens and self._entries:
                self._drop(next(iter(self._entries.values())))

    def _drop(self, e: _Entry) -> None:
        if self._entries.pop(id(e), None) is None:
            return
        self._held -= len(e.ids)
        for k in e.keys:
            hit = self._at.get(k)
            if hit is not None and hit[0] is e:
                del self._at[k]

    @property
    def held(self) -> int:
        """Ids held now."""
        return self._held
