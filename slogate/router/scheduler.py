"""Composes an ordering policy with a placement policy into dispatch / shed / preempt decisions."""

from __future__ import annotations

import heapq
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from slogate.router.capacity import AT_RISK_S
from slogate.router.placement.base import PlacementPolicy
from slogate.router.policies.base import OrderingPolicy
from slogate.router.registry import make_ordering, make_placement, ordering_params, parse_combo
from slogate.router.request import RESUME_WITHIN_S, Request, SLOClass
from slogate.router.view import FleetPrefill, ReplicaView, fleet_stream_cost, refresh_prefill

log = logging.getLogger("slogate.scheduler")

# How many waiting first tokens (those due soonest) `Scheduler.absorbed` prices each decision.
ABSORB_LOOK = 32


def deadline_spare(now: float, answers: Sequence[Request], pool: Sequence[ReplicaView], timeline: bool = True) -> float:
    """How long the most pressed of `answers` (deadline answers waiting for a slot) could still
    wait and end by its deadline on its best replica of `pool`: its first token after the
    prefill queued there and its own, then its expected length (`Request.remaining_mean`: a
    bound several times the answer judged every deadline answer late) at the pace that
    replica's streams get. Priced for the ABSORB_LOOK answers whose deadlines come first (a long
    queue costs no more than that)."""
    paces = [p.pace_now(now, timeline) for p in pool]
    first = heapq.nsmallest(ABSORB_LOOK, answers, key=lambda r: r.deadline_at)
    return min(max(r.deadline_at - p.first_token_at(now, r) - r.remaining_mean * v for p, v in zip(pool, paces, strict=True))
               for r in first)


def _waits_with_deadline(r: Request) -> bool:
    """An answer with a deadline waiting for its first slot (`Scheduler.absorbed` stands down for it)."""
    return r.kind in (SLOClass.DEADLINE, SLOClass.COMPOUND) and not r.generated


@dataclass(slots=True)
class Decisions:
    dispatch: list[tuple[Request, int]] = field(default_factory=list)  # (request, replica id)
    shed: list[tuple[Request, str]] = field(default_factory=list)
    preempt: list[Request] = field(default_factory=list)
    absorbed: int = 0  # of `dispatch`, first tokens placed beyond every lent slot (Scheduler.absorbed)


