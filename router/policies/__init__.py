from router.policies.base import KeyOrdering, OrderingPolicy, Selection
from router.policies.gmax import GMAX
from router.policies.sa import SimulatedAnnealing
from router.policies.simple import EDF, FCFS, LTR, PLAS, SJF, StrictPriority
from router.policies.slide import SlideBatching
from router.policies.vtc import WeightedVTC

__all__ = [
    "EDF", "FCFS", "GMAX", "LTR", "PLAS", "SJF", "KeyOrdering", "OrderingPolicy", "Selection",
    "SimulatedAnnealing", "SlideBatching", "StrictPriority", "WeightedVTC",
]
