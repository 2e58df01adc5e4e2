"""A request's way through the decision core once the scheduler has placed it.

The one copy of these steps: the live gateway's admission queue (`gateway/admission.py`) and the
simulator (`sim/cluster.py`) both call them, so the ordering policy (VTC's counters, GMAX's
fairness and frame reward, PLAS's attained service), the replica views and the per-call goodput
see the same events in simulation as in production. What each driver measures on the way (the
gateway's per-token gaps, the simulator's step times) stays with the driver.
"""

from __future__ import annotations

from collections.abc import Sequence

from slogate.router.capacity import stream_pace
from slogate.router.goodput import RequestLedger
from slogate.router.policies.base import OrderingPolicy
from slogate.router.request import Request, SLOClass
from slogate.router.view import ReplicaView


def call_goodput(led: RequestLedger) -> float:
    """What one finished call is worth to the ordering's feedback: token goodput, and for a call
    of an agent workflow its tokens when it ended by the workflow's deadline."""
    r = led.req
    if r.kind is SLOClass.COMPOUND:
        deadline = r.workflow.deadline_at if r.workflow is not None else r.deadline_at
        return float(r.input_tokens + led.tokens) if led.last_at is not None and led.last_at <= deadline else 0.0
    return led.token_goodput()


class Lifecycle:
    def __init__(self, ordering: OrderingPolicy, views: Sequence[ReplicaView]) -> None:
        self.ordering = ordering
        self.by_rid = {v.rid: v for v in views}

    def dispatched(self, req: Request, now: float) -> None:
        """The scheduler claimed a slot for `req` (`view.claim`) and the driver sends it: its
        prompt (and, after a preemption, what it had generated) is served now."""
        self.ordering.on_service(req, req.context_tokens, now)

    def tokens(self, req: Request, n: int, now: float) -> float | None:
        """`n` more output tokens of `req` arrived at `now`. Returns the gap per token since the
        previous ones (None for its first token on this replica: no decode gap), for the driver's
        speed measurements."""
        view = self.by_rid[req.replica]  # type: ignore[index]
        view.heard_at = now
        gap = None
        if req.rid in view.prefill_queue or req.last_token_at is None:  # its first token here (after a preemption too)
            view.first_token(req, now)
            if req.first_token_at is None:
                req.first_token_at = now
            if n > 1:
                view.token(n - 1)
        else:
            gap = (now - req.last_token_at) / n  # type: ignore[operator]
            view.token(n)
            slo = req.slo
            if slo.tbt_s and slo.ttft_s is not None and now > req.arrival + slo.ttft_s + req.generated * slo.tbt_s:
                req.late_after_first = True  # the chunk's first token (index `generated`) is the tightest of it
        req.generated += n
        req.last_token_at = now
        req.len_bound = max(req.len_bound - n, 1.0)
        self.ordering.on_service(req, n, now)
        return gap

    def answered(self, req: Request, n: int, now: float) -> None:
        """A whole non-streamed answer of `n` tokens arrived: served, but the view learns no first-
        token time from it (the answer's time is not the prefill's); `finished` follows."""
        if req.replica is not None:
            self.by_rid[req.replica].heard_at = now
        req.generated += n
        req.last_token_at = now
        self.ordering.on_service(req, n, now)

    def finished(self, req: Request, now: float, goodput: float) -> None:
        """`req` left its replica (completed, failed or cancelled) worth `goodput`."""
        if req.replica is not None:
            view = self.by_rid[req.replica]
            view.release(req, now)
            if (pace := stream_pace(req)) is not None:
                view.finished_paces.append(pace)
        self.ordering.on_finish(req, now, goodput)

    def preempted(self, req: Request, now: float) -> None:
        """`req` was taken off its replica to wait again; what it generated stays (re-prefilled
        with its prompt when it is dispatched again)."""
        if req.replica is not None:
            self.by_rid[req.replica].release(req, now)
        req.ran_on = req.replica
        req.replica = None
        req.dispatched_at = None
        req.preemptions += 1