class Scheduler:
    """Pure: `schedule` reads the views, claims slots on them for what it dispatches, and
    returns the decisions; the driver carries them out."""

    def __init__(self, ordering: OrderingPolicy, placement: PlacementPolicy, at_risk_s: float = AT_RISK_S,
                 resume_within_s: float = RESUME_WITHIN_S, absorb: bool = False, absorb_by: str = "timeline",
                 absorb_beside_deadlines: bool | str = False) -> None:
        self.ordering = ordering
        self.placement = placement
        self.fleet_prefill = FleetPrefill()  # new replicas' prefill price: the fleet's pooled first tokens
        self.at_risk_s = at_risk_s  # a first token due within this (beyond its prefill) may take an overdraft slot
        self.absorb = absorb  # then, one still waiting goes where the streams running can absorb it (ReplicaView.absorbs)
        self.absorb_by = absorb_by  # the rule the streams running are kept on time by: "timeline" or "tpot"
        # Absorb also while an answer with a deadline waits: never (False), always (True), or
        # "slack": when every such answer could wait out the absorbed stream's life and still end on time.
        self.absorb_beside_deadlines = absorb_beside_deadlines
        # A paused answer's reader is mid-answer: after this long it takes the next free slot
        # before anything else, wherever that is (no ordering's priority or cached holder keeps it).
        self.resume_within_s = placement.resume_within_s = resume_within_s

    @classmethod
    def from_combo(cls, combo: str, seed: int = 0) -> Scheduler:
        o, p = parse_combo(combo)
        o_spec, p_spec = combo.split("+")
        return cls(make_ordering(o, seed=seed, **ordering_params(o_spec)[1]), make_placement(p, seed=seed, **ordering_params(p_spec)[1]))

    @property
    def name(self) -> str:
        return f"{self.ordering.name}+{self.placement.name}"

    def schedule(self, now: float, waiting: Sequence[Request], replicas: Sequence[ReplicaView]) -> Decisions:
        """Dispatch into free slots by the ordering and placement; then first tokens that cannot
        wait into the replicas' overdraft slots; then streams being read that were shed."""
        # A replica with few first tokens of its own is priced by the fleet's; one nothing is
        # placed on would keep a stale prefill price for ever.
        self.fleet_prefill.share(replicas)
        if (stale := refresh_prefill(now, replicas)) and log.isEnabledFor(logging.DEBUG):
            log.debug("prefill price of replica(s) %s stale: the fleet's now (%.2f)", [p.rid for p in stale], stale[0].model.beta_p)
        slots = sum(p.free for p in replicas if p.role != "decode")
        # One pass over the queue only where it can matter: a free slot, or a preemption (below).
        overdue = self._overdue(now, waiting) if slots else None
        first = self._place_in_order(now, overdue, replicas) if overdue else []
        if first:
            slots = sum(p.free for p in replicas if p.role != "decode")
            done = {r.rid for r, _ in first}
            waiting = [r for r in waiting if r.rid not in done]
        sel = self.ordering.select(now, waiting, slots, replicas)
        # A request that has streamed tokens (preempted, or resumed after its replica failed) is
        # being read by its client: finished late, never cut. It gets what room is left below.
        late = [r for r, _ in sel.shed if r.generated]
        # No new pause while a paused answer is overdue: the fleet holds more than preemption can
        # juggle, and each further pause only lengthens the queue of readers waiting mid-answer.
        preempt = sel.preempt
        if preempt and (overdue if overdue is not None else self._overdue(now, waiting)):
            preempt = []
        out = Decisions(dispatch=first, shed=[(r, why) for r, why in sel.shed if not r.generated], preempt=preempt)
        taken: set[int] = set()  # dispatched, or chosen and left waiting by the placement (e.g. for the replica holding its prefix)
        for _ in range(3):
            declined = False
            for req in sel.dispatch:
                taken.add(req.rid)
                target = self.placement.place(now, req, replicas)
                if target is None:
                    declined = True
                    continue
                target.claim(req, now)
                out.dispatch.append((req, target.rid))
            slots = sum(p.free for p in replicas if p.role != "decode")
            if not declined or not slots:
                break
            # A slot the placement declined to fill goes to the next request in the ordering's eyes.
            gone = taken | {r.rid for r, _ in out.shed}
            rest = [r for r in waiting if r.rid not in gone]
            if not rest:
                break
            sel = self.ordering.select(now, rest, slots, replicas)
            late += [r for r, _ in sel.shed if r.generated and r not in late]
        lending = any(p.overdraft for p in replicas)
        if lending or self.absorb:
            gone = taken | {r.rid for r, _ in out.shed} | {r.rid for r in late}
            rest = [r for r in waiting if r.rid not in gone]
            if lending:
                out.dispatch += self.overdraw(now, rest, replicas)
            if self.absorb:
                placed = {r.rid for r, _ in out.dispatch}
                more = self.absorbed(now, [r for r in rest if r.rid not in placed], replicas)
                out.dispatch += more
                out.absorbed = len(more)
        out.dispatch += self._place_in_order(now, late, replicas)
        return out

    def _overdue(self, now: float, waiting: Sequence[Request]) -> list[Request]:
        """Paused answers whose reader has waited `resume_within_s` for the next token, longest
        paused first. Otherwise a paused deadline answer past its deadline, worth nothing to the
        ordering, waited for a spare slot behind every fresh request: 100 s in simulation."""
        due = now - self.resume_within_s
        paused = [r for r in waiting if r.generated and r.last_token_at is not None and r.last_token_at <= due]
        paused.sort(key=lambda r: (r.last_token_at, r.rid))
        return paused

    def _place_in_order(self, now: float, reqs: Sequence[Request], replicas: Sequence[ReplicaView]) -> list[tuple[Request, int]]:
        """`reqs` into free slots in order, wherever placement puts them, until one finds none."""
        out: list[tuple[Request, int]] = []
        for req in reqs:
            target = self.placement.place(now, req, replicas)
            if target is None:
                break
            target.claim(req, now)
            out.append((req, target.rid))
        return out

    def overdraw(self, now: float, waiting: Sequence[Request], replicas: Sequence[ReplicaView]) -> list[tuple[Request, int]]:
        """Latency requests that would lose their first token waiting for a slot, placed (by the
        same placement) on replicas with overdraft room where that first token is still in time,
        most urgent first. What the budget's margin keeps for pace spread buys a first token
        that is otherwise certainly lost; the learner lends it only while the replica is fast.
        Then, where a replica is far below its pace goal (its `lend_now` slots), latency requests
        that could still wait: waiting there would only start them later. A request on the built-in
        default SLO qualifies too: that default is the interactive pace users' tools judge by, and in
        simulation lending to it took guidellm's goodput at the knee from 0.98x round robin to 1.02x."""
        pool = [p for p in replicas if p.room > 0 and p.role != "decode"]
        if not pool:
            return []
        by_spare = self._by_spare(now, [r for r in waiting if r.first_token_pending], pool)
        out = self._lend(now, [r for s, _, r in by_spare if s <= self.at_risk_s], replicas, [p.overdraft for p in replicas])
        if any(p.lend_now for p in pool):
            out += self._lend(now, [r for s, _, r in by_spare if s > self.at_risk_s], replicas, [p.lend_now for p in replicas])
        return out

    def absorbed(self, now: float, waiting: Sequence[Request], replicas: Sequence[ReplicaView]) -> list[tuple[Request, int]]:
        """Latency requests that would lose their first token waiting for a slot, with no slot
        lent anywhere: each goes, most urgent first, to the replica where its first token comes
        soonest among those whose running streams can absorb it (`ReplicaView.absorbs`) and
        where it is still on time. A refusal loses the request for certain; this admits it only
        where no stream on time now is put late by it. Unless `absorb_beside_deadlines`, not while
        an answer with a deadline waits: the ordering decides who takes the next slot, and a stream
        slipped in beyond the budget would take that answer's time (in simulation deadline
        attainment past the knee fell from 94% to 77% without this rule). With "slack", only
        where that answer has the time to spare (`deadline_spare`)."""
        pool = [p for p in replicas if p.healthy and p.role != "decode" and p.decoding]
        if not pool:
            return []
        timeline = self.absorb_by == "timeline"
        spare = math.inf  # the least time any waiting deadline answer could still wait for a slot
        if self.absorb_beside_deadlines == "slack":
            if answers := [r for r in waiting if _waits_with_deadline(r)]:
                spare = deadline_spare(now, answers, pool, timeline)
        elif self.absorb_beside_deadlines is not True and any(_waits_with_deadline(r) for r in waiting):
            return []
        cost = fleet_stream_cost(replicas)
        # The first tokens due soonest only: a frame absorbs a few at most (each one spends the
        # streams' slack), and pricing every one of a long queue on every replica took 35 ms a
        # frame at 2,000 waiting (bench/absorb_cost.py).
        due = heapq.nsmallest(ABSORB_LOOK, (r for r in waiting if r.first_token_pending), key=lambda r: r.ttft_deadline)
        out: list[tuple[Request, int]] = []
        debug = log.isEnabledFor(logging.DEBUG)
        for _, _, req in (x for x in self._by_spare(now, due, pool) if x[0] <= self.at_risk_s):
            fits, terms = [], []
            for p in pool:
                at = p.first_token_at(now, req)
                on_time = at <= req.ttft_deadline
                # Only where it puts no stream on time now late. Weighing the tokens it brings
                # against those it would put late refused fewer and delivered less on real vLLM
                # at the knee (docs/benchmarks.md, sitting S23).
                loss = p.absorb_loss(now, req, cost, timeline) if on_time or debug else None
                if on_time and loss == 0.0:
                    fits.append((at, p.inflight, p.rid, p))
                if debug:
                    terms.append((p, at, loss))
            if debug:  # why a first token at risk was (not) absorbed: each replica's terms, as decided
                log.debug("absorb %d (due in %.3f s, bound %.0f): %s", req.rid, req.ttft_deadline - now, req.remaining_bound, "; ".join(
                    f"{p.rid}: first token {at - req.ttft_deadline:+.3f} s vs due, loss {loss}, {p.n_decode} decoding"
                    + (f", pace {1000 * s[0]:.1f} ms, {len(s[1])} on time" if (s := p._slack(now, timeline)) else ", no pace")
                    for p, at, loss in terms))
            if fits:
                at, _, _, target = min(fits)
                if spare < math.inf:
                    # Beside a waiting deadline answer only if it could wait out this stream's whole
                    # expected life in its slot (it waits for one more slot to free, sooner) and still end on time.
                    life = at - now + req.remaining_mean * target.pace_now(now, timeline)
                    if life > spare:
                        if debug:
                            log.debug("absorb %d: not beside a deadline answer with %.3f s to spare (its life %.3f s)", req.rid, spare, life)
                        continue
                    spare -= life  # the next one absorbed waits behind this one too
                target.claim(req, now)
                out.append((req, target.rid))
        return out

    @staticmethod
    def _by_spare(now: float, reqs: Sequence[Request], pool: Sequence[ReplicaView]) -> list[tuple[float, int, Request]]:
        """(time to spare before its first token on the quickest replica of `pool`, rid, request)
        for those of `reqs` still in time, least to spare first."""
        return sorted((s, r.rid, r) for r in reqs if (s := r.ttft_deadline - min(p.first_token_at(now, r) for p in pool)) >= 0)

    def _lend(self, now: float, reqs: Sequence[Request], replicas: Sequence[ReplicaView], lent: Sequence[int]) -> list[tuple[Request, int]]:
        out: list[tuple[Request, int]] = []
        if not reqs:
            return out
        for p, x in zip(replicas, lent, strict=True):
            p.budget += x  # placement sees the lent slots as free for this pass only
        try:
            for req in reqs:
                target = self.placement.place(now, req, replicas)
                if target is None or target.first_token_at(now, req) > req.ttft_deadline:
                    continue  # late there too: lending a slot would slow the others for nothing
                target.claim(req, now)
                out.append((req, target.rid))
                if not any(p.free for p in replicas):
                    break
        finally:
            for p, x in zip(replicas, lent, strict=True):
                p.budget -= x
        return out
