"""vLLM's ``fused_experts`` call shape on our grouped matmuls: a drop-in for code written against
``vllm.model_executor.layers.fused_moe.fused_experts``, with quantized weights as ScaledTensors."""

from __future__ import annotations

import torch

from ..formats import FORMATS, ScaledTensor, format_spec, unwrap_torchao
from ..formats.layouts import ROW
from ..grouped_matmul import GPT_OSS_SWIGLU, SwiGLU
from ..launch import PlanCache
from ..ops import combine, dispatch, grouped_matmul, quantize
from ..runtime import check_device, describe, first_true, forward_only, has_internal_overlap
from .layer import FP8_ACTIVATION_BLOCK, FP8_WEIGHT_BLOCK, format_family

__all__ = ["fused_experts"]

# vLLM's activation names -> our fused gated epilogues ("swigluoai": gpt-oss', on interleaved w1 rows)
_ACTIVATIONS = {"silu": SwiGLU(), "swigluoai": GPT_OSS_SWIGLU}
_HIDDEN_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # what combine writes
_BIAS_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what the grouped matmul adds
_ID_DTYPES = (torch.int32, torch.int64)
_FP8_WEIGHT_TILE = FP8_WEIGHT_BLOCK[0]  # vLLM's block_shape [128, 128]: the only one fp8 blocks take


def _epilogue(activation) -> SwiGLU:
    if isinstance(activation, SwiGLU):
        return activation
    if isinstance(activation, str) and activation in _ACTIVATIONS:
        return _ACTIVATIONS[activation]
    raise NotImplementedError(f"activation={activation!r}: supported {sorted(_ACTIVATIONS)} or a SwiGLU")


def _check_hidden_states(hidden_states, inplace: bool) -> None:
    if (
        not isinstance(hidden_states, torch.Tensor)
        or hidden_states.dim() != 2
        or hidden_states.dtype not in _HIDDEN_DTYPES
    ):
        raise TypeError(f"hidden_states must be a bf16/fp16/fp32 [T, K] tensor, got {describe(hidden_states)}")
    if inplace and has_internal_overlap(hidden_states):
        raise ValueError(
            f"hidden_states has elements that share memory (strides {hidden_states.stride()}, e.g. an "
            f"expanded view): inplace=True cannot write it"
        )


