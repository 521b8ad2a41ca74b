"""Every public function, called on tiny inputs whose tensors are named leaves.

A :class:`Call` holds fresh inputs as a flat ``{leaf: tensor}`` dict and a function that makes the call
from such a dict, so that a test can swap any one leaf for a view of itself (``test_any_strides.py``),
for a copy inside a hostile buffer (``test_canaries.py``) or for a bad value (``test_errors.py``) and
compare with the untouched call. Leaf names follow the argument they feed: ``"q"``, ``"a.scales"`` (a
field of the ScaledTensor passed as ``a``), ``"kv_cache.block_table"``, ``"score_mod.slopes"``. The
leaves in :attr:`Call.written` (``"out"``, a KV cache appended to in place, ``hidden_states`` of an
in-place call) are written by the call: their contents afterwards are part of its outcome.

:func:`discover_public` finds the public surface by itself: every function and class in the ``__all__``
of :data:`PUBLIC_MODULES`, and the public methods of those classes. Each one is walked here
(:data:`PUBLIC`, with :data:`NON_TENSOR_ARGUMENTS` naming its arguments that hold no tensor), or takes
no tensor at all (:data:`NO_TENSOR_FUNCTIONS`, whose error cases ``test_errors.py`` lists), or reads
nothing of a tensor's values (:data:`NOT_WALKED`, each with the reason). ``test_any_strides`` checks
that every discovered function is in exactly one of them and that every tensor argument of every walked
function is the root of some leaf, so that a public function or tensor argument added later cannot go
unwalked.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import pkgutil
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

import llmkernels as lk
from llmkernels import flash_attn, formats
from llmkernels.attention.paged import PagedKVCache
from llmkernels.integrations import transformers as lk_transformers
from llmkernels.moe import MoEFeedForward, combine, dispatch, dispatch_reference, fused_experts, route, select_experts

HEAD_DIM = 16
ATTENTION_CONFIG = lk.FA4Config(BM=16, BN=16, num_kv_stages=1)


@dataclass(frozen=True)
class Call:
    name: str
    functions: tuple  # the keys of PUBLIC whose arguments it feeds
    make: Callable[[torch.device], dict]  # device -> {leaf: tensor}, fresh random inputs
    run: Callable[[dict], object]  # {leaf: tensor} -> the call's result
    written: tuple = ()  # the leaves the call writes in place
    aliases: tuple = ()  # (leaf, name) pairs: an adapter's argument under the name of the function it calls


PUBLIC_MODULES = (
    "llmkernels",
    "llmkernels.flash_attn",
    "llmkernels.moe",
    "llmkernels.formats",
    "llmkernels.integrations",
)


def _public_modules():
    """:data:`PUBLIC_MODULES` and the submodules of the packages among them that are not themselves public
    package members (``llmkernels.integrations.transformers``)."""
    for name in PUBLIC_MODULES:
        module = importlib.import_module(name)
        yield module
        if name == "llmkernels.integrations":
            for info in pkgutil.iter_modules(module.__path__):
                yield importlib.import_module(f"{name}.{info.name}")


def discover_public() -> dict:
    """``{key: function or class}`` for every public function and class of :data:`PUBLIC_MODULES` (their
    ``__all__``) and every public method (plain, class- or static-) of those classes, keyed by name or
    ``"Class.method"``. An object reachable under two names is listed once: the ops layer's wrappers
    (``lk.quantize`` wraps ``llmkernels.formats.quantize``) count as the function they wrap."""
    found, seen = {}, set()
    for module in _public_modules():
        for name in module.__all__:
            obj = getattr(module, name)
            if not callable(obj) or isinstance(obj, lk.SwiGLU):  # constants (FORMATS, GPT_OSS_SWIGLU, NAME)
                continue
            identity = id(inspect.unwrap(obj))
            if identity in seen:
                continue
            seen.add(identity)
            key = name if name not in found else f"{module.__name__}.{name}"
            found[key] = obj
            if inspect.isclass(obj):
                for attr, value in vars(obj).items():
                    if (
                        not attr.startswith("_")
                        and isinstance(value, (classmethod, staticmethod))
                        or (not attr.startswith("_") and inspect.isfunction(value))
                    ):
                        found[f"{key}.{attr}"] = getattr(obj, attr)
    return found


# The public surface walked for tensor arguments: functions, and classes whose fields are tensors.
PUBLIC = {
    "quantize": lk.quantize,
    "dequantize": lk.dequantize,
    "ScaledTensor": lk.ScaledTensor,
    "ScaledTensor.to_layout": lk.ScaledTensor.to_layout,
    "grouped_matmul": lk.grouped_matmul,
    "attention": lk.attention,
    "PagedKVCache": PagedKVCache,
    "alibi": lk.alibi,
    "route": route,
    "select_experts": select_experts,
    "dispatch": dispatch,
    "combine": combine,
    "MoEFeedForward": MoEFeedForward,
    "MoEFeedForward.forward": MoEFeedForward.forward,
    "MoEFeedForward.from_float": MoEFeedForward.from_float,
    "quantize_reference": lk.quantize_reference,
    "grouped_matmul_reference": lk.grouped_matmul_reference,
    "attention_reference": lk.attention_reference,
    "dispatch_reference": dispatch_reference,
    "fused_experts": fused_experts,
    "ScaledTensor.validate": lk.ScaledTensor.validate,
    "ScaledTensor.unchecked": lk.ScaledTensor.unchecked,
    "ScaledTensor.row_data": lk.ScaledTensor.row_data,
    "ScaledTensor.row_scales": lk.ScaledTensor.row_scales,
    "flash_attn_func": flash_attn.flash_attn_func,
    "flash_attn_varlen_func": flash_attn.flash_attn_varlen_func,
    "flash_attn_with_kvcache": flash_attn.flash_attn_with_kvcache,
    "nvfp4_global_scale": formats.nvfp4_global_scale,
    "to_blocked_scales": formats.to_blocked_scales,
    "from_blocked_scales": formats.from_blocked_scales,
    "to_grouped_blocked_scales": formats.to_grouped_blocked_scales,
    "from_grouped_blocked_scales": formats.from_grouped_blocked_scales,
    "scaled_tensor_parts": formats.scaled_tensor_parts,
    "scaled_tensor_from_parts": formats.scaled_tensor_from_parts,
    "from_torchao": formats.from_torchao,
    "to_torchao": formats.to_torchao,
    "unwrap_torchao": formats.unwrap_torchao,
    "attention_forward": lk_transformers.attention_forward,
    "experts_forward": lk_transformers.experts_forward,
    "quantize_experts": lk_transformers.quantize_experts,
}

# Public functions that take no tensor: their bad arguments are cases of test_errors.py's table.
NO_TENSOR_FUNCTIONS = (
    "BlockScaledMatmulConfig",
    "SwiGLU",
    "FA4Config",
    "FA4Config.replace",
    "SlidingWindow",
    "Chunked",
    "softcap",
    "FormatSpec",
    "format_spec",
    "register",
)

# The PyTorch references take what the function they mirror takes and check nothing (they are oracles for
# tests: a bad argument raises whatever PyTorch raises); the error walk leaves them out.
REFERENCES = ("quantize_reference", "grouped_matmul_reference", "attention_reference", "dispatch_reference")


class InputRejected(Exception):
    """The leaves cannot form the argument at all (another library's constructor refused them): the trial
    says nothing about our function."""


# Public functions that read no tensor element, with the reason.
NOT_WALKED = {
    "ScaledTensor.dim": "the number of logical dims, from metadata",
    "ScaledTensor.plan_key": "a hashable of dtypes, shapes and strides, from metadata",
    "PagedKVCache.plan_key": "a hashable of dtypes, shapes and strides, from metadata",
    "is_torchao_tensor": "a check of the argument's class",
    "MoEFeedForward.weight": "a view of the block's buffers (walked through MoEFeedForward.forward)",
    "ExpertWeights": "a frozen record of what quantize_experts made (quantize_experts is walked)",
}

NON_TENSOR_ARGUMENTS = {
    "quantize": {"format", "scale_layout", "block", "power_of_two_scales"},
    "dequantize": set(),
    "ScaledTensor": {"format", "scale_layout", "logical_shape", "block"},
    "ScaledTensor.to_layout": {"self", "layout"},
    "grouped_matmul": {"epilogue", "out_dtype", "config", "validate"},
    "attention": {
        "causal",
        "mask",
        "softmax_scale",
        "max_seqlen_q",
        "max_seqlen_k",
        "num_splits",
        "return_lse",
        "config",
        "validate",
    },
    "PagedKVCache": set(),
    "alibi": set(),
    "route": {"top_k", "scoring", "renormalize", "num_groups", "topk_groups"},
    "select_experts": {"top_k", "scoring", "renormalize"},
    "dispatch": {"num_experts"},
    "combine": {"out_dtype"},
    "MoEFeedForward": {
        "top_k",
        "activation_format",
        "scoring",
        "renormalize",
        "num_groups",
        "topk_groups",
        "process_group",
        "capacity",
        "dispatch_format",
    },
    "MoEFeedForward.forward": {"self"},
    "MoEFeedForward.from_float": {
        "top_k",
        "weight_format",
        "activation_format",
        "weight_layout",
        "process_group",
        "capacity",
        "dispatch_format",
        "routing",
    },
    "quantize_reference": {"format", "block", "power_of_two_scales"},
    "grouped_matmul_reference": {"epilogue"},
    "attention_reference": {"causal", "mask", "softmax_scale", "return_lse", "_ignored"},
    "dispatch_reference": {"num_experts"},
    "fused_experts": {
        "inplace",
        "activation",
        "apply_router_weight_on_input",
        "global_num_experts",
        "activation_format",
        "validate",
        "use_fp8_w8a8",
        "block_shape",
        "per_act_token_quant",
        "a1_scale",  # static activation scales: only None is taken (dynamic fp8 scales), no tensor is read
        "a2_scale",
    },
    "ScaledTensor.validate": set(),
    "ScaledTensor.unchecked": {"format", "scale_layout", "logical_shape", "block"},
    "ScaledTensor.row_data": set(),
    "ScaledTensor.row_scales": set(),
    "flash_attn_func": {
        "dropout_p",
        "softmax_scale",
        "causal",
        "window_size",
        "softcap",
        "deterministic",
        "return_attn_probs",
        "attention_chunk",
        "num_splits",
    },
    "flash_attn_varlen_func": {
        "max_seqlen_q",
        "max_seqlen_k",
        "dropout_p",
        "softmax_scale",
        "causal",
        "window_size",
        "softcap",
        "deterministic",
        "return_attn_probs",
        "attention_chunk",
        "num_splits",
    },
    "flash_attn_with_kvcache": {
        "softmax_scale",
        "causal",
        "window_size",
        "softcap",
        "rotary_interleaved",
        "num_splits",
        "return_softmax_lse",
        "attention_chunk",
        "validate",
    },
    "nvfp4_global_scale": set(),
    "to_blocked_scales": set(),
    "from_blocked_scales": {"rows", "cols"},
    "to_grouped_blocked_scales": set(),
    "from_grouped_blocked_scales": {"num_rows", "cols"},
    "scaled_tensor_parts": set(),
    "scaled_tensor_from_parts": {"format", "scale_layout", "shape", "block"},
    "from_torchao": set(),
    "to_torchao": {"orig_dtype"},
    "unwrap_torchao": set(),
    "attention_forward": {"module", "dropout", "scaling", "is_causal", "softcap", "kwargs"},
    "experts_forward": set(),
    "quantize_experts": {"weight_format", "scale_layout"},
}

# Classes passed as one argument whose tensor fields become leaves "<argument>.<field>".
CONTAINERS = {
    "ScaledTensor": ("a", "b", "x", "w_gate_up", "w_down", "w1", "w2"),
    "PagedKVCache": ("kv_cache",),
    "alibi": ("score_mod",),
}


def scaled_leaves(prefix: str, tensor: lk.ScaledTensor) -> dict:
    fields = ("data", "scales", "global_scale", "group_offsets", "group_scale_offsets")
    return {f"{prefix}.{field}": getattr(tensor, field) for field in fields if getattr(tensor, field) is not None}


def scaled_from(leaves: dict, prefix: str, format: str, layout: str = "row", shape=None, block=None) -> lk.ScaledTensor:
    """The ScaledTensor of the leaves under ``prefix`` (``shape``: the logical shape of the hopper layout; ``block``:
    fp8's)."""
    part = lambda field: leaves.get(f"{prefix}.{field}")  # noqa: E731
    return lk.ScaledTensor(
        part("data"),
        part("scales"),
        format,
        part("global_scale"),
        layout,
        part("group_offsets"),
        part("group_scale_offsets"),
        shape,
        block,
    )


def _offsets(sizes, device) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()], dtype=torch.int32, device=device)


