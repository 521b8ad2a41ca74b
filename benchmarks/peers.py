"""The peers benchmarks run beside llmkernels, written once: PyTorch's SDPA with a chosen backend (flash,
cuDNN) and FlexAttention (inputs in SDPA's layout ``[B, H, S, D]``), and a Mixture-of-Experts block in plain
PyTorch ops. Each function returns a zero-argument callable or a function of the input (what the timers take)."""

from __future__ import annotations

import torch

_COMPILED_FLEX = {}


def sdpa_backend(name: str):
    """``"flash"``, ``"cudnn"``, ``"efficient"`` or ``"math"`` → the ``SDPBackend``."""
    from torch.nn.attention import SDPBackend

    return {
        "flash": SDPBackend.FLASH_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "math": SDPBackend.MATH,
    }[name]


def sdpa_runner(backend: str, q, k, v, *, causal: bool = False, attn_mask=None):
    """SDPA under one backend (GQA when k has fewer heads than q); ``attn_mask`` bool ``[Sq, Skv]``."""
    from torch.nn.attention import sdpa_kernel

    chosen = sdpa_backend(backend)
    enable_gqa = q.shape[1] != k.shape[1]

    def run():
        with sdpa_kernel(chosen):
            return torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=attn_mask, is_causal=causal, enable_gqa=enable_gqa
            )

    return run


def lower_right_mask(q_len: int, kv_len: int, device) -> torch.Tensor:
    """bool ``[q_len, kv_len]``, bottom-right aligned causal: query i sees keys ``j <= i + kv_len - q_len`` (SDPA's
    ``attn_mask``)."""
    rows = torch.arange(q_len, device=device)[:, None]
    return torch.arange(kv_len, device=device)[None, :] <= rows + kv_len - q_len


def causal_mask_mod(q_len: int, kv_len: int):
    """FlexAttention ``mask_mod`` of bottom-right aligned causal attention (query i sees keys
    ``j <= i + kv_len - q_len``)."""
    offset = kv_len - q_len
    return lambda b, h, q_idx, kv_idx: kv_idx <= q_idx + offset


def flex_runner(q, k, v, mask_mod=None):
    """FlexAttention, compiled once per process (one graph per shape: the recompile limits are raised so
    that a sweep never falls back to the unfused eager path), with the block mask of ``mask_mod``."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if "fn" not in _COMPILED_FLEX:
        torch._dynamo.config.recompile_limit = 64
        torch._dynamo.config.accumulated_recompile_limit = 1024
        _COMPILED_FLEX["fn"] = torch.compile(flex_attention, dynamic=False)
    block_mask = None
    if mask_mod is not None:
        block_mask = create_block_mask(mask_mod, None, None, q.shape[2], k.shape[2], device=q.device)
    enable_gqa = q.shape[1] != k.shape[1]
    return lambda: _COMPILED_FLEX["fn"](q, k, v, block_mask=block_mask, enable_gqa=enable_gqa)


def moe_batched_mm_runner(router_weight, w_gate_up, w_down, top_k: int):
    """A Mixture-of-Experts block in plain PyTorch ops, the way transformers' ``batched_mm`` experts run a
    decode step: softmax top-k routing (renormalized), each copy's expert weights gathered and applied with
    ``torch.bmm`` in bf16, SwiGLU, weighted sum. Weights as :meth:`MoEFeedForward.from_float` takes them
    (``[E, H]``, ``[E, 2I, H]``, ``[E, H, I]``); returns ``run(x [T, H] bf16) -> [T, H]``. Meant for a few
    tokens: it materializes every copy's weights."""
    router = router_weight.float()
    w_gate_up, w_down = w_gate_up.to(torch.bfloat16), w_down.to(torch.bfloat16)
    intermediate = w_down.shape[2]

    def run(x):
        weights, ids = torch.topk((x.float() @ router.t()).softmax(-1), top_k)
        weights = weights / weights.sum(-1, keepdim=True)
        copies = x.repeat_interleave(top_k, 0)[:, :, None]  # [T·k, H, 1]
        gate_up = torch.bmm(w_gate_up[ids.view(-1)], copies)  # [T·k, 2I, 1]
        h = torch.nn.functional.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:]
        y = torch.bmm(w_down[ids.view(-1)], h).view(x.shape[0], top_k, -1)  # [T, k, H]
        return (y.float() * weights[..., None]).sum(1).to(x.dtype)

    return run


class TritonKernelsExperts:
    """OpenAI's ``triton_kernels.matmul_ogs`` (Triton repository, tag v3.6.0; pure Python, never a dependency of
    this project: carried beside it, e.g. ``PYTHONPATH=.peers/triton_kernels``) on one expert projection:
    bf16 × MXFP4 weights in its Hopper value and scale layouts, and bf16 × bf16. Rows arrive grouped by
    expert (ragged routing metadata, one expert per row, no gather or scatter), as ours do.

    ``w``: bf16 ``[E, N, K]``. Raises ``ImportError`` when the package is not importable.
    """

    def __init__(self, w: torch.Tensor, scale_warps: int = 8):
        from triton_kernels.matmul_ogs import PrecisionConfig, matmul_ogs
        from triton_kernels.numerics_details.mxfp import downcast_to_mxfp
        from triton_kernels.tensor import FP4, convert_layout, wrap_torch_tensor
        from triton_kernels.tensor_details import layout

        self._matmul = matmul_ogs
        self.w_t = w.transpose(-2, -1)  # its logical [E, K, N], K contiguous
        data, scales = downcast_to_mxfp(self.w_t, torch.uint8, axis=1)  # quantized along K
        value_layout, value_options = layout.make_default_matmul_mxfp4_w_layout(mx_axis=1)
        scale_layout, scale_options = layout.make_default_matmul_mxfp4_w_scale_layout(mx_axis=1, num_warps=scale_warps)
        self.w_mxfp4 = convert_layout(wrap_torch_tensor(data, dtype=FP4), value_layout, **value_options)
        self.precision = PrecisionConfig(
            weight_scale=convert_layout(wrap_torch_tensor(scales), scale_layout, **scale_options)
        )

    @staticmethod
    def _routing(offsets: torch.Tensor):
        from triton_kernels.matmul_ogs import RoutingData
        from triton_kernels.tensor import make_ragged_tensor_metadata

        sizes = (offsets[1:] - offsets[:-1]).to(torch.int32)
        rows = int(offsets[-1])
        metadata = make_ragged_tensor_metadata(sizes, rows)
        return RoutingData(
            None,
            metadata.slice_sizes,
            sizes.numel(),
            1,
            metadata,
            expected_tokens_per_expt=max(1, rows // max(sizes.numel(), 1)),
        )

    def mxfp4(self, x: torch.Tensor, offsets: torch.Tensor):
        """bf16 ``x [rows, K]`` × MXFP4 weights, groups at ``offsets`` (int32 ``[E + 1]``)."""
        routing = self._routing(offsets)
        return lambda: self._matmul(x, self.w_mxfp4, None, routing, precision_config=self.precision)

    def bf16(self, x: torch.Tensor, offsets: torch.Tensor):
        routing = self._routing(offsets)
        return lambda: self._matmul(x, self.w_t, None, routing)
