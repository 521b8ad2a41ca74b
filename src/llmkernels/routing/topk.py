"""Router: scores of every expert per token → the top-k experts and their weights, on the device."""
from __future__ import annotations

import torch

from .._runtime import describe

__all__ = ["route", "check_selection", "SCORINGS"]

SCORINGS = ("softmax", "sigmoid")


def route(router_logits: torch.Tensor, top_k: int, *, scoring: str = "softmax", renormalize: bool = True,
          num_groups: int | None = None, topk_groups: int | None = None,
          correction_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing.

    Args:
        router_logits: ``[T, E]`` router outputs (any float dtype; computed in float32).
        top_k: experts per token, ``1 <= top_k <= E``.
        scoring: ``"softmax"`` (Mixtral, Qwen3, gpt-oss) or ``"sigmoid"`` (DeepSeek-V3) of the logits.
        renormalize: divide each token's k weights by their sum.
        num_groups, topk_groups: DeepSeek-style grouped selection: experts in ``num_groups`` equal
            groups, a group scored by the sum of its two best experts, experts picked only from the
            ``topk_groups`` best groups.
        correction_bias: optional float32 ``[E]`` added to the scores for the selection only
            (DeepSeek-V3's load-balancing bias); the weights come from the unbiased scores.

    Returns:
        ``(weights, expert_ids)``: float32 ``[T, top_k]`` and int32 ``[T, top_k]``.

    Plain PyTorch: any strides, and differentiable (the weights carry the logits' gradient).

    Raises:
        TypeError: router_logits not a floating tensor, correction_bias not a floating tensor, top_k /
            num_groups / topk_groups not ints.
        ValueError: router_logits not 2D, top_k outside [1, E], unknown scoring, num_groups not dividing E
            or < 1, topk_groups outside [1, num_groups], correction_bias not ``[E]`` or on another device.
    """
    check_selection(router_logits, top_k, scoring, correction_bias)
    num_experts = router_logits.shape[1]
    if num_groups is not None or topk_groups is not None:
        _check_int("num_groups", num_groups)
        _check_int("topk_groups", topk_groups)
        if num_groups < 1 or num_experts % num_groups or not 1 <= topk_groups <= num_groups:
            raise ValueError(f"num_groups ({num_groups}) must be >= 1 and divide E ({num_experts}), and topk_groups "
                             f"({topk_groups}) lie in [1, num_groups]")
    logits = router_logits.float()
    scores = logits.softmax(-1) if scoring == "softmax" else logits.sigmoid()
    selection = scores if correction_bias is None else scores + correction_bias.float()
    if num_groups is not None:
        grouped = selection.view(-1, num_groups, num_experts // num_groups)
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(topk_groups, dim=-1).indices, True)
        selection = grouped.masked_fill(~keep[..., None], float("-inf")).view(-1, num_experts)
    expert_ids = selection.topk(top_k, dim=-1).indices
    weights = scores.gather(1, expert_ids)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, expert_ids.to(torch.int32)


def check_selection(router_logits, top_k, scoring, correction_bias) -> None:
    """The checks :func:`route` and :func:`llmkernels.routing.select_experts` share: floating ``[T, E]``
    logits, an int ``top_k`` in ``[1, E]``, a known scoring, a fitting correction bias."""
    if not isinstance(router_logits, torch.Tensor) or not router_logits.is_floating_point():
        raise TypeError(f"router_logits must be a floating [T, E] tensor, got {describe(router_logits)}")
    if router_logits.dim() != 2:
        raise ValueError(f"router_logits must be [T, E], got shape {tuple(router_logits.shape)}")
    num_experts = router_logits.shape[1]
    _check_int("top_k", top_k)
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be an int in [1, {num_experts}], got {top_k!r}")
    if scoring not in SCORINGS:
        raise ValueError(f"scoring must be one of {SCORINGS}, got {scoring!r}")
    check_correction_bias(correction_bias, num_experts, router_logits.device)


def check_correction_bias(correction_bias, num_experts: int, device: torch.device | None = None) -> None:
    """None, or a floating ``[E]`` tensor (on ``device`` when given); raises TypeError / ValueError."""
    if correction_bias is None:
        return
    if not isinstance(correction_bias, torch.Tensor) or not correction_bias.is_floating_point():
        raise TypeError(f"correction_bias must be a floating [E] tensor, got {describe(correction_bias)}")
    if tuple(correction_bias.shape) != (num_experts,):
        raise ValueError(f"correction_bias must be [E] = [{num_experts}], got {tuple(correction_bias.shape)}")
    if device is not None and correction_bias.device != device:
        raise ValueError(f"correction_bias is on {correction_bias.device} but router_logits on {device}")


def _check_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")

