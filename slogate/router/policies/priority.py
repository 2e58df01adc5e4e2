"""`priority`: strict tiers, FCFS within one."""

from __future__ import annotations

from slogate.router.policies.base import KeyOrdering
from slogate.router.request import Request


class StrictPriority(KeyOrdering):
    """Strict tiers (highest weight first), FCFS within a tier."""

    name = "priority"

    def key(self, req: Request, now: float) -> tuple[float, float]:
        return (-req.tier.weight, req.arrival)
