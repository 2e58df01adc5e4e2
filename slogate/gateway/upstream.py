"""Talking to the replicas: the upstream body, sending it (retrying elsewhere on a connect error
or a 5xx before the first byte), and reading a stream's events with what they carry (moving the
request to another replica if the stream fails before its first token)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from array import array
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

import aiohttp
import orjson

from slogate.gateway.admission import Ticket
from slogate.gateway.config import GatewayConfig
from slogate.gateway.errors import APIError
from slogate.gateway.exchange import Exchange
from slogate.gateway.fleet import Backend, Fleet
from slogate.gateway.metrics import Metrics
from slogate.gateway.resume import by_ids, continued, ids_body
from slogate.gateway.schema import PATHS
from slogate.gateway.sse import KEEPALIVE, EventInfo, EventSplitter, hide_ids, inspect

log = logging.getLogger("slogate.gateway")

Event = tuple[bytes, EventInfo | None, float]  # the event's bytes, what it carries, when it arrived
READ_MAX = 1 << 16  # bytes of one upstream read (see `_read`)


def engine_asks(kind: str, stream: bool, with_ids: bool, by_id_count: bool) -> dict[str, Any]:
    """What the gateway adds to a request for a replica of `kind` (bench/gateway_ttft.py measures
    what these cost the engine by sending them itself). `with_ids`: the chunks' token ids, so a
    continuation from them is exact (gateway/resume.py); `by_id_count`: those ids count the tokens."""
    asks: dict[str, Any] = {}
    if stream:
        so: dict[str, Any] = {"include_usage": True}  # exact token counts
        if kind != "openai" and not by_id_count:
            # The running count in every chunk: an engine sends no chunk for a token that
            # detokenizes to nothing (part of a character), so one chunk can carry several
            # tokens, and the gaps the capacity learner measures must be per token. (Where
            # the chunks carry their token ids these count them: no usage to strip per token.)
            so["continuous_usage_stats"] = True
        asks["stream_options"] = so
    if with_ids:
        asks["return_token_ids"] = True
    return asks


def resumable(kind: str, body: dict[str, Any], stream: bool) -> bool:
    """Whether an answer cut mid-stream can be continued on another replica from its text so far:
    one streamed chat or completion choice, nothing per token the continuation would lose."""
    if not stream or kind not in ("chat", "completions") or (body.get("n") or 1) != 1 or body.get("logprobs") or body.get("echo"):
        return False
    return kind == "chat" or isinstance(body.get("prompt"), str)


def _with_usage(ev: bytes, info: EventInfo) -> bytes:
    """The event with its usage rewritten to the whole answer's (after a resume)."""
    try:
        d = orjson.loads(ev[ev.index(b"data:") + 5:])
    except (ValueError, orjson.JSONDecodeError):
        return ev
    u = d.get("usage") if isinstance(d, dict) else None
    if not isinstance(u, dict):
        return ev
    u["completion_tokens"] = info.usage_out
    if info.usage_in:
        u["prompt_tokens"] = info.usage_in
    u["total_tokens"] = (u.get("prompt_tokens") or 0) + (info.usage_out or 0)
    return b"data: " + orjson.dumps(d) + b"\n\n"


class _Retryable(Exception):
    pass


class Preempted(Exception):
    """Raised into a stream's reader when the scheduler takes its replica slot back."""


