"""The Mixture-of-Experts feed-forward block around the grouped matmul, and the routing functions it uses."""
from ..ops import combine, dispatch
from ..routing import SCORINGS, dispatch_reference, route
from .layer import MoEFeedForward

__all__ = ["MoEFeedForward", "route", "dispatch", "dispatch_reference", "combine", "SCORINGS"]
