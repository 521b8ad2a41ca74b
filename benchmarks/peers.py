"""The peers benchmarks run beside llmkernels, written once: PyTorch's SDPA with a chosen backend (flash,
cuDNN) and FlexAttention (inputs in SDPA's layout ``[B, H, S, D]``), cuDNN's FP8 attention through the cuDNN
frontend's Python graph API, and a Mixture-of-Experts block in plain PyTorch ops. Each function returns a
zero-argument callable or a function of the input (what the timers take)."""

from __future__ import annotations

import math

import torch

_COMPILED_FLEX = {}
_CUDNN_HANDLES = {}
E4M3_MAX = 448.0
CUDNN_FRONTEND_WHEEL = "nvidia-cudnn-frontend 1.32.0"


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


def cudnn_frontend():
    """The cuDNN frontend's Python module ``cudnn`` (wheel ``nvidia-cudnn-frontend``, never a dependency of this
    project: carried beside it, e.g. ``pip install --no-deps --target /tmp/cfe nvidia_cudnn_frontend-*.whl`` and
    ``PYTHONPATH=/tmp/cfe``). Raises ``ImportError`` whose message names the wheel when it does not import."""
    try:
        import cudnn
    except Exception as error:  # noqa: BLE001 - a missing wheel, or one built for another Python / CUDA
        raise ImportError(
            f"cuDNN FP8 attention needs the python module `cudnn` of the {CUDNN_FRONTEND_WHEEL} wheel "
            f"(pip install --no-deps nvidia-cudnn-frontend==1.32.0); importing it failed: "
            f"{type(error).__name__}: {error}"
        ) from error
    return cudnn


def _per_tensor(descale) -> float:
    """A Python float from a descale given as a number or a tensor whose entries are all equal (cuDNN's FP8 SDPA
    takes one scalar per tensor); raises ``ValueError`` for per-head values it cannot take."""
    if not isinstance(descale, torch.Tensor):
        return float(descale)
    flat = descale.detach().float().flatten()
    if not bool((flat == flat[0]).all()):
        raise ValueError("cuDNN's FP8 SDPA takes per-tensor descales; got different values per head")
    return float(flat[0])


