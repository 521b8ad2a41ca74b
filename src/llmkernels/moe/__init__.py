"""The Mixture-of-Experts feed-forward block around the grouped matmul, and the routing functions it uses."""

from ..ops import combine, dispatch, select_experts
from ..routing import SCORINGS, dispatch_reference, route
from .fused import fused_experts
from .layer import MoEFeedForward

__all__ = [
    "MoEFeedForward",
    "fused_experts",
    "route",
    "select_experts",
    "dispatch",
    "dispatch_reference",
    "combine",
    "SCORINGS",
]