def _check_weights(w1, w2, activation_format: str, epilogue: SwiGLU) -> None:
    """Shapes, and the format pairs and layouts the two grouped matmuls take (their activations are bf16, or
    quantized to ``activation_format``)."""
    for name, weight in (("w1", w1), ("w2", w2)):
        if isinstance(weight, ScaledTensor):
            weight.validate()
            if weight.format == "fp8" and tuple(weight.block) != FP8_WEIGHT_BLOCK:
                raise ValueError(f"{name} in fp8 must have block={FP8_WEIGHT_BLOCK}, got block={weight.block}")
        elif isinstance(weight, torch.Tensor) and weight.dtype == torch.float8_e4m3fn:
            raise TypeError(
                f"{name} is a float8_e4m3fn tensor: pass use_fp8_w8a8=True, block_shape=[128, 128] and "
                f"{name}_scale (its float32 block scales), or a ScaledTensor"
            )
        elif not isinstance(weight, torch.Tensor) or weight.dtype != torch.bfloat16:
            raise TypeError(f"{name} must be a bf16 tensor or a ScaledTensor, got {describe(weight)}")
        if len(weight.shape) != 3:
            raise ValueError(f"{name} must have 3 dims, got shape {tuple(weight.shape)}")
    num_experts, two_n, k = w1.shape
    if two_n % 2 or tuple(w2.shape) != (num_experts, k, two_n // 2):
        raise ValueError(f"w1 [E, 2N, K] and w2 [E, K, N] do not fit: w1 {tuple(w1.shape)}, w2 {tuple(w2.shape)}")
    if activation_format not in ("bf16", *FORMATS):
        raise ValueError(f"activation_format must be 'bf16' or one of {tuple(FORMATS)}, got {activation_format!r}")
    if activation_format != "bf16":
        for name, weight in (("w1", w1), ("w2", w2)):
            if not isinstance(weight, ScaledTensor) or format_family(weight.format) != format_family(activation_format):
                raise TypeError(
                    f"activation_format {activation_format} needs {name} quantized to a format of its "
                    f"family (nvfp4 pairs only with nvfp4, fp8 only with fp8), got {getattr(weight, 'format', 'bf16')}"
                )
    if activation_format not in ("bf16", "fp8"):  # fp8 blocks take partial tiles
        block = format_spec(activation_format).block
        if k % block or (two_n // 2) % block:
            raise ValueError(
                f"activation_format {activation_format} quantizes blocks of {block} along K and N, "
                f"got K = {k}, N = {two_n // 2}"
            )
    layout = getattr(w1, "scale_layout", ROW)  # a plain tensor's rows are row-major
    if epilogue.interleaved and layout is not ROW:
        raise ValueError(
            f"interleaved gate and up rows (activation {epilogue}) need w1 with {ROW} scales, got the {layout} layout"
        )
    if (two_n // 2) % layout.rows_per_block:
        raise ValueError(
            f"w1 in the {layout} layout needs N to be a multiple of {layout.rows_per_block}, got N = {two_n // 2}"
        )


def _check_fp8_arguments(
    w1, w2, use_fp8_w8a8, block_shape, w1_scale, w2_scale, a1_scale, a2_scale, per_act_token_quant
) -> tuple:
    """vLLM's fp8 arguments. With ``use_fp8_w8a8``: raw float8_e4m3fn w1 / w2 and their float32 block scales,
    returned as checked fp8 ScaledTensors of block ``(128, 128)``; without it, none of them (w1 and w2 returned as
    given). Static activation scales and per-token quantization are refused in both cases."""
    for name, flag in (("use_fp8_w8a8", use_fp8_w8a8), ("per_act_token_quant", per_act_token_quant)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    if per_act_token_quant:
        raise ValueError(
            "per_act_token_quant=True (per-token activation scales with per-channel weight scales) is not "
            "supported: fp8 blocks scale activations per token and 128 columns (block_shape=[128, 128])"
        )
    for name, scale in (("a1_scale", a1_scale), ("a2_scale", a2_scale)):
        if scale is not None:
            raise ValueError(
                f"{name} must be None: static activation scales are not supported (fp8 blocks quantize the "
                f"activations on the fly, one float32 scale per token and 128 columns)"
            )
    if not use_fp8_w8a8:
        for name, value in (("block_shape", block_shape), ("w1_scale", w1_scale), ("w2_scale", w2_scale)):
            if value is not None:
                raise ValueError(
                    f"{name} goes with use_fp8_w8a8=True (raw float8_e4m3fn weights), got use_fp8_w8a8=False"
                )
        return w1, w2
    if not isinstance(block_shape, (list, tuple)) or list(block_shape) != list(FP8_WEIGHT_BLOCK):
        raise ValueError(
            f"block_shape must be [128, 128] with use_fp8_w8a8=True (per-tensor fp8 and other blocks are not "
            f"supported), got {block_shape!r}"
        )
    weights = []
    for name, weight, scale in (("w1", w1, w1_scale), ("w2", w2, w2_scale)):
        if not isinstance(weight, torch.Tensor) or weight.dtype != torch.float8_e4m3fn or weight.dim() != 3:
            raise TypeError(
                f"{name} must be a float8_e4m3fn [E, rows, cols] tensor with use_fp8_w8a8=True, got {describe(weight)}"
            )
        if scale is None:
            raise ValueError(f"use_fp8_w8a8=True needs {name}_scale, the float32 block scales of {name}")
        if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32:
            raise TypeError(f"{name}_scale must be a float32 tensor, got {describe(scale)}")
        tile = _FP8_WEIGHT_TILE
        expected = (weight.shape[0], -(-weight.shape[1] // tile), -(-weight.shape[2] // tile))
        if tuple(scale.shape) != expected:
            raise ValueError(
                f"{name}_scale must be [E, ceil(rows / 128), ceil(cols / 128)] = {list(expected)} for {name} of "
                f"shape {tuple(weight.shape)}, got {tuple(scale.shape)}"
            )
        if scale.device != weight.device:
            raise ValueError(f"{name}_scale is on {scale.device} but {name} on {weight.device}")
        weights.append(ScaledTensor(weight, scale, "fp8", block=FP8_WEIGHT_BLOCK))
    return tuple(weights)


def _check_routing(topk_weights, topk_ids, num_tokens: int) -> None:
    if not isinstance(topk_ids, torch.Tensor) or topk_ids.dtype not in _ID_DTYPES:
        raise TypeError(f"topk_ids must be an int32/int64 [T, top_k] tensor, got {describe(topk_ids)}")
    if not isinstance(topk_weights, torch.Tensor) or not topk_weights.is_floating_point():
        raise TypeError(f"topk_weights must be a floating [T, top_k] tensor, got {describe(topk_weights)}")
    if topk_ids.dim() != 2 or topk_weights.shape != topk_ids.shape or topk_ids.shape[0] != num_tokens:
        raise ValueError(
            f"topk_weights and topk_ids must both be [T, top_k] with hidden_states' T = {num_tokens}, "
            f"got {tuple(topk_weights.shape)} and {tuple(topk_ids.shape)}"
        )


def _check_biases(w1_bias, w2_bias, num_experts: int, two_n: int, k: int) -> None:
    for name, bias, rows in (("w1_bias", w1_bias, two_n), ("w2_bias", w2_bias, k)):
        if bias is None:
            continue
        if not isinstance(bias, torch.Tensor) or bias.dtype not in _BIAS_DTYPES:
            raise TypeError(f"{name} must be a float32/bf16/fp16 [E, {rows}] tensor or None, got {describe(bias)}")
        if tuple(bias.shape) != (num_experts, rows):
            raise ValueError(f"{name} must be a [E, {rows}] tensor, got {tuple(bias.shape)}")


def _global_expert_count(global_num_experts, expert_map, num_experts: int) -> int:
    """G, the number of ids topk_ids may hold: ``len(expert_map)`` with a map, E without; ``global_num_experts``
    must be -1 or that number."""
    if expert_map is not None and (
        not isinstance(expert_map, torch.Tensor) or expert_map.dim() != 1 or expert_map.dtype not in _ID_DTYPES
    ):
        raise TypeError(
            f"expert_map must be an int32/int64 [global_num_experts] tensor (-1: not on this rank), "
            f"got {describe(expert_map)}"
        )
    if expert_map is not None and expert_map.numel() == 0:
        raise ValueError("expert_map must hold at least one expert")
    num_global = num_experts if expert_map is None else expert_map.numel()
    if isinstance(global_num_experts, bool) or not isinstance(global_num_experts, int):
        raise TypeError(f"global_num_experts must be an int, got {type(global_num_experts).__name__}")
    if global_num_experts not in (-1, num_global):
        what = (
            f"len(expert_map) = {num_global}" if expert_map is not None else f"w1's E = {num_experts} (no expert_map)"
        )
        raise ValueError(f"global_num_experts must be -1 or {what}, got {global_num_experts}")
    return num_global


def _check(
    hidden_states,
    w1,
    w2,
    topk_weights,
    topk_ids,
    inplace,
    epilogue,
    global_num_experts,
    expert_map,
    w1_bias,
    w2_bias,
    activation_format,
    validate,
    *fp8_arguments,
) -> int:
    """Every check of :func:`fused_experts` that needs no device value (no launch, no sync); returns G."""
    _check_hidden_states(hidden_states, inplace)
    raw_w1, raw_w2 = w1, w2  # vLLM's float8_e4m3fn tensors, before they become ScaledTensors
    w1, w2 = _check_fp8_arguments(w1, w2, *fp8_arguments)
    _check_weights(w1, w2, activation_format, epilogue)
    num_experts, two_n, k = w1.shape
    if hidden_states.shape[1] != k:
        raise ValueError(f"hidden_states [T, K={hidden_states.shape[1]}] does not fit w1 [E, 2N, K={k}]")
    _check_routing(topk_weights, topk_ids, hidden_states.shape[0])
    _check_biases(w1_bias, w2_bias, num_experts, two_n, k)
    num_global = _global_expert_count(global_num_experts, expert_map, num_experts)
    if not isinstance(validate, bool):
        raise TypeError(f"validate must be a bool, got {type(validate).__name__}")
    check_device(
        hidden_states=hidden_states,
        w1=w1,
        w2=w2,
        topk_weights=topk_weights,
        topk_ids=topk_ids,
        expert_map=expert_map,
        w1_bias=w1_bias,
        w2_bias=w2_bias,
    )
    forward_only(
        "fused_experts",
        hidden_states=hidden_states,
        topk_weights=topk_weights,
        w1=raw_w1 if isinstance(raw_w1, torch.Tensor) else None,
        w2=raw_w2 if isinstance(raw_w2, torch.Tensor) else None,
        w1_bias=w1_bias,
        w2_bias=w2_bias,
        w1_scale=fp8_arguments[2],
        w2_scale=fp8_arguments[3],
    )
    return num_global


_CHECKED = PlanCache("fused_experts")  # signatures whose checks passed -> G


def _checked_global_count(*arguments) -> int:
    """:func:`_check` once per call signature (shapes, dtypes, strides, devices, grad state, flags)."""
    if torch.compiler.is_compiling():
        return _check(*arguments)
    key, num_global = _CHECKED.lookup(*arguments)
    if num_global is None:
        num_global = _CHECKED.put(key, _check(*arguments))
    return num_global


def _validate_ids_on_host(
    topk_ids: torch.Tensor, expert_map: torch.Tensor | None, num_global: int, num_experts: int
) -> None:
    """``validate=True``: the ids' and the map's values, read on the host (one sync)."""
    ids = topk_ids.cpu()
    bad = first_true((ids < -1) | (ids >= num_global))
    if bad is not None:
        raise ValueError(
            f"topk_ids must lie in [-1, {num_global}) (-1: no expert): topk_ids[{bad[0]}, {bad[1]}] = {int(ids[bad])}"
        )
    if expert_map is not None:
        local = expert_map.cpu()
        bad = first_true((local < -1) | (local >= num_experts))
        if bad is not None:
            raise ValueError(
                f"expert_map must hold local experts in [-1, {num_experts}) (-1: another rank's): "
                f"expert_map[{bad[0]}] = {int(local[bad])}"
            )


def _local_ids(topk_ids: torch.Tensor, expert_map: torch.Tensor | None, num_global: int) -> torch.Tensor:
    """Each copy's local expert ``[T, top_k]``; any id outside ``[0, E)`` is one :func:`dispatch` drops.

    Without a map the ids are local already (dispatch drops those outside ``[0, E)``). With one, ids outside
    ``[0, G)`` (-1 included) become -1 on the device, so that no id indexes the map out of its bounds (a
    device-side assert on the GPU) nor from its end (a Python-style -1)."""
    if expert_map is None:
        return topk_ids
    ids = topk_ids.long()
    in_range = (ids >= 0) & (ids < num_global)
    return torch.where(in_range, expert_map[ids.clamp(0, num_global - 1)], -1)


def _activation_format(weight, activation_format: str) -> str:
    """What a grouped matmul's activations are quantized to: fp8 (1x128 blocks) for fp8 weights, which take no
    other (bf16 would be quantized inside the grouped matmul, a pass apart from the gather), else
    ``activation_format``."""
    return "fp8" if isinstance(weight, ScaledTensor) and weight.format == "fp8" else activation_format


def _quantize(x: torch.Tensor, format: str, rows: torch.Tensor | None = None) -> ScaledTensor:
    if format == "fp8":
        return quantize(x, "fp8", block=FP8_ACTIVATION_BLOCK, rows=rows)
    return quantize(x, format, rows=rows)


def fused_experts(
    hidden_states: torch.Tensor,
    w1,
    w2,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    inplace: bool = False,
    activation: str = "silu",
    apply_router_weight_on_input: bool = False,
    global_num_experts: int = -1,
    expert_map: torch.Tensor | None = None,
    *,
    w1_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    use_fp8_w8a8: bool = False,
    block_shape: list[int] | None = None,
    w1_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    a1_scale: torch.Tensor | None = None,
    a2_scale: torch.Tensor | None = None,
    per_act_token_quant: bool = False,
    activation_format: str = "bf16",
    validate: bool = False,
) -> torch.Tensor:
    """``out[t] = Σ_j topk_weights[t, j] · (w2[e] act(w1[e] x_t + b1[e]) + b2[e])``, ``e = topk_ids[t, j]``, with
    ``act`` the gated activation of w1's gate and up rows (``silu(gate) · up`` for ``"silu"``).

    Args:
        hidden_states: bf16/fp16/fp32 ``[T, K]`` (any strides).
        w1: ``[E, 2N, K]``, gate rows first (vLLM's ``w13``; interleaved gate, up, gate, ... for
            ``"swigluoai"``); w2: ``[E, K, N]``. bf16 tensors or ScaledTensors (mxfp8 / mxfp4 / nvfp4, row or
            hopper layout: :func:`llmkernels.quantize`; fp8 with ``block=(128, 128)``; interleaved rows need the
            row layout; torchao MX / NVFP4 tensors are read as ScaledTensors), or with ``use_fp8_w8a8`` raw
            float8_e4m3fn tensors (vLLM's fp8 block checkpoints: DeepSeek-V3, Qwen3-FP8).
        topk_weights: float ``[T, top_k]``; topk_ids: int32/int64 ``[T, top_k]``, global expert ids in
            ``[0, G)`` (G: ``global_num_experts``); -1 means no expert.
        inplace: write the result into ``hidden_states`` and return it (every argument is checked before the
            first launch: a call that raises leaves hidden_states as it was).
        activation: ``"silu"`` (SwiGLU), ``"swigluoai"`` (gpt-oss' clamped SwiGLU on interleaved rows, as
            vLLM names it) or a :class:`llmkernels.SwiGLU`; fused into the first grouped matmul.
        apply_router_weight_on_input: scale each token copy's input by its weight instead of its output (as
            vLLM does for top-1 routing; any top_k here).
        global_num_experts, expert_map: expert parallelism as vLLM spells it: ``expert_map[global id]`` is the
            local expert or -1; copies routed to other ranks' experts contribute nothing here.
            ``global_num_experts`` is -1 (G = ``len(expert_map)``, or E without a map) or that same number.
        w1_bias: optional ``[E, 2N]`` (in w1's row order), w2_bias ``[E, K]``: per-expert biases (keyword-only,
            as vLLM's gpt-oss path passes them).
        use_fp8_w8a8, block_shape, w1_scale, w2_scale: vLLM's fp8 block quantization (keyword-only): w1 / w2
            float8_e4m3fn, ``block_shape=[128, 128]`` (the only one taken), ``w1_scale`` float32 ``[E,
            ceil(2N/128), ceil(K/128)]`` and ``w2_scale`` ``[E, ceil(K/128), ceil(N/128)]``: vLLM's (and the
            checkpoints' ``weight_scale_inv``) decode scales, ``w ≈ w1[e, r, c] · w1_scale[e, r // 128, c //
            128]``. They are read in place (no copy). Activations are quantized to fp8 on the fly, one float32
            scale per token and 128 columns (``amax / 448``), the gather of the dispatched copies fused into the
            first quantize; fp8 ScaledTensor weights run the same way, whatever ``activation_format`` (``"bf16"``
            or ``"fp8"``).
        a1_scale, a2_scale: static activation scales: only None is taken (dynamic per-token-group scales, as vLLM
            computes them for block-quantized weights).
        per_act_token_quant: only False is taken (per-token / per-channel fp8 is not supported).
        activation_format: ``"bf16"`` (weight-only) or a format the activations are quantized to before each
            grouped matmul (keyword-only; not vLLM's); it needs w1 and w2 quantized to a format of its family.
        validate: read ``topk_ids`` (and ``expert_map``) on the host first (one sync) and raise on ids outside
            ``[-1, G)`` or map entries outside ``[-1, E)``.

    Out-of-range ids (read on the device, no sync, CUDA-graph capturable): a copy whose id lies outside
    ``[0, G)`` (-1 included), or whose ``expert_map`` entry lies outside ``[0, E)``, contributes nothing to its
    token (its weight is not renormalized away); no id is ever used as an address outside w1, w2 or
    expert_map. ``validate=True`` raises instead, except for -1.

    Returns:
        ``[T, K]`` in hidden_states' dtype.

    Raises:
        TypeError / ValueError: arguments of the wrong type, dtype or device, shapes that do not fit, weights
            that do not pair with ``activation_format``, ``global_num_experts`` other than -1 or G, inplace
            into an expanded hidden_states; with ``use_fp8_w8a8``: weights that are not float8_e4m3fn, a missing
            ``w1_scale`` / ``w2_scale`` or one of another dtype or shape, ``block_shape`` other than ``[128,
            128]``; a raw float8_e4m3fn weight, a scale or a block_shape without ``use_fp8_w8a8``; a1_scale /
            a2_scale not None, ``per_act_token_quant=True``; all before any launch.
        ValueError: an input that requires grad while grad mode is on (fused_experts is forward-only); with
            ``validate=True``, the first bad index of topk_ids or expert_map.
        NotImplementedError: another activation.
    """
    epilogue = _epilogue(activation)
    w1, w2 = unwrap_torchao(w1), unwrap_torchao(w2)
    num_global = _checked_global_count(
        hidden_states,
        w1,
        w2,
        topk_weights,
        topk_ids,
        inplace,
        epilogue,
        global_num_experts,
        expert_map,
        w1_bias,
        w2_bias,
        activation_format,
        validate,
        use_fp8_w8a8,
        tuple(block_shape) if isinstance(block_shape, list) else block_shape,  # a list has no plan key
        w1_scale,
        w2_scale,
        a1_scale,
        a2_scale,
        per_act_token_quant,
    )
    if use_fp8_w8a8:  # checked: views of vLLM's parts
        w1 = ScaledTensor.unchecked(w1, w1_scale, "fp8", block=FP8_WEIGHT_BLOCK)
        w2 = ScaledTensor.unchecked(w2, w2_scale, "fp8", block=FP8_WEIGHT_BLOCK)
    num_experts = w1.shape[0]
    if validate:
        _validate_ids_on_host(topk_ids, expert_map, num_global, num_experts)
    token_of_row, a_offsets, row_of_copy = dispatch(_local_ids(topk_ids, expert_map, num_global), num_experts)
    # rows past the placed copies (dropped ids) hold no token: point them at token 0
    rows = torch.arange(token_of_row.shape[0], device=token_of_row.device)
    token_of_row = torch.where(rows < a_offsets[-1], token_of_row, 0)
    weights = topk_weights.float()
    x = hidden_states.to(torch.bfloat16)
    first_format, second_format = _activation_format(w1, activation_format), _activation_format(w2, activation_format)
    if first_format == "fp8" and not apply_router_weight_on_input:  # the gather inside the quantize kernel
        a = _quantize(x, first_format, rows=token_of_row)
    else:
        a = x[token_of_row]
    if apply_router_weight_on_input:
        weight_of_row = torch.zeros(token_of_row.shape[0], dtype=torch.float32, device=x.device)
        placed = row_of_copy.flatten() >= 0  # an unplaced copy adds 0 to row 0 (accumulate: no lost write)
        weight_of_row.index_put_(
            (torch.where(placed, row_of_copy.flatten(), 0),),
            torch.where(placed, weights.flatten(), 0.0),
            accumulate=True,
        )
        a = (a.float() * weight_of_row[:, None]).to(torch.bfloat16)
        weights = torch.ones_like(weights)
    if first_format != "bf16" and not isinstance(a, ScaledTensor):
        a = _quantize(a, first_format)
    expert_ids = torch.arange(num_experts, dtype=torch.int32, device=x.device)
    h = grouped_matmul(a, w1, a_offsets, expert_ids, epilogue=epilogue, bias=w1_bias)
    if second_format != "bf16":
        h = _quantize(h, second_format)
    y = grouped_matmul(h, w2, a_offsets, expert_ids, bias=w2_bias)
    out = combine(y, row_of_copy, weights, hidden_states.dtype)
    if inplace:
        hidden_states.copy_(out)
        return hidden_states
    return out