# ----------------------------------------------------------------------------- formats


def _quantize_call(format: str, gather: bool, grouped: bool) -> Call:
    def make(device):
        leaves = {"x": torch.randn(10, 64, device=device)}
        if format == "nvfp4":
            leaves["global_scale"] = torch.tensor(0.003, device=device)
        if gather:
            leaves["rows"] = torch.tensor([3, 0, 9, 9, 4, 1, 7], device=device)
        if grouped:
            leaves["group_offsets"] = _offsets([3, 0, 4], device)
        return leaves

    def run(leaves):
        return lk.quantize(
            leaves["x"],
            format,
            global_scale=leaves.get("global_scale"),
            rows=leaves.get("rows"),
            scale_layout="128x4" if grouped else "row",
            group_offsets=leaves.get("group_offsets"),
        )

    return Call(
        f"quantize[{format}{', rows' if gather else ''}{', grouped 128x4' if grouped else ''}]",
        ("quantize",),
        make,
        run,
    )


def _fp8_quantize_call(block: tuple, gather: bool = False, power_of_two_scales: bool = False) -> Call:
    """fp8 with K = 200 (a partial last column block); ``(128, 128)``: two [129, 200] matrices (partial row tiles)."""
    shape = (2, 129, 200) if block[0] > 1 else (10, 200)

    def make(device):
        leaves = {"x": torch.randn(*shape, device=device)}
        if gather:
            leaves["rows"] = torch.tensor([3, 0, 9, 9, 4, 1, 7], device=device)
        return leaves

    def run(leaves):
        return lk.quantize(
            leaves["x"], "fp8", block=block, rows=leaves.get("rows"), power_of_two_scales=power_of_two_scales
        )

    options = f"{', rows' if gather else ''}{', power of two' if power_of_two_scales else ''}"
    return Call(f"quantize[fp8 {block}{options}]", ("quantize",), make, run)


def _fp8_dequantize_call(block: tuple) -> Call:
    shape = (2, 129, 200) if block[0] > 1 else (12, 200)

    def make(device):
        return scaled_leaves("x", lk.quantize(torch.randn(*shape, device=device), "fp8", block=block))

    return Call(
        f"dequantize[fp8 {block}]",
        ("dequantize", "ScaledTensor"),
        make,
        lambda leaves: lk.dequantize(scaled_from(leaves, "x", "fp8", block=block)),
    )


def _dequantize_call(format: str, layout: str) -> Call:
    shape = (12, 96)

    def make(device):
        x = lk.quantize(torch.randn(*shape, device=device), format)
        if layout in ("128x4", "grouped"):
            x = x.to_layout("128x4", group_offsets=_offsets([5, 0, 7], device) if layout == "grouped" else None)
        elif layout == "hopper":
            x = x.to_layout("hopper")
        return scaled_leaves("x", x)

    scale_layout = "128x4" if layout == "grouped" else layout
    return Call(
        f"dequantize[{format}, {layout}]",
        ("dequantize", "ScaledTensor"),
        make,
        lambda leaves: lk.dequantize(
            scaled_from(leaves, "x", format, scale_layout, shape if layout == "hopper" else None)
        ),
    )


def _to_layout_call() -> Call:
    def make(device):
        x = lk.quantize(torch.randn(12, 64, device=device), "mxfp8")
        return {**scaled_leaves("self", x), "group_offsets": _offsets([5, 0, 7], device)}

    return Call(
        "ScaledTensor.to_layout[grouped 128x4]",
        ("ScaledTensor.to_layout",),
        make,
        lambda leaves: scaled_from(leaves, "self", "mxfp8").to_layout("128x4", leaves["group_offsets"]),
    )


# ----------------------------------------------------------------------------- grouped matmul


