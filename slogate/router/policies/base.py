"""The ordering/admission policy interface: one method that decides, two optional hooks."""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from slogate.router.request import Request
from slogate.router.view import ReplicaView


@dataclass(slots=True)
class Selection:
    """An ordering policy's answer for one scheduling point.

    `dispatch` is in the order placement should try; `shed` are refused with a reason;
    `preempt` are running requests to stop and requeue (their generated tokens kept).
    """

    dispatch: list[Request] = field(default_factory=list)
    shed: list[tuple[Request, str]] = field(default_factory=list)
    preempt: list[Request] = field(default_factory=list)


class OrderingPolicy(ABC):
    name: ClassVar[str]  # the registry key (router/registry.py), also the module's file name
    aliases: ClassVar[tuple[str, ...]] = ()  # older keys that still select it

    @abstractmethod
    def select(self, now: float, waiting: Sequence[Request], slots: int, replicas: Sequence[ReplicaView]) -> Selection:
        """Pick up to `slots` waiting requests to dispatch now."""

    def on_service(self, req: Request, tokens: int, now: float) -> None:  # noqa: B027
        """`tokens` more tokens (input at dispatch, then output) were served for `req`."""

    def on_finish(self, req: Request, now: float, goodput: float) -> None:  # noqa: B027
        """`req` finished, contributing `goodput` (feedback for adaptive parameters)."""


class KeyOrdering(OrderingPolicy):
    """Baselines that are a sort key: the `slots` smallest keys go first, nothing is shed."""

    @abstractmethod
    def key(self, req: Request, now: float) -> float | tuple[float, ...]: ...

    def select(self, now: float, waiting: Sequence[Request], slots: int, replicas: Sequence[ReplicaView]) -> Selection:
        if slots <= 0 or not waiting:
            return Selection()
        if slots >= len(waiting):
            chosen = sorted(waiting, key=lambda r: self.key(r, now))
        else:
            chosen = heapq.nsmallest(slots, waiting, key=lambda r: self.key(r, now))
        return Selection(dispatch=chosen)
