"""The Mixture-of-Experts feed-forward block around the grouped matmul."""
from .combine import combine
from .dispatch import dispatch, dispatch_reference
from .layer import MoEFeedForward
from .routing import SCORINGS, route

__all__ = ["MoEFeedForward", "route", "dispatch", "dispatch_reference", "combine", "SCORINGS"]