def _grouped_matmul_call(
    a_format: str, b_format: str, a_layout: str = "row", b_layout: str = "row", epilogue=None, bias: bool = False
) -> Call:
    sizes, experts, n, k = [5, 0, 9, 3], 3, 32, 64

    def make(device):
        x = torch.randn(sum(sizes) + 2, k, device=device)  # two rows outside every group
        w = torch.randn(experts, n, k, device=device) / 8
        leaves = {
            "a_offsets": _offsets(sizes, device),
            "expert_ids": torch.tensor([2, 0, 1, -1], dtype=torch.int32, device=device),
            "expert_scales": torch.rand(experts, device=device) + 0.5,
        }
        if bias:
            leaves["bias"] = torch.randn(experts, n, device=device)
        if a_format == "bf16":
            leaves["a"] = x.bfloat16()
        else:
            a = lk.quantize(x, a_format)
            if a_layout != "row":
                a = a.to_layout("128x4", group_offsets=leaves["a_offsets"] if a_layout == "grouped" else None)
            leaves.update(scaled_leaves("a", a))
        if b_format == "bf16":
            leaves["b"] = w.bfloat16()
        else:
            b = lk.quantize(w, b_format)
            leaves.update(scaled_leaves("b", b.to_layout(b_layout) if b_layout != "row" else b))
        n_out = n // 2 if epilogue == "swiglu" or isinstance(epilogue, lk.SwiGLU) else n
        leaves["out"] = torch.full((x.shape[0], n_out), float("nan"), dtype=torch.bfloat16, device=device)
        return leaves

    def run(leaves):
        a = (
            leaves["a"]
            if a_format == "bf16"
            else scaled_from(leaves, "a", a_format, "row" if a_layout == "row" else "128x4")
        )
        b = (
            leaves["b"]
            if b_format == "bf16"
            else scaled_from(leaves, "b", b_format, b_layout, (experts, n, k) if b_layout == "hopper" else None)
        )
        return lk.grouped_matmul(
            a,
            b,
            leaves["a_offsets"],
            leaves["expert_ids"],
            leaves["expert_scales"],
            epilogue=epilogue,
            bias=leaves.get("bias"),
            out=leaves["out"],
        )

    name = (
        f"grouped_matmul[{a_format} ({a_layout}) x {b_format} ({b_layout}){f', {epilogue}' if epilogue else ''}"
        f"{', bias' if bias else ''}]"
    )
    return Call(name, ("grouped_matmul", "ScaledTensor"), make, run, written=("out",))


# ----------------------------------------------------------------------------- attention


def _attention_call(mode: str) -> Call:
    """mode: "dense" (causal window, sinks, ALiBi, an additive mask tensor), "ragged" (cu_seqlens, sliding
    window), "paged" (one pass, shuffled pages, starts), "decode" (paged, split-KV with sinks), "dense-decode"
    (split-KV, sinks, a bool mask tensor)."""
    heads, kv_heads, dtype = 4, 2, torch.float16

    def make(device):
        rand = lambda *shape: torch.randn(*shape, dtype=dtype, device=device)  # noqa: E731
        leaves = {}
        if mode in ("dense", "dense-decode"):
            sq = 20 if mode == "dense" else 2
            leaves.update(
                q=rand(2, sq, heads, HEAD_DIM), k=rand(2, 37, kv_heads, HEAD_DIM), v=rand(2, 37, kv_heads, HEAD_DIM)
            )
        elif mode == "ragged":
            leaves.update(
                q=rand(29, heads, HEAD_DIM),
                k=rand(41, kv_heads, HEAD_DIM),
                v=rand(41, kv_heads, HEAD_DIM),
                cu_seqlens_q=_offsets([9, 0, 20], device),
                cu_seqlens_k=_offsets([12, 5, 24], device),
            )
        else:
            page_size, num_pages = 16, 7
            leaves.update(
                q=rand(2, 3 if mode == "decode" else 18, heads, HEAD_DIM),
                **{
                    "kv_cache.k_pages": rand(num_pages, page_size, kv_heads, HEAD_DIM),
                    "kv_cache.v_pages": rand(num_pages, page_size, kv_heads, HEAD_DIM),
                    "kv_cache.block_table": torch.tensor([[4, 1, 6], [0, 5, 2]], dtype=torch.int32, device=device),
                    "kv_cache.seqlens": torch.tensor([40, 23], dtype=torch.int32, device=device),
                    "kv_cache.starts": torch.tensor([3, 0], dtype=torch.int32, device=device),
                },
            )
        if mode in ("dense", "decode", "dense-decode"):
            leaves["sinks"] = torch.randn(heads, device=device)
        if mode == "dense":
            leaves["score_mod.slopes"] = torch.rand(heads, device=device) / 4
            leaves["mask.tensor"] = torch.randn(2, 1, 20, 37, device=device)  # an additive bias
        if mode == "dense-decode":
            leaves["mask.tensor"] = torch.rand(2, heads, 1, 37, device=device) > 0.2
        return leaves

    def run(leaves):
        kv_cache = None
        if "kv_cache.k_pages" in leaves:
            kv_cache = PagedKVCache(
                *(leaves[f"kv_cache.{field}"] for field in ("k_pages", "v_pages", "block_table", "seqlens", "starts"))
            )
        ragged = "cu_seqlens_q" in leaves
        return lk.attention(
            leaves["q"],
            leaves.get("k"),
            leaves.get("v"),
            causal=mode != "ragged",
            mask=lk.SlidingWindow(12, 3) if mode == "ragged" else leaves.get("mask.tensor"),
            score_mod=lk.alibi(leaves["score_mod.slopes"]) if "score_mod.slopes" in leaves else None,
            sinks=leaves.get("sinks"),
            cu_seqlens_q=leaves.get("cu_seqlens_q"),
            cu_seqlens_k=leaves.get("cu_seqlens_k"),
            max_seqlen_q=20 if ragged else None,
            max_seqlen_k=24 if ragged else None,
            kv_cache=kv_cache,
            num_splits=3 if mode in ("decode", "dense-decode") else 1,
            return_lse=True,
            config=ATTENTION_CONFIG,
        )

    return Call(f"attention[{mode}]", ("attention", "PagedKVCache", "alibi"), make, run)


def _attention_fp8_call(mode: str, function: str = "attention") -> Call:
    """FP8 attention (FA3's descales): mode "dense" (e4m3 q, K, V, the three descales ``[B, Hkv]`` / ``[B, 1]``,
    causal), "paged" (bf16 q over e4m3 shuffled pages, per-tensor descales ``[1, 1]``, split-KV decode);
    ``function``: ``attention`` or ``attention_reference``."""
    heads, kv_heads = 4, 2

    def make(device):
        e4m3 = lambda *shape: torch.randn(*shape, device=device).to(torch.float8_e4m3fn)  # noqa: E731
        descale = lambda *shape: torch.rand(*shape, device=device) + 0.5  # noqa: E731
        if mode == "dense":
            return {
                "q": e4m3(2, 9, heads, HEAD_DIM),
                "k": e4m3(2, 13, kv_heads, HEAD_DIM),
                "v": e4m3(2, 13, kv_heads, HEAD_DIM),
                "q_descale": descale(2, kv_heads),
                "k_descale": descale(2, kv_heads),
                "v_descale": descale(2, 1),
            }
        return {
            "q": torch.randn(2, 1, heads, HEAD_DIM, dtype=torch.bfloat16, device=device),
            "kv_cache.k_pages": e4m3(7, 16, kv_heads, HEAD_DIM),
            "kv_cache.v_pages": e4m3(7, 16, kv_heads, HEAD_DIM),
            "kv_cache.block_table": torch.tensor([[4, 1, 6], [0, 5, 2]], dtype=torch.int32, device=device),
            "kv_cache.seqlens": torch.tensor([40, 23], dtype=torch.int32, device=device),
            "k_descale": descale(1, 1),
            "v_descale": descale(1, 1),
        }

    def run(leaves):
        kv_cache = None
        if "kv_cache.k_pages" in leaves:
            kv_cache = PagedKVCache(
                *(leaves[f"kv_cache.{field}"] for field in ("k_pages", "v_pages", "block_table", "seqlens"))
            )
        arguments = dict(
            causal=True,
            kv_cache=kv_cache,
            return_lse=True,
            q_descale=leaves.get("q_descale"),
            k_descale=leaves["k_descale"],
            v_descale=leaves["v_descale"],
        )
        if function == "attention_reference":
            return lk.attention_reference(leaves["q"], leaves.get("k"), leaves.get("v"), **arguments)
        return lk.attention(
            leaves["q"],
            leaves.get("k"),
            leaves.get("v"),
            num_splits=3 if mode == "paged" else 1,
            config=ATTENTION_CONFIG,
            **arguments,
        )

    return Call(f"{function}[fp8 {mode}]", (function, "PagedKVCache"), make, run)


