"""Several gateways acting as one: slot claims and per-replica load shared through the state
store (Redis), and what a gateway does while the store is away.

Each dispatch is confirmed by an atomic claim against the replica's budget; releases and first
tokens are handed to the store in the background; a sync loop heartbeats, renews this gateway's
claims and turns the other gateways' entries into remote load in the replica views, and tells the
others which prompts this gateway sent where (and learns theirs), so every gateway's picture of
each replica's prefix cache holds every gateway's requests. While the store is down the gateway
serves on local state within its share of each budget.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections import deque
from collections.abc import Callable
from typing import Any

from slogate.gateway.admission import Ticket
from slogate.gateway.config import StateConfig
from slogate.gateway.fleet import Fleet
from slogate.gateway.metrics import Metrics
from slogate.gateway.state.base import Entry, SlotStore, StateUnavailable
from slogate.gateway.state.memory import MemoryStore
from slogate.gateway.state.redis import RedisStore

log = logging.getLogger("slogate.gateway")


class StateSync:
    def __init__(self, sc: StateConfig, fleet: Fleet, metrics: Metrics, running: Callable[[], list[Ticket]],
                 share_prefixes: bool = True) -> None:
        self.sc = sc
        self.fleet = fleet
        self.metrics = metrics
        self.running = running  # this gateway's requests that hold a replica slot now
        self.instance = uuid.uuid4().hex[:12]
        self.store: SlotStore = RedisStore(sc.url, sc.prefix, sc.timeout_s) if sc.kind == "redis" else MemoryStore()
        self.shared = self.store.kind != "memory"
        self.degraded = False
        self.n_gateways = 1
        self._pending_release: set[tuple[str, str]] = set()
        self._grace_until = 0.0
        self._ready_syncs = 0
        self._n_at_outage = 1
        self._outage_at = 0.0
        self._remote_at_outage: dict[int, int] = {}
        self._bg: set[asyncio.Task[None]] = set()
        # Prompts dispatched since the last sync, for the other gateways' prefix indexes (bounded:
        # an outage drops the oldest, which only makes their picture a little staler).
        self.share_prefixes = share_prefixes and self.shared
        self._prefixes_out: deque[tuple[str, tuple[int, ...]]] = deque(maxlen=4096)
        self._prefixes_at = "0"  # where in the store's prefix history this gateway has read to

    def key(self, rid: int) -> str:
        return self.fleet.by_rid[rid].cfg.url  # the same replica is the same key in every gateway

    def entry_id(self, t: Ticket) -> str:
        return f"{self.instance}:{t.req.rid}"

    async def close(self) -> None:
        """Shutdown: give back every claim this gateway still holds (a stream cut at the end of
        the grace period) and leave, so the other gateways get the budgets now, not after a lease."""
        if self.shared and not self.degraded:
            for t in self.running():
                if t.replica is not None and t.replica in self.fleet.by_rid:
                    self._background(self._store_call(self.store.release(self.key(t.replica), self.entry_id(t))))
            self._background(self._store_call(self.store.leave(self.instance)))
        if self._bg:
            await asyncio.gather(*self._bg, return_exceptions=True)
        await self.store.close()

    # ------------------------------------------------------------------ per request
    async def confirm(self, t: Ticket) -> bool:
        """Claim the slot the local decision took, atomically across gateways."""
        assert t.replica is not None
        if self.degraded:
            self._dispatched(t)  # shared once the store is back
            return True  # no per-request timeouts while the store is down; the sync loop probes it
        e = Entry(self.entry_id(t), self.instance, "prefill", t.req.input_tokens, t.req.len_bound, 0.0)
        view = self.fleet.by_rid[t.replica].view
        # The local decision gave overdraft slots to first tokens only (scheduler.py): the store
        # bounds every gateway's claims together by the same lent ceiling.
        limit = view.budget + view.overdraft
        try:
            ok = await self.store.claim(self.key(t.replica), e, limit, self.sc.lease_s)
        except StateUnavailable as err:
            # The decision was made before the store went away; re-judge it within the local share.
            self._degrade(err)
            ok = view.inflight <= limit
        if ok:
            self._dispatched(t)
        return ok

    def _dispatched(self, t: Ticket) -> None:
        """`t`'s prompt goes to its replica: the other gateways' prefix indexes learn it at the next sync."""
        if self.share_prefixes and t.req.prefix:
            self._prefixes_out.append((self.key(t.replica), t.req.prefix))  # type: ignore[arg-type]

    def released(self, t: Ticket) -> None:
        if t.replica is None or not self.shared:
            return
        if self.degraded:
            self._pending_release.add((self.key(t.replica), self.entry_id(t)))  # applied when the store is back
        else:
            self._background(self._store_call(self.store.release(self.key(t.replica), self.entry_id(t))))

    def first_token(self, t: Ticket) -> None:
        if t.replica is not None and self.shared and not self.degraded:
            self._background(self._store_call(self.store.update(self.key(t.replica), self.entry_id(t), "decode", t.req.len_bound)))

    def _background(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)

    async def _store_call(self, coro: Any) -> None:
        try:
            await coro
        except StateUnavailable as err:
            self._degrade(err)  # the lease expires the entry if the release never lands

    # ------------------------------------------------------------------ outages
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
                self._remote_at_outage = {b.view.rid: b.view.budget - b.view.local_inflight for b in self.fleet.backends}
        self._degrade_share()

    def _degrade_share(self) -> None:
        """Phantom remote load: only this gateway's share of each budget stays free, and whatever
        the other gateways may have had in flight when the store went away still counts, fading out
        over one lease — the time a claim lives without renewal (an even share alone would let a
        gateway with little in flight overfill a replica that the others had nearly filled)."""
        fade = max(0.0, 1.0 - (time.monotonic() - self._outage_at) / self.sc.lease_s)
        for b in self.fleet.backends:
            share = max(b.view.budget // max(self.n_gateways, 1), 1)
            remembered = math.ceil(self._remote_at_outage.get(b.view.rid, 0) * fade)
            b.view.set_remote(max(b.view.budget - share, remembered), 0, 0, 0.0)

    # ------------------------------------------------------------------ the sync loop
    async def sync(self) -> None:
        """Read every replica's in-flight entries; other gateways' become remote load in our views."""
        backends = list(self.fleet.backends)  # replicas may join or leave during the awaits below
        keys = [b.cfg.url for b in backends]
        try:
            n = await self.store.heartbeat(self.instance, max(3 * self.sc.sync_s, 2.0))
            # A restarted Redis has forgotten the other gateways until they heartbeat again: while
            # recovering, never let the count (and with it our share of each budget) grow.
            self.n_gateways = max(n, self.n_gateways) if (self.degraded or time.monotonic() < self._grace_until) else n
            mine: dict[str, list[str]] = {}
            for t in self.running():
                mine.setdefault(self.key(t.replica), []).append(self.entry_id(t))  # type: ignore[arg-type]
            for key, eid in list(self._pending_release):  # releases that happened while it was down
                await self.store.release(key, eid)
                self._pending_release.discard((key, eid))
            if self.degraded:  # Redis is back: put our in-flight requests back before counting
                for t in self.running():  # read after the awaits above: requests started meanwhile count too
                    e = Entry(self.entry_id(t), self.instance, "decode" if t.req.generated else "prefill",
                              t.req.input_tokens, t.req.len_bound, 0.0)
                    await self.store.claim(self.key(t.replica), e, 1 << 30, self.sc.lease_s)  # type: ignore[arg-type]
            for key, ids in mine.items():
                await self.store.renew(key, ids, self.sc.lease_s)
            snap = await self.store.snapshot(keys)
            if self.share_prefixes:
                await self._share_prefixes()
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
        for b in backends:
            others = [e for e in snap.get(b.cfg.url, []) if e.owner != self.instance]
            pre = [e for e in others if e.phase == "prefill"]
            dec = [e for e in others if e.phase == "decode"]
            b.view.set_remote(len(pre), len(dec), sum(e.input_tokens for e in dec),
                              sum(b.view.model.raw_prefill(e.input_tokens) for e in pre))
            if b.learner is not None and b.learner.growing and b.view.inflight > b.view.budget:
                # Other gateways already run more there than this one's slow start allows: begin at that.
                b.learner.hold_at_least(b.view.inflight)
                self.fleet.apply_budget(b, b.learner.budget)
        self.metrics.gateways.set(self.n_gateways)

    async def _share_prefixes(self, batch: int = 500) -> None:
        """Send the prompts dispatched since the last sync; put the other gateways' into the
        replicas' prefix indexes (a new gateway reads the store's whole history, a batch at a time)."""
        out = list(self._prefixes_out)
        if out:
            await self.store.publish_prefixes(self.instance, out)
            for _ in out:
                self._prefixes_out.popleft()  # sent: not again after an outage
            self.metrics.prefix_shared.labels("sent").inc(len(out))
        by_url = {b.cfg.url: b for b in self.fleet.backends}
        for _ in range(40):  # at most 40 small batches a sync: catching up never holds the loop long
            self._prefixes_at, got = await self.store.read_prefixes(self._prefixes_at, batch)
            n = 0
            for owner, replica, hashes in got:
                b = by_url.get(replica)
                if owner != self.instance and b is not None and b.view.cache is not None:
                    b.view.cache.insert(hashes)
                    n += 1
            self.metrics.prefix_shared.labels("received").inc(n)
            if len(got) < batch:
                break

    async def sync_loop(self) -> None:
        while True:
            await asyncio.sleep(self.sc.sync_s)
            try:
                await self.sync()
            except Exception:
                log.exception("state sync failed")
