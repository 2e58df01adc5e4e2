"""`ltr`: shortest predicted remaining output first, with a starvation guard."""

from __future__ import annotations

from slogate.router.policies.base import KeyOrdering
from slogate.router.request import Request


class LTR(KeyOrdering):
    """Learning-to-rank style: shortest predicted *remaining* output first, with the
    starvation guard of Fu et al. (a request waiting longer than `starvation_s` jumps ahead)."""

    name = "ltr"

    def __init__(self, starvation_s: float = 30.0) -> None:
        self.starvation_s = starvation_s

    def key(self, req: Request, now: float) -> tuple[int, float]:
        if now - req.arrival > self.starvation_s:
            return (0, req.arrival)
        return (1, req.remaining_mean)
