from router.placement.base import PlacementPolicy
from router.placement.cache_aware import CacheAware, PrefixScore, SessionHash
from router.placement.gorouting import GoRouting, GoRoutingPD
from router.placement.pok import PowerOfK
from router.placement.simple import LeastLoad, PowerOfTwo, RandomPlacement, RoundRobin

__all__ = ["CacheAware", "GoRouting", "GoRoutingPD", "LeastLoad", "PlacementPolicy", "PowerOfK", "PowerOfTwo", "PrefixScore", "RandomPlacement", "RoundRobin", "SessionHash"]