class Upstream:
    def __init__(self, cfg: GatewayConfig, fleet: Fleet, metrics: Metrics) -> None:
        self.fleet = fleet
        self.metrics = metrics
        self.configure(cfg)

    def configure(self, cfg: GatewayConfig) -> None:
        """Retries and timeouts from `cfg` (at start and on a config reload)."""
        self.cfg = cfg
        self.answer_timeout = aiohttp.ClientTimeout(total=None, sock_connect=cfg.connect_timeout_s, sock_read=cfg.first_byte_timeout_s)
        # A stream's headers come at once and its chunks keep coming: a silence longer than
        # stream_idle_timeout_s is a stalled replica. A whole (non-streamed) answer may take long.
        self.stream_timeout = aiohttp.ClientTimeout(total=None, sock_connect=cfg.connect_timeout_s, sock_read=cfg.stream_idle_timeout_s)

    def body(self, b: Backend, ex: Exchange) -> dict[str, Any]:
        res = ex.res
        body = dict(res.body)
        if b.cfg.kind != "openai":
            body.pop("service_tier", None)
        if b.cfg.priority_scheduling:
            # vLLM: lower runs first. The client's integer wins; else heavier tiers go first.
            body["priority"] = res.vllm_priority if res.vllm_priority is not None else -round(res.tier.weight * 10)
        else:
            body.pop("priority", None)
        with_ids = ex.text is not None and b.cfg.kind == "vllm"  # asked for its token ids (below)
        # Ids count the tokens only where they cover the whole answer so far: not after an
        # attempt on a replica that gave none (a mixed fleet), whose tokens have no ids.
        by_id_count = with_ids and b.gives_ids and len(ex.ids or ()) == ex.resumed
        if with_ids and ex.ids is None:
            ex.ids, ex.hide_ids = array("l"), not body.get("return_token_ids")  # 8 bytes a token, not ~36
        asked = engine_asks(b.cfg.kind, ex.stream and ex.kind != "responses", with_ids, by_id_count)
        if "stream_options" in asked:
            body["stream_options"] = {**(body.get("stream_options") or {}), **asked.pop("stream_options")}
        body.update(asked)
        ex.upstream_kind, ex.again = None, ""  # per attempt: only a continuation by ids makes text again
        if with_ids and ex.resumed and by_ids(ex, ex.resumed):
            # From the last token known to end a character: a prompt that ends inside one
            # makes vLLM's detokenizer hold its whole prompt back and send it as answer text
            # (measured). The tokens after it are made again: the text of theirs the client
            # already has (a chunk of several ids, whose last may have been held back) is
            # dropped from the continuation, not sent twice.
            keep = ex.ids_whole
            cont = ids_body(body, ex, b.max_len, keep)
            if cont is not None:
                assert ex.ids is not None
                del ex.ids[keep:]
                ex.resumed, ex.upstream_kind = keep, "completions"
                ex.again = ex.text.getvalue()[ex.text_whole:]
                return cont
        if ex.resumed and ex.text is not None:
            # The answer so far goes back as the start of the answer (vLLM's and SGLang's
            # continue_final_message; a completion's prompt + its text), for what is left of it.
            text = ex.text.getvalue()
            if ex.kind == "chat":
                body["messages"] = [*body["messages"], {"role": "assistant", "content": text}]
                body["continue_final_message"], body["add_generation_prompt"] = True, False
            else:
                body["prompt"] = body["prompt"] + text
            for k in ("max_tokens", "max_completion_tokens"):
                if isinstance(body.get(k), int):
                    body[k] = max(body[k] - ex.resumed, 1)
        return body

    async def open(self, ex: Exchange) -> None:
        """Send `ex` to its ticket's replica, retrying elsewhere on a connect error or 5xx; keeps
        `ex.ticket` (the slot held) and `ex.resp` (the open response) current for cleanup."""
        client = self.fleet.client
        assert client is not None and ex.ticket is not None
        attempt = 0
        timeout = self.stream_timeout if ex.stream else self.answer_timeout
        while True:
            b = self.fleet.by_rid[ex.ticket.replica]  # type: ignore[index]
            body = self.body(b, ex)
            content = await asyncio.to_thread(json.dumps, body) if ex.big else json.dumps(body)
            try:
                async with asyncio.timeout(None) as cm:
                    b.waiting.add(cm)
                    try:
                        resp = await client.post(b.cfg.url + PATHS[ex.upstream_kind or ex.kind], data=content, timeout=timeout,
                                                 headers={"content-type": "application/json", **b.headers})
                    finally:
                        b.waiting.discard(cm)
                if resp.status >= 500:
                    text = (await resp.read())[:200].decode("utf-8", "replace")
                    resp.release()
                    raise _Retryable(f"{b.name} answered {resp.status}: {text}")
                ex.resp = resp
                return
            except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, TimeoutError, _Retryable) as e:
                if isinstance(e, aiohttp.ClientConnectionError | TimeoutError):
                    self.fleet.mark_unhealthy(b)  # refused, dropped or silent: the retry goes elsewhere
                t, ex.ticket = ex.ticket, None
                ex.adm.release(t, completed=False)
                attempt += 1
                self.metrics.retries.labels(b.name).inc()
                log.warning("upstream attempt %d on %s failed: %s", attempt, b.name, e)
                if attempt > self.cfg.retries:
                    raise APIError(502, f"all upstream attempts failed; last: {e!s}") from None
                await self._wait_again(ex, t)

    @staticmethod
    async def _wait_again(ex: Exchange, t: Ticket) -> None:
        """`t` gave its slot back: wait in the queue for another replica (at least a second)."""
        t.req.dispatched_at = None
        ex.ticket = await ex.adm.acquire(t.req, max(ex.res.waiting_s, 1.0))

    async def events(self, ex: Exchange) -> AsyncIterator[Event]:
        """The replica's events with what they carry, keeping the client alive while the first
        token is slow. If the replica fails before the first token (the client has had headers
        and keep-alives, no content), the request moves to another replica and goes on there.
        One generator (no per-event layers): it runs once per token of every stream."""
        moves = 0
        while True:
            try:
                async for item in self._read(ex):
                    yield item
                return
            except Preempted:
                t = ex.ticket
                assert t is not None and ex.resp is not None
                b = self.fleet.by_rid[t.replica]  # type: ignore[index]
                ex.resp.close()  # the engine aborts the sequence and frees its KV
                ex.ticket = None
                self.metrics.preemptions.labels(b.name).inc()
                log.info("stream on %s preempted after %d tokens: it waits and continues", b.name, t.req.generated)
                ex.resumed = t.req.generated
                ex.adm.requeue(t)
                await self._wait_again(ex, t)
                # What the next replica prefills again: the prompt and the answer so far, less what
                # the gateway expects its prefix cache to hold (all but the tail where it ran).
                self.metrics.recompute.inc(max(t.req.context_tokens - t.req.cached, 0))
                await self.open(ex)
            except (aiohttp.ClientError, TimeoutError, ValueError) as e:
                t = ex.ticket
                if t is None or moves >= self.cfg.retries:
                    raise
                b = self.fleet.by_rid[t.replica]  # type: ignore[index]
                mid = t.req.generated > 0
                if mid and (ex.text is None or b.cfg.kind == "openai" or not any(v.healthy for v in ex.adm.views if v is not b.view)):
                    raise  # nothing to continue from, an API without continue_final_message, or nowhere to go
                moves += 1
                ex.resp.close()  # type: ignore[union-attr]
                self.fleet.mark_unhealthy(b)
                self.metrics.retries.labels(b.name).inc()
                ex.ticket = None
                if mid:
                    # The client has part of the answer: the rest comes from another replica,
                    # continued from the text so far; the client sees a longer gap, not an error.
                    log.warning("stream on %s failed after %d tokens (%s): continuing it elsewhere", b.name, t.req.generated, e)
                    self.metrics.resumes.labels(b.name).inc()
                    ex.resumed = t.req.generated
                    ex.adm.requeue(t)
                else:
                    log.warning("stream on %s failed before its first token (%s): moving it", b.name, e)
                    ex.adm.release(t, completed=False)
                await self._wait_again(ex, t)
                await self.open(ex)

    async def _read(self, ex: Exchange) -> AsyncIterator[Event]:
        resp, t, adm = ex.resp, ex.ticket, ex.adm
        assert resp is not None and t is not None
        b = self.fleet.by_rid[t.replica]  # type: ignore[index]
        view, learner, content = b.view, b.learner, resp.content
        offset = ex.resumed  # tokens earlier attempts made: this replica's counts start after them
        ids, cont = ex.ids, ex.upstream_kind is not None  # continued from token ids (gateway/resume.py)
        if ids is not None and len(ids) != offset:
            ids = ex.ids = None  # an attempt without ids (another engine kind) broke the count: text from here on
        sp = EventSplitter()
        first = True
        while True:
            if first:
                # Until the first token, read in slices and send keep-alive comments. `readany` is
                # safe to cancel (the bytes stay buffered), and `asyncio.timeout` spawns no task.
                try:
                    async with asyncio.timeout(self.cfg.keepalive_s) as quiet:
                        chunk = await content.readany()
                except TimeoutError:
                    if not quiet.expired():
                        raise  # the replica's own idle timeout (aiohttp's): a stalled stream, not a pause
                    yield KEEPALIVE, None, time.monotonic()
                    continue
            else:
                # At most READ_MAX at a time: what a stalled reader's stream holds in parsed events
                # is bounded by it, not by how much the engine made meanwhile (~1,000 events, 0.4 MB,
                # in one `readany` of a fast engine's burst).
                chunk = await content.read(READ_MAX)
            events = sp.feed(chunk) if chunk else sp.rest()
            now = time.monotonic()
            for ev in events:
                if isinstance(content.exception(), Preempted):
                    # Preempted while this read's events go out one by one: the rest of them are
                    # made again by the continuation, so none is counted or sent twice (otherwise a
                    # stream preempted before its last token and resumed after it asks for one more).
                    raise Preempted()
                info = inspect(ev)
                drop, whole = 0, bool(info.text)
                if ex.again and info.text:
                    # What the continuation makes again of text the client has (see `body`).
                    drop = min(len(ex.again), len(info.text))
                    ex.again, info.text = ex.again[drop:], info.text[drop:]
                if info.usage_out is not None:
                    if offset:
                        info.usage_out += offset
                        info.usage_in = ex.prompt_tokens or info.usage_in
                        ev = _with_usage(ev, info)  # the client sees one answer's counts
                    elif info.usage_in:
                        ex.prompt_tokens = info.usage_in
                if info.usage_out is not None and not info.usage_only:
                    # Several tokens in one chunk (see `body`), or none new: a continuation making
                    # again the tokens after its last whole character.
                    info.tokens = max(info.usage_out - t.req.generated, 0)
                elif ids is not None and info.ids is not None:
                    # The same from the chunk's token ids (the ids so far may have been cut back to
                    # a continuation's start, whose tokens it makes again: those are not new).
                    info.tokens = max(len(ids) + len(info.ids) - t.req.generated, 0)
                if ex.text is not None and (info.tokens or info.text):
                    # (text without new tokens: what a continuation makes again of a character
                    # the engine had held back; see `body`)
                    if info.opaque:
                        ex.text = None
                    else:
                        ex.text.write(info.text)
                if info.tokens:
                    n, kv, before = view.n_decode, view.decode_kv, t.req.last_token_at
                    gap = adm.tokens(t, info.tokens, now)
                    if gap is None:
                        first = False
                        if offset and before is not None:
                            self.metrics.resume_gap.observe(now - before)
                        if ex.text is not None and b.cfg.kind != "openai":
                            t.preempt = partial(content.set_exception, Preempted())  # resumable from here on
                            t.req.preemptible = True
                    elif n:
                        # Measured decode speed corrects the replica's latency model online (β).
                        view.model.observe(gap, view.model.raw_decode_step_time(n, kv // n * n))
                        if learner is not None:
                            # Everything the engine runs shares the step: streams yet to see a first
                            # token and non-streamed answers too, not just the decoding streams.
                            learner.observe(view.inflight + int(b.external + 0.5), gap, view.decode_only(now, gap))
                if info.finished and t.preempt is not None:
                    t.preempt, t.req.preemptible = None, False  # a whole answer: a resume would add to it
                if ids is not None:
                    if info.prompt_ids is not None and ex.prompt_ids is None:
                        ex.prompt_ids, ex.head = info.prompt_ids, info.head
                    if info.ids:
                        ids.extend(info.ids)
                        b.gives_ids = True  # from its next request on, no running usage in every chunk
                        if whole and len(info.ids) == 1 and ex.text is not None:
                            # One token whose step made text: nothing held back, a continuation
                            # may start here. (A chunk of several, merged by a busy engine, may
                            # end in a token held back as part of a character: not known.)
                            ex.ids_whole, ex.text_whole = len(ids), ex.text.n
                    if cont:
                        ev = continued(ev, ex, drop)
                    if ex.hide_ids and (info.ids is not None or info.prompt_ids is not None):
                        ev = hide_ids(ev)
                    info.ids = info.prompt_ids = None  # kept in `ex`; the event may wait in a slow client's buffer
                yield ev, info, now
            if not chunk:
                return
