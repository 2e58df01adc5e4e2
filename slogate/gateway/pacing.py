"""Smoothing buffer for latency streams (PROSERVE's): it hides engine stalls, it never slows a
stream down to its SLO.

A client sees a stall (another request's prefill, later a preemption) as a long gap between
tokens. To hide one, some tokens must already be held when it starts: the buffer builds that
reserve by releasing tokens a little slower than the engine makes them, and spends it while the
engine is silent. Token k (arriving at a_k, first token at t0) is released at

    r_k = max(a_k, min(r_{k-1} + g·(1 + build), a_k + reserve, t0 + k·ceiling·TBT))

- g is the engine's own per-token gap (a moving average that a stall does not inflate), so the
  client gets tokens at the engine's pace, at most `build` slower while the reserve grows;
- no token is held longer than `reserve` (a few TBTs), and a stall shorter than the reserve
  held is invisible; when the engine's stream ends, what is held goes out at once (nothing is
  left to hide), so the answer ends when the engine's does;
- no token is held past the timeline `t0 + k·ceiling·TBT` (ceiling < 1): a paced stream's mean
  TPOT is at most max(the engine's, ceiling·TBT), and token k is never later than the engine
  made it or than its TBT timeline — so pacing costs no SLO, by either rule, that the unpaced
  stream would meet;
- the first token goes out at once.

Only streams with an SLO someone chose (request, key, tier or model) are paced: a stream whose
TBT is the gateway's built-in default is relayed as fast as the engine makes it.

`slack(now)` is how long the stream could go without a new token from the engine and still
meet its TBT timeline: what a preemption may take from it. Upstream reading continues while
tokens are held, so arrival times (goodput, the latency model) stay exact, and `on_end` fires
when the engine's stream ends — the replica's slot is free then, not when the client has read
its last held token.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

import anyio

T = TypeVar("T")


class Pacer:
    def __init__(self, tbt_s: float, ceiling: float = 0.8, reserve_tbts: float = 4.0, build: float = 0.25,
                 clock: Callable[[], float] = time.monotonic, flush_at_end: bool = True) -> None:
        self.tbt = tbt_s
        self.flush_at_end = flush_at_end  # what is held goes out at once when the engine's stream ends
        self.step = ceiling * tbt_s  # the slowest release pace, on the stream's own timeline
        self.reserve = reserve_tbts * tbt_s
        self.build = build
        self.clock = clock
        self.t0: float | None = None
        self.arrived = 0  # tokens arrived from the engine
        self.last_due = 0.0  # release time of the latest event (events keep their order)
        self.last_at: float | None = None  # arrival of the latest token event
        self.gap: float | None = None  # the engine's per-token gap, a moving average
        # Events read together (one upstream read, one arrival time) are one observation: the
        # time since the previous read over all the tokens it brought. Kept to redo the latest
        # update as more events of the same read come in.
        self._read_dt = 0.0
        self._read_tokens = 0
        self._gap_before: float | None = None

    def due(self, now: float, tokens: int) -> float:
        """When an event carrying `tokens` tokens that arrived at `now` may be released."""
        if tokens <= 0:  # role, finish, usage, [DONE]: after whatever came before, never held for itself
            at = now if self.t0 is None else max(now, self.last_due)
            self.last_due = at
            return at
        if self.t0 is None:
            self.t0 = self.last_due = self.last_at = now
            self.arrived = tokens
            self._read_dt, self._read_tokens = 0.0, tokens
            return now
        assert self.last_at is not None
        if now == self.last_at:  # the same read as the previous event
            self._read_tokens += tokens
        else:
            self._read_dt, self._read_tokens, self._gap_before = now - self.last_at, tokens, self.gap
        if self._read_dt > 0:  # (events read with the first token measure nothing)
            g = self._read_dt / self._read_tokens
            # Neither a stall nor the burst after it is the engine's pace: a gap counts at most twice,
            # at least half the average.
            prev = self._gap_before
            self.gap = g if prev is None else 0.8 * prev + 0.2 * min(max(g, 0.5 * prev), 2.0 * prev)
        self.last_at = now
        self.arrived += tokens
        k = self.arrived - 1  # index of this event's last token
        gap = self.gap or 0.0  # none measured yet: release at once
        at = min(self.last_due + tokens * gap * (1.0 + self.build), now + self.reserve, self.t0 + k * self.step)
        at = max(now, at, self.last_due)
        self.last_due = at
        return at

    def slack(self, now: float) -> float:
        """Seconds the stream can go without a new token and still meet its TBT timeline."""
        if self.t0 is None:
            return 0.0
        return max(0.0, self.t0 + self.arrived * self.tbt - now)


def _release(fut: asyncio.Future[None] | None) -> None:
    if fut is not None and not fut.done():
        fut.set_result(None)


async def paced(events: AsyncIterator[tuple[T, int, float]], pacer: Pacer, max_buffered: int = 4096,
                on_end: Callable[[bool], None] | None = None) -> AsyncIterator[T]:
    """Re-time (item, tokens, arrival) triples on the pacer's schedule; reading goes on in a
    task so held tokens never slow the upstream read. `on_end(ok)` runs when the upstream ends
    (ok: normally); not when the consumer is cancelled. Once the upstream has ended there is no
    stall left to hide: whatever is still held goes out at once, so the answer ends when the
    engine's does (a paced stream's total time, hence its mean TPOT, is the unpaced one's)."""
    q: asyncio.Queue[tuple[T, float] | BaseException | None] = asyncio.Queue(max_buffered)
    loop = asyncio.get_running_loop()
    ended = False
    wake: asyncio.Future[None] | None = None  # the consumer's current hold, cut short by the end

    async def reader() -> None:
        try:
            async for ev, n, at in events:
                await q.put((ev, pacer.due(at, n)))
        except asyncio.CancelledError:
            raise  # the client left: the relay's cleanup frees the slot
        except BaseException as e:
            _end(False)
            await q.put(e)
            return
        _end(True)
        await q.put(None)

    def _end(ok: bool) -> None:
        nonlocal ended
        if pacer.flush_at_end:
            ended = True
            _release(wake)
        if on_end is not None:
            on_end(ok)

    task = loop.create_task(reader())
    try:
        while True:
            item = await q.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            ev, at = item
            wait = at - pacer.clock()
            if wait > 0 and not ended:
                wake = loop.create_future()
                timer = loop.call_later(wait, _release, wake)
                try:
                    await wake
                finally:
                    timer.cancel()
                    wake = None
            yield ev
    finally:
        task.cancel()
        # Shielded: under anyio's level-triggered cancellation an unshielded await would return
        # at once, leaving the reader mid-read on the upstream connection it must let go of.
        with anyio.CancelScope(shield=True), contextlib.suppress(asyncio.CancelledError, Exception):
            await task
