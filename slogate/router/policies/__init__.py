from slogate.router.policies.base import KeyOrdering, OrderingPolicy, Selection
from slogate.router.policies.gmax import GMAX
from slogate.router.policies.sa import SimulatedAnnealing
from slogate.router.policies.simple import EDF, FCFS, LTR, PLAS, SJF, StrictPriority
from slogate.router.policies.slide import SlideBatching
from slogate.router.policies.vtc import WeightedVTC

__all__ = [
    "EDF", "FCFS", "GMAX", "LTR", "PLAS", "SJF", "KeyOrdering", "OrderingPolicy", "Selection",
    "SimulatedAnnealing", "SlideBatching", "StrictPriority", "WeightedVTC",
]
