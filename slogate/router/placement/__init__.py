from slogate.router.placement.base import PlacementPolicy
from slogate.router.placement.cache_aware import CacheAware, PrefixScore, SessionHash
from slogate.router.placement.gorouting import GoRouting, GoRoutingPD
from slogate.router.placement.pok import PowerOfK
from slogate.router.placement.simple import LeastLoad, PowerOfTwo, RandomPlacement, RoundRobin

__all__ = ["CacheAware", "GoRouting", "GoRoutingPD", "LeastLoad", "PlacementPolicy", "PowerOfK", "PowerOfTwo", "PrefixScore", "RandomPlacement", "RoundRobin", "SessionHash"]
