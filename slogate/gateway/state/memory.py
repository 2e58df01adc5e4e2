"""The embedded store: one process, no network (the default)."""

from __future__ import annotations

import time

from slogate.gateway.state.base import Entry, SlotStore


class MemoryStore(SlotStore):
    kind = "memory"

    def __init__(self, clock=time.monotonic) -> None:  # type: ignore[no-untyped-def]
        self.clock = clock
        self.inflight: dict[str, dict[str, tuple[Entry, float]]] = {}  # replica → id → (entry, lease expiry)
        self.windows: dict[tuple[str, int], tuple[int, int]] = {}  # (subject, window) → (requests, tokens)

    def _live(self, replica: str) -> dict[str, tuple[Entry, float]]:
        now = self.clock()
        d = self.inflight.setdefault(replica, {})
        for k in [k for k, (_, exp) in d.items() if exp <= now]:
            del d[k]
        return d

    async def claim(self, replica: str, entry: Entry, budget: int, lease_s: float) -> bool:
        d = self._live(replica)
        if entry.req_id in d:
            return True
        if len(d) >= budget:
            return False
        entry.claimed_at = self.clock()
        d[entry.req_id] = (entry, self.clock() + lease_s)
        return True

    async def release(self, replica: str, req_id: str) -> None:
        self.inflight.get(replica, {}).pop(req_id, None)

    async def update(self, replica: str, req_id: str, phase: str, remaining: float) -> None:
        cur = self.inflight.get(replica, {}).get(req_id)
        if cur is not None:
            cur[0].phase, cur[0].remaining = phase, remaining

    async def renew(self, replica: str, req_ids: list[str], lease_s: float) -> None:
        d = self.inflight.get(replica, {})
        exp = self.clock() + lease_s
        for r in req_ids:
            if r in d:
                d[r] = (d[r][0], exp)

    async def rate(self, subject: str, window_s: float, max_requests: int | None, tokens: int, max_tokens: int | None) -> tuple[bool, float]:
        now = time.time()
        w = int(now // window_s)
        key = (subject, w)
        n, t = self.windows.get(key, (0, 0))
        if (max_requests is not None and n + 1 > max_requests) or (max_tokens is not None and t + tokens > max_tokens):
            return False, (w + 1) * window_s - now
        if len(self.windows) > 10_000:
            self.windows = {k: v for k, v in self.windows.items() if k[1] >= w}
        self.windows[key] = (n + 1, t + tokens)
        return True, 0.0

    async def snapshot(self, replicas: list[str]) -> dict[str, list[Entry]]:
        return {r: [e for e, _ in self._live(r).values()] for r in replicas}
