"""`plas`: Autellix's program-level least attained service."""

from __future__ import annotations

from slogate.router.policies.base import KeyOrdering
from slogate.router.request import Request


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
