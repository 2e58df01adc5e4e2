"""Policies by name, so config files and the CLI pick them with a string like `gmax+gorouting`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from slogate.router.placement import (
    CacheAware,
    GoRouting,
    GoRoutingPD,
    LeastLoad,
    PlacementPolicy,
    PowerOfK,
    PowerOfTwo,
    PrefixScore,
    RandomPlacement,
    RoundRobin,
    SessionHash,
)
from slogate.router.policies import (
    EDF,
    FCFS,
    GMAX,
    LTR,
    PLAS,
    SJF,
    OrderingPolicy,
    SimulatedAnnealing,
    SlideBatching,
    StrictPriority,
    WeightedVTC,
)

ORDERING: dict[str, Callable[..., OrderingPolicy]] = {
    cls.name: cls for cls in (GMAX, FCFS, EDF, SJF, LTR, PLAS, SlideBatching, StrictPriority, WeightedVTC, SimulatedAnnealing)
}
PLACEMENT: dict[str, Callable[..., PlacementPolicy]] = {
    cls.name: cls for cls in (GoRouting, GoRoutingPD, PowerOfK, LeastLoad, RoundRobin, RandomPlacement, PowerOfTwo,
                        CacheAware, PrefixScore, SessionHash)
}
_SEEDED = {"gmax", "sa"}


def check_policy(family: str, name: str) -> str:
    """`name` if it is a known `family` ("ordering" or "placement") policy, else a ValueError listing the known ones."""
    table = ORDERING if family == "ordering" else PLACEMENT
    if name not in table:
        raise ValueError(f"unknown {family} policy {name!r}; known: {', '.join(sorted(table))}")
    return name


def make_ordering(name: str, seed: int = 0, **params: Any) -> OrderingPolicy:
    check_policy("ordering", name)
    if name in _SEEDED:
        params.setdefault("seed", seed)
    return ORDERING[name](**params)


def make_placement(name: str, seed: int = 0, **params: Any) -> PlacementPolicy:
    return PLACEMENT[check_policy("placement", name)](seed=seed, **params)


def parse_combo(combo: str) -> tuple[str, str]:
    """'gmax+gorouting' -> ('gmax', 'gorouting'), validating both names."""
    if combo.count("+") != 1:
        raise ValueError(f"policy combination must be ORDERING+PLACEMENT, got {combo!r}")
    o, p = combo.split("+")
    return check_policy("ordering", o), check_policy("placement", p)
