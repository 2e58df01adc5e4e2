"""The live gateway: FastAPI app driving the decision core (`router/`) and predictors.

Upstream HTTP is aiohttp: httpx/httpcore 1.0's connection pool rescans every connection for
every idle one on each request (quadratic; 4.4 ms per request at 100 streams, measured) and
parses responses in pure Python (h11); aiohttp's pool is per host and its parser is C.

Request path: read and validate the body (size limit, JSON, OpenAI shape) → resolve SLO /
tier / workflow (`gateway.slo`) → wait in the admission queue (`gateway.admission`) until the
ordering and placement policies give it a replica → open the upstream request (retrying on
another replica on a connect error or a 5xx before the first byte) → stream the engine's
events through unchanged (paced for latency streams), counting tokens and their times for
goodput, the replica's view and the length predictor → release the slot and settle metrics.
A client that disconnects — while queued, while waiting for the upstream, or mid-stream —
closes the upstream request and frees the slot at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import re
import time
import uuid
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from slogate.gateway.admission import Admission, Ticket
from slogate.gateway.auth import Authenticator
from slogate.gateway.config import BackendConfig, GatewayConfig
from slogate.gateway.errors import APIError, as_openai_error, error_body
from slogate.gateway.metrics import Metrics
from slogate.gateway.pacing import Pacer, paced
from slogate.gateway.schema import PATHS, POOLING, openapi, validate_body
from slogate.gateway.slo import Resolved, WorkflowRegistry, resolve
from slogate.gateway.sse import KEEPALIVE, USAGE_FIELD, EventInfo, EventSplitter, error_event, inspect
from slogate.gateway.state.base import Entry, SlotStore, StateUnavailable
from slogate.gateway.state.memory import MemoryStore
from slogate.gateway.state.redis import RedisStore
from slogate.predictors.features import prompt_from_body
from slogate.predictors.online import OnlineLengthPredictor
from slogate.router.capacity import CapacityLearner, learned_budget
from slogate.router.goodput import RequestLedger
from slogate.router.latency import PROFILES, BatchLatencyModel
from slogate.router.lifecycle import call_goodput
from slogate.router.prefix import PrefixCache, text_block_hashes
from slogate.router.registry import make_ordering, make_placement
from slogate.router.request import Request as CoreRequest
from slogate.router.request import SLOClass
from slogate.router.scheduler import Scheduler
from slogate.router.view import ReplicaView

log = logging.getLogger("slogate.gateway")

JSON_IN_THREAD = 256 * 1024  # bodies larger than this are parsed / encoded off the event loop
HASH_IN_THREAD = 64 * 1024  # prompts longer than this (characters) are cut into prefix blocks off the loop (~0.15 ms)


@dataclass(eq=False)
class Backend:
    cfg: BackendConfig
    view: ReplicaView
    name: str
    models: set[str] = field(default_factory=set)
    # Attempts waiting for this replica's response headers: cut at once when its health check
    # fails, so a hung (half-open, stopped) replica's requests move elsewhere in seconds.
    waiting: set[asyncio.Timeout] = field(default_factory=set)
    learner: CapacityLearner | None = None
    external: float = 0.0  # requests the engine holds that no gateway sent (from its /metrics)
    kv_usage: float | None = None


KV_FULL = 0.97  # vLLM's KV-cache use at which no more requests are sent there


_CACHE_INFO = re.compile(r'(block_size|num_gpu_blocks)="(\d+)"')


def _engine_gauges(text: str) -> tuple[float | None, float | None, tuple[int, int] | None]:
    """(running + waiting, KV-cache use, (KV-cache size in tokens, block size)) from vLLM's
    Prometheus text, summed over its models."""
    held: float | None = None
    kv: float | None = None
    size: tuple[int, int] | None = None
    for line in text.splitlines():
        if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting")):
            held = (held or 0.0) + float(line.rsplit(" ", 1)[1])
        elif line.startswith(("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")):
            kv = max(kv or 0.0, float(line.rsplit(" ", 1)[1]))
        elif line.startswith("vllm:cache_config_info{"):
            info = dict(_CACHE_INFO.findall(line))
            if "block_size" in info and "num_gpu_blocks" in info:
                size = int(info["block_size"]) * int(info["num_gpu_blocks"]), int(info["block_size"])
    return held, kv, size


class _Retryable(Exception):
    pass


@dataclass
class _Attempt:
    """The upstream attempt a stream is reading now (a retry before the first token replaces it)."""

    ticket: Ticket | None
    resp: aiohttp.ClientResponse
    freed: Ticket | None = None  # the ticket whose slot went back when the engine finished (paced streams)


Reopen = Callable[[Ticket, dict[str, Any]], Awaitable[tuple[aiohttp.ClientResponse, Ticket]]]


class Gateway:
    def __init__(self, cfg: GatewayConfig, predictor: OnlineLengthPredictor | None = None) -> None:
        if not cfg.backends:
            raise ValueError("the gateway needs at least one backend")
        self.cfg = cfg
        self.metrics = Metrics()
        self.workflows = WorkflowRegistry()
        coeffs = PROFILES[cfg.policies.profile]
        self.backends = [Backend(b, ReplicaView(i, BatchLatencyModel(coeffs), budget=b.budget), b.name or b.url, set(b.models),
                                 learner=CapacityLearner(b.budget, margin=cfg.capacity.margin) if cfg.capacity.learn else None)
                         for i, b in enumerate(cfg.backends)]
        pc = cfg.prefix
        self.prefix_chars = pc.block_chars if pc.enabled else 0
        if pc.enabled:
            for b in self.backends:
                b.view.cache = PrefixCache(self._cache_blocks(b.cfg.kv_cache_tokens or pc.kv_tokens))
        self.predictor = predictor
        self.groups: dict[str, Admission] = {}
        self.client: aiohttp.ClientSession | None = None
        self._tasks: list[asyncio.Task[None]] = []
        sc = cfg.state
        self.instance = uuid.uuid4().hex[:12]
        self.store: SlotStore = RedisStore(sc.url, sc.prefix, sc.timeout_s) if sc.kind == "redis" else MemoryStore()
        self.degraded = False
        self.n_gateways = 1
        self._pending_release: set[tuple[str, str]] = set()
        self._grace_until = 0.0
        self._ready_syncs = 0
        self._n_at_outage = 1
        self._outage_at = 0.0
        self._remote_at_outage: dict[int, int] = {}
        self.auth = Authenticator(cfg.auth, self.store)
        self._bg: set[asyncio.Task[None]] = set()

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        total = sum(b.cfg.budget for b in self.backends)
        self._answer_timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.cfg.connect_timeout_s, sock_read=self.cfg.first_byte_timeout_s)
        self._stream_timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.cfg.connect_timeout_s,
                                                     sock_read=self.cfg.stream_idle_timeout_s)
        self.client = aiohttp.ClientSession(
            # Idle upstream connections are dropped after 4 s, before vLLM's uvicorn drops them (5 s):
            # reusing one the engine is closing fails the request, and a retry could briefly put
            # one request too many on a replica that already had it.
            connector=aiohttp.TCPConnector(limit=total + 64, limit_per_host=0, keepalive_timeout=4),
            timeout=self._answer_timeout, auto_decompress=False)
        await asyncio.gather(*(self._check(b, discover=True) for b in self.backends))
        self._update_budgets()
        self._rebuild_groups()
        for adm in self.groups.values():
            adm.start()
        self._tasks.append(asyncio.get_running_loop().create_task(self._health_loop()))
        if self.store.kind != "memory":
            await self._sync()
            self._tasks.append(asyncio.get_running_loop().create_task(self._sync_loop()))

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await t
        for adm in self.groups.values():
            await adm.stop()
        if self.client is not None:
            await self.client.close()
        if self._bg:
            await asyncio.gather(*self._bg, return_exceptions=True)
        await self.store.close()
        if self.predictor is not None:
            self.predictor.close()

    def _rebuild_groups(self) -> None:
        models = sorted({m for b in self.backends for m in b.models})
        for m in models:
            if m in self.groups:
                continue
            p = self.cfg.policies
            try:
                ordering = make_ordering(p.ordering, seed=p.seed, **p.params)
            except TypeError as e:
                raise ValueError(f"policies.params do not fit ordering {p.ordering!r}: {e}") from None
            sched = Scheduler(ordering, make_placement(p.placement, seed=p.seed))
            views = [b.view for b in self.backends if m in b.models]
            adm = Admission(sched, views, max_queue=self.cfg.max_queue, frame_s=p.frame_s, predictor=self.predictor,
                            refine_every=self.cfg.predictor.refine_every)
            adm.on_refused = lambda t, reason, m=m: self.metrics.shed.labels(m, reason).inc()
            adm.on_decision = self.metrics.decision.observe
            adm.confirm = self._confirm
            adm.on_release = self._released
            adm.on_first_token = self._first_token
            self.groups[m] = adm
            with contextlib.suppress(RuntimeError):
                adm.start()

    async def _check(self, b: Backend, discover: bool = False) -> None:
        assert self.client is not None
        try:
            async with self.client.get(f"{b.cfg.url}/v1/models", timeout=aiohttp.ClientTimeout(total=1.5), headers=self._auth(b)) as r:
                ok = r.status == 200
                if ok and (discover or not b.models) and not b.cfg.models:
                    data = (await r.json(content_type=None)).get("data", [])
                    b.models = {m["id"] for m in data if isinstance(m, dict) and "id" in m}
        except (aiohttp.ClientError, TimeoutError, ValueError, AttributeError):
            ok = False
        if ok != b.view.healthy:
            log.warning("backend %s is now %s", b.name, "healthy" if ok else "UNHEALTHY")
        if not ok:
            self._cut_waiting(b)
        b.view.healthy = ok
        self.metrics.healthy.labels(b.name).set(1 if ok else 0)
        if ok and self.cfg.capacity.engine_metrics and b.cfg.kind == "vllm":
            await self._engine_load(b)

    async def _engine_load(self, b: Backend) -> None:
        """What vLLM itself reports: requests beyond ours (other clients) and KV-cache use."""
        assert self.client is not None
        try:
            async with self.client.get(f"{b.cfg.url}/metrics", timeout=aiohttp.ClientTimeout(total=1.5), headers=self._auth(b)) as r:
                if r.status != 200:
                    return
                text = await r.text()
        except (aiohttp.ClientError, TimeoutError, UnicodeDecodeError):
            return
        held, kv, size = _engine_gauges(text)
        if size and b.view.cache is not None:
            if b.cfg.kv_cache_tokens is None:
                b.view.cache.capacity = self._cache_blocks(size[0])
            b.view.kv_block = size[1]
        if held is not None:
            now_ext = max(0.0, held - b.view.inflight)
            b.external = 0.5 * b.external + 0.5 * now_ext  # smoothed: our counts and its scrape are not simultaneous
        b.kv_usage = kv

    def _update_budgets(self) -> None:
        """Each replica's budget: the learned SLO-safe concurrency (capped by the configured
        budget), less what other clients run there; none while its KV cache is full."""
        now = time.monotonic()
        for b in self.backends:
            v = b.view
            ext = int(b.external + 0.5)
            learned = b.cfg.budget
            if b.learner is not None:
                learned = learned_budget(b.learner, v, now, ext)
                if log.isEnabledFor(logging.DEBUG):
                    lr = b.learner
                    log.debug("budget %s: %d (holds %d + %d external; decode line %s, prefill %.4f s/stream, pace %s)",
                              b.name, learned, v.inflight, ext, lr.fit, lr.stall, lr.pace)
            budget = max(1, learned - ext)
            if b.kv_usage is not None and b.kv_usage >= KV_FULL:
                budget = max(1, min(budget, v.inflight))
            v.budget = budget
            self.metrics.budget.labels(b.name).set(budget)
            self.metrics.external.labels(b.name).set(round(b.external, 2))

    def _cut_waiting(self, b: Backend) -> None:
        """Nothing has reached the clients of requests still waiting for this replica's headers:
        end their wait now (a TimeoutError in `_open`, which retries them elsewhere)."""
        if b.waiting:
            now = asyncio.get_running_loop().time()
            for cm in list(b.waiting):
                if cm.expired() is False:
                    cm.reschedule(now)
            log.warning("backend %s: %d waiting request(s) moved to other replicas", b.name, len(b.waiting))

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.health_interval_s)
            await asyncio.gather(*(self._check(b) for b in self.backends), return_exceptions=True)
            self._update_budgets()
            self._rebuild_groups()
            self.refresh_gauges()
            self.workflows.expire(time.monotonic())

    def refresh_gauges(self) -> None:
        for b in self.backends:
            self.metrics.inflight.labels(b.name).set(b.view.inflight)
        for m, adm in self.groups.items():
            self.metrics.queue_depth.labels(m).set(len(adm.waiting))

    # ------------------------------------------------------------------ shared state
    def _key(self, rid: int) -> str:
        return self.backends[rid].cfg.url  # the same replica is the same key in every gateway

    def _entry_id(self, t: Ticket) -> str:
        return f"{self.instance}:{t.req.rid}"

    async def _confirm(self, t: Ticket) -> bool:
        """Claim the slot the local decision took, atomically across gateways."""
        assert t.replica is not None
        if self.degraded:
            return True  # no per-request timeouts while the store is down; the sync loop probes it
        e = Entry(self._entry_id(t), self.instance, "prefill", t.req.input_tokens, t.req.len_bound, 0.0)
        view = self.backends[t.replica].view
        try:
            return await self.store.claim(self._key(t.replica), e, view.budget, self.cfg.state.lease_s)
        except StateUnavailable as err:
            # The decision was made before the store went away; re-judge it within the local share.
            self._degrade(err)
            return view.inflight <= view.budget

    def _background(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)

    def _released(self, t: Ticket) -> None:
        if t.replica is None:
            return
        if self.degraded:
            self._pending_release.add((self._key(t.replica), self._entry_id(t)))  # applied when the store is back
        else:
            self._background(self._store_call(self.store.release(self._key(t.replica), self._entry_id(t))))

    def _first_token(self, t: Ticket) -> None:
        if t.replica is not None and self.store.kind != "memory" and not self.degraded:
            self._background(self._store_call(self.store.update(self._key(t.replica), self._entry_id(t), "decode", t.req.len_bound)))

    async def _store_call(self, coro: Any) -> None:
        try:
            await coro
        except StateUnavailable as err:
            self._degrade(err)  # the lease expires the entry if the release never lands

    def _degrade(self, err: Exception) -> None:
        if not self.degraded:
            log.warning("shared state unavailable (%s): serving on local state within 1/%d of each budget", err, self.n_gateways)
            self.degraded = True
            self.metrics.state_degraded.set(1)
            if time.monotonic() >= self._grace_until:
                self._n_at_outage = self.n_gateways
                # Our last snapshot may miss the others' latest claims: assume they hold everything we
                # did not, so at first we only replace our own finished requests.
                self._outage_at = time.monotonic()
                self._remote_at_outage = {b.view.rid: b.view.budget - b.view.local_inflight for b in self.backends}
        self._degrade_share()

    def _degrade_share(self) -> None:
        """Phantom remote load: only this gateway's share of each budget stays free, and whatever
        the other gateways may have had in flight when the store went away still counts, fading out
        over one lease — the time a claim lives without renewal (an even share alone would let a
        gateway with little in flight overfill a replica that the others had nearly filled)."""
        fade = max(0.0, 1.0 - (time.monotonic() - self._outage_at) / self.cfg.state.lease_s)
        for b in self.backends:
            share = max(b.view.budget // max(self.n_gateways, 1), 1)
            remembered = math.ceil(self._remote_at_outage.get(b.view.rid, 0) * fade)
            b.view.set_remote(max(b.view.budget - share, remembered), 0, 0, 0.0)

    def _running(self) -> list[Ticket]:
        """This gateway's requests that hold a replica slot now."""
        return [t for adm in self.groups.values() for t in adm.running.values() if t.replica is not None]

    async def _sync(self) -> None:
        """Read every replica's in-flight entries; other gateways' become remote load in our views."""
        keys = [b.cfg.url for b in self.backends]
        try:
            n = await self.store.heartbeat(self.instance, max(3 * self.cfg.state.sync_s, 2.0))
            # A restarted Redis has forgotten the other gateways until they heartbeat again: while
            # recovering, never let the count (and with it our share of each budget) grow.
            self.n_gateways = max(n, self.n_gateways) if (self.degraded or time.monotonic() < self._grace_until) else n
            mine: dict[str, list[str]] = {}
            for t in self._running():
                mine.setdefault(self._key(t.replica), []).append(self._entry_id(t))  # type: ignore[arg-type]
            for key, eid in list(self._pending_release):  # releases that happened while it was down
                await self.store.release(key, eid)
                self._pending_release.discard((key, eid))
            if self.degraded:  # Redis is back: put our in-flight requests back before counting
                for t in self._running():  # read after the awaits above: requests started meanwhile count too
                    e = Entry(self._entry_id(t), self.instance, "decode" if t.req.generated else "prefill",
                              t.req.input_tokens, t.req.len_bound, 0.0)
                    await self.store.claim(self._key(t.replica), e, 1 << 30, self.cfg.state.lease_s)  # type: ignore[arg-type]
            for key, ids in mine.items():
                await self.store.renew(key, ids, self.cfg.state.lease_s)
            snap = await self.store.snapshot(keys)
        except StateUnavailable as err:
            self._degrade(err)
            return
        now = time.monotonic()
        if self.degraded:
            # Redis is back, empty if it restarted. Other gateways re-register their in-flight
            # requests on their next sync: until they all have, trusting the store would let this
            # gateway fill budgets they are still using, so keep the local share a little longer.
            log.warning("shared state is back; reconciling")
            self.degraded = False
            self._grace_until = now + 5.0  # at most: a gateway that never comes back must not hold us
            self._ready_syncs = 0
        if now < self._grace_until:
            # Leave the local share once every gateway known before the outage has heartbeaten again
            # and one more sync has passed (each re-registers its requests in the same sync).
            self._ready_syncs = self._ready_syncs + 1 if n >= self._n_at_outage else 0
            if self._ready_syncs < 3:
                self._degrade_share()
                return
            self._grace_until = 0.0
        self.metrics.state_degraded.set(0)
        for b in self.backends:
            others = [e for e in snap.get(b.cfg.url, []) if e.owner != self.instance]
            pre = [e for e in others if e.phase == "prefill"]
            dec = [e for e in others if e.phase == "decode"]
            b.view.set_remote(len(pre), len(dec), sum(e.input_tokens for e in dec),
                              sum(b.view.model.raw_prefill(e.input_tokens) for e in pre))
        self.metrics.gateways.set(self.n_gateways)

    async def _sync_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.state.sync_s)
            try:
                await self._sync()
            except Exception:
                log.exception("state sync failed")

    def _cache_blocks(self, kv_tokens: int) -> int:
        """A KV cache of `kv_tokens` in prompt blocks (4 characters a token)."""
        return max(int(kv_tokens * 4 // max(self.cfg.prefix.block_chars, 1)), 1)

    @staticmethod
    def _auth(b: Backend) -> dict[str, str]:
        return {"authorization": f"Bearer {b.cfg.api_key}"} if b.cfg.api_key else {}

    # ------------------------------------------------------------------ the request path
    async def handle(self, kind: str, request: Request) -> Response:
        t_recv = time.perf_counter()
        key = self.auth.identify(request.headers)  # 401 before the body is even read
        body, body_size = await self._read_json(request)
        pooling = kind in POOLING
        validate_body(kind, body)
        if body.get("model") is None:  # /tokenize and /detokenize may leave it out, as vLLM's do
            if len(self.groups) != 1:
                raise APIError(400, "model: required when the gateway serves several models", param="model")
            body["model"] = next(iter(self.groups))
        model = body["model"]
        self.auth.check_model(key, model)
        adm = self.groups.get(model)
        if adm is None:
            raise APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")
        now = time.monotonic()
        res = resolve(body, request.headers, self.cfg, self.workflows, now, key)
        # Embeddings and the like: no answer to predict, one unit of output; the body's size
        # estimates what the engine reads.
        prompt = None if pooling else prompt_from_body(body)
        n_in = max(body_size // 4, 1) if prompt is None else max(len(prompt.text) // 4, 1)
        max_tokens = 1 if prompt is None else prompt.max_tokens
        await self.auth.check_rate(key, n_in + (max_tokens or 256))
        req = CoreRequest(adm.new_rid(), now, n_in, res.slo, tier=res.tier, tenant=key.tenant if key else res.tier.name,
                          max_tokens=max_tokens, workflow=res.workflow, stage=res.stage)
        if prompt is None:
            req.len_bound = req.len_mean = 1.0
        elif self.prefix_chars and len(prompt.text) >= self.prefix_chars:
            if len(prompt.text) > HASH_IN_THREAD:  # ~20 µs per 64 blocks: a long context is hashed off the loop
                req.prefix = await asyncio.to_thread(text_block_hashes, prompt.text, self.prefix_chars)
            else:
                req.prefix = text_block_hashes(prompt.text, self.prefix_chars)
            req.tokens_per_block = self.prefix_chars * n_in / len(prompt.text)
            sess = request.headers.get("x-session-id") or body.get("user")
            if isinstance(sess, str) and sess:
                req.session = zlib.crc32(sess.encode()) or 1
        labels = (model, res.tier.name, res.slo.kind.value)
        stream = bool(body.get("stream"))
        overhead = time.perf_counter() - t_recv
        # A client that leaves while its request waits (queue, upstream headers, a non-streamed
        # answer) cancels this handler: no per-step tasks on the hot path, one watcher.
        handler = asyncio.current_task()
        gone = False

        def on_disconnect(w: asyncio.Task[None]) -> None:
            nonlocal gone
            if not w.cancelled() and w.exception() is None and handler is not None:
                gone = True
                handler.cancel()

        watcher = asyncio.get_running_loop().create_task(_disconnected(request))
        watcher.add_done_callback(on_disconnect)
        st: dict[str, Any] = {}  # what to undo if the client leaves: the claimed ticket, the open response
        try:
            try:
                ticket = st["ticket"] = await adm.acquire(req, res.waiting_s, prompt)
            except APIError as e:
                outcome = "refused_429" if e.status == 429 else "refused_503" if e.status == 503 else "error"
                self.metrics.requests.labels(*labels, outcome).inc()
                raise
            self.metrics.queue_wait.labels(*labels).observe(time.monotonic() - now)
            first_bound = req.len_bound
            try:
                resp, ticket = await self._open(adm, ticket, kind, res, stream, body_size > JSON_IN_THREAD, st)
            except APIError:
                self.metrics.requests.labels(*labels, "failed").inc()
                raise
            self.metrics.overhead.observe(overhead)  # parse, validate, resolve: queue and upstream time excluded
            if ticket.replica is not None and prompt is not None:
                bname = self.backends[ticket.replica].name
                self.metrics.prompt_tokens.labels(bname).inc(req.input_tokens)
                if req.cached:
                    self.metrics.prefix_cached.labels(bname).inc(req.cached)
            if resp.status >= 400:  # the engine refused it (4xx): pass its answer on, in the OpenAI shape
                try:
                    content = as_openai_error(await resp.read(), resp.status)
                except (aiohttp.ClientError, TimeoutError):
                    content = json.dumps(error_body(f"upstream answered {resp.status}")).encode()
                resp.release()
                st.clear()
                adm.release(ticket, completed=False)
                self.metrics.requests.labels(*labels, "upstream_4xx").inc()
                return Response(content, status_code=resp.status, media_type="application/json")
            led = RequestLedger(req)
            if not stream:
                try:
                    content = await resp.read()
                except (aiohttp.ClientError, TimeoutError) as e:
                    resp.close()
                    st.clear()
                    adm.release(ticket, completed=False)
                    self.metrics.requests.labels(*labels, "failed").inc()
                    raise APIError(502, f"upstream failed while answering: {e!s}") from None
                resp.release()
                st.clear()
                n_out, n_in = _usage(content)
                t_end = time.monotonic()
                for _ in range(max(n_out, 1 if content else 0)):
                    led.on_token(t_end)
                adm.answered(ticket, n_out, t_end)
                self._settle(adm, ticket, led, labels, "completed", first_bound, n_in)
                return Response(content, status_code=resp.status, media_type="application/json")
        except asyncio.CancelledError:
            if not gone:
                raise
            handler.uncancel()  # type: ignore[union-attr]
            if "resp" in st:
                st["resp"].close()  # drops the connection: the engine aborts the request
            if "ticket" in st:
                adm.release(st["ticket"], completed=False)
            self.metrics.cancelled.labels(model).inc()
            self.metrics.requests.labels(*labels, "cancelled").inc()
            return Response(status_code=499)
        finally:
            watcher.remove_done_callback(on_disconnect)
            watcher.cancel()  # from here the StreamingResponse watches the client itself
        so = body.get("stream_options") or {}
        client_usage = (bool(so.get("include_usage")), bool(so.get("include_usage") and so.get("continuous_usage_stats")))
        big = body_size > JSON_IN_THREAD

        async def reopen(t: Ticket, st: dict[str, Any]) -> tuple[aiohttp.ClientResponse, Ticket]:
            return await self._open(adm, t, kind, res, stream, big, st)

        pacer = self._pacer(req, res)
        gen = self._relay(adm, ticket, resp, led, labels, client_usage, first_bound, reopen, res.waiting_s, pacer)
        return StreamingResponse(gen, media_type="text/event-stream", headers={"cache-control": "no-cache", "x-accel-buffering": "no"})

    async def _read_json(self, request: Request) -> tuple[dict[str, Any], int]:
        """The body as a JSON object, and its size in bytes."""
        limit = self.cfg.max_body_bytes
        cl = request.headers.get("content-length")
        if cl and cl.isdigit() and int(cl) > limit:
            raise APIError(413, f"request body exceeds {limit} bytes")
        chunks, size = [], 0
        try:
            async for c in request.stream():
                size += len(c)
                if size > limit:
                    raise APIError(413, f"request body exceeds {limit} bytes")
                chunks.append(c)
        except ClientDisconnect:
            raise APIError(499, "the client disconnected while sending the request body") from None
        raw = b"".join(chunks)
        try:
            body = await asyncio.to_thread(json.loads, raw) if len(raw) > JSON_IN_THREAD else json.loads(raw)
        except UnicodeDecodeError:
            raise APIError(400, "request body is not valid UTF-8") from None
        except (json.JSONDecodeError, RecursionError):
            raise APIError(400, "request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise APIError(400, "request body must be a JSON object")
        return body, len(raw)

    def _upstream_body(self, b: Backend, kind: str, res: Resolved, stream: bool) -> dict[str, Any]:
        body = dict(res.body)
        if b.cfg.kind != "openai":
            body.pop("service_tier", None)
        if b.cfg.priority_scheduling:
            # vLLM: lower runs first. The client's integer wins; else heavier tiers go first.
            body["priority"] = res.vllm_priority if res.vllm_priority is not None else -round(res.tier.weight * 10)
        else:
            body.pop("priority", None)
        if stream and kind != "responses":
            so = dict(body.get("stream_options") or {})
            so["include_usage"] = True  # exact token counts
            if b.cfg.kind != "openai":
                # The running count in every chunk: an engine sends no chunk for a token that
                # detokenizes to nothing (part of a character), so one chunk can carry several
                # tokens, and the gaps the capacity learner measures must be per token.
                so["continuous_usage_stats"] = True
            body["stream_options"] = so
        return body

    async def _open(self, adm: Admission, ticket: Ticket, kind: str, res: Resolved, stream: bool,
                    big: bool, st: dict[str, Any]) -> tuple[aiohttp.ClientResponse, Ticket]:
        """Send upstream, retrying elsewhere on a connect error or 5xx; keeps `st` (the ticket
        holding a slot, the open response) current for the caller's cleanup."""
        assert self.client is not None
        attempt = 0
        # A stream's headers come at once and its chunks keep coming: a silence longer than
        # stream_idle_timeout_s is a stalled replica. A whole (non-streamed) answer may take long.
        timeout = self._stream_timeout if stream else self._answer_timeout
        while True:
            b = self.backends[ticket.replica]  # type: ignore[index]
            body = self._upstream_body(b, kind, res, stream)
            content = await asyncio.to_thread(json.dumps, body) if big else json.dumps(body)
            try:
                async with asyncio.timeout(None) as cm:
                    b.waiting.add(cm)
                    try:
                        resp = await self.client.post(b.cfg.url + PATHS[kind], data=content, timeout=timeout,
                                                      headers={"content-type": "application/json", **self._auth(b)})
                    finally:
                        b.waiting.discard(cm)
                if resp.status >= 500:
                    text = (await resp.read())[:200].decode("utf-8", "replace")
                    resp.release()
                    raise _Retryable(f"{b.name} answered {resp.status}: {text}")
                st["resp"] = resp
                return resp, ticket
            except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, TimeoutError, _Retryable) as e:
                if isinstance(e, aiohttp.ClientConnectionError | TimeoutError):
                    # Refused, dropped or silent: out until its health check answers again (one
                    # period), so the retry goes to another replica.
                    b.view.healthy = False
                    self.metrics.healthy.labels(b.name).set(0)
                adm.release(ticket, completed=False)
                st.pop("ticket", None)
                attempt += 1
                self.metrics.retries.labels(b.name).inc()
                log.warning("upstream attempt %d on %s failed: %s", attempt, b.name, e)
                if attempt > self.cfg.retries:
                    raise APIError(502, f"all upstream attempts failed; last: {e!s}") from None
                ticket.req.dispatched_at = None
                ticket = st["ticket"] = await adm.acquire(ticket.req, max(res.waiting_s, 1.0))

    def _pacer(self, req: CoreRequest, res: Resolved) -> Pacer | None:
        """A smoothing buffer for a latency stream whose TBT someone chose (request, key, tier,
        model); one whose TBT is only the built-in default goes out as fast as the engine makes it."""
        pc = self.cfg.pacing
        if not pc.enabled or req.kind is not SLOClass.LATENCY or not req.slo.tbt_s:
            return None
        if res.sources.get("tbt_ms", "default") == "default" and not pc.default_slo:
            return None
        return Pacer(req.slo.tbt_s, ceiling=pc.ceiling, reserve_tbts=pc.reserve_tbts, build=pc.build)

    async def _relay(self, adm: Admission, t: Ticket, resp: aiohttp.ClientResponse, led: RequestLedger, labels: tuple[str, str, str],
                     client_usage: tuple[bool, bool], first_bound: float, reopen: Reopen | None = None,
                     waiting_s: float = 1.0, pacer: Pacer | None = None) -> AsyncIterator[bytes]:
        """`client_usage`: whether the client asked for the final usage chunk, and for usage in
        every chunk (which the gateway asks for itself and otherwise strips)."""
        req = t.req
        outcome = "completed"
        exact: int | None = None
        exact_in: int | None = None
        counted = 0
        cur = _Attempt(t, resp)
        engine_led = RequestLedger(req) if pacer is not None else None

        def engine_done(ok: bool) -> None:
            # The engine's stream ended while held tokens are still going out: its slot is free now.
            tk, cur.ticket = cur.ticket, None
            if tk is None:
                return
            assert engine_led is not None
            now = time.monotonic()
            for _ in range(req.generated - engine_led.tokens):  # tokens the last chunks carried at once
                engine_led.on_token(now)
            adm.release(tk, goodput=call_goodput(engine_led) if ok else 0.0, completed=ok)
            cur.freed = tk

        try:
            source = self._upstream_events(adm, cur, reopen, waiting_s)
            items: AsyncIterator[tuple[bytes, EventInfo | None]] = (
                paced(_triples(source, engine_led), pacer, on_end=engine_done) if pacer else _pairs(source))  # type: ignore[arg-type]
            async for ev, info in items:
                if info is not None:
                    if info.usage_out is not None:
                        exact = info.usage_out
                    if info.usage_in:
                        exact_in = info.usage_in
                    if info.usage_only and not client_usage[0]:
                        continue
                    if info.usage_out is not None and not info.usage_only and not client_usage[1]:
                        ev = USAGE_FIELD.sub(b"", ev)
                    if info.tokens:
                        now = time.monotonic()
                        for _ in range(info.tokens):
                            led.on_token(now)
                        counted += info.tokens
                yield ev
        except (aiohttp.ClientError, TimeoutError, ValueError) as e:
            outcome = "failed"
            log.warning("upstream stream broke after the first byte: %s", e)
            yield error_event(f"the upstream stream failed: {e!s}")
        except APIError as e:  # a retry before the first token found no replica
            outcome = "failed"
            yield error_event(e.message)
        except asyncio.CancelledError:
            outcome = "cancelled"
            self.metrics.cancelled.labels(labels[0]).inc()
            raise
        finally:
            # Closing (not releasing) drops the connection unless the answer was read to the end,
            # so an engine stops generating for a client that left. Synchronous: no await for
            # Starlette's cancellation to interrupt.
            if outcome == "completed" and cur.resp.content.at_eof():
                cur.resp.release()
            else:
                cur.resp.close()
            if exact is not None and exact > counted:  # several tokens per chunk: count the rest at the end
                now = time.monotonic()
                for _ in range(exact - counted):
                    led.on_token(now)
            if cur.ticket is not None:
                self._settle(adm, cur.ticket, led, labels, outcome, first_bound, exact_in)
            elif cur.freed is not None:  # the slot went back when the engine finished
                self._settle(adm, cur.freed, led, labels, outcome, first_bound, exact_in, released=True)
            else:  # released when a retry found no replica
                self.metrics.requests.labels(*labels, outcome).inc()

    async def _upstream_events(self, adm: Admission, cur: _Attempt, reopen: Reopen | None,
                               waiting_s: float) -> AsyncIterator[tuple[bytes, EventInfo | None, float]]:
        """The replica's events; if it fails before the first token (the client has had headers
        and keep-alives, no content), the request moves to another replica and goes on there."""
        moves = 0
        while True:
            try:
                async for item in self._inspected(cur.resp, adm, cur.ticket):  # type: ignore[arg-type]
                    yield item
                return
            except (aiohttp.ClientError, TimeoutError, ValueError) as e:
                t = cur.ticket
                if reopen is None or t is None or t.req.generated > 0 or moves >= self.cfg.retries:
                    raise
                moves += 1
                b = self.backends[t.replica]  # type: ignore[index]
                cur.resp.close()
                b.view.healthy = False  # until its health check answers again
                self.metrics.healthy.labels(b.name).set(0)
                self.metrics.retries.labels(b.name).inc()
                log.warning("stream on %s failed before its first token (%s): moving it", b.name, e)
                adm.release(t, completed=False)
                cur.ticket = None
                t.req.dispatched_at = None
                st: dict[str, Any] = {"ticket": await adm.acquire(t.req, max(waiting_s, 1.0))}
                try:
                    cur.resp, cur.ticket = await reopen(st["ticket"], st)
                except BaseException:
                    cur.ticket = st.get("ticket")  # what `_open` still holds (None once it gave up)
                    raise

    async def _inspected(self, resp: aiohttp.ClientResponse, adm: Admission, t: Ticket) -> AsyncIterator[tuple[bytes, EventInfo | None, float]]:
        """Upstream events with what they carry, keeping the client alive while the first token is slow."""
        sp = EventSplitter()
        first = True
        done = False
        while not done:
            if first:
                # Until the first token, read in slices and send keep-alive comments. `readany` is
                # safe to cancel (the bytes stay buffered), and `asyncio.timeout` spawns no task.
                try:
                    async with asyncio.timeout(self.cfg.keepalive_s) as quiet:
                        chunk = await resp.content.readany()
                except TimeoutError:
                    if not quiet.expired():
                        raise  # the replica's own idle timeout (aiohttp's): a stalled stream, not a pause
                    yield KEEPALIVE, None, time.monotonic()
                    continue
            else:
                chunk = await resp.content.readany()
            if chunk:
                events = sp.feed(chunk)
            else:
                events, done = sp.rest(), True
            for ev in events:
                info = inspect(ev)
                if info.usage_out is not None and not info.usage_only and info.usage_out > t.req.generated:
                    info.tokens = info.usage_out - t.req.generated  # several tokens in one chunk (see _upstream_body)
                if info.tokens:
                    b = self.backends[t.replica]  # type: ignore[index]
                    view = b.view
                    n, kv = view.n_decode, view.decode_kv
                    gap = adm.tokens(t, info.tokens, time.monotonic())
                    if gap is None:
                        first = False
                    elif n:
                        # Measured decode speed corrects the replica's latency model online (β).
                        view.model.observe(gap, view.model.raw_decode_step_time(n, kv // n * n))
                        if b.learner is not None:
                            # Everything the engine runs shares the step: streams yet to see a first
                            # token and non-streamed answers too, not just the decoding streams.
                            b.learner.observe(view.inflight + int(b.external + 0.5), gap)
                yield ev, info, time.monotonic()

    def _settle(self, adm: Admission, t: Ticket, led: RequestLedger, labels: tuple[str, str, str], outcome: str, first_bound: float,
                input_tokens: int | None = None, released: bool = False) -> None:
        req = t.req
        m = self.metrics
        if not released:
            adm.release(t, goodput=call_goodput(led), completed=outcome == "completed")
        if input_tokens:  # the engine's exact count replaces our estimate (after release: the view used the estimate)
            req.input_tokens = input_tokens
        gp = call_goodput(led)
        m.requests.labels(*labels, outcome).inc()
        m.tokens.labels(*labels, "input").inc(req.input_tokens)
        m.tokens.labels(*labels, "output").inc(led.tokens)
        if outcome != "completed":
            return
        m.token_goodput.labels(*labels).inc(gp)
        attained = led.attained() if req.kind is not SLOClass.COMPOUND else (led.last_at is not None and led.last_at <= req.deadline_at)
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
            m.pred_covered.labels(labels[0]).inc(int(req.generated <= first_bound))


async def _pairs(src: AsyncIterator[tuple[bytes, EventInfo | None, float]]) -> AsyncIterator[tuple[bytes, EventInfo | None]]:
    async for ev, info, _ in src:
        yield ev, info


async def _triples(src: AsyncIterator[tuple[bytes, EventInfo | None, float]],
                   engine_led: RequestLedger | None = None) -> AsyncIterator[tuple[tuple[bytes, EventInfo | None], int, float]]:
    """Events with their token counts and arrival times; `engine_led` records the engine's timeline."""
    async for ev, info, at in src:
        n = info.tokens if info else 0
        if engine_led is not None:
            for _ in range(n):
                engine_led.on_token(at)
        yield (ev, info), n, at


def _usage(content: bytes) -> tuple[int, int | None]:
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


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body has been read already)."""
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


def create_app(cfg: GatewayConfig, predictor: OnlineLengthPredictor | None = None) -> FastAPI:
    gw = Gateway(cfg, predictor)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        await gw.start()
        yield
        await gw.stop()

    app = FastAPI(title="slogate", lifespan=lifespan)
    app.state.gateway = gw

    @app.exception_handler(APIError)
    async def _api_error(_r: Request, e: APIError) -> JSONResponse:
        return e.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_r: Request, e: StarletteHTTPException) -> JSONResponse:
        """Routing errors (unknown path, wrong method) in the OpenAI shape too."""
        resp = APIError(e.status_code, str(e.detail)).response()
        resp.headers.update(e.headers or {})  # e.g. Allow on a 405 (RFC 9110)
        return resp

    @app.exception_handler(RequestValidationError)
    async def _validation(_r: Request, e: RequestValidationError) -> JSONResponse:
        return JSONResponse(error_body(str(e.errors()[:3])), status_code=400)

    @app.exception_handler(Exception)
    async def _unexpected(_r: Request, e: Exception) -> JSONResponse:
        log.exception("unexpected error")
        return JSONResponse(error_body("internal error in the gateway", "internal_error"), status_code=500)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(request: Request) -> Response:
        return await gw.handle("chat", request)

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> Response:
        return await gw.handle("completions", request)

    @app.post("/v1/responses", response_model=None)
    async def responses(request: Request) -> Response:
        return await gw.handle("responses", request)

    def route(kind: str) -> Any:
        async def endpoint(request: Request) -> Response:
            return await gw.handle(kind, request)
        return endpoint

    for kind in sorted(POOLING):  # vLLM's pooling and tokenizer endpoints, passed to a replica of the model
        app.add_api_route(PATHS[kind], route(kind), methods=["POST"], response_model=None, name=kind)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        data = [{"id": m, "object": "model", "created": 0, "owned_by": "slogate",
                 "backends": [b.name for b in gw.backends if m in b.models]} for m in sorted(gw.groups)]
        return {"object": "list", "data": data}

    @app.get("/admin/state")
    async def admin_state(request: Request) -> dict[str, Any]:
        gw.auth.require_admin(request.headers)
        return {"instance": gw.instance, "store": gw.store.kind, "degraded": gw.degraded, "gateways": gw.n_gateways,
                "replicas": [{"name": b.name, "healthy": b.view.healthy, "budget": b.view.budget, "inflight_here": b.view.local_inflight,
                              "inflight_remote": b.view.inflight - b.view.local_inflight,
                              "models": sorted(b.models), "beta": round(b.view.model.beta, 3)} for b in gw.backends],
                "queues": {m: len(a.waiting) for m, a in gw.groups.items()}}

    @app.get("/health")
    @app.get("/health/ready")
    async def health() -> JSONResponse:
        """Readiness: 200 while at least one backend is healthy (a load balancer should send traffic)."""
        healthy = [b.name for b in gw.backends if b.view.healthy]
        ok = bool(healthy)
        return JSONResponse({"status": "ok" if ok else "unavailable", "healthy_backends": len(healthy), "backends": len(gw.backends),
                             "state_degraded": gw.degraded}, status_code=200 if ok else 503)

    @app.get("/health/live")
    async def live() -> dict[str, str]:
        """Liveness: the event loop answers. Independent of backends, so an engine outage never
        makes an orchestrator restart every gateway."""
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> Response:
        gw.refresh_gauges()
        return Response(gw.metrics.render(), media_type="text/plain; version=0.0.4")

    def _openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = openapi(app)
        return app.openapi_schema

    app.openapi = _openapi  # type: ignore[method-assign]

    return app