class CudnnFp8Attention:
    """cuDNN's FP8 attention forward (the frontend's ``graph.sdpa_fp8``), built once for one set of inputs; each
    call executes the built graph on them (on the current stream, so it can be captured in a CUDA graph).

    ``q8`` ``[B, Sq, Hq, D]``, ``k8`` / ``v8`` ``[B, Skv, Hkv, D]``: float8_e4m3fn on the GPU, flash-attn's layout
    (cuDNN reads them through strides as ``[B, H, S, D]``). ``q_descale`` / ``k_descale`` / ``v_descale``: one
    number per tensor (a float, or a tensor whose entries are all equal), multiplying the stored values. Softmax
    scale ``D^-0.5``; ``causal``: cuDNN's causal mask (top-left aligned: the library's bottom-right one only when
    Sq == Skv). The output is e4m3 ``[B, Sq, Hq, D]`` (cuDNN's FP8 SDPA on Hopper writes FP8 O), holding
    ``O * scale_o``; :meth:`dequantized` divides it back. ``o_amax``: the expected max |O| (``scale_o = 448 /
    o_amax``); None calibrates it as FP8 recipes do, from cuDNN's own amax output of a first call made with
    ``scale_o = 1`` (or, where that call saturated, the bound ``448 * v_descale``). The probabilities P (<= 1) are
    scaled into e4m3 by ``scale_s = 448`` for P V and back by ``descale_s = 1 / 448``.

    Raises ``ImportError`` (naming the wheel) when the ``cudnn`` module does not import, ``ValueError`` for
    per-head descales, and cuDNN's own errors when it has no engine for the problem (a head dim, GQA).
    """

    def __init__(self, q8, k8, v8, q_descale=1.0, k_descale=1.0, v_descale=1.0, causal=False, o_amax=None):
        cudnn = cudnn_frontend()
        descales = [_per_tensor(d) for d in (q_descale, k_descale, v_descale)]
        device = q8.device
        if device.index not in _CUDNN_HANDLES:
            _CUDNN_HANDLES[device.index] = cudnn.create_handle()
        self.cudnn, self.handle = cudnn, _CUDNN_HANDLES[device.index]
        cudnn.set_stream(handle=self.handle, stream=torch.cuda.current_stream().cuda_stream)
        e4m3, fp32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
        graph = cudnn.pygraph(
            io_data_type=e4m3, intermediate_data_type=fp32, compute_data_type=fp32, handle=self.handle
        )
        head_dim = q8.shape[3]

        def bhsd(t):  # [B, H, S, D] dims over [B, S, H, D] storage
            return t.permute(0, 2, 1, 3)

        self.inputs = [bhsd(t) for t in (q8, k8, v8)]
        q_node, k_node, v_node = (
            graph.tensor(name=name, dim=list(t.shape), stride=list(t.stride()), data_type=e4m3)
            for name, t in zip(("q", "k", "v"), self.inputs)
        )
        scalar = dict(dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=fp32)
        names = ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")
        scalar_nodes = [graph.tensor(name=name, **scalar) for name in names]
        self.scale_o = 1.0 if o_amax is None else E4M3_MAX / max(float(o_amax), 1e-30)
        values = (*descales, 1.0 / E4M3_MAX, E4M3_MAX, self.scale_o)
        self.scalars = [torch.full((1, 1, 1, 1), value, dtype=torch.float32, device=device) for value in values]
        out_node, _, amax_s_node, amax_o_node = graph.sdpa_fp8(
            q=q_node,
            k=k_node,
            v=v_node,
            descale_q=scalar_nodes[0],
            descale_k=scalar_nodes[1],
            descale_v=scalar_nodes[2],
            descale_s=scalar_nodes[3],
            scale_s=scalar_nodes[4],
            scale_o=scalar_nodes[5],
            is_inference=True,
            attn_scale=1.0 / math.sqrt(head_dim),
            use_causal_mask=causal,
            name="sdpa_fp8",
        )
        self.out = torch.empty(q8.shape, dtype=torch.float8_e4m3fn, device=device)
        out_view = bhsd(self.out)
        out_node.set_output(True).set_dim(list(out_view.shape)).set_stride(list(out_view.stride())).set_data_type(e4m3)
        self.amax_s, self.amax_o = (torch.zeros(1, 1, 1, 1, dtype=torch.float32, device=device) for _ in range(2))
        for node in (amax_s_node, amax_o_node):
            node.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(fp32)
        graph.validate()
        graph.build_operation_graph()
        graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        graph.check_support()
        graph.build_plans()
        self.graph = graph
        self.variant_pack = {q_node: self.inputs[0], k_node: self.inputs[1], v_node: self.inputs[2]}
        self.variant_pack.update({out_node: out_view, amax_s_node: self.amax_s, amax_o_node: self.amax_o})
        self.variant_pack.update(dict(zip(scalar_nodes, self.scalars)))
        self.workspace = torch.empty(graph.get_workspace_size(), dtype=torch.uint8, device=device)
        if o_amax is None:  # calibrate scale_o from cuDNN's amax of O, as delayed-scaling FP8 recipes do
            self()
            measured = self.amax_o.item()  # with scale_o = 1 the amax before and after scaling are one number
            # |O| <= max |V| <= 448 * v_descale: the bound where O saturated e4m3 in the calibration call
            self.set_o_amax(measured if 0.0 < measured < E4M3_MAX else E4M3_MAX * descales[2])

    def set_o_amax(self, o_amax: float) -> None:
        """``scale_o = 448 / o_amax`` for the following calls (a device scalar: no rebuild)."""
        self.scale_o = E4M3_MAX / max(float(o_amax), 1e-30)
        self.scalars[5].fill_(self.scale_o)

    def __call__(self) -> torch.Tensor:
        # the current stream at each call: a CUDA-graph capture runs on a side stream
        self.cudnn.set_stream(handle=self.handle, stream=torch.cuda.current_stream().cuda_stream)
        self.graph.execute(self.variant_pack, self.workspace, handle=self.handle)
        return self.out

    def dequantized(self) -> torch.Tensor:
        """float64 ``[B, Sq, Hq, D]``: the last call's e4m3 O divided by ``scale_o``."""
        return self.out.double() / self.scale_o


def cudnn_fp8_runner(q8, k8, v8, q_descale=1.0, k_descale=1.0, v_descale=1.0, causal=False, o_amax=None):
    """cuDNN's FP8 attention on ``[B, S, H, D]`` e4m3 inputs with per-tensor descales, built once: a
    :class:`CudnnFp8Attention` (call it to run; ``.dequantized()`` for O in float64). Raises ``ImportError`` naming
    the ``nvidia-cudnn-frontend`` wheel when its ``cudnn`` module does not import."""
    return CudnnFp8Attention(q8, k8, v8, q_descale, k_descale, v_descale, causal, o_amax)


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
