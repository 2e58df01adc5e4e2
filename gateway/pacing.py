"""Pacing buffer for latency-sensitive streams (PROSERVE's smoothing buffer).

Tokens that arrive ahead of the stream's TBT timeline are held and released on it: token i
no earlier than t_first + i·TBT·pace (the first token goes out at once). The engine may then
run ahead — a burst after a stall, or a fast replica — without the client seeing jitter, and
the buffered tokens are slack: `slack(now)` says how long the stream could go without a new
token and still meet its timeline. Upstream reading continues while tokens are held, so
arrival times (which feed goodput and the latency model) stay exact.
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
    def __init__(self, tbt_s: float, pace: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.step = tbt_s * pace
        self.clock = clock
        self.t0: float | None = None
        self.i = 0  # index of the next token to release
        self.arrived = 0

    def due(self, now: float, tokens: int) -> float:
        """When an event carrying `tokens` tokens that arrived at `now` may be released."""
        self.arrived += tokens
        if tokens <= 0:
            return now if self.t0 is None else max(now, self.t0 + self.i * self.step)
        if self.t0 is None:
            self.t0 = now
        at = max(now, self.t0 + self.i * self.step)
        self.i += tokens
        return at

    def slack(self, now: float) -> float:
        """Seconds of buffered tokens ahead of the timeline."""
        if self.t0 is None:
            return 0.0
        return max(0.0, self.t0 + self.arrived * self.step - now)


async def paced(events: AsyncIterator[tuple[T, int, float]], pacer: Pacer, max_buffered: int = 4096) -> AsyncIterator[T]:
    """Re-time (item, tokens, arrival) triples on the pacer's timeline; reading goes on in a
    task so held tokens never slow the upstream read."""
    q: asyncio.Queue[tuple[T, float] | BaseException | None] = asyncio.Queue(max_buffered)

    async def reader() -> None:
        try:
            async for ev, n, at in events:
                await q.put((ev, pacer.due(at, n)))
            await q.put(None)
        except BaseException as e:
            await q.put(e)

    task = asyncio.get_running_loop().create_task(reader())
    try:
        while True:
            item = await q.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            ev, at = item
            wait = at - pacer.clock()
            if wait > 0:
                await asyncio.sleep(wait)
            yield ev
    finally:
        task.cancel()
        # Shielded: under anyio's level-triggered cancellation an unshielded await would return
        # at once, leaving the reader mid-read on the upstream connection it must let go of.
        with anyio.CancelScope(shield=True), contextlib.suppress(asyncio.CancelledError, Exception):
            await task
