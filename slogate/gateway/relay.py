"""Relaying a stream to the client and settling what it was worth.

The engine's events go through unchanged (re-timed by the smoothing buffer for paced latency
streams), but for the usage the gateway asked for and the client did not; every token is counted
with its delivery time for goodput. When the engine's stream ends the replica's slot goes back
(a paced stream's held tokens may still be going out); when the client has its answer, or leaves,
the request is settled in the metrics.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from slogate.gateway.admission import Ticket
from slogate.gateway.errors import APIError
from slogate.gateway.exchange import Exchange
from slogate.gateway.metrics import Metrics
from slogate.gateway.pacing import Pacer, paced
from slogate.gateway.sse import USAGE_FIELD, EventInfo, error_event
from slogate.gateway.upstream import Event, Upstream
from slogate.router.goodput import RequestLedger
from slogate.router.lifecycle import call_goodput
from slogate.router.request import SLOClass

log = logging.getLogger("slogate.gateway")


class ClosingStreamingResponse(StreamingResponse):
    """Closes its body when the response ends, however it ends, then runs `on_close`. Starlette
    leaves an unfinished body generator to the garbage collector when the client leaves while a
    send is awaited (the relay parked at its `yield`): until a collection the replica's slot stayed
    held, the engine kept generating for nobody, and the request was never counted. A client gone
    while the headers were sent leaves a relay that never started, whose cleanup never runs:
    `on_close` lets go of what it would have."""

    def __init__(self, content: AsyncIterator[bytes], *, on_close: Callable[[], object], **kw: Any) -> None:
        super().__init__(content, **kw)
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self.body_iterator.aclose()  # type: ignore[attr-defined]
            finally:
                self.on_close()  # even if the close was cancelled (a server shutting down)


class Relay:
    def __init__(self, upstream: Upstream, metrics: Metrics) -> None:
        self.upstream = upstream
        self.metrics = metrics

    async def stream(self, ex: Exchange, pacer: Pacer | None) -> AsyncIterator[bytes]:
        req, led = ex.req, ex.led
        assert led is not None and ex.resp is not None
        outcome = "completed"
        exact: int | None = None
        exact_in: int | None = None
        counted = 0
        answered = False  # the client has been sent [DONE]
        engine_led = RequestLedger(req) if pacer is not None else None
        strip_usage, keep_final_usage = not ex.client_usage[1], ex.client_usage[0]

        def engine_done(ok: bool) -> None:
            # The engine's stream ended while held tokens are still going out: its slot is free now.
            tk, ex.ticket = ex.ticket, None
            if tk is None:
                return
            assert engine_led is not None
            now = time.monotonic()
            for _ in range(req.generated - engine_led.tokens):  # tokens the last chunks carried at once
                engine_led.on_token(now)
            ex.adm.release(tk, goodput=call_goodput(engine_led) if ok else 0.0, completed=ok)
            ex.freed = tk

        try:
            source = self.upstream.events(ex)
            items: AsyncIterator[tuple[bytes, EventInfo | None, float]] = (
                paced(_triples(source, engine_led), pacer, on_end=engine_done) if pacer else source)  # type: ignore[arg-type]
            async for ev, info, _ in items:
                if info is not None:
                    if info.usage_out is not None:
                        exact = info.usage_out
                    if info.usage_in:
                        exact_in = info.usage_in
                    if info.usage_only and not keep_final_usage:
                        continue
                    if info.usage_out is not None and not info.usage_only and strip_usage:
                        ev = USAGE_FIELD.sub(b"", ev)
                    if info.tokens:
                        now = time.monotonic()
                        for _ in range(info.tokens):
                            led.on_token(now)
                        counted += info.tokens
                yield ev
                if info is not None and info.done:
                    answered = True
        except (aiohttp.ClientError, TimeoutError, ValueError) as e:
            outcome = "failed"
            log.warning("upstream stream broke after the first byte: %s", e)
            yield error_event(f"the upstream stream failed: {e!s}")
        except APIError as e:  # a retry before the first token found no replica
            outcome = "failed"
            yield error_event(e.message)
        except (asyncio.CancelledError, GeneratorExit) as e:
            # Cancelled inside an await here, or (the client left while Starlette awaited the send of
            # our last event) closed at the `yield`: both are a client gone. One that leaves after
            # its [DONE] had its whole answer.
            if not answered:
                outcome = "cancelled"
                self.metrics.cancelled.labels(ex.labels[0]).inc()
            if isinstance(e, GeneratorExit) and items is not source:
                # Closed at the `yield`, the pacer was not unwound with us: its reader would go on,
                # and one waiting for a slot to resume in would take it for nobody.
                await items.aclose()  # type: ignore[attr-defined]
            raise
        finally:
            # Closing (not releasing) drops the connection unless the answer was read to the end,
            # so an engine stops generating for a client that left. Synchronous: no await for
            # Starlette's cancellation to interrupt.
            resp = ex.resp
            if resp is not None:
                if outcome == "completed" and resp.content.at_eof():
                    resp.release()
                else:
                    resp.close()
            if exact is not None and exact > counted:  # several tokens per chunk: count the rest at the end
                now = time.monotonic()
                for _ in range(exact - counted):
                    led.on_token(now)
            if ex.ticket is not None:
                self.settle(ex, ex.ticket, outcome, exact_in)
            elif ex.freed is not None:  # the slot went back when the engine finished
                self.settle(ex, ex.freed, outcome, exact_in, released=True)
            else:  # released when a retry found no replica
                self.metrics.requests.labels(*ex.labels, outcome).inc()

    def settle(self, ex: Exchange, t: Ticket, outcome: str, input_tokens: int | None = None, released: bool = False) -> None:
        req, led, labels = t.req, ex.led, ex.labels
        assert led is not None
        m = self.metrics
        gp = call_goodput(led)
        if not released:
            ex.ticket = None
            ex.adm.release(t, goodput=gp, completed=outcome == "completed")
        if input_tokens:  # the engine's exact count replaces our estimate (after release: the view used the estimate)
            req.input_tokens = input_tokens
            gp = call_goodput(led)
        if ex.call is not None:
            ex.call.ended(led.tokens, time.monotonic())
        m.requests.labels(*labels, outcome).inc()
        m.tokens.labels(*labels, "input").inc(req.input_tokens)
        m.tokens.labels(*labels, "output").inc(led.tokens)
        if outcome != "completed":
            return
        m.token_goodput.labels(*labels).inc(gp)
        # A workflow's call is judged by the workflow deadline (its stage sub-deadline only orders work).
        dl = req.workflow.deadline_at if req.workflow is not None else req.deadline_at
        attained = led.attained() if req.kind is not SLOClass.COMPOUND else (led.last_at is not None and led.last_at <= dl)
        m.request_goodput.labels(*labels).inc(int(attained))
        m.tdg.labels(*labels).inc(led.tdg_value() if req.kind is not SLOClass.COMPOUND else (led.tdg_ideal() if attained else 0.0))
        m.tdg_ideal.labels(*labels).inc(led.tdg_ideal())
        if led.first_at is not None:
            m.ttft.labels(*labels).observe(led.first_at - req.arrival)
        if led.last_at is not None:
            m.e2e.labels(*labels).observe(led.last_at - req.arrival)
            if led.tokens > 1 and led.first_at is not None:
                m.tbt.labels(*labels).observe((led.last_at - led.first_at) / (led.tokens - 1))
        if t.track is not None and req.generated > 0:
            m.pred_bounds.labels(labels[0]).inc()
            m.pred_covered.labels(labels[0]).inc(int(req.generated <= ex.first_bound))


async def _triples(src: AsyncIterator[Event], engine_led: RequestLedger | None = None) -> AsyncIterator[tuple[Event, int, float]]:
    """Events with their token counts and arrival times, for the pacer; `engine_led` records the
    engine's timeline."""
    async for ev, info, at in src:
        n = info.tokens if info else 0
        if engine_led is not None:
            for _ in range(n):
                engine_led.on_token(at)
        yield (ev, info, at), n, at


def usage_of(content: bytes) -> tuple[int, int | None]:
    """(output tokens, input tokens) from a non-streamed answer's usage."""
    try:
        d = json.loads(content)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return 0, None
    u = d.get("usage") if isinstance(d, dict) else None
    if isinstance(u, dict):
        n = u.get("completion_tokens", u.get("output_tokens"))
        i = u.get("prompt_tokens", u.get("input_tokens"))
        return (n if isinstance(n, int) else 0), (i if isinstance(i, int) and i > 0 else None)
    return 0, None