# ----------------------------------------------------------------------------- MoE


def _route_call() -> Call:
    def make(device):
        return {"router_logits": torch.randn(6, 8, device=device), "correction_bias": torch.rand(8, device=device)}

    return Call(
        "route[grouped, bias]",
        ("route",),
        make,
        lambda leaves: route(
            leaves["router_logits"],
            2,
            scoring="sigmoid",
            num_groups=4,
            topk_groups=2,
            correction_bias=leaves["correction_bias"],
        ),
    )


def _select_call() -> Call:
    def make(device):
        return {"router_logits": torch.randn(6, 12, device=device), "correction_bias": torch.rand(12, device=device)}

    return Call(
        "select_experts[sigmoid, bias]",
        ("select_experts",),
        make,
        lambda leaves: select_experts(
            leaves["router_logits"], 3, scoring="sigmoid", correction_bias=leaves["correction_bias"]
        ),
    )


def _dispatch_call() -> Call:
    return Call(
        "dispatch",
        ("dispatch",),
        lambda device: {"expert_ids": torch.randint(0, 5, (7, 3), device=device)},
        lambda leaves: dispatch(leaves["expert_ids"], 5),
    )


def _combine_call() -> Call:
    def make(device):
        return {
            "y": torch.randn(12, 40, dtype=torch.bfloat16, device=device),
            "row_of_copy": torch.randperm(12, device=device).view(6, 2),
            "weights": torch.rand(6, 2, device=device),
        }

    return Call(
        "combine", ("combine",), make, lambda leaves: combine(leaves["y"], leaves["row_of_copy"], leaves["weights"])
    )


def _moe_call(weight_format: str, weight_layout: str = "row") -> Call:
    experts, hidden, intermediate = 4, 64, 32
    shapes = {"w_gate_up": (experts, 2 * intermediate, hidden), "w_down": (experts, hidden, intermediate)}

    def make(device):
        block = MoEFeedForward.from_float(
            torch.randn(experts, hidden, device=device),
            torch.randn(experts, 2 * intermediate, hidden, device=device) / 8,
            torch.randn(experts, hidden, intermediate, device=device) / 8,
            2,
            weight_format=weight_format,
            weight_layout=weight_layout,
        )
        leaves = {
            "router_weight": block.router_weight,
            "correction_bias": torch.rand(experts, device=device) / 8,
            "hidden_states": torch.randn(5, hidden, dtype=torch.bfloat16, device=device),
        }
        for name in ("w_gate_up", "w_down"):
            weight = block.weight(name)
            leaves.update(scaled_leaves(name, weight) if weight_format != "bf16" else {name: weight})
        return leaves

    def run(leaves):
        weights = [
            leaves[name]
            if weight_format == "bf16"
            else scaled_from(
                leaves, name, weight_format, weight_layout, shapes[name] if weight_layout == "hopper" else None
            )
            for name in ("w_gate_up", "w_down")
        ]
        block = MoEFeedForward(
            leaves["router_weight"],
            *weights,
            2,
            correction_bias=leaves["correction_bias"],
            activation_format=weight_format if weight_format != "mxfp4" else "bf16",
        )
        return block(leaves["hidden_states"])

    return Call(
        f"MoEFeedForward[{weight_format}{', hopper' if weight_layout == 'hopper' else ''}]",
        ("MoEFeedForward", "MoEFeedForward.forward", "ScaledTensor"),
        make,
        run,
    )


# ----------------------------------------------------------------------------- references (PyTorch)


def _quantize_reference_call(format: str) -> Call:
    def make(device):
        leaves = {"x": torch.randn(6, 64, device=device)}
        if format == "nvfp4":
            leaves["global_scale"] = torch.tensor(0.002, device=device)
        return leaves

    return Call(
        f"quantize_reference[{format}]",
        ("quantize_reference",),
        make,
        lambda leaves: lk.quantize_reference(
            leaves["x"], format, leaves.get("global_scale"), block=(128, 128) if format == "fp8" else None
        ),
    )


def _grouped_matmul_reference_call() -> Call:
    sizes, experts, n, k = [3, 0, 4], 3, 32, 64

    def make(device):
        a = lk.quantize(torch.randn(sum(sizes) + 1, k, device=device), "mxfp8")
        b = lk.quantize(torch.randn(experts, n, k, device=device) / 8, "mxfp4")
        return {
            **scaled_leaves("a", a),
            **scaled_leaves("b", b),
            "a_offsets": _offsets(sizes, device),
            "expert_ids": torch.tensor([2, 0, -1], dtype=torch.int32, device=device),
            "expert_scales": torch.rand(experts, device=device) + 0.5,
            "bias": torch.randn(experts, n, device=device),
        }

    def run(leaves):
        return lk.grouped_matmul_reference(
            scaled_from(leaves, "a", "mxfp8"),
            scaled_from(leaves, "b", "mxfp4"),
            leaves["a_offsets"],
            leaves["expert_ids"],
            leaves["expert_scales"],
            epilogue="swiglu",
            bias=leaves["bias"],
        )

    return Call("grouped_matmul_reference[mxfp8 x mxfp4, swiglu, bias]", ("grouped_matmul_reference",), make, run)


def _attention_reference_call(paged: bool) -> Call:
    def make(device):
        rand = lambda *shape: torch.randn(*shape, dtype=torch.float16, device=device)  # noqa: E731
        leaves = {
            "q": rand(2, 5, 4, HEAD_DIM),
            "sinks": torch.randn(4, device=device),
            "score_mod.slopes": torch.rand(4, device=device) / 4,
        }
        if paged:
            leaves.update(
                {
                    "kv_cache.k_pages": rand(5, 16, 2, HEAD_DIM),
                    "kv_cache.v_pages": rand(5, 16, 2, HEAD_DIM),
                    "kv_cache.block_table": torch.tensor([[3, 0], [1, 4]], dtype=torch.int32, device=device),
                    "kv_cache.seqlens": torch.tensor([20, 9], dtype=torch.int32, device=device),
                    "kv_cache.starts": torch.tensor([2, 0], dtype=torch.int32, device=device),
                }
            )
        else:
            leaves.update(
                q=rand(11, 4, HEAD_DIM),
                k=rand(13, 2, HEAD_DIM),
                v=rand(13, 2, HEAD_DIM),
                cu_seqlens_q=_offsets([5, 6], device),
                cu_seqlens_k=_offsets([6, 7], device),
            )
        return leaves

    def run(leaves):
        kv_cache = None
        if paged:
            kv_cache = PagedKVCache(
                *(leaves[f"kv_cache.{field}"] for field in ("k_pages", "v_pages", "block_table", "seqlens", "starts"))
            )
        return lk.attention_reference(
            leaves["q"],
            leaves.get("k"),
            leaves.get("v"),
            causal=True,
            score_mod=lk.alibi(leaves["score_mod.slopes"]),
            sinks=leaves["sinks"],
            cu_seqlens_q=leaves.get("cu_seqlens_q"),
            cu_seqlens_k=leaves.get("cu_seqlens_k"),
            kv_cache=kv_cache,
            return_lse=True,
        )

    return Call(
        f"attention_reference[{'paged' if paged else 'ragged'}]",
        ("attention_reference", "PagedKVCache", "alibi"),
        make,
        run,
    )


def _dispatch_reference_call() -> Call:
    return Call(
        "dispatch_reference",
        ("dispatch_reference",),
        lambda device: {"expert_ids": torch.randint(0, 5, (7, 3), device=device)},
        lambda leaves: dispatch_reference(leaves["expert_ids"], 5),
    )


# ----------------------------------------------------------------------------- formats: layouts, parts, torchao

# torchao is optional (the [test] extra installs it); without it its converters' calls are not walked.
HAS_TORCHAO = importlib.util.find_spec("torchao") is not None
TORCHAO_FUNCTIONS = ("from_torchao", "unwrap_torchao", "to_torchao")


