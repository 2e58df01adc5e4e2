"""The gateway-side queue: the decision core run on the event loop.

Each request waits here (an asyncio future) until the configured ordering policy picks it and
the placement policy finds a replica with room in its concurrency budget. The scheduler runs
once per loop iteration after arrivals (all arrivals of that iteration in one call), on every
completion, and every frame Δ (for shedding and waiting-time expiry). Length bounds for new
arrivals and refinements of running streams are answered in one batched predictor call just
before each decision. Refusals: a full queue → 503, not dispatched within the waiting time or
shed as unattainable → 429; both with Retry-After. Best-effort requests have a waiting time as
long as their default deadline, so they wait rather than get refused, and GMAX never lets them
go unserved forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from slogate.gateway.errors import APIError
from slogate.predictors.features import PromptInput
from slogate.predictors.online import OnlineLengthPredictor, Track
from slogate.router.capacity import waiting_demand
from slogate.router.lifecycle import Lifecycle
from slogate.router.request import Request, SLOClass
from slogate.router.scheduler import Scheduler
from slogate.router.view import ReplicaView

log = logging.getLogger("slogate.admission")
# A refusal within this of arrival was decided on the request's first look: nothing it waited for made it late.
AT_ONCE_S = 0.05


@dataclass(eq=False)
class Ticket:
    req: Request
    fut: asyncio.Future[int]
    wait_until: float
    track: Track | None = None
    replica: int | None = None
    last_refine: int = 0
    # Stops the upstream stream so the answer continues elsewhere (set while a stream can be
    # resumed: it has a first token and its text so far); a policy's preempt list calls it.
    preempt: Callable[[], None] | None = None


class AdmissionHooks:
    """What the gateway around an admission queue is told, and asked: no-ops by default."""

    shared = False  # every dispatch must be confirmed (`confirm`) against the other gateways

    async def confirm(self, t: Ticket) -> bool:
        """Claim the slot the local decision took, atomically across gateways (False: another
        gateway took the last slot)."""
        return True

    def refused(self, t: Ticket, reason: str) -> None:
        """`t` was refused (429 / 503) for `reason`."""

    def decided(self, seconds: float) -> None:
        """One scheduling decision took `seconds`."""

    def released(self, t: Ticket) -> None:
        """`t` gave its replica slot back."""

    def first_token(self, t: Ticket) -> None:
        """`t` got its first token: prefill is over."""

    def absorbed(self, n: int) -> None:
        """`n` first tokens were placed beyond every lent slot (`capacity.absorb`)."""


class Admission:
    def __init__(self, scheduler: Scheduler, views: list[ReplicaView], *, hooks: AdmissionHooks | None = None, max_queue: int = 2000,
                 frame_s: float = 0.3, predictor: OnlineLengthPredictor | None = None, refine_every: int = 50,
                 clock: Callable[[], float] = time.monotonic, max_preemptions: int = 8) -> None:
        self.scheduler = scheduler
        self.views = views
        self.by_rid = {v.rid: v for v in views}
        self.lifecycle = Lifecycle(scheduler.ordering, views)  # the same steps the simulator takes
        self.max_queue = max_queue
        self.frame_s = frame_s
        self.predictor = predictor
        self.refine_every = refine_every
        self.clock = clock
        self.max_preemptions = max_preemptions  # per request, whatever a policy asks: a stream is never bounced around for ever
        self.waiting: dict[int, Ticket] = {}
        self.running: dict[int, Ticket] = {}
        self._ids = itertools.count(1)
        self._to_predict: dict[int, Ticket] = {}
        self._soon: asyncio.Handle | None = None
        self._frames: asyncio.Task[None] | None = None
        self.hooks = hooks or AdmissionHooks()

    def queued(self) -> int:
        """The demand the replicas' budgets turn away now (router/capacity.py, `lend_in_bursts`)."""
        return waiting_demand(t.req for t in self.waiting.values())

    def new_rid(self) -> int:
        return next(self._ids)

    def set_views(self, views: list[ReplicaView]) -> None:
        """The replicas placement may choose from now on (one joined, drained or left). A view
        no longer listed still serves the requests running on it until they finish."""
        self.views = views
        keep = {v.rid for v in views} | {rid for rid, v in self.by_rid.items() if v.prefill_queue or v.decoding}
        self.by_rid = {rid: v for rid, v in {**self.by_rid, **{v.rid: v for v in views}}.items() if rid in keep}
        self.lifecycle.by_rid = self.by_rid
        if self.waiting and any(v.free for v in views):
            self._schedule_soon()

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        if self._frames is None:
            self._frames = asyncio.get_running_loop().create_task(self._frame_loop())

    async def stop(self) -> None:
        if self._frames is not None:
            self._frames.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._frames
            self._frames = None
        for t in list(self.waiting.values()):
            if not t.fut.done():
                t.fut.set_exception(APIError(503, "the gateway is shutting down", retry_after=1))
        self.waiting.clear()

    async def _frame_loop(self) -> None:
        while True:
            await asyncio.sleep(self.frame_s)
            try:
                self._schedule(frame=True)
            except Exception:  # a policy bug must not kill the loop that serves everyone
                log.exception("scheduling failed")

    # ------------------------------------------------------------------ requests
    def retry_after(self) -> float:
        """A rough time until a slot frees: queue length over the fleet's budget, ≥ 1 s."""
        budget = sum(v.budget for v in self.views if v.healthy) or 1
        return max(1.0, min(30.0, len(self.waiting) / budget * 2.0))

    async def acquire(self, req: Request, waiting_s: float, prompt: PromptInput | None = None) -> Ticket:
        """Wait until `req` is dispatched; returns its ticket with `.replica` set."""
        if not any(v.healthy for v in self.views):
            raise APIError(503, "no healthy backend replica", retry_after=2.0)
        if len(self.waiting) >= self.max_queue:
            raise APIError(503, f"the gateway queue is full ({self.max_queue} waiting)", code="queue_full", retry_after=self.retry_after())
        now = self.clock()
        t = Ticket(req, asyncio.get_running_loop().create_future(), now + waiting_s)
        if self.predictor is not None and prompt is not None:
            t.track = self.predictor.track(prompt)
            self._to_predict[req.rid] = t
        self.waiting[req.rid] = t
        if len(self.waiting) == 1 and self._soon is None and any(v.free for v in self.views):
            self._schedule()  # an empty queue and room: decide now, no trip through the event loop
        else:
            self._schedule_soon()  # a queue: this iteration's arrivals are decided together
        while True:
            try:
                t.replica = await t.fut
            except asyncio.CancelledError:
                # The client went away while waiting; if a slot was already claimed, give it back.
                self.waiting.pop(req.rid, None)
                self._to_predict.pop(req.rid, None)
                if t.fut.done() and not t.fut.cancelled() and t.fut.exception() is None:
                    self.by_rid[t.fut.result()].release(req, self.clock())
                    self._schedule_soon()
                raise
            if not self.hooks.shared:
                break
            try:
                ok = await self.hooks.confirm(t)
            except asyncio.CancelledError:
                self.by_rid[t.replica].release(req, self.clock())
                self.hooks.released(t)  # the claim may have landed before the cancel
                raise
            if ok:
                break
            # Another gateway took the replica's last slot: count it full until the next sync, wait again.
            view = self.by_rid[t.replica]
            view.release(req, self.clock())
            view.remote_prefill += 1
            t.replica = None
            t.fut = asyncio.get_running_loop().create_future()
            self.waiting[req.rid] = t
            self._schedule_soon()
        self.running[req.rid] = t
        return t

    def tokens(self, t: Ticket, n: int, now: float) -> float | None:
        """n more tokens of a running request arrived at `now`; returns the gap per token since
        the previous ones (None for the first)."""
        if t.replica is None or n <= 0:
            return None
        first = t.req.rid in self.by_rid[t.replica].prefill_queue  # its first token here (also after a resume)
        gap = self.lifecycle.tokens(t.req, n, now)
        if first:
            self.hooks.first_token(t)
            if log.isEnabledFor(logging.DEBUG) and t.req.dispatched_at is not None:
                log.debug("first token %d on %d: %.3f s after dispatch", t.req.rid, t.replica, now - t.req.dispatched_at)
        if t.track is not None and t.req.generated - t.last_refine >= self.refine_every:
            t.last_refine = t.req.generated
            self._to_predict[t.req.rid] = t  # refined with the next decision's batch
        return gap

    def requeue(self, t: Ticket) -> None:
        """`t` leaves its replica mid-answer (the replica failed) to be dispatched again with what
        it has generated: released there, not finished."""
        self.running.pop(t.req.rid, None)
        self._to_predict.pop(t.req.rid, None)
        if t.replica is not None:
            self.lifecycle.preempted(t.req, self.clock())
            self.hooks.released(t)
        self._schedule_soon()

    def answered(self, t: Ticket, n: int, now: float) -> None:
        """A non-streamed answer of n tokens arrived whole."""
        if t.replica is not None and n > 0:
            self.lifecycle.answered(t.req, n, now)

    def release(self, t: Ticket, goodput: float = 0.0, completed: bool = True) -> None:
        """The request left its replica (finished, failed or cancelled)."""
        now = self.clock()
        self.running.pop(t.req.rid, None)
        self._to_predict.pop(t.req.rid, None)
        if t.replica is not None:
            self.lifecycle.finished(t.req, now, goodput)
            self.hooks.released(t)
        else:
            self.scheduler.ordering.on_finish(t.req, now, goodput)
        if completed and t.track is not None and self.predictor is not None and t.req.generated > 0:
            self.predictor.observe(t.track, t.req.generated)
        self._schedule_soon()

    # ------------------------------------------------------------------ deciding
    def _schedule_soon(self) -> None:
        if self._soon is None:
            self._soon = asyncio.get_running_loop().call_soon(self._run_soon)

    def _run_soon(self) -> None:
        self._soon = None
        try:
            self._schedule()
        except Exception:
            log.exception("scheduling failed")

    def _predict(self) -> None:
        if not self._to_predict or self.predictor is None:
            return
        ts = [t for t in self._to_predict.values() if t.track is not None]
        self._to_predict.clear()
        bound, med = self.predictor.predict([t.track for t in ts], [t.req.generated for t in ts],  # type: ignore[misc]
                                            [t.req.max_tokens for t in ts])
        for t, b, m in zip(ts, bound.tolist(), med.tolist(), strict=True):
            t.req.len_bound = float(b)
            t.req.len_mean = float(t.req.generated + m)

    def _schedule(self, frame: bool = False) -> None:
        t0 = time.perf_counter()
        now = self.clock()
        self._predict()
        for rid, t in list(self.waiting.items()):
            if t.fut.done():
                self.waiting.pop(rid, None)
            elif now > t.wait_until and t.req.kind is not SLOClass.BEST_EFFORT and not t.req.generated:
                self._refuse(t, "waiting_time_exceeded")
        # `room` counts the overdraft: a first token that cannot wait may still go (scheduler.py).
        # With every replica full, only a frame's decision can preempt (as in the simulator) or
        # place a first token where the running streams absorb it, and only when one of those is
        # on: otherwise nothing can change.
        full_frame = frame and (self.scheduler.absorb or any(t.preempt for t in self.running.values()))
        if self.waiting and (any(v.room for v in self.views) or full_frame):
            d = self.scheduler.schedule(now, [t.req for t in self.waiting.values()], self.views)
            for req, reason in d.shed:  # never one its client is reading (the scheduler's rule)
                t = self.waiting.get(req.rid)
                if t is not None:
                    self._refuse(t, reason)
            for req, rid in d.dispatch:
                self._dispatch(req, rid, now)
            if d.absorbed:
                self.hooks.absorbed(d.absorbed)
            for req in d.preempt:
                self.preempt(req)
        self.hooks.decided(time.perf_counter() - t0)

    def _dispatch(self, req: Request, rid: int, now: float) -> None:
        t = self.waiting.pop(req.rid, None)
        if t is None or t.fut.done():
            self.by_rid[rid].release(req, now)  # its client left meanwhile
            return
        t.fut.set_result(rid)
        self.lifecycle.dispatched(req, now)  # `claim` set its replica and dispatch time
        if log.isEnabledFor(logging.DEBUG):  # where it went and what each replica held (placement's inputs)
            # On the replica chosen, `claim` has queued req (its backlog includes req's prefill) and
            # entered its prompt in the prefix picture: its own prefill is priced by the hit found
            # before (`req.cached`), not by a match against itself.
            log.debug("dispatch %d (%d tokens, bound %.0f) to %d after %.3f s waiting; replicas: %s", req.rid, req.context_tokens,
                      req.remaining_bound, rid, now - req.arrival,
                      "; ".join(f"{v.rid}: {len(v.prefill_queue)} prefilling, backlog {v.prefill_backlog(now):.3f} s, "
                                f"{v.n_decode} decoding, overlap {v.overlap(req):.2f}, "
                                f"own prefill {v.prefill_cost(req, req.cached if v.rid == rid else None):.3f} s"
                                for v in self.views))

    def preempt(self, req: Request) -> bool:
        """Stop `req`'s stream on its replica; it waits again and continues from its text so far
        (upstream.py). False where it cannot be: not a resumable stream, preempted enough, or with
        its whole answer out."""
        t = self.running.get(req.rid)
        if t is None or t.preempt is None or req.preemptions >= self.max_preemptions:
            return False
        if req.max_tokens is not None and req.generated >= req.max_tokens:
            return False  # every token is out (its finish has yet to come): nothing is left to resume
        stop, t.preempt = t.preempt, None
        req.preemptible = False  # until its next first token
        stop()
        return True

    def _refuse(self, t: Ticket, reason: str) -> None:
        if log.isEnabledFor(logging.DEBUG):
            log.debug("refuse %d (%s) after %.3f s waiting; replicas: %s", t.req.rid, reason, self.clock() - t.req.arrival,
                      "; ".join(f"{v.rid}: {v.inflight} held of {v.budget} (+{v.overdraft} lent), {len(v.prefill_queue)} prefilling"
                                for v in self.views))
        self.waiting.pop(t.req.rid, None)
        self._to_predict.pop(t.req.rid, None)
        if not t.fut.done():
            msg = {"waiting_time_exceeded": "not admitted within its waiting time", "slo_unattainable": "its SLO cannot be met at the current load"}
            if reason == "slo_unattainable" and self.clock() - t.req.arrival < AT_ONCE_S:
                # Refused on arrival: no load made it late (GMAX holds a refusal against the request's
                # own prefill at its fastest lately), its SLO asks for less than that.
                msg[reason] = "its SLO cannot be met even if it started now: its prompt takes longer to prefill here than its first token or deadline allows"
            t.fut.set_exception(APIError(429, f"request refused: {msg.get(reason, reason)}", code=reason, retry_after=self.retry_after()))
        self.hooks.refused(t, reason)
