"""Router: scores of every expert per token → the top-k experts and their weights, on the device."""

from __future__ import annotations

import torch

from ..runtime import describe

__all__ = ["route", "check_selection", "check_routing", "check_groups", "check_correction_bias", "SCORINGS"]

SCORINGS = ("softmax", "sigmoid")


def route(
    router_logits: torch.Tensor,
    top_k: int,
    *,
    scoring: str = "softmax",
    renormalize: bool = True,
    num_groups: int | None = None,
    topk_groups: int | None = None,
    correction_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing.

    Args:
        router_logits: ``[T, E]`` router outputs (any float dtype; computed in float32).
        top_k: experts per token, ``1 <= top_k <= E``.
        scoring: ``"softmax"`` (Mixtral, Qwen3, gpt-oss) or ``"sigmoid"`` (DeepSeek-V3) of the logits.
        renormalize: divide each token's k weights by their sum; without it the weights are the
            picked experts' scores themselves (no scaling factor is applied either way).
        num_groups, topk_groups: DeepSeek-V3's grouped selection: experts in ``num_groups`` equal groups
            of consecutive ids, a group scored by the sum of its two best selection scores (its one score
            for groups of one expert), experts picked only from the ``topk_groups`` best groups, which
            must hold at least ``top_k`` experts.
        correction_bias: optional float32 ``[E]`` added to the scores for the selection only, group
            scores included (DeepSeek-V3's load-balancing bias); the weights come from the unbiased scores.

    Returns:
        ``(weights, expert_ids)``: float32 ``[T, top_k]`` and int32 ``[T, top_k]``, the experts in
        decreasing order of selection score.

    Plain PyTorch: any strides, and differentiable (the weights carry the logits' gradient).

    Raises:
        TypeError: router_logits not a floating tensor, correction_bias not a floating tensor, top_k /
            num_groups / topk_groups not ints.
        ValueError: router_logits not 2D, top_k outside [1, E], unknown scoring, num_groups not dividing E
            or < 1, topk_groups outside [1, num_groups], kept groups holding fewer than top_k experts,
            correction_bias not ``[E]`` or on another device.
    """
    check_selection(router_logits, top_k, scoring, correction_bias)
    num_experts = router_logits.shape[1]
    check_groups(num_experts, top_k, num_groups, topk_groups)
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
    check_routing(router_logits.shape[1], top_k, scoring, None, None, correction_bias, router_logits.device)


def check_routing(
    num_experts: int, top_k, scoring, num_groups, topk_groups, correction_bias, device: torch.device | None = None
) -> None:
    """Every routing argument of :func:`route` for ``num_experts`` experts, without the logits (what a
    block checks when it is built).

    Raises:
        TypeError: top_k, num_groups or topk_groups not ints, correction_bias not a floating tensor.
        ValueError: top_k outside ``[1, E]``, an unknown scoring, groups that do not fit (:func:`check_groups`),
            correction_bias not ``[E]`` or not on ``device``.
    """
    _check_int("top_k", top_k)
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be an int in [1, {num_experts}], got {top_k!r}")
    if scoring not in SCORINGS:
        raise ValueError(f"scoring must be one of {SCORINGS}, got {scoring!r}")
    check_groups(num_experts, top_k, num_groups, topk_groups)
    check_correction_bias(correction_bias, num_experts, device)


def check_groups(num_experts: int, top_k: int, num_groups, topk_groups) -> None:
    """None for both, or ints with ``num_groups >= 1`` dividing E, ``1 <= topk_groups <= num_groups``, and
    the kept groups holding at least ``top_k`` experts (else the selection would pick masked-out experts).

    Raises:
        TypeError: one of them None or not an int.
        ValueError: values that do not fit.
    """
    if num_groups is None and topk_groups is None:
        return
    _check_int("num_groups", num_groups)
    _check_int("topk_groups", topk_groups)
    if num_groups < 1 or num_experts % num_groups or not 1 <= topk_groups <= num_groups:
        raise ValueError(
            f"num_groups ({num_groups}) must be >= 1 and divide E ({num_experts}), and topk_groups "
            f"({topk_groups}) lie in [1, num_groups]"
        )
    if top_k > topk_groups * (num_experts // num_groups):
        raise ValueError(
            f"top_k ({top_k}) exceeds the {topk_groups * (num_experts // num_groups)} experts of the "
            f"topk_groups ({topk_groups}) kept groups of E / num_groups = {num_experts // num_groups}"
        )


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