def _scale_layout_call(grouped: bool) -> Call:
    rows, cols = 12, 3

    def make(device):
        scales = lk.quantize(torch.randn(rows, 32 * cols, device=device), "mxfp8").scales
        leaves = {"scales": scales}
        if grouped:
            leaves["group_offsets"] = _offsets([5, 0, 7], device)
        return leaves

    def run(leaves):
        if grouped:
            tiles, group_scale_offsets = formats.to_grouped_blocked_scales(leaves["scales"], leaves["group_offsets"])
            return (
                tiles,
                group_scale_offsets,
                formats.from_grouped_blocked_scales(tiles, leaves["group_offsets"], rows, cols),
            )
        tiles = formats.to_blocked_scales(leaves["scales"])
        return tiles, formats.from_blocked_scales(tiles, rows, cols)

    functions = (
        ("to_grouped_blocked_scales", "from_grouped_blocked_scales")
        if grouped
        else ("to_blocked_scales", "from_blocked_scales")
    )
    return Call(f"{functions[0]} + {functions[1]}", functions, make, run)


def _blocked_scales_call(grouped: bool) -> Call:
    """The inverse layouts on hostile tiles of their own (not only on what the forward ones made)."""
    rows, cols = 12, 3

    def make(device):
        scales = lk.quantize(torch.randn(rows, 32 * cols, device=device), "mxfp8").scales
        if grouped:
            offsets = _offsets([5, 0, 7], device)
            return {"blocked": formats.to_grouped_blocked_scales(scales, offsets)[0], "group_offsets": offsets}
        return {"blocked": formats.to_blocked_scales(scales)}

    def run(leaves):
        if grouped:
            return formats.from_grouped_blocked_scales(leaves["blocked"], leaves["group_offsets"], rows, cols)
        return formats.from_blocked_scales(leaves["blocked"], rows, cols)

    name = "from_grouped_blocked_scales" if grouped else "from_blocked_scales"
    return Call(name, (name,), make, run)


def _global_scale_call() -> Call:
    return Call(
        "nvfp4_global_scale",
        ("nvfp4_global_scale",),
        lambda device: {"x": torch.randn(5, 48, device=device)},
        lambda leaves: formats.nvfp4_global_scale(leaves["x"]),
    )


def _parts_call() -> Call:
    def make(device):
        x = lk.quantize(torch.randn(12, 64, device=device), "nvfp4").to_layout("128x4", _offsets([5, 0, 7], device))
        return {
            **scaled_leaves("x", x),
            "data": x.data,
            "scales": x.scales,
            "global_scale": x.global_scale,
            "group_offsets": x.group_offsets,
            "group_scale_offsets": x.group_scale_offsets,
        }

    def run(leaves):
        parts = formats.scaled_tensor_parts(scaled_from(leaves, "x", "nvfp4", "128x4"))
        rebuilt = formats.scaled_tensor_from_parts(
            leaves["data"],
            leaves["scales"],
            leaves["global_scale"],
            "nvfp4",
            "128x4",
            leaves["group_offsets"],
            leaves["group_scale_offsets"],
        )
        unchecked = lk.ScaledTensor.unchecked(
            leaves["data"],
            leaves["scales"],
            "nvfp4",
            leaves["global_scale"],
            "128x4",
            leaves["group_offsets"],
            leaves["group_scale_offsets"],
        )
        return parts, lk.dequantize(rebuilt), lk.dequantize(unchecked)

    return Call(
        "scaled_tensor_parts + scaled_tensor_from_parts + unchecked",
        ("scaled_tensor_parts", "scaled_tensor_from_parts", "ScaledTensor.unchecked"),
        make,
        run,
    )


def _scaled_tensor_methods_call(layout: str) -> Call:
    """validate, row_data, row_scales and the unchecked constructor on one tensor of ``layout``."""
    shape = (6, 40, 64) if layout == "hopper" else (12, 64)

    def make(device):
        x = lk.quantize(torch.randn(*shape, device=device), "mxfp4")
        x = x.to_layout(layout) if layout != "row" else x
        return {**scaled_leaves("self", x), "data": x.data, "scales": x.scales}

    def run(leaves):
        x = scaled_from(leaves, "self", "mxfp4", layout, shape if layout == "hopper" else None)
        x.validate()
        built = lk.ScaledTensor.unchecked(
            leaves["data"], leaves["scales"], "mxfp4", None, layout, logical_shape=shape if layout == "hopper" else None
        )
        return x.row_data(), x.row_scales(), lk.dequantize(built)

    return Call(
        f"ScaledTensor methods[{layout}]",
        ("ScaledTensor.validate", "ScaledTensor.row_data", "ScaledTensor.row_scales", "ScaledTensor.unchecked"),
        make,
        run,
    )


def _torchao_tensor(leaves: dict, prefix: str, format: str):
    """torchao's MXTensor / NVFP4Tensor of the leaves under ``prefix`` (qdata, scale, per_tensor_scale)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torchao.prototype.mx_formats.mx_tensor import MXTensor
        from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor
        from torchao.quantization.quantize_.common.kernel_preference import KernelPreference
    qdata, scale = leaves[f"{prefix}.qdata"], leaves[f"{prefix}.scale"]
    try:
        if format == "nvfp4":
            return NVFP4Tensor(
                qdata,
                scale,
                block_size=16,
                orig_dtype=torch.float32,
                per_tensor_scale=leaves[f"{prefix}.per_tensor_scale"].reshape(()),
            )
        element = torch.float8_e4m3fn if format == "mxfp8" else torch.float4_e2m1fn_x2
        return MXTensor(qdata, scale, element, 32, torch.float32, KernelPreference.EMULATED, None, False)
    except (AssertionError, RuntimeError, IndexError) as error:  # torchao's checks
        raise InputRejected(f"torchao refused the {prefix} leaves: {error}") from error


def _torchao_call(format: str) -> Call:
    def make(device):
        x = lk.quantize(torch.randn(10, 64, device=device), format)
        theirs = formats.to_torchao(x, torch.float32)
        leaves = {"x.qdata": theirs.qdata, "x.scale": theirs.scale}
        if format == "nvfp4":
            leaves["x.per_tensor_scale"] = theirs.per_tensor_scale.reshape(1)
        return leaves

    def run(leaves):
        ours = formats.from_torchao(_torchao_tensor(leaves, "x", format))
        unwrapped = formats.unwrap_torchao(_torchao_tensor(leaves, "x", format))
        back = formats.to_torchao(ours, torch.float32)
        return lk.dequantize(ours), lk.dequantize(unwrapped), torchao_parts(back)

    return Call(f"from_torchao + unwrap_torchao + to_torchao[{format}]", ("from_torchao", "unwrap_torchao"), make, run)


def _to_torchao_call(format: str) -> Call:
    def make(device):
        return scaled_leaves("x", lk.quantize(torch.randn(10, 64, device=device), format))

    return Call(
        f"to_torchao[{format}]",
        ("to_torchao", "ScaledTensor"),
        make,
        lambda leaves: torchao_parts(formats.to_torchao(scaled_from(leaves, "x", format), torch.float32)),
    )


def torchao_parts(x) -> tuple:
    """A torchao tensor's stored tensors and its dequantized values."""
    per_tensor = getattr(x, "per_tensor_scale", None)
    return (x.qdata, x.scale, *(() if per_tensor is None else (per_tensor,)), x.dequantize(torch.float32))


# ----------------------------------------------------------------------------- flash-attn drop-ins


def _flash_attn_func_call() -> Call:
    head_dim = 24  # not a multiple of 16: the padded path

    def make(device):
        rand = lambda *shape: torch.randn(*shape, dtype=torch.bfloat16, device=device)  # noqa: E731
        return {
            "q": rand(2, 7, 4, head_dim),
            "k": rand(2, 11, 2, head_dim),
            "v": rand(2, 11, 2, head_dim),
            "alibi_slopes": torch.rand(4, device=device) / 4,
            "learnable_sink": torch.randn(4, device=device),
        }

    def run(leaves):
        return flash_attn.flash_attn_func(
            leaves["q"],
            leaves["k"],
            leaves["v"],
            causal=True,
            window_size=(6, 0),
            alibi_slopes=leaves["alibi_slopes"],
            return_attn_probs=True,
            learnable_sink=leaves["learnable_sink"],
        )

    return Call("flash_attn_func[D 24, causal window, alibi, sink]", ("flash_attn_func",), make, run)


