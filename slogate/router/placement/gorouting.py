"""GoRouting (PROSERVE §4.3, Alg. 2): gain-oriented, capability-aware dispatch.

For each replica p with room: Δ_p = gain(Q_p ∪ {req}) − gain(Q_p), where Q_p is p's prefill
queue and gain counts the TDG value of every queued request whose first token still fits
before its due time under the aggressive estimate φ_a (all of Q finishes together, eq. 8)
plus the decode load n_d·b_d. Candidates C = {p : Δ_p ≥ α·Δ_max}. If Δ_max > 0: the most
idle light replica (exec < μ·SLO) if any; else the *busiest* candidate that is not heavy
(exec with req > λ·SLO), keeping light replicas free for future long / high-priority
requests (the over-balancing fix); else the least loaded candidate. By default (`pack:
false`) nothing is packed: every request goes to the lightest replica that is not heavy, by
when its answer would be done there (the prefill queued ahead and the batch it would decode
in): on real vLLM a stream's pace follows its engine's batch, and packing cost SLO-carrying
streams their timeline (measured, docs/benchmarks.md "Sitting L"). `pack: true` is the paper's
rule for every request; `"chosen"` only for a request whose TBT someone chose (a client that
sent no SLO is never packed: it judges the stream by the engine's pace). If no replica can
meet the SLO (Δ_max ≤ 0) we take the least loaded one — the paper falls back to random,
which under overload only adds queueing — except a latency request not yet started whose client
chose its TTFT and whose first token would be late on every replica with room (`hold_late`): it
waits for a queue to drain, or for GMAX to refuse it, instead of failing its SLO and stalling
the streams where it lands.

`harm: true` (a knob, off; with `balance: overlap`) also counts, among light replicas, the stall req's prefill puts on each
stream decoding there: one about to end waits as long as a young one (docs/benchmarks.md, S21b–c).
Among light replicas the default (`balance: share`) prices each by the shares of SLO budgets req
would use up there, its own and every stream's (`ReplicaView.budget_share`): on real vLLM it
matched the best plain router below the knee where `overlap` (the earlier default: when req's
answer would be done there) lost to it by 13%, and it gave up 7% past the knee, still 3.4× the
peers there (docs/benchmarks.md, sittings S22b and S23).

`GoRoutingPD` is the prefill/decode-disaggregated variant: a prefill replica by the same
rule over the prefill pool, and the decode replica with the most free KV blocks.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Literal

from slogate.router.placement.base import PlacementPolicy
from slogate.router.request import Request, SLOClass
from slogate.router.view import ReplicaView, fleet_stream_cost

log = logging.getLogger("slogate.placement")


def first_token_budget(req: Request, now: float, v_token: float) -> float:
    """Seconds left until req's first token is due (for deadline classes: to still finish)."""
    if req.kind is SLOClass.LATENCY:
        return req.ttft_deadline - now
    return req.deadline_at - req.remaining_bound * v_token - now


