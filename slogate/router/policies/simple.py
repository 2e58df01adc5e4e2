"""Sort-key baselines: FCFS, EDF, SJF, LTR-style shortest-predicted, strict priority, PLAS."""

from __future__ import annotations

from slogate.router.policies.base import KeyOrdering
from slogate.router.request import Request


class FCFS(KeyOrdering):
    """First come, first served: vLLM's default and the usual gateway queue."""

    name = "fcfs"

    def key(self, req: Request, now: float) -> float:
        return req.arrival


class EDF(KeyOrdering):
    """Earliest deadline first, on the deadline of the next thing due (first token or answer)."""

    name = "edf"

    def key(self, req: Request, now: float) -> float:
        return req.ttft_deadline


class SJF(KeyOrdering):
    """Shortest job first on the predicted total output length (point estimate)."""

    name = "sjf"

    def key(self, req: Request, now: float) -> tuple[float, float]:
        return (req.len_mean, req.arrival)


class LTR(KeyOrdering):
    """Learning-to-rank style: shortest predicted *remaining* output first, with the
    starvation guard of Fu et al. (a request waiting longer than `starvation_s` jumps ahead)."""

    name = "ltr"

    def __init__(self, starvation_s: float = 30.0) -> None:
        self.starvation_s = starvation_s

    def key(self, req: Request, now: float) -> tuple[int, float]:
        if now - req.arrival > self.starvation_s:
            return (0, req.arrival)
        return (1, max(req.len_mean - req.generated, 1.0))


class StrictPriority(KeyOrdering):
    """Strict tiers (highest weight first), FCFS within a tier."""

    name = "priority"

    def key(self, req: Request, now: float) -> tuple[float, float]:
        return (-req.tier.weight, req.arrival)


class PLAS(KeyOrdering):
    """Autellix's program-level least attained service: the program (workflow) that has
    received the least service so far goes first; a lone request is its own program."""

    name = "plas"

    def __init__(self) -> None:
        self.attained: dict[str, int] = {}

    @staticmethod
    def _program(req: Request) -> str:
        return req.workflow.workflow_id if req.workflow is not None else f"r{req.rid}"

    def key(self, req: Request, now: float) -> tuple[int, float]:
        return (self.attained.get(self._program(req), 0), req.arrival)

    def on_service(self, req: Request, tokens: int, now: float) -> None:
        p = self._program(req)
        self.attained[p] = self.attained.get(p, 0) + tokens

    def on_finish(self, req: Request, now: float, goodput: float) -> None:
        if req.workflow is None:
            self.attained.pop(self._program(req), None)