def _flash_attn_fp8_call(function: str) -> Call:
    """FA3's FP8: e4m3 q, k, v with ``q_descale`` / ``k_descale`` / ``v_descale`` through ``flash_attn_func`` or
    ``flash_attn_varlen_func`` (ragged)."""

    def make(device):
        e4m3 = lambda *shape: torch.randn(*shape, device=device).to(torch.float8_e4m3fn)  # noqa: E731
        ragged = function == "flash_attn_varlen_func"
        leaves = {
            "q": e4m3(*((9,) if ragged else (2, 5)), 4, HEAD_DIM),
            "k": e4m3(*((20,) if ragged else (2, 10)), 2, HEAD_DIM),
            "v": e4m3(*((20,) if ragged else (2, 10)), 2, HEAD_DIM),
            "q_descale": torch.rand(2, 2, device=device) + 0.5,
            "k_descale": torch.rand(2, 2, device=device) + 0.5,
            "v_descale": torch.rand(2, 1, device=device) + 0.5,
        }
        if ragged:
            leaves.update(cu_seqlens_q=_offsets([4, 5], device), cu_seqlens_k=_offsets([12, 8], device))
        return leaves

    def run(leaves):
        descales = {name: leaves[name] for name in ("q_descale", "k_descale", "v_descale")}
        if function == "flash_attn_func":
            return flash_attn.flash_attn_func(
                leaves["q"], leaves["k"], leaves["v"], causal=True, return_attn_probs=True, **descales
            )
        return flash_attn.flash_attn_varlen_func(
            leaves["q"],
            leaves["k"],
            leaves["v"],
            leaves["cu_seqlens_q"],
            leaves["cu_seqlens_k"],
            5,
            12,
            causal=True,
            return_attn_probs=True,
            **descales,
        )

    return Call(f"{function}[fp8]", (function,), make, run)


def _flash_attn_varlen_call(mode: str) -> Call:
    """mode: "seqused_k" (ragged K, FA3's seqused_k), "block_table" / "page_table" (K / V as shuffled pages)."""

    def make(device):
        rand = lambda *shape: torch.randn(*shape, dtype=torch.float16, device=device)  # noqa: E731
        leaves = {
            "q": rand(9, 4, HEAD_DIM),
            "cu_seqlens_q": _offsets([4, 0, 5], device),
            "learnable_sink": torch.randn(4, device=device),
        }
        if mode == "seqused_k":
            leaves.update(
                k=rand(30, 2, HEAD_DIM),
                v=rand(30, 2, HEAD_DIM),
                cu_seqlens_k=_offsets([12, 3, 15], device),
                seqused_k=torch.tensor([9, 0, 15], dtype=torch.int32, device=device),
                alibi_slopes=torch.rand(4, device=device) / 4,
            )
        else:
            leaves.update(
                k=rand(6, 16, 2, HEAD_DIM),
                v=rand(6, 16, 2, HEAD_DIM),
                cu_seqlens_k=_offsets([20, 5, 31], device),
                **{mode: torch.tensor([[4, 1], [0, 3], [5, 2]], dtype=torch.int32, device=device)},
            )
        return leaves

    def run(leaves):
        return flash_attn.flash_attn_varlen_func(
            leaves["q"],
            leaves["k"],
            leaves["v"],
            leaves["cu_seqlens_q"],
            leaves["cu_seqlens_k"],
            5,
            32,
            causal=True,
            alibi_slopes=leaves.get("alibi_slopes"),
            return_attn_probs=True,
            block_table=leaves.get("block_table"),
            seqused_k=leaves.get("seqused_k"),
            page_table=leaves.get("page_table"),
            learnable_sink=leaves["learnable_sink"],
        )

    return Call(f"flash_attn_varlen_func[{mode}]", ("flash_attn_varlen_func",), make, run)


def _flash_attn_kvcache_call(mode: str) -> Call:
    """mode: "dense" (append with rotary into a cache of 40 positions, cache_batch_idx, cache_leftpad, sinks),
    "page_table" (append into shuffled pages, ALiBi, three splits), "block_table" (no new keys, softcap, a chunk),
    "fp8" (bf16 keys appended into e4m3 pages with FA3's descales, e4m3 q)."""
    heads, kv_heads, dtype = 4, 2, torch.bfloat16

    def make(device):
        rand = lambda *shape: torch.randn(*shape, dtype=dtype, device=device)  # noqa: E731
        if mode == "fp8":
            e4m3 = lambda *shape: torch.randn(*shape, device=device).to(torch.float8_e4m3fn)  # noqa: E731
            return {
                "q": e4m3(2, 2, heads, HEAD_DIM),
                "k_cache": e4m3(7, 16, kv_heads, HEAD_DIM),
                "v_cache": e4m3(7, 16, kv_heads, HEAD_DIM),
                "k": rand(2, 2, kv_heads, HEAD_DIM),
                "v": rand(2, 2, kv_heads, HEAD_DIM),
                "block_table": torch.tensor([[4, 1, 6], [0, 5, 2]], dtype=torch.int32, device=device),
                "cache_seqlens": torch.tensor([20, 31], dtype=torch.int32, device=device),
                "q_descale": torch.rand(2, kv_heads, device=device) + 0.5,
                "k_descale": torch.rand(2, kv_heads, device=device) + 0.5,
                "v_descale": torch.rand(1, 1, device=device) + 0.5,
            }
        if mode == "dense":
            leaves = {
                "q": rand(2, 2, heads, HEAD_DIM),
                "k_cache": rand(3, 40, kv_heads, HEAD_DIM),
                "v_cache": rand(3, 40, kv_heads, HEAD_DIM),
                "k": rand(2, 2, kv_heads, HEAD_DIM),
                "v": rand(2, 2, kv_heads, HEAD_DIM),
                "rotary_cos": torch.rand(48, 4, device=device).to(dtype),
                "rotary_sin": torch.rand(48, 4, device=device).to(dtype),
                "cache_seqlens": torch.tensor([5, 37], dtype=torch.int32, device=device),
                "cache_batch_idx": torch.tensor([2, 0], dtype=torch.int32, device=device),
                "cache_leftpad": torch.tensor([1, 0], dtype=torch.int32, device=device),
                "learnable_sink": torch.randn(heads, device=device),
            }
        else:
            leaves = {
                "q": rand(2, 1, heads, HEAD_DIM),
                "k_cache": rand(7, 16, kv_heads, HEAD_DIM),
                "v_cache": rand(7, 16, kv_heads, HEAD_DIM),
                mode: torch.tensor([[4, 1, 6], [0, 5, 2]], dtype=torch.int32, device=device),
                "cache_seqlens": torch.tensor([20, 30], dtype=torch.int32, device=device),
            }
            if mode == "page_table":
                leaves.update(
                    k=rand(2, 3, kv_heads, HEAD_DIM),
                    v=rand(2, 3, kv_heads, HEAD_DIM),
                    alibi_slopes=torch.rand(heads, device=device) / 4,
                )
        return leaves

    def run(leaves):
        return flash_attn.flash_attn_with_kvcache(
            leaves["q"],
            leaves["k_cache"],
            leaves["v_cache"],
            leaves.get("k"),
            leaves.get("v"),
            rotary_cos=leaves.get("rotary_cos"),
            rotary_sin=leaves.get("rotary_sin"),
            cache_seqlens=leaves["cache_seqlens"],
            cache_batch_idx=leaves.get("cache_batch_idx"),
            cache_leftpad=leaves.get("cache_leftpad"),
            block_table=leaves.get("block_table"),
            page_table=leaves.get("page_table"),
            causal=mode != "block_table",
            softcap=2.0 if mode == "block_table" else 0.0,
            alibi_slopes=leaves.get("alibi_slopes"),
            num_splits=3 if mode == "page_table" else 0,
            return_softmax_lse=True,
            attention_chunk=32 if mode == "block_table" else 0,
            learnable_sink=leaves.get("learnable_sink"),
            q_descale=leaves.get("q_descale"),
            k_descale=leaves.get("k_descale"),
            v_descale=leaves.get("v_descale"),
        )

    written = ("k_cache", "v_cache") if mode != "block_table" else ()
    return Call(f"flash_attn_with_kvcache[{mode}]", ("flash_attn_with_kvcache",), make, run, written=written)


# ----------------------------------------------------------------------------- vLLM's fused_experts


