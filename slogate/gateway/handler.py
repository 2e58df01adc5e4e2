"""The gateway: one admission queue per model over the fleet, and a request's way through it.

Request path: read and validate the body (size limit, JSON, OpenAI shape) → resolve SLO / tier /
workflow (`slo.py`) → wait in the model's admission queue (`admission.py`) until the ordering and
placement policies give it a replica → open the upstream request (`upstream.py`, retrying on
another replica on a connect error or a 5xx before the first byte) → relay the engine's events
(`relay.py`, paced for latency streams), counting tokens and their times for goodput, the
replica's view and the length predictor → release the slot and settle metrics. A client that
disconnects — while queued, while waiting for the upstream, or mid-stream — closes the upstream
request and frees the slot at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
from fastapi import Request
from fastapi.responses import Response
from starlette.requests import ClientDisconnect

from slogate.gateway.admission import Admission, AdmissionHooks, Ticket
from slogate.gateway.auth import Authenticator
from slogate.gateway.config import RESTART_ONLY, GatewayConfig, KeyConfig
from slogate.gateway.discovery import Discovery
from slogate.gateway.errors import APIError, as_openai_error, error_body
from slogate.gateway.exchange import AnswerText, Disconnect, Exchange
from slogate.gateway.fleet import Backend, Fleet
from slogate.gateway.kv_events import KVEventFeeds
from slogate.gateway.metrics import Metrics
from slogate.gateway.pacing import Pacer
from slogate.gateway.relay import ClosingStreamingResponse, Relay, usage_of
from slogate.gateway.schema import POOLING, validate_body
from slogate.gateway.slo import Resolved, resolve
from slogate.gateway.statesync import StateSync
from slogate.gateway.tokenizer import PromptTokenizer
from slogate.gateway.upstream import Upstream, resumable
from slogate.gateway.workflows import WorkflowBook
from slogate.predictors.features import PromptInput, prompt_from_body
from slogate.predictors.online import OnlineLengthPredictor
from slogate.router.goodput import RequestLedger
from slogate.router.prefix import text_block_hashes, token_block_hashes
from slogate.router.registry import make_ordering, make_placement
from slogate.router.request import SLO, SLOClass
from slogate.router.request import Request as CoreRequest
from slogate.router.scheduler import Scheduler

log = logging.getLogger("slogate.gateway")

JSON_IN_THREAD = 256 * 1024  # bodies larger than this are parsed / encoded off the event loop
HASH_IN_THREAD = 64 * 1024  # prompts longer than this (characters) are cut into prefix blocks off the loop (~0.15 ms)
IDLE_QUICK_S = 0.5  # how often the quick-budget loop looks for a learner that wants it (a cut starts a probe)
STREAM_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


def _file_stamp(path: Path | None) -> tuple[int, int, int] | None:
    """What tells a changed file (a ConfigMap swaps a symlink: the inode changes too)."""
    try:
        st = os.stat(path) if path is not None else None
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size, st.st_ino) if st is not None else None


class _Hooks(AdmissionHooks):
    """A model's admission queue reports to the metrics and to the shared state."""

    def __init__(self, model: str, metrics: Metrics, state: StateSync, fleet: Fleet) -> None:
        self.model, self.metrics, self.state, self.fleet = model, metrics, state, fleet
        self.shared = state.shared

    async def confirm(self, t: Ticket) -> bool:
        return await self.state.confirm(t)

    def refused(self, t: Ticket, reason: str) -> None:
        self.metrics.shed.labels(self.model, reason).inc()
        self.fleet.refused += 1  # demand turned away: the learners' guard (CapacityLearner.price_by_arrivals)

    def decided(self, seconds: float) -> None:
        self.metrics.decision.observe(seconds)

    def released(self, t: Ticket) -> None:
        self.state.released(t)

    def first_token(self, t: Ticket) -> None:
        self.state.first_token(t)

    def absorbed(self, n: int) -> None:
        self.metrics.absorbed.labels(self.model).inc(n)


