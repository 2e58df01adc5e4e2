"""Ordering policies: one module each, named for its registry key (`router/registry.py`)."""

from slogate.router.policies.base import KeyOrdering, OrderingPolicy, Selection
from slogate.router.policies.edf import EDF
from slogate.router.policies.fcfs import FCFS
from slogate.router.policies.gmax import GMAX
from slogate.router.policies.ltr import LTR
from slogate.router.policies.plas import PLAS
from slogate.router.policies.priority import StrictPriority
from slogate.router.policies.simulated_annealing import SimulatedAnnealing
from slogate.router.policies.sjf import SJF
from slogate.router.policies.slide import SlideBatching
from slogate.router.policies.vtc import WeightedVTC

__all__ = [
    "EDF", "FCFS", "GMAX", "LTR", "PLAS", "SJF", "KeyOrdering", "OrderingPolicy", "Selection",
    "SimulatedAnnealing", "SlideBatching", "StrictPriority", "WeightedVTC",
]
