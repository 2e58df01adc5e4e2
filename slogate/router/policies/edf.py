"""`edf`: earliest deadline first."""

from __future__ import annotations

from slogate.router.policies.base import KeyOrdering
from slogate.router.request import Request


class EDF(KeyOrdering):
    """Earliest deadline first, on the deadline of the next thing due (first token or answer)."""

    name = "edf"

    def key(self, req: Request, now: float) -> float:
        return req.ttft_deadline
