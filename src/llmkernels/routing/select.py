"""select_experts(): :func:`llmkernels.moe.route` without expert groups as one Triton launch (scores, top-k,
weights), for the forward-only MoE block, where PyTorch's softmax, topk, gather, sum and division would be
six launches of host time per decode step."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import runtime
from ..launch import BoundKernel, PlanCache, bind
from ..runtime import check_device, forward_only, next_power_of_2
from .topk import check_selection

__all__ = ["select_experts"]


@triton.jit
def _select_kernel(
    logits_ptr,
    bias_ptr,
    weights_ptr,
    ids_ptr,
    stride_logits,
    num_experts,
    TOP_K: tl.constexpr,
    SOFTMAX: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One program per token: scores of its ``num_experts`` logits, the ``TOP_K`` best (ties: the lowest
    expert id) by ``score + bias``, their unbiased scores as weights. A NaN logit makes the token's weights
    NaN (as torch's softmax and topk would), never a silent pick among the others."""
    token = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, BLOCK_E)
    valid = experts < num_experts
    logits = tl.load(logits_ptr + token * stride_logits + experts, mask=valid, other=float("-inf")).to(tl.float32)
    has_nan = tl.sum((logits != logits).to(tl.int32), axis=0) > 0
    if SOFTMAX:
        shifted = tl.exp(logits - tl.max(logits, axis=0))
        scores = shifted / tl.sum(shifted, axis=0)
    else:
        scores = tl.sigmoid(logits)
    selection = scores
    if HAS_BIAS:
        selection += tl.load(bias_ptr + experts, mask=valid, other=0.0).to(tl.float32)
    selection = tl.where(valid, selection, float("-inf"))
    slots = tl.arange(0, BLOCK_K)
    picked = tl.zeros([BLOCK_K], dtype=tl.int32)
    weights = tl.zeros([BLOCK_K], dtype=tl.float32)
    for slot in tl.static_range(TOP_K):
        best = tl.max(selection, axis=0)
        expert = tl.min(tl.where(selection == best, experts, BLOCK_E), axis=0)
        expert = tl.where(expert < num_experts, expert, 0)  # no candidate left equal to the max: NaN row
        weight = tl.sum(tl.where(experts == expert, scores, 0.0), axis=0)
        picked = tl.where(slots == slot, expert, picked)
        weights = tl.where(slots == slot, weight, weights)
        selection = tl.where(experts == expert, float("-inf"), selection)
    if RENORMALIZE:
        weights = weights / tl.sum(tl.where(slots < TOP_K, weights, 0.0), axis=0)
    weights = tl.where(has_nan, float("nan"), weights)
    tl.store(weights_ptr + token * TOP_K + slots, weights, mask=slots < TOP_K)
    tl.store(ids_ptr + token * TOP_K + slots, picked, mask=slots < TOP_K)


def select_experts(
    router_logits: torch.Tensor,
    top_k: int,
    *,
    scoring: str = "softmax",
    renormalize: bool = True,
    correction_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`llmkernels.moe.route` without ``num_groups`` in one launch (forward only, no autograd).

    Args:
        router_logits: float ``[T, E]`` (any strides; computed in float32).
        top_k: ``1 <= top_k <= E``; scoring ``"softmax"`` or ``"sigmoid"``; renormalize and
            correction_bias (float ``[E]``) as in :func:`route`.

    Returns:
        ``(weights, expert_ids)``: float32 ``[T, top_k]`` and int32 ``[T, top_k]``, the experts in
        decreasing order of biased score (ties: the lowest id first).

    Raises:
        TypeError: router_logits not a floating tensor, top_k not an int, correction_bias not floating.
        ValueError: router_logits not 2D, top_k outside [1, E], unknown scoring, correction_bias not ``[E]``
            or on another device, a CPU tensor outside the interpreter, an input that requires grad.
    """
    key, plan = PLANS.lookup(router_logits, top_k, scoring, renormalize, correction_bias)
    if plan is None:
        _check(router_logits, top_k, scoring, correction_bias)
        plan = PLANS.put(key, _Plan(router_logits, top_k, scoring, renormalize, correction_bias is not None))
    return plan(router_logits, correction_bias)


PLANS = PlanCache("select_experts")


def _check(router_logits, top_k, scoring, correction_bias) -> None:
    check_selection(router_logits, top_k, scoring, correction_bias)
    check_device(router_logits=router_logits, correction_bias=correction_bias)
    forward_only("select_experts", router_logits=router_logits, correction_bias=correction_bias)


class _Plan:
    def __init__(self, logits, top_k: int, scoring: str, renormalize: bool, has_bias: bool):
        self.num_tokens, self.num_experts = logits.shape
        self.top_k, self.scoring, self.renormalize, self.has_bias = top_k, scoring, renormalize, has_bias
        self.device = logits.device
        self.bound = None

    def __call__(self, logits, bias) -> tuple[torch.Tensor, torch.Tensor]:
        weights = runtime.new_buffer((self.num_tokens, self.top_k), torch.float32, self.device)
        ids = runtime.new_buffer((self.num_tokens, self.top_k), torch.int32, self.device)
        if self.num_tokens == 0:
            return weights, ids
        logits = runtime.unit_last_stride(logits)
        bias = bias.contiguous() if bias is not None else weights
        (self.bound or self._bind(logits, bias, weights, ids))(logits, bias, weights, ids)
        return weights, ids

    def _bind(self, logits, bias, weights, ids) -> BoundKernel:
        self.bound = bind(
            _select_kernel,
            (self.num_tokens,),
            logits,
            bias,
            weights,
            ids,
            logits.stride(0),
            self.num_experts,
            TOP_K=self.top_k,
            SOFTMAX=self.scoring == "softmax",
            HAS_BIAS=self.has_bias,
            RENORMALIZE=self.renormalize,
            BLOCK_E=next_power_of_2(self.num_experts),
            BLOCK_K=next_power_of_2(self.top_k),
        )
        return self.bound
