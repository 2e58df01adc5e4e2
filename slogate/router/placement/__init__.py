"""Placement policies: one module each, named for its registry key (`router/registry.py`)."""

from slogate.router.placement.base import PlacementPolicy
from slogate.router.placement.cache_aware import CacheAware
from slogate.router.placement.gorouting import GoRouting
from slogate.router.placement.gorouting_pd import GoRoutingPD
from slogate.router.placement.least_load import LeastLoad
from slogate.router.placement.power_of_k import PowerOfK
from slogate.router.placement.power_of_two import PowerOfTwo
from slogate.router.placement.prefix_score import PrefixScore
from slogate.router.placement.random import RandomPlacement
from slogate.router.placement.round_robin import RoundRobin
from slogate.router.placement.session_hash import SessionHash

__all__ = ["CacheAware", "GoRouting", "GoRoutingPD", "LeastLoad", "PlacementPolicy", "PowerOfK", "PowerOfTwo", "PrefixScore", "RandomPlacement",
           "RoundRobin", "SessionHash"]
