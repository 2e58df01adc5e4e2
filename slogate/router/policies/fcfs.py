"""`fcfs`: first come, first served."""

from __future__ import annotations

from slogate.router.policies.base import KeyOrdering
from slogate.router.request import Request


class FCFS(KeyOrdering):
    """First come, first served: vLLM's default and the usual gateway queue."""

    name = "fcfs"

    def key(self, req: Request, now: float) -> float:
        return req.arrival