def _fused_experts_call(weight_format: str, inplace: bool) -> Call:
    """bf16 weights with biases and an expert map (one expert on another rank), or quantized weights run
    in place with the router weight on the input and quantized activations."""
    experts, hidden, intermediate, top_k = 4, 64, 32, 2

    def make(device):
        w1 = torch.randn(experts, 2 * intermediate, hidden, device=device) / 8
        w2 = torch.randn(experts, hidden, intermediate, device=device) / 8
        leaves = {
            "hidden_states": torch.randn(5, hidden, dtype=torch.bfloat16, device=device),
            "topk_weights": torch.rand(5, top_k, device=device),
            "topk_ids": torch.randint(0, experts + 1, (5, top_k), dtype=torch.int32, device=device),
        }
        if weight_format == "bf16":
            leaves.update(
                w1=w1.bfloat16(),
                w2=w2.bfloat16(),
                w1_bias=torch.randn(experts, 2 * intermediate, device=device),
                w2_bias=torch.randn(experts, hidden, device=device),
                expert_map=torch.tensor([0, 1, -1, 2, 3], dtype=torch.int32, device=device),
            )
        else:
            leaves.update(
                scaled_leaves("w1", lk.quantize(w1, weight_format)),
                **scaled_leaves("w2", lk.quantize(w2, weight_format)),
            )
            leaves["topk_ids"] %= experts
        return leaves

    def run(leaves):
        weights = [
            leaves[name] if weight_format == "bf16" else scaled_from(leaves, name, weight_format)
            for name in ("w1", "w2")
        ]
        return fused_experts(
            leaves["hidden_states"],
            *weights,
            leaves["topk_weights"],
            leaves["topk_ids"],
            inplace=inplace,
            apply_router_weight_on_input=inplace,
            global_num_experts=experts + 1 if "expert_map" in leaves else -1,
            expert_map=leaves.get("expert_map"),
            w1_bias=leaves.get("w1_bias"),
            w2_bias=leaves.get("w2_bias"),
            activation_format="bf16" if not inplace else weight_format,
        )

    return Call(
        f"fused_experts[{weight_format}{', in place' if inplace else ', expert_map, biases'}]",
        ("fused_experts", "ScaledTensor"),
        make,
        run,
        written=("hidden_states",) if inplace else (),
    )


def _fused_experts_fp8_call() -> Call:
    """vLLM's fp8 block call: raw float8_e4m3fn weights and their float32 block scales as leaves of their own; K = 72
    and N = 40 (partial 128-tiles)."""
    experts, hidden, intermediate, top_k = 2, 72, 40, 2

    def make(device):
        w1 = lk.quantize(torch.randn(experts, 2 * intermediate, hidden, device=device) / 8, "fp8", block=(128, 128))
        w2 = lk.quantize(torch.randn(experts, hidden, intermediate, device=device) / 6, "fp8", block=(128, 128))
        return {
            "hidden_states": torch.randn(4, hidden, dtype=torch.bfloat16, device=device),
            "w1": w1.data,
            "w2": w2.data,
            "topk_weights": torch.rand(4, top_k, device=device),
            "topk_ids": torch.randint(-1, experts, (4, top_k), dtype=torch.int32, device=device),
            "w1_scale": w1.scales,
            "w2_scale": w2.scales,
        }

    def run(leaves):
        return fused_experts(
            leaves["hidden_states"],
            leaves["w1"],
            leaves["w2"],
            leaves["topk_weights"],
            leaves["topk_ids"],
            use_fp8_w8a8=True,
            block_shape=[128, 128],
            w1_scale=leaves["w1_scale"],
            w2_scale=leaves["w2_scale"],
        )

    return Call("fused_experts[fp8 blocks, vLLM's arguments]", ("fused_experts",), make, run)


def _from_float_fp8_call() -> Call:
    experts, hidden, intermediate = 2, 72, 40

    def make(device):
        return {
            "router_weight": torch.randn(experts, hidden, device=device),
            "w_gate_up": torch.randn(experts, 2 * intermediate, hidden, device=device) / 8,
            "w_down": torch.randn(experts, hidden, intermediate, device=device) / 8,
        }

    def run(leaves):
        block = MoEFeedForward.from_float(
            leaves["router_weight"], leaves["w_gate_up"], leaves["w_down"], 1, weight_format="fp8"
        )
        return (block.router_weight, lk.dequantize(block.weight("w_gate_up")), lk.dequantize(block.weight("w_down")))

    return Call("MoEFeedForward.from_float[fp8]", ("MoEFeedForward.from_float",), make, run)


def _from_float_call() -> Call:
    experts, hidden, intermediate = 4, 64, 32

    def make(device):
        return {
            "router_weight": torch.randn(experts, hidden, device=device),
            "w_gate_up": torch.randn(experts, 2 * intermediate, hidden, device=device) / 8,
            "w_down": torch.randn(experts, hidden, intermediate, device=device) / 8,
            "correction_bias": torch.rand(experts, device=device),
        }

    def run(leaves):
        block = MoEFeedForward.from_float(
            leaves["router_weight"],
            leaves["w_gate_up"],
            leaves["w_down"],
            2,
            weight_format="nvfp4",
            weight_layout="hopper",
            scoring="sigmoid",
            correction_bias=leaves["correction_bias"],
        )
        return (
            block.router_weight,
            block.correction_bias,
            lk.dequantize(block.weight("w_gate_up")),
            lk.dequantize(block.weight("w_down")),
        )

    return Call("MoEFeedForward.from_float[nvfp4, hopper]", ("MoEFeedForward.from_float",), make, run)


# ----------------------------------------------------------------------------- transformers integration


class _AttentionModule(torch.nn.Module):
    is_causal = True


def _attention_forward_call() -> Call:
    def make(device):
        rand = lambda *shape: torch.randn(*shape, dtype=torch.bfloat16, device=device)  # noqa: E731
        mask = torch.ones(2, 1, 6, 9, dtype=torch.bool, device=device).tril(3)
        mask[1, :, :, :2] = False  # left padding
        return {
            "query": rand(2, 4, 6, HEAD_DIM),
            "key": rand(2, 2, 9, HEAD_DIM),
            "value": rand(2, 2, 9, HEAD_DIM),
            "attention_mask": mask,
            "s_aux": torch.randn(4, device=device),
        }

    def run(leaves):
        return lk_transformers.attention_forward(
            _AttentionModule(),
            leaves["query"],
            leaves["key"],
            leaves["value"],
            leaves["attention_mask"],
            scaling=0.3,
            s_aux=leaves["s_aux"],
        )[0]

    return Call(
        "attention_forward[bool mask, sinks]",
        ("attention_forward",),
        make,
        run,
        aliases=(("query", "q"), ("key", "k"), ("value", "v"), ("attention_mask", "mask"), ("s_aux", "sinks")),
    )


