from router.placement.base import PlacementPolicy
from router.placement.gorouting import GoRouting, GoRoutingPD
from router.placement.pok import PowerOfK
from router.placement.simple import LeastLoad, PowerOfTwo, RandomPlacement, RoundRobin

__all__ = ["GoRouting", "GoRoutingPD", "LeastLoad", "PlacementPolicy", "PowerOfK", "PowerOfTwo", "RandomPlacement", "RoundRobin"]
