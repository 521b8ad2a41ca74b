"""Token routing for Mixture-of-Experts: top-k selection, the expert-sorted layout of the token copies
(dispatch), the router-weighted sum back (combine), and the expert-parallel exchange's plan and row gather."""

from .combine import combine
from .dispatch import dispatch, dispatch_reference
from .exchange import gather_rows, plan_exchange
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
    "plan_exchange",
    "gather_rows",
]
