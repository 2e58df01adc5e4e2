"""The replicas behind the gateway: their views, health, engine gauges and concurrency budgets.

Upstream HTTP is aiohttp: httpx/httpcore 1.0's connection pool rescans every connection for
every idle one on each request (quadratic; 4.4 ms per request at 100 streams, measured) and
parses responses in pure Python (h11); aiohttp's pool is per host and its parser is C.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from dataclasses import dataclass, field

import aiohttp

from slogate.gateway.config import BackendConfig, GatewayConfig
from slogate.gateway.metrics import Metrics
from slogate.router.capacity import CapacityLearner, learned_budget
from slogate.router.latency import PROFILES, BatchLatencyModel
from slogate.router.prefix import PrefixCache
from slogate.router.view import ReplicaView

log = logging.getLogger("slogate.gateway")

KV_FULL = 0.97  # vLLM's KV-cache use at which no more requests are sent there
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
    headers: dict[str, str] = field(default_factory=dict)  # what every request to it carries (its API key)


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
    def __init__(self, cfg: GatewayConfig, metrics: Metrics) -> None:
        if not cfg.backends:
            raise ValueError("the gateway needs at least one backend")
        self.cfg = cfg
        self.metrics = metrics
        coeffs = PROFILES[cfg.policies.profile]
        self.backends = [Backend(b, ReplicaView(i, BatchLatencyModel(coeffs), budget=b.budget), b.name or b.url, set(b.models),
                                 learner=CapacityLearner(b.budget, margin=cfg.capacity.margin) if cfg.capacity.learn else None,
                                 headers={"authorization": f"Bearer {b.api_key}"} if b.api_key else {})
                         for i, b in enumerate(cfg.backends)]
        if cfg.prefix.enabled:
            for b in self.backends:
                b.view.cache = PrefixCache(self.cache_blocks(b.cfg.kv_cache_tokens or cfg.prefix.kv_tokens))
        self.client: aiohttp.ClientSession | None = None

    def open(self) -> aiohttp.ClientSession:
        total = sum(b.cfg.budget for b in self.backends)
        self.client = aiohttp.ClientSession(
            # Idle upstream connections are dropped after 4 s, before vLLM's uvicorn drops them (5 s):
            # reusing one the engine is closing fails the request, and a retry could briefly put
            # one request too many on a replica that already had it.
            connector=aiohttp.TCPConnector(limit=total + 64, limit_per_host=0, keepalive_timeout=4),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.cfg.connect_timeout_s, sock_read=self.cfg.first_byte_timeout_s),
            auto_decompress=False)
        return self.client

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()

    def models(self) -> list[str]:
        return sorted({m for b in self.backends for m in b.models})

    def cache_blocks(self, kv_tokens: int) -> int:
        """A KV cache of `kv_tokens` in prompt blocks (4 characters a token)."""
        return max(int(kv_tokens * 4 // max(self.cfg.prefix.block_chars, 1)), 1)

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
            async with self.client.get(f"{b.cfg.url}/v1/models", timeout=aiohttp.ClientTimeout(total=1.5), headers=b.headers) as r:
                ok = r.status == 200
                if ok and (discover or not b.models) and not b.cfg.models:
                    data = (await r.json(content_type=None)).get("data", [])
                    b.models = {m["id"] for m in data if isinstance(m, dict) and "id" in m}
        except (aiohttp.ClientError, TimeoutError, ValueError, AttributeError):
            ok = False
        if ok != b.view.healthy:
            log.warning("backend %s is now %s", b.name, "healthy" if ok else "UNHEALTHY")
        if not ok:
            self.cut_waiting(b)
        b.view.healthy = ok
        self.metrics.healthy.labels(b.name).set(1 if ok else 0)
        if ok and self.cfg.capacity.engine_metrics and b.cfg.kind == "vllm":
            await self._engine_load(b)

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

    def update_budgets(self) -> None:
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