def _mixtral_experts(leaves: dict, prefix: str) -> torch.nn.Module:
    """transformers' Mixtral experts module (the default fused layout) holding the leaves under ``prefix``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralExperts
    gate_up, down = leaves[f"{prefix}.gate_up_proj"], leaves[f"{prefix}.down_proj"]
    experts = MixtralExperts(
        MixtralConfig(
            hidden_size=MOE_SIZES[1],
            intermediate_size=MOE_SIZES[2],
            num_local_experts=MOE_SIZES[0],
            num_experts_per_tok=2,
        )
    )
    experts.gate_up_proj = torch.nn.Parameter(gate_up, requires_grad=False)
    experts.down_proj = torch.nn.Parameter(down, requires_grad=False)
    return experts


MOE_SIZES = (4, 64, 32)  # experts, hidden, intermediate of the transformers experts module


def _experts_call(quantized: bool) -> Call:
    experts, hidden, intermediate = MOE_SIZES
    prefix = "model" if quantized else "self"

    def make(device):
        leaves = {
            f"{prefix}.gate_up_proj": torch.randn(experts, 2 * intermediate, hidden, device=device).bfloat16() / 8,
            f"{prefix}.down_proj": torch.randn(experts, hidden, intermediate, device=device).bfloat16() / 8,
        }
        if not quantized:
            leaves.update(
                hidden_states=torch.randn(5, hidden, dtype=torch.bfloat16, device=device),
                top_k_index=torch.randint(0, experts, (5, 2), device=device),
                top_k_weights=torch.rand(5, 2, device=device),
            )
        return leaves

    def run(leaves):
        module = _mixtral_experts(leaves, prefix)
        if not quantized:
            return lk_transformers.experts_forward(
                module, leaves["hidden_states"], leaves["top_k_index"], leaves["top_k_weights"]
            )
        count = lk_transformers.quantize_experts(torch.nn.Sequential(module), "mxfp4")
        weights = module.llmkernels_weights
        return torch.tensor(count), lk.dequantize(weights.w1), lk.dequantize(weights.w2)

    name = "quantize_experts" if quantized else "experts_forward"
    aliases = (
        ("top_k_index", "topk_ids"),
        ("top_k_weights", "topk_weights"),
        (f"{prefix}.gate_up_proj", "w1"),
        (f"{prefix}.down_proj", "w2"),
    )
    return Call(f"{name}[Mixtral experts]", (name,), make, run, aliases=aliases)


CALLS = [
    _quantize_call("mxfp8", gather=False, grouped=False),
    _quantize_call("mxfp4", gather=True, grouped=False),
    _quantize_call("nvfp4", gather=True, grouped=True),
    _fp8_quantize_call((1, 128), gather=True),
    _fp8_quantize_call((128, 128), power_of_two_scales=True),
    _fp8_dequantize_call((1, 128)),
    _fp8_dequantize_call((128, 128)),
    _dequantize_call("nvfp4", "row"),
    _dequantize_call("mxfp4", "128x4"),
    _dequantize_call("mxfp8", "grouped"),
    _dequantize_call("mxfp4", "hopper"),
    _dequantize_call("nvfp4", "hopper"),
    _to_layout_call(),
    _grouped_matmul_call("mxfp8", "mxfp8"),
    _grouped_matmul_call("nvfp4", "nvfp4", epilogue="swiglu"),
    _grouped_matmul_call("bf16", "mxfp4", b_layout="128x4"),
    _grouped_matmul_call("mxfp8", "mxfp4", a_layout="grouped", b_layout="128x4"),
    _grouped_matmul_call("bf16", "bf16", epilogue="silu"),
    _grouped_matmul_call("bf16", "mxfp4", b_layout="hopper", epilogue="swiglu"),
    _grouped_matmul_call("mxfp4", "mxfp4", b_layout="hopper"),
    _grouped_matmul_call("nvfp4", "nvfp4", a_layout="128x4", b_layout="hopper", epilogue="swiglu"),
    _grouped_matmul_call("bf16", "mxfp4", epilogue=lk.GPT_OSS_SWIGLU, bias=True),
    _grouped_matmul_call("bf16", "nvfp4", b_layout="hopper", epilogue=lk.SwiGLU(alpha=1.702, limit=0.5), bias=True),
    _attention_call("dense"),
    _attention_call("dense-decode"),
    _attention_call("ragged"),
    _attention_call("paged"),
    _attention_call("decode"),
    _attention_fp8_call("dense"),
    _attention_fp8_call("paged"),
    _route_call(),
    _select_call(),
    _dispatch_call(),
    _combine_call(),
    _moe_call("mxfp8"),
    _moe_call("nvfp4"),
    _moe_call("mxfp4", "hopper"),
    _moe_call("nvfp4", "hopper"),
    _quantize_reference_call("mxfp4"),
    _quantize_reference_call("nvfp4"),
    _quantize_reference_call("fp8"),
    _grouped_matmul_reference_call(),
    _attention_reference_call(paged=False),
    _attention_reference_call(paged=True),
    _attention_fp8_call("dense", "attention_reference"),
    _dispatch_reference_call(),
    _scale_layout_call(grouped=False),
    _scale_layout_call(grouped=True),
    _blocked_scales_call(grouped=False),
    _blocked_scales_call(grouped=True),
    _global_scale_call(),
    _parts_call(),
    _scaled_tensor_methods_call("128x4"),
    _scaled_tensor_methods_call("hopper"),
    *((_torchao_call("mxfp4"), _torchao_call("nvfp4"), _to_torchao_call("mxfp8")) if HAS_TORCHAO else ()),
    _flash_attn_func_call(),
    _flash_attn_fp8_call("flash_attn_func"),
    _flash_attn_fp8_call("flash_attn_varlen_func"),
    _flash_attn_varlen_call("seqused_k"),
    _flash_attn_varlen_call("block_table"),
    _flash_attn_varlen_call("page_table"),
    _flash_attn_kvcache_call("dense"),
    _flash_attn_kvcache_call("page_table"),
    _flash_attn_kvcache_call("block_table"),
    _flash_attn_kvcache_call("fp8"),
    _fused_experts_call("bf16", inplace=False),
    _fused_experts_call("mxfp8", inplace=True),
    _fused_experts_fp8_call(),
    _from_float_call(),
    _from_float_fp8_call(),
    _attention_forward_call(),
    _experts_call(quantized=False),
    _experts_call(quantized=True),
]
CALLS_BY_NAME = {call.name: call for call in CALLS}


def patch_launches(monkeypatch, replace) -> None:
    """Every way a kernel launches (Triton's JIT, its interpreter, a cached plan's bound kernel) goes, from here
    on, through ``replace(original)``."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    from llmkernels.launch import BoundKernel

    for owner, name in ((JITFunction, "run"), (InterpretedFunction, "run"), (BoundKernel, "__call__")):
        monkeypatch.setattr(owner, name, replace(getattr(owner, name)))


def forbid_launches(monkeypatch) -> None:
    """From here on any kernel launch fails the test: the errors must come first."""

    def launched(*args, **kwargs):
        raise AssertionError("a kernel was launched before the error")

    patch_launches(monkeypatch, lambda original: launched)


def fill(tensor: torch.Tensor, filling: str) -> torch.Tensor:
    """``"high"``: NaN (floating; 0xFF bytes for the one-byte types) or the integer maximum; ``"low"``:
    zero (floating, bytes) or the integer minimum. Values that show when a kernel reads them."""
    if tensor.element_size() == 1:
        tensor.view(torch.uint8).fill_(0xFF if filling == "high" else 0)
    elif tensor.is_floating_point():
        tensor.fill_(float("nan") if filling == "high" else 0.0)
    else:
        info = torch.iinfo(tensor.dtype)
        tensor.fill_(info.max if filling == "high" else info.min)
    return tensor


def poisoned_buffer(shape, dtype, device) -> torch.Tensor:
    """Stands in for ``llmkernels.runtime.new_buffer``: every buffer a kernel writes starts "high"
    (:func:`fill`), so that elements a call leaves unwritten compare equal between two runs instead of
    holding whatever memory held."""
    return fill(torch.empty(shape, dtype=dtype, device=device), "high")


def observe(call: Call, leaves: dict):
    """Copies of the tensors of the call's result (:func:`flat_tensors`) and, after them, of the leaves it writes
    in place: a later run on the same tensors (an ``out=`` the result aliases) cannot change them."""
    parts = [*flat_tensors(call.run(leaves)), *(leaves[name] for name in call.written)]
    return [part.clone() if isinstance(part, torch.Tensor) else part for part in parts]


def outcome(call: Call, leaves: dict):
    """:func:`observe`, or the TypeError / ValueError the call raised."""
    try:
        return observe(call, leaves)
    except (TypeError, ValueError) as error:
        return error


PLAIN_VALUES = (type(None), bool, int, float, str, torch.dtype, torch.Size)


def flat_tensors(result) -> list:
    """The tensors of a call's result in a fixed order (tuples, ScaledTensors, plain tensors), with the plain
    values among them (None, numbers, strings) where they stand."""
    if isinstance(result, torch.Tensor) or isinstance(result, PLAIN_VALUES):
        return [result]
    if isinstance(result, lk.ScaledTensor):
        return [t for t in scaled_leaves("", result).values()]
    if isinstance(result, (tuple, list)):
        return [t for part in result for t in flat_tensors(part)]
    raise TypeError(f"unexpected result type {type(result).__name__}")


def as_bits(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of a tensor's elements in row-major order (NaN payloads and -0 included)."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def bit_differences(actual, expected) -> str | None:
    """None when two outcomes are the same: results of the same shapes, dtypes and bytes, or errors of
    the same type and message; else what differs."""
    if isinstance(expected, Exception) or isinstance(actual, Exception):
        same = type(actual) is type(expected) and str(actual) == str(expected)
        return None if same else f"{actual!r} where {expected!r} was expected"
    actual, expected = flat_tensors(actual), flat_tensors(expected)
    if len(actual) != len(expected):
        return f"{len(actual)} result tensors, expected {len(expected)}"
    for i, (a, e) in enumerate(zip(actual, expected)):
        if not isinstance(e, torch.Tensor) or not isinstance(a, torch.Tensor):
            if type(a) is not type(e) or a != e:
                return f"result {i}: {a!r} != {e!r}"
            continue
        if a.shape != e.shape or a.dtype != e.dtype:
            return f"result {i}: {a.dtype}{tuple(a.shape)} != {e.dtype}{tuple(e.shape)}"
        if not torch.equal(as_bits(a), as_bits(e)):
            differ = (as_bits(a) != as_bits(e)).sum().item()
            return f"result {i} ({e.dtype}{tuple(e.shape)}): {differ} bytes differ"
    return None