class GoRouting(PlacementPolicy):
    name = "gorouting"

    def __init__(self, alpha: float = 0.8, mu: float = 0.1, lam: float = 0.7, w_p: float = 1.0, w_d: float = 1.0,
                 wait_for_cache: float = 0.2, balance: Literal["overlap", "count", "share"] = "share",
                 pack: bool | Literal["chosen"] = False, harm: bool = False, hold_late: bool = True,
                 seed: int = 0) -> None:
        super().__init__(seed)
        self.alpha, self.mu, self.lam, self.w_p, self.w_d = alpha, mu, lam, w_p, w_d
        # The lightest of the light replicas by `overlap`, the paper's n_d·b_d (`count`), or by the
        # shares of SLO budgets req would use up there, its own and every stream's (`share`).
        self.balance = balance
        # Past the light ones: the busiest that is not heavy (the paper: True), else the lightest
        # (False); "chosen": the paper's rule only for a request whose TBT someone chose.
        self.pack = pack
        # Also price the stall req's prefill puts on every stream decoding there (each one's answer
        # ends that much later, however little it has left): knob, measured in docs/benchmarks.md.
        self.harm = harm
        self.wait_for_cache = wait_for_cache  # share of the prompt a full holder must hold more than any free replica (0: never wait)
        # A latency request whose client chose its TTFT, not started, that no replica with room can
        # give its first token in time waits (None) instead of going where it would be late anyway.
        self.hold_late = hold_late

    def _value(self, r: Request) -> float:
        return r.tier.weight * (self.w_p + self.w_d * r.remaining_bound)

    def _done_in(self, now: float, p: ReplicaView, work: float, min_remain: float, new: float = 0.0) -> float:
        """φ_a: the whole prefill queue is assumed done after its total exec (eq. 8), with
        t_budget = the smallest remaining time in the queue capped by a TPOT SLO (100 ms)
        and floored at 2·t_c, plus the decode load n_d·b_d. Lag compensation (time since the
        queue last changed) runs down only the `work` already queued: a `new` prefill has not
        started (compensating it too had an idle replica finish any prompt at once)."""
        m = p.model
        t_budget = max(min(min_remain, 0.1), 2 * m.t_c)
        left = max(work - (now - p.ts_prefill), 0.0) if work else 0.0
        return t_budget / (t_budget - m.t_c) * (left + new) + p.n_decode * m.b_d

    def _fitting_value(self, now: float, p: ReplicaView, work: float, budgets: list[float], values: list[float],
                       new: float = 0.0) -> float:
        """ESTIMATEGAIN core: Σ value of queued requests whose budget covers φ_a(work + new)."""
        if not budgets:
            return 0.0
        done = self._done_in(now, p, work, min(budgets), new)
        return sum(val for val, b in zip(values, budgets, strict=True) if done <= b)

    def gains(self, now: float, p: ReplicaView, req: Request, cached: int | None = None) -> tuple[float, float]:
        """(pre_gain, post_gain): TDG value of queued requests whose first token fits, without
        and with `req` — the queue's budgets and values are computed once for both. `req` adds
        only the prefill its prompt's cached prefix on p (`cached` tokens) does not save."""
        v = p.token_time(0)
        queue = list(p.prefill_queue.values())
        budgets = [first_token_budget(r, now, v) for r in queue]
        values = [self._value(r) for r in queue]
        work = p.model.beta_p * p.prefill_raw
        pre = self._fitting_value(now, p, work, budgets, values)
        post = self._fitting_value(now, p, work, [*budgets, first_token_budget(req, now, v)], [*values, self._value(req)],
                                   p.prefill_cost(req, cached))
        return pre, post

    def estimate_gain(self, now: float, p: ReplicaView, queue: list[Request]) -> float:
        """ESTIMATEGAIN(Q) for an arbitrary queue on replica p (used by tests and tools)."""
        v = p.token_time(0)
        work = sum(p.model.prefill_time(r.context_tokens) for r in queue)
        return self._fitting_value(now, p, work, [first_token_budget(r, now, v) for r in queue], [self._value(r) for r in queue])

    def _choose(self, now: float, req: Request, pool: Sequence[ReplicaView]) -> ReplicaView | None:
        if not pool:
            return None
        deltas, hits = [], []
        for p in pool:
            c = p.cached_tokens(req)
            pre, post = self.gains(now, p, req, c)
            deltas.append(post - pre)
            hits.append(c)
        d_max = max(deltas)
        if d_max <= 0:  # nobody meets it: the earliest first token, its cached prefix counted
            if log.isEnabledFor(logging.DEBUG):
                log.debug("place %d: no gain anywhere (deltas %s), exec %s", req.rid, [round(d, 2) for d in deltas],
                          [round(p.estimate_exec(now, req), 3) for p in pool])
            return self.argmin_random_ties(pool, lambda p: p.estimate_exec(now, req))
        # Among replicas where the goodput arithmetic finds it (nearly) as good, the one holding
        # most of its prompt: the prefill it saves is bandwidth every later request gets. The
        # holder drops out of the candidates once its queue would break someone's SLO.
        near = [(p, c) for p, d, c in zip(pool, deltas, hits, strict=True) if d >= self.alpha * d_max]
        best_hit = max(c for _, c in near)
        cands = [p for p, c in near if c == best_hit]
        slo = max(first_token_budget(req, now, cands[0].token_time()), 1e-3)
        if self.pack is True or (self.pack == "chosen" and req.tbt_chosen):
            light = [p for p in cands if p.estimate_exec(now) < self.mu * slo]
        else:  # every replica that is not heavy counts as light: balance, never pack. Each stream's
            # pace follows its engine's batch (guidellm and our client against round robin, measured)
            light = [p for p in cands if p.estimate_exec(now, req) <= self.lam * slo]
        if log.isEnabledFor(logging.DEBUG):
            log.debug("place %d: d_max %.2f, hits %s, candidates %s, light %s, exec %s, slo %.3f", req.rid, d_max, hits,
                      [p.rid for p in cands], [p.rid for p in light], [round(p.estimate_exec(now, req), 3) for p in pool], slo)
        if light:
            # The lightest by when req's answer would be done: the prefill queued ahead of it and
            # the batch it would decode in over its life, streams about to end counting for little
            # (a count of streams sent a request beside younger ones, and the engine's pace, hence
            # every stream's TPOT, follows the batch; real vLLM, measured). Both in seconds, the
            # decode term at the fleet's measured cost per stream: per token, as the profile's
            # b_d alone, it was ~1% of a prefill and a replica holding 17 streams beside one holding
            # 7 looked the lighter whenever the other had a prompt in prefill (guidellm, measured).
            if self.balance == "count":
                return self.argmin_random_ties(light, lambda p: p.estimate_exec(now))
            cost = fleet_stream_cost(pool)
            if self.balance == "share":
                return self.argmin_random_ties(light, lambda p: p.budget_share(now, req, cost))
            return self.argmin_random_ties(light, lambda p: p.prefill_backlog(now) + p.decode_delay(req, cost)
                                           + (p.prefill_cost(req) * p.n_decode if self.harm else 0.0))
        not_heavy = [p for p in cands if p.estimate_exec(now, req) <= self.lam * slo]
        if not_heavy:
            return max(not_heavy, key=lambda p: p.estimate_exec(now))
        return self.argmin_random_ties(cands, lambda p: p.estimate_exec(now))

    def busy_holder(self, now: float, req: Request, replicas: Sequence[ReplicaView], room: Sequence[ReplicaView]) -> ReplicaView | None:
        """A replica with no free slot that holds much more of `req`'s context than any replica with
        room, if `req` can wait for its next free slot and still have its first token in time: the
        request is better left waiting for it (the scheduler fills the free slot with another)."""
        if not (req.prefix or req.generated) or self.wait_for_cache <= 0:
            return None
        full = [p for p in replicas if p.healthy and p.free == 0 and p.cache is not None and p.role != "decode"]
        if not full:
            return None
        hits = [p.cached_tokens(req) for p in full]
        best = max(hits)
        if best - max((p.cached_tokens(req) for p in room), default=0) < self.wait_for_cache * req.context_tokens:
            return None
        holder = full[hits.index(best)]
        v = holder.token_time(0)
        # Its next free slot: the running request with the least left to generate (a bound).
        left = min((r.remaining_bound for r in holder.decoding.values()), default=0.0)
        wait = left * v + holder.prefill_backlog(now)
        first = wait + holder.prefill_cost(req, best) + holder.model.t_c
        budget = first_token_budget(req, now, v)
        if req.generated and req.last_token_at is not None:  # paused mid-answer: its reader waits
            budget = min(budget, req.last_token_at + self.resume_within_s - now)
        return holder if first <= budget else None

    def place(self, now: float, req: Request, replicas: Sequence[ReplicaView]) -> ReplicaView | None:
        room = self.with_room(replicas)
        if self.busy_holder(now, req, replicas, room) is not None:
            return None
        if self.hold_late and room and late_everywhere(now, req, room):
            if log.isEnabledFor(logging.DEBUG):
                log.debug("hold %d: first token late on every replica with room (%s s vs due)", req.rid,
                          [round(p.first_token_at(now, req) - req.ttft_deadline, 3) for p in room])
            return None
        return self._choose(now, req, room)


def late_everywhere(now: float, req: Request, room: Sequence[ReplicaView]) -> bool:
    """A latency request not yet started, its TTFT chosen by its client, whose first token would
    be late wherever it went now (behind each replica's queued prefill). Dispatched, it fails its
    SLO by either rule and its prefill stalls every stream there (on real vLLM below the knee,
    3 dispatched together behind 0.9 s of prefill: first tokens 0.7-1.3 s later); waiting, it
    may still find a replica whose queue has drained, or it is refused when even the fastest
    prefill cannot bring its first token in time (GMAX's `strict_ttft`)."""
    return req.first_token_pending and req.ttft_chosen and min(p.first_token_at(now, req) for p in room) > req.ttft_deadline