class Gateway:
    def __init__(self, cfg: GatewayConfig, predictor: OnlineLengthPredictor | None = None,
                 source: Callable[[], GatewayConfig] | None = None, watch: Path | None = None) -> None:
        """`source` re-reads the configuration (file, environment, flags) for a reload: on SIGHUP,
        on `POST /admin/reload`, and when the file `watch` changes."""
        self.cfg = cfg
        self.metrics = Metrics()
        self.workflows = WorkflowBook(cfg.workflows)
        self.fleet = Fleet(cfg, self.metrics)
        self.fleet.queued = lambda: sum(adm.queued() for adm in self.groups.values())
        self.backends = self.fleet.backends  # the same list: replicas join and leave in place
        self.discovery = Discovery(cfg.discovery)
        self.prefix_chars = cfg.prefix.block_chars if cfg.prefix.enabled else 0
        pc = cfg.prefix
        self.tokenizer = PromptTokenizer(pc.tokenizer, pc.token_cache) if pc.enabled and pc.tokenizer is not None else None
        if self.tokenizer is not None and self.tokenizer.cache is not None:
            self.tokenizer.cache.on_encoded = self._count_tokenized
        self.kv_feeds = KVEventFeeds(pc.block_tokens, pc.kv_events_topic, self.metrics)
        self.predictor = predictor
        self.groups: dict[str, Admission] = {}
        self._retired: list[Admission] = []  # queues of the policies before a reload: they finish their requests
        self.state = StateSync(cfg.state, self.fleet, self.metrics, self._running, share_prefixes=cfg.prefix.enabled and cfg.prefix.share)
        self.auth = Authenticator(cfg.auth, self.state.store)
        self.upstream = Upstream(cfg, self.fleet, self.metrics)
        self.relay = Relay(self.upstream, self.metrics)
        self.source, self.watch = source, watch
        self._stamp = _file_stamp(watch)
        self._members = asyncio.Lock()  # one membership change at a time (discovery, reload)
        self._tasks: list[asyncio.Task[None]] = []

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        self.fleet.open()
        await self._resolve()
        await self.fleet.check_all(discover=True)
        self._sync_groups()
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(self._health_loop()))
        self._tasks.append(loop.create_task(self._discovery_loop()))
        self._tasks.append(loop.create_task(self._quick_loop()))
        if self.tokenizer is not None:
            self.kv_feeds.sync(self.fleet.backends)
        if self.state.shared:
            await self.state.sync()
            self._tasks.append(loop.create_task(self.state.sync_loop()))
        if self.source is not None:
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):  # not the main thread, or no signals here
                loop.add_signal_handler(signal.SIGHUP, lambda: self._tasks.append(loop.create_task(self.reload_from_source("SIGHUP"))))

    async def stop(self) -> None:
        if self.source is not None:
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
        for t in self._tasks:
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await t
        await self.kv_feeds.close()
        for adm in [*self.groups.values(), *self._retired]:
            await adm.stop()
        await self.state.close()  # gives back what it still holds: uses the fleet's replicas
        await self.fleet.close()
        if self.predictor is not None:
            self.predictor.close()

    def _sync_groups(self) -> None:
        """An admission queue for every model some replica serves (new ones as they appear), each
        over the replicas that take new requests for it now."""
        p = self.cfg.policies
        active = self.fleet.active()
        for m in self.fleet.models():
            if m not in self.groups:
                sched = Scheduler(make_ordering(p.ordering, seed=p.seed, **p.params), make_placement(p.placement, seed=p.seed, **p.placement_params),
                                  at_risk_s=self.cfg.capacity.overdraft_within_s, resume_within_s=p.resume_within_s,
                                  absorb=self.cfg.capacity.absorb and self.cfg.capacity.learn, absorb_by=self.cfg.capacity.absorb_by,
                                  absorb_beside_deadlines=self.cfg.capacity.absorb_beside_deadlines)
                self.groups[m] = adm = Admission(sched, [], hooks=_Hooks(m, self.metrics, self.state, self.fleet), max_queue=self.cfg.max_queue,
                                                 frame_s=p.frame_s, predictor=self.predictor, refine_every=self.cfg.predictor.refine_every)
                adm.start()
        for m, adm in self.groups.items():
            views = [b.view for b in active if m in b.models]
            if views != adm.views:
                adm.set_views(views)
        for adm in self._retired:
            adm.set_views([v for v in adm.views if any(b.view is v for b in active)])

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.health_interval_s)
            try:
                await self.fleet.check_all()
                self.fleet.reap({t.replica for t in self._running()})
                self._sync_groups()
                if self.tokenizer is not None:
                    self.kv_feeds.sync(self.fleet.backends)
                await self._retire_idle()
                self.refresh_gauges()
                await self.workflows.expire(time.monotonic())
                if self.watch is not None and _file_stamp(self.watch) != self._stamp:
                    await self.reload_from_source(f"{self.watch} changed")
            except Exception:  # the loop that keeps the fleet's picture must outlive any one bug
                log.exception("health loop step failed")

    async def _quick_loop(self) -> None:
        """While a replica's learner wants it (`CapacityLearner.quick`: slow start, out of reach,
        just after a cut that probes) its budget is re-decided every `grow_every_s`, between the health
        checks that do so once a second (router/capacity.py)."""
        while True:
            quick = [b.learner for b in self.fleet.backends if b.learner is not None and b.learner.quick]
            # Never returns: a learner becomes quick again at its next cut.
            await asyncio.sleep(min(lr.grow_every_s for lr in quick) if quick else IDLE_QUICK_S)
            if not any(b.learner is not None and b.learner.quick and b.view.inflight >= b.view.budget for b in self.fleet.backends):
                continue  # none full: nothing to grow for (the health check's update still runs once a second)
            try:
                self.fleet.update_budgets()
            except Exception:
                log.exception("quick budget step failed")

    # ------------------------------------------------------------------ membership and reload
    async def _discovery_loop(self) -> None:
        """Re-resolve the `dns+` backends every `discovery.interval_s`, and at once after a
        replica fails (a replaced pod has a new address)."""
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.fleet.failed.wait(), self.cfg.discovery.interval_s)
            self.fleet.failed.clear()
            try:
                await self._resolve()
            except Exception:
                log.exception("discovery failed")

    async def _resolve(self) -> None:
        """Bring the fleet in line with the configured backends (DNS names resolved now)."""
        async with self._members:
            wanted = await self.discovery.replicas(self.cfg.backends)
            if self.fleet.reconcile(wanted):
                new = [b for b in self.fleet.backends if not b.view.healthy and b.state == "active"]
                await asyncio.gather(*(self.fleet.check(b, discover=True) for b in new), return_exceptions=True)
                self.fleet.update_budgets()
                self._sync_groups()

    async def reload_from_source(self, why: str) -> str | None:
        """Read the configuration again and apply it; a broken one changes nothing (returns why)."""
        if self.source is None:
            raise APIError(409, "this gateway was started without a config source to reload from", code="reload_unavailable")
        self._stamp = _file_stamp(self.watch)  # this read covers the file as it is now: the watch need not read it again
        try:
            new = await asyncio.to_thread(self.source)  # file I/O and validation off the loop
            if not new.backends:
                raise ValueError("backends: the new config has none")
        except Exception as e:  # any failure leaves the running config as it is
            err = " ".join(str(e).split())
            log.error("config reload (%s) rejected, the running config stays: %s", why, err)
            self.metrics.reloads.labels("rejected").inc()
            return err
        await self.reload(new)
        log.info("config reloaded (%s)", why)
        return None

    async def reload(self, new: GatewayConfig) -> None:
        """Apply `new` to requests from now on; running ones keep what they started with."""
        old = self.cfg
        kept = [k for k in RESTART_ONLY if getattr(new, k) != getattr(old, k)]
        if kept:
            log.warning("config reload: %s change(s) need a restart; the running values stay", ", ".join(kept))
            new = new.model_copy(update={k: getattr(old, k) for k in kept})
        self.cfg = self.fleet.cfg = new
        self.upstream.configure(new)
        self.auth = Authenticator(new.auth, self.state.store)
        if new.discovery != old.discovery:
            self.discovery = Discovery(new.discovery)
        if new.policies != old.policies:
            # Queued and running requests finish under the policies they were admitted by; new
            # ones queue under the new ones (both queues place on the same replica views).
            self._retired.extend(self.groups.values())
            self.groups = {}
        for adm in self.groups.values():
            adm.max_queue, adm.frame_s, adm.refine_every = new.max_queue, new.policies.frame_s, new.predictor.refine_every
        self._sync_groups()
        await self._resolve()
        self.metrics.reloads.labels("applied").inc()

    async def _retire_idle(self) -> None:
        for adm in [a for a in self._retired if a.idle]:
            self._retired.remove(adm)
            await adm.stop()

    def drain(self, name: str, on: bool) -> Backend:
        """An operator holds a replica out (`on`) or lets it back in."""
        b = self.fleet.named(name)
        if b is None:
            raise APIError(404, f"no backend named {name!r}", param="name", code="backend_not_found")
        if on:
            self.fleet.drain(b, leave=False)
        else:
            self.fleet.undrain(b)
        self._sync_groups()
        return b

    def refresh_gauges(self) -> None:
        self.fleet.refresh_gauges()
        for m, adm in self.groups.items():
            self.metrics.queue_depth.labels(m).set(len(adm.waiting))

    def _running(self) -> list[Ticket]:
        """This gateway's requests that hold a replica slot now."""
        return [t for adm in [*self.groups.values(), *self._retired] for t in adm.running.values() if t.replica is not None]

    def _unknown_model(self, model: str, key: KeyConfig | None) -> APIError:
        """The answer to a request for a model no replica serves now."""
        if unknown := self.fleet.models_unknown():
            # A replica that has not yet said what it serves (a vLLM still loading its weights, started
            # beside the gateway) may serve this model: a 404 would tell the client it never will.
            return APIError(503, f"The model `{model}` is not served by any replica reachable now; {unknown} of "
                            f"{len(self.fleet.backends)} backend(s) have not said which models they serve yet",
                            code="backend_unavailable", retry_after=max(self.cfg.health_interval_s, 1.0))
        # What it could have asked for (as far as its key may see): a typo or a served-model-name is the usual cause.
        served = [f"`{m}`" for m in self.fleet.models() if key is None or not key.models or m in key.models]
        listed = ", ".join(served[:10]) + (f" and {len(served) - 10} more" if len(served) > 10 else "") if served else "none"
        return APIError(404, f"The model `{model}` does not exist. Served here: {listed}.", param="model", code="model_not_found")

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
        if adm is None and model in self.fleet.models():
            # A replica has said it serves the model since the last health pass made its queue (one
            # still running: `check_all` sets what each replica serves before it syncs the groups).
            self._sync_groups()
            adm = self.groups.get(model)
        if adm is None:
            raise self._unknown_model(model, key)
        now = time.monotonic()
        res = resolve(body, request.headers, self.cfg, self.workflows, now, key)
        # Embeddings and the like: no answer to predict, one unit of output; the body's size
        # estimates what the engine reads.
        prompt = None if pooling else prompt_from_body(body)
        n_in = max(body_size // 4, 1) if prompt is None else prompt.token_ids or max(len(prompt.text) // 4, 1)
        max_tokens = 1 if prompt is None else prompt.max_tokens
        await self.auth.check_rate(key, n_in + (max_tokens or 256))
        call = None
        if res.workflow is not None:  # its stage's share of the workflow deadline
            call = self.workflows.issue(res.workflow, res.stage, n_in, res.label, res.final, now)
            res.slo = SLO.compound(max(call.deadline_at - now, 0.05))
        req = CoreRequest(adm.new_rid(), now, n_in, res.slo, tier=res.tier, tenant=key.tenant if key else res.tier.name,
                          max_tokens=max_tokens, workflow=res.workflow, stage=res.stage, preemptible=False,
                          tbt_chosen=res.tbt_chosen, ttft_chosen=res.ttft_chosen)
        if prompt is None:
            req.len_bound = req.len_mean = 1.0
        elif self.tokenizer is not None:
            n_tok = await asyncio.to_thread(self._token_blocks, body, req)
            if n_tok is not None:
                req.input_tokens = max(n_tok, 1)  # exact, as the engine counts them
            self._session(request, body, req)
        elif self.prefix_chars and len(prompt.text) >= self.prefix_chars:
            if len(prompt.text) > HASH_IN_THREAD:  # ~20 µs per 64 blocks: a long context is hashed off the loop
                req.prefix = await asyncio.to_thread(text_block_hashes, prompt.text, self.prefix_chars)
            else:
                req.prefix = text_block_hashes(prompt.text, self.prefix_chars)
            req.tokens_per_block = self.prefix_chars * n_in / len(prompt.text)
            self._session(request, body, req)
        stream = bool(body.get("stream"))
        ex = Exchange(kind, adm, req, res, (model, res.tier.name, res.slo.kind.value), stream, body_size > JSON_IN_THREAD,
                      text=AnswerText() if resumable(kind, res.body, stream) else None, call=call)
        overhead = time.perf_counter() - t_recv
        dc = Disconnect(request)
        try:
            with dc.watching():
                answer = await self._dispatch(ex, prompt, now, overhead)
        except asyncio.CancelledError:
            if not dc.gone:
                raise
            asyncio.current_task().uncancel()  # type: ignore[union-attr]
            self._abandon(ex)
            return Response(status_code=499)
        if answer is not None:
            return answer
        so = body.get("stream_options") or {}
        ex.client_usage = (bool(so.get("include_usage")), bool(so.get("include_usage") and so.get("continuous_usage_stats")))
        return ClosingStreamingResponse(self.relay.stream(ex, self._pacer(req, res)), media_type="text/event-stream", headers=STREAM_HEADERS,
                                        on_close=lambda: self._abandon(ex) if ex.ticket is not None else None)

    def _abandon(self, ex: Exchange) -> None:
        """The client left while `ex` held its upstream and slot and no relay was there to let go of
        them: waiting in the queue or for the engine's headers, or gone while the response's headers
        were sent (its relay never ran; one that ran has settled, and holds no ticket)."""
        if ex.resp is not None:
            ex.resp.close()  # drops the connection: the engine aborts the request
        if ex.ticket is not None:
            ex.adm.release(ex.ticket, completed=False)
            ex.ticket = None
        self.metrics.cancelled.labels(ex.labels[0]).inc()
        self.metrics.requests.labels(*ex.labels, "cancelled").inc()

    async def _dispatch(self, ex: Exchange, prompt: PromptInput | None, arrived: float, overhead: float) -> Response | None:
        """Queue `ex`, send it upstream; a whole answer (non-streamed, or the engine's 4xx) is
        returned here, a stream is left open on `ex.resp` for the relay."""
        m, req = self.metrics, ex.req
        try:
            ex.ticket = await ex.adm.acquire(req, ex.res.waiting_s, prompt)
        except APIError as e:
            m.requests.labels(*ex.labels, "refused_429" if e.status == 429 else "refused_503" if e.status == 503 else "error").inc()
            if e.code == "queue_full":  # demand turned away too (the scheduler's own refusals count in its hook)
                self.fleet.refused += 1
            raise
        m.queue_wait.labels(*ex.labels).observe(time.monotonic() - arrived)
        ex.first_bound = req.len_bound
        try:
            await self.upstream.open(ex)
        except APIError:
            m.requests.labels(*ex.labels, "failed").inc()
            raise
        m.overhead.observe(overhead)  # parse, validate, resolve: queue and upstream time excluded
        resp, ticket = ex.resp, ex.ticket
        assert resp is not None and ticket is not None
        if ticket.replica is not None and prompt is not None:
            bname = self.fleet.by_rid[ticket.replica].name
            m.prompt_tokens.labels(bname).inc(req.input_tokens)
            if req.cached:
                m.prefix_cached.labels(bname).inc(req.cached)
        if resp.status >= 400:  # the engine refused it (4xx): pass its answer on, in the OpenAI shape
            try:
                content = as_openai_error(await resp.read(), resp.status)
            except (aiohttp.ClientError, TimeoutError):
                content = json.dumps(error_body(f"upstream answered {resp.status}")).encode()
            resp.release()
            ex.resp = ex.ticket = None
            ex.adm.release(ticket, completed=False)
            m.requests.labels(*ex.labels, "upstream_4xx").inc()
            return Response(content, status_code=resp.status, media_type="application/json")
        ex.led = RequestLedger(req)
        if ex.stream:
            return None
        try:
            content = await resp.read()
        except (aiohttp.ClientError, TimeoutError) as e:
            resp.close()
            ex.resp = ex.ticket = None
            ex.adm.release(ticket, completed=False)
            m.requests.labels(*ex.labels, "failed").inc()
            raise APIError(502, f"upstream failed while answering: {e!s}") from None
        resp.release()
        ex.resp = None
        n_out, n_in = usage_of(content)
        t_end = time.monotonic()
        for _ in range(max(n_out, 1 if content else 0)):
            ex.led.on_token(t_end)
        ex.adm.answered(ticket, n_out, t_end)
        self.relay.settle(ex, ticket, "completed", n_in)
        return Response(content, status_code=resp.status, media_type="application/json")

    def _token_blocks(self, body: dict[str, Any], req: CoreRequest) -> int | None:
        """`req`'s prompt in blocks of token ids, as the engine tokenizes it; its length in
        tokens (None: the gateway cannot tokenize this body). Runs in a worker thread."""
        assert self.tokenizer is not None
        ids = self.tokenizer.ids(body)
        if ids is None:
            return None
        bt = self.cfg.prefix.block_tokens
        req.prefix = token_block_hashes(ids, bt)[0]
        req.tokens_per_block = float(bt)
        return len(ids)

    def _count_tokenized(self, done: int, kept: int) -> None:
        tt = self.metrics.tokenizer_tokens  # thread-safe: called from the tokenizing worker thread
        tt.labels("tokenized").inc(done)
        tt.labels("reused").inc(kept)

    @staticmethod
    def _session(request: Request, body: dict[str, Any], req: CoreRequest) -> None:
        sess = request.headers.get("x-session-id") or body.get("user")
        if isinstance(sess, str) and sess:
            req.session = zlib.crc32(sess.encode()) or 1

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

    def _pacer(self, req: CoreRequest, res: Resolved) -> Pacer | None:
        """A smoothing buffer for a latency stream whose TBT someone chose (request, key, tier,
        model); one whose TBT is only the built-in default goes out as fast as the engine makes it."""
        pc = self.cfg.pacing
        if not pc.enabled or req.kind is not SLOClass.LATENCY or not req.slo.tbt_s:
            return None
        if not res.tbt_chosen and not pc.default_slo:
            return None
        return Pacer(req.slo.tbt_s, ceiling=pc.ceiling, reserve_tbts=pc.reserve_tbts, build=pc.build, flush_at_end=pc.flush_at_end)
