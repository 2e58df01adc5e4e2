"""`sjf`: shortest predicted job first."""

from __future__ import annotations

from slogate.router.policies.base import KeyOrdering
from slogate.router.request import Request


class SJF(KeyOrdering):
    """Shortest job first on the predicted total output length (point estimate)."""

    name = "sjf"

    def key(self, req: Request, now: float) -> tuple[float, float]:
        return (req.len_mean, req.arrival)
