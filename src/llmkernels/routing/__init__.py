"""Token routing for Mixture-of-Experts: top-k selection, the expert-sorted layout of the token copies
(dispatch) and the router-weighted sum back (combine). ``routing.exchange`` holds the expert-parallel exchange's
internal kernels."""

from .combine import combine
from .dispatch import dispatch, dispatch_reference
from .select import select_experts
from .topk import SCORINGS, check_correction_bias, check_routing, route

__all__ = [
    "route",
    "select_experts",
    "SCORINGS",
    "check_correction_bias",
    "check_routing",
    "dispatch",
    "dispatch_reference",
    "combine",
]
