"""Shared per-replica state: which requests are in flight on each backend replica.

Several gateway processes must never put more requests on a replica than its budget, and
each must see the others' load when it orders and places requests. The store holds, per
replica, the in-flight entries (request id → owner gateway, phase, input tokens, remaining
tokens, claim time) with a lease each, so a crashed gateway's claims expire. `claim` is
atomic: it succeeds only while the replica has fewer than `budget` live entries.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass


@dataclass(slots=True)
class Entry:
    req_id: str
    owner: str  # gateway instance id
    phase: str  # "prefill" | "decode"
    input_tokens: int
    remaining: float  # predicted tokens still to generate
    claimed_at: float  # store time (s)

    def encode(self) -> str:
        return f"{self.owner}|{self.phase}|{self.input_tokens}|{self.remaining:.1f}|{self.claimed_at:.3f}"

    @classmethod
    def decode(cls, req_id: str, raw: str) -> Entry:
        owner, phase, inp, rem, at = raw.split("|")
        return cls(req_id, owner, phase, int(inp), float(rem), float(at))


class StateUnavailable(Exception):
    """The shared store cannot be reached; callers fall back to local decisions."""


class SlotStore(ABC):
    kind: str

    @abstractmethod
    async def claim(self, replica: str, entry: Entry, budget: int, lease_s: float) -> bool:
        """Add `entry` if the replica has fewer than `budget` live entries; atomic."""

    @abstractmethod
    async def release(self, replica: str, req_id: str) -> None:
        """Remove the entry (idempotent)."""

    @abstractmethod
    async def update(self, replica: str, req_id: str, phase: str, remaining: float) -> None:
        """Change phase / remaining tokens of a live entry (no-op if it is gone)."""

    @abstractmethod
    async def renew(self, replica: str, req_ids: list[str], lease_s: float) -> None:
        """Extend the leases of live entries."""

    @abstractmethod
    async def snapshot(self, replicas: list[str]) -> dict[str, list[Entry]]:
        """Live entries per replica (expired leases are dropped first)."""

    @abstractmethod
    async def rate(self, subject: str, window_s: float, max_requests: int | None, tokens: int, max_tokens: int | None) -> tuple[bool, float]:
        """Count one request of `tokens` in the current fixed window; (allowed, seconds until the
        window ends). A refused request is not counted."""

    async def heartbeat(self, owner: str, ttl_s: float) -> int:
        """Announce this gateway; return how many gateways are alive (for a safe local share)."""
        return 1

    async def leave(self, owner: str) -> None:  # noqa: B027 - optional
        """This gateway is shutting down: the others stop counting it at once (not after its
        heartbeat's TTL), so their share of each budget grows back."""

    async def publish_prefixes(self, owner: str, items: list[tuple[str, tuple[int, ...]]]) -> None:  # noqa: B027 - optional
        """Tell the other gateways which prompts (their chained block hashes) `owner` sent to
        which replica, so their pictures of each replica's prefix cache hold them too."""

    async def read_prefixes(self, after: str, count: int) -> tuple[str, list[tuple[str, str, list[int]]]]:
        """At most `count` of the prompts published after position `after` ("0": the history the
        store keeps) as (owner, replica, block hashes), oldest first, and the position to read on from."""
        return after, []

    async def close(self) -> None:  # noqa: B027 - optional
        pass
