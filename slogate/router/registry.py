"""Policies by name, so config files and the CLI pick them with a string like `gmax+gorouting`.

One pattern for every plugin family: a class names its registry key (`name`, also its module's
file name with `-` as `_`) and any older keys (`aliases`); its parameters are its constructor's,
typed by the annotations there, and `Registry.check_params` validates a config's parameters
against them when the config loads (a typo or a wrong type is an error naming the parameter,
not a crash at the first request).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping
from typing import Any, Generic, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError, create_model

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

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, family: str, classes: Iterable[type[T]]) -> None:
        self.family = family
        self.classes: dict[str, type[T]] = {}
        self.aliases: dict[str, str] = {}
        self._models: dict[str, type[BaseModel]] = {}
        for cls in classes:
            key = cls.name  # type: ignore[attr-defined]
            self.classes[key] = cls
            for old in getattr(cls, "aliases", ()):
                self.aliases[old] = key

    def __contains__(self, name: object) -> bool:
        return name in self.classes or name in self.aliases

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self.classes)

    def key(self, name: str) -> str:
        """The canonical key of `name` (an old key maps to its new one), else a ValueError listing the known."""
        if name in self.classes:
            return name
        if name in self.aliases:
            return self.aliases[name]
        raise ValueError(f"unknown {self.family} policy {name!r}; known: {', '.join(sorted(self.classes))}")

    def params_model(self, name: str) -> type[BaseModel]:
        """The plugin's parameters as a strict pydantic model, from its constructor's signature
        (`seed` is the registry's to pass, not a parameter)."""
        key = self.key(name)
        if key not in self._models:
            sig = inspect.signature(self.classes[key].__init__, eval_str=True)
            fields: dict[str, Any] = {
                p.name: (p.annotation if p.annotation is not inspect.Parameter.empty else Any, p.default)
                for p in list(sig.parameters.values())[1:]
                if p.name != "seed" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
            }
            self._models[key] = create_model(f"{self.classes[key].__name__}Params", __config__=ConfigDict(extra="forbid"), **fields)
        return self._models[key]

    def check_params(self, name: str, params: Mapping[str, Any]) -> dict[str, Any]:
        """`params` validated and converted for `name`, else a ValueError naming each bad one."""
        try:
            model = self.params_model(name).model_validate(dict(params))
        except ValidationError as e:
            bad = "; ".join(f"{'.'.join(str(x) for x in err['loc'])}: {err['msg']}" for err in e.errors())
            known = ", ".join(self.params_model(name).model_fields) or "none"
            raise ValueError(f"parameters of {self.family} policy {name!r}: {bad} (its parameters: {known})") from None
        return model.model_dump(exclude_unset=True)

    def make(self, name: str, seed: int = 0, **params: Any) -> T:
        key = self.key(name)
        cls = self.classes[key]
        kw = self.check_params(key, params)
        if "seed" in inspect.signature(cls.__init__).parameters:
            kw["seed"] = seed
        return cls(**kw)


ORDERING: Registry[OrderingPolicy] = Registry(
    "ordering", (GMAX, FCFS, EDF, SJF, LTR, PLAS, SlideBatching, StrictPriority, WeightedVTC, SimulatedAnnealing))
PLACEMENT: Registry[PlacementPolicy] = Registry(
    "placement", (GoRouting, GoRoutingPD, PowerOfK, LeastLoad, RoundRobin, RandomPlacement, PowerOfTwo, CacheAware, PrefixScore, SessionHash))


def check_policy(family: str, name: str) -> str:
    """The canonical key of a `family` ("ordering" or "placement") policy, else a ValueError listing the known ones."""
    return (ORDERING if family == "ordering" else PLACEMENT).key(name)


def make_ordering(name: str, seed: int = 0, **params: Any) -> OrderingPolicy:
    return ORDERING.make(name, seed, **params)


def make_placement(name: str, seed: int = 0, **params: Any) -> PlacementPolicy:
    return PLACEMENT.make(name, seed, **params)


def parse_combo(combo: str) -> tuple[str, str]:
    """'gmax+gorouting' -> ('gmax', 'gorouting'), validating both names (and each policy's
    parameters, if any: `gmax?lead_factor=0+gorouting?balance=count`, see `ordering_params`)."""
    if combo.count("+") != 1:
        raise ValueError(f"policy combination must be ORDERING+PLACEMENT, got {combo!r}")
    o, p = combo.split("+")
    o, params = ordering_params(o)
    p, p_params = ordering_params(p)
    name = check_policy("ordering", o)
    ORDERING.check_params(ORDERING.key(name), params)
    p_name = check_policy("placement", p)
    PLACEMENT.check_params(PLACEMENT.key(p_name), p_params)
    return name, p_name


def ordering_params(spec: str) -> tuple[str, dict[str, Any]]:
    """'gmax?lead_factor=0&preempt=false' -> ('gmax', {'lead_factor': 0, 'preempt': False}): a
    policy's parameters inside a combination (the simulator's `--policies`), values as YAML."""
    import yaml

    name, _, query = spec.partition("?")
    params: dict[str, Any] = {}
    for kv in filter(None, query.split("&")):
        k, eq, v = kv.partition("=")
        if not eq:
            raise ValueError(f"ordering parameter {kv!r}: expected NAME=VALUE")
        params[k] = yaml.safe_load(v)
    return name, params
