"""A vLLM-like engine model: continuous batching with chunked prefill.

Per step (vLLM V1 scheduler order): every running sequence gets its next tokens — one
decode token, or the next prefill chunk — within a token budget (`max_batched_tokens`),
then waiting sequences are admitted FCFS while there is budget, a free sequence slot
(`max_num_seqs`) and KV-cache room. KV is allocated in blocks of 16 tokens; when a decode
needs a block and none is free, the most recently admitted sequence is preempted and
recomputed later (vLLM's recompute preemption). Step time comes from the batch latency
model with the replica's true coefficients; a token is emitted at the end of the step in
which a sequence finishes its prefill or decodes.

Automatic prefix caching as vLLM does it: a prompt's full blocks stay cached (LRU, up to the
KV capacity) once computed, and a sequence admitted later starts its prefill after the longest
cached prefix of its prompt (`Request.prefix`: chained block hashes). Its hits and queries are
counted in prompt tokens, like vLLM's `prefix_cache_hits` / `prefix_cache_queries`.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

from slogate.router.latency import BatchLatencyModel
from slogate.router.prefix import PrefixCache, hit_tokens
from slogate.router.request import Request

BLOCK = 16
ANSWERS_KEPT = 4096  # aborted answers whose cached blocks are remembered


@dataclass(slots=True, eq=False)
class Seq:
    req: Request
    true_len: int  # total output tokens this request will produce
    computed: int = 0  # context tokens whose KV is computed
    blocks: int = 0
    admitted_at: float = 0.0
    active: bool = True  # False once aborted; a step in flight then skips it
    cached_in: bool = False  # its prompt's blocks are in the prefix cache

    @property
    def target(self) -> int:
        """Context to compute before the next token can be sampled."""
        return self.req.input_tokens + self.req.generated


class EngineSim:
    def __init__(
        self,
        rid: int,
        model: BatchLatencyModel,
        max_num_seqs: int = 256,
        max_batched_tokens: int = 512,
        kv_capacity_tokens: int = 400_000,
    ) -> None:
        self.rid = rid
        self.model = model
        self.max_num_seqs = max_num_seqs
        self.max_batched_tokens = max_batched_tokens
        self.total_blocks = kv_capacity_tokens // BLOCK
        self.free_blocks = self.total_blocks
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []
        self.busy = False
        self.preemptions = 0
        self.kv_capacity_tokens = kv_capacity_tokens
        self.prefix_cache: PrefixCache | None = None  # made on the first prompt with block hashes
        self.prefix_hits = 0  # prompt tokens found cached at admission
        self.prefix_queries = 0  # prompt tokens looked up
        # Aborted mid-answer (a gateway's preemption): the context blocks it had computed stay
        # cached (vLLM caches answer blocks as they fill), found again when it is sent back here.
        self.answers: OrderedDict[int, int] = OrderedDict()
        self._step: list[tuple[Seq, int]] = []  # (seq, tokens scheduled) for the step in flight

    # -- admission / abort ------------------------------------------------------------------
    def add(self, seq: Seq) -> None:
        self.waiting.append(seq)

    def abort(self, rid: int) -> Seq | None:
        for i, s in enumerate(self.running):
            if s.req.rid == rid:
                self.running.pop(i)
                if s.req.generated and (s.cached_in or not s.req.prefix):
                    self.answers[rid] = s.computed - s.computed % BLOCK
                    if len(self.answers) > ANSWERS_KEPT:
                        self.answers.popitem(last=False)
                self._free(s)
                s.active = False
                return s
        for s in self.waiting:
            if s.req.rid == rid:
                self.waiting.remove(s)
                s.active = False
                return s
        return None

    def _free(self, s: Seq) -> None:
        self.free_blocks += s.blocks
        s.blocks = 0
        s.computed = 0

    def _grow(self, s: Seq, tokens: int) -> bool:
        need = -(-(s.computed + tokens) // BLOCK) - s.blocks
        if need <= 0:
            return True
        if need > self.free_blocks:
            return False
        self.free_blocks -= need
        s.blocks += need
        return True

    def _lookup(self, s: Seq) -> None:
        """A sequence starting from nothing: its cached prompt prefix needs no prefill."""
        req = s.req
        held = self.answers.pop(req.rid, 0)
        if req.prefix:
            if self.prefix_cache is None:
                self.prefix_cache = PrefixCache(max(int(self.kv_capacity_tokens // max(req.tokens_per_block, 1.0)), 1))
            s.computed = hit_tokens(self.prefix_cache.match(req.prefix), req.tokens_per_block, req.input_tokens)
        if held and (not req.prefix or s.computed >= req.input_tokens - max(req.tokens_per_block, BLOCK)):
            s.computed = max(s.computed, min(held, s.target - 1))

    def _preempt_last(self) -> Seq | None:
        victim = self.running.pop()
        self._free(victim)
        self.waiting.appendleft(victim)
        self.preemptions += 1
        return victim

    # -- one step ------------------------------------------------------------------------------
    def start_step(self, now: float) -> float | None:
        """Form the next batch; return its duration, or None if there is nothing to run."""
        budget = self.max_batched_tokens
        sched: list[tuple[Seq, int]] = []
        prefills: list[tuple[int, int]] = []
        decode_kv: list[int] = []
        i = 0
        while i < len(self.running) and budget > 0:
            s = self.running[i]
            todo = s.target - s.computed
            decode = s.req.generated > 0 and todo <= 1
            n = 1 if decode else min(todo, budget)
            while not self._grow(s, n):
                if self._preempt_last() is s:
                    s = None
                    break
            if s is None:
                break
            sched.append((s, n))
            if decode:
                decode_kv.append(s.computed)
            else:
                prefills.append((n, s.computed))
            budget -= n
            i += 1
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            s = self.waiting[0]
            fresh = s.computed == 0
            if fresh:
                self._lookup(s)
            n = min(s.target - s.computed, budget)
            if not self._grow(s, n):
                s.computed = 0
                break
            if fresh and (s.req.prefix or s.req.generated):
                self.prefix_queries += s.req.context_tokens
                self.prefix_hits += s.computed
            self.waiting.popleft()
            s.admitted_at = now
            self.running.append(s)
            sched.append((s, n))
            prefills.append((n, s.computed))
            budget -= n
        if not sched:
            self.busy = False
            return None
        self._step = sched
        self.busy = True
        return self.model.raw_batch_time(prefills, decode_kv)

    def finish_step(self) -> list[Seq]:
        """Apply the step: return sequences that emitted a token (caller records tokens)."""
        emitted = []
        for s, n in self._step:
            if not s.active:
                continue  # aborted while the step ran
            s.computed += n
            if not s.cached_in and s.computed >= s.req.input_tokens and s.req.prefix and self.prefix_cache is not None:
                self.prefix_cache.insert(s.req.prefix)
                s.cached_in = True
            if s.computed >= s.target:
                emitted.append(s)
        self._step = []
        return emitted

    def remove(self, s: Seq) -> None:
        self.running.remove(s)
        self._free(s)

    @property
    def load(self) -> int:
        return len(self.running) + len(self.waiting)
