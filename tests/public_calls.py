"""Every public function, called on tiny inputs whose tensors are named leaves.

A :class:`Call` holds fresh inputs as a flat ``{leaf: tensor}`` dict and a function that makes the call
from such a dict, so that a test can swap any one leaf for a view of itself (``test_any_strides.py``)
or for a copy inside a hostile buffer (``test_canaries.py``) and compare with the untouched call.
Leaf names follow the argument they feed: ``"q"``, ``"a.scales"`` (a field of the ScaledTensor passed
as ``a``), ``"kv_cache.block_table"``, ``"score_mod.slopes"``. A leaf named ``"out"`` is written by
the call. :data:`NON_TENSOR_ARGUMENTS` lists the arguments that hold no tensor; ``test_any_strides``
checks that every other argument of every public function is the root of some leaf here, so that a
tensor argument added later cannot go unwalked.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

import llmkernels as lk
from llmkernels.attention.paged import PagedKVCache
from llmkernels.moe import MoEFeedForward, combine, dispatch, route, select_experts

HEAD_DIM = 16
ATTENTION_CONFIG = lk.FA4Config(BM=16, BN=16, num_kv_stages=1)


@dataclass(frozen=True)
class Call:
    name: str
    functions: tuple  # the keys of PUBLIC whose arguments it feeds
    make: Callable[[torch.device], dict]  # device -> {leaf: tensor}, fresh random inputs
    run: Callable[[dict], object]  # {leaf: tensor} -> the call's result


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
}

NON_TENSOR_ARGUMENTS = {
    "quantize": {"format", "scale_layout"},
    "dequantize": set(),
    "ScaledTensor": {"format", "scale_layout", "logical_shape"},
    "ScaledTensor.to_layout": {"self", "layout"},
    "grouped_matmul": {"epilogue", "out_dtype", "config", "validate"},
    "attention": {"causal", "mask", "softmax_scale", "max_seqlen_q", "max_seqlen_k", "num_splits", "return_lse",
                  "config", "validate"},
    "PagedKVCache": set(),
    "alibi": set(),
    "route": {"top_k", "scoring", "renormalize", "num_groups", "topk_groups"},
    "select_experts": {"top_k", "scoring", "renormalize"},
    "dispatch": {"num_experts"},
    "combine": {"out_dtype"},
    "MoEFeedForward": {"top_k", "activation_format", "scoring", "renormalize", "num_groups", "topk_groups",
                       "process_group", "capacity"},
    "MoEFeedForward.forward": {"self"},
}

# Classes passed as one argument whose tensor fields become leaves "<argument>.<field>".
CONTAINERS = {"ScaledTensor": ("a", "b", "x", "w_gate_up", "w_down"), "PagedKVCache": ("kv_cache",),
              "alibi": ("score_mod",)}


def scaled_leaves(prefix: str, tensor: lk.ScaledTensor) -> dict:
    fields = ("data", "scales", "global_scale", "group_offsets", "group_scale_offsets")
    return {f"{prefix}.{field}": getattr(tensor, field) for field in fields if getattr(tensor, field) is not None}


def scaled_from(leaves: dict, prefix: str, format: str, layout: str = "row", shape=None) -> lk.ScaledTensor:
    """The ScaledTensor of the leaves under ``prefix`` (``shape``: the logical shape of the hopper layout)."""
    part = lambda field: leaves.get(f"{prefix}.{field}")  # noqa: E731
    return lk.ScaledTensor(part("data"), part("scales"), format, part("global_scale"), layout,
                           part("group_offsets"), part("group_scale_offsets"), shape)


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
        return lk.quantize(leaves["x"], format, global_scale=leaves.get("global_scale"), rows=leaves.get("rows"),
                           scale_layout="128x4" if grouped else "row", group_offsets=leaves.get("group_offsets"))

    return Call(f"quantize[{format}{', rows' if gather else ''}{', grouped 128x4' if grouped else ''}]",
                ("quantize",), make, run)


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
    return Call(f"dequantize[{format}, {layout}]", ("dequantize", "ScaledTensor"), make,
                lambda leaves: lk.dequantize(scaled_from(leaves, "x", format, scale_layout,
                                                         shape if layout == "hopper" else None)))


def _to_layout_call() -> Call:
    def make(device):
        x = lk.quantize(torch.randn(12, 64, device=device), "mxfp8")
        return {**scaled_leaves("self", x), "group_offsets": _offsets([5, 0, 7], device)}

    return Call("ScaledTensor.to_layout[grouped 128x4]", ("ScaledTensor.to_layout",), make,
                lambda leaves: scaled_from(leaves, "self", "mxfp8").to_layout("128x4", leaves["group_offsets"]))


# ----------------------------------------------------------------------------- grouped matmul

def _grouped_matmul_call(a_format: str, b_format: str, a_layout: str = "row", b_layout: str = "row",
                         epilogue=None, bias: bool = False) -> Call:
    sizes, experts, n, k = [5, 0, 9, 3], 3, 32, 64

    def make(device):
        x = torch.randn(sum(sizes) + 2, k, device=device)  # two rows outside every group
        w = torch.randn(experts, n, k, device=device) / 8
        leaves = {"a_offsets": _offsets(sizes, device),
                  "expert_ids": torch.tensor([2, 0, 1, -1], dtype=torch.int32, device=device),
                  "expert_scales": torch.rand(experts, device=device) + 0.5}
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
        a = leaves["a"] if a_format == "bf16" else scaled_from(leaves, "a", a_format, "row" if a_layout == "row"
                                                                 else "128x4")
        b = leaves["b"] if b_format == "bf16" else scaled_from(leaves, "b", b_format, b_layout,
                                                                 (experts, n, k) if b_layout == "hopper" else None)
        return lk.grouped_matmul(a, b, leaves["a_offsets"], leaves["expert_ids"], leaves["expert_scales"],
                                 epilogue=epilogue, bias=leaves.get("bias"), out=leaves["out"])

    name = (f"grouped_matmul[{a_format} ({a_layout}) x {b_format} ({b_layout}){f', {epilogue}' if epilogue else ''}"
            f"{', bias' if bias else ''}]")
    return Call(name, ("grouped_matmul", "ScaledTensor"), make, run)


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
            leaves.update(q=rand(2, sq, heads, HEAD_DIM), k=rand(2, 37, kv_heads, HEAD_DIM),
                          v=rand(2, 37, kv_heads, HEAD_DIM))
        elif mode == "ragged":
            leaves.update(q=rand(29, heads, HEAD_DIM), k=rand(41, kv_heads, HEAD_DIM), v=rand(41, kv_heads, HEAD_DIM),
                          cu_seqlens_q=_offsets([9, 0, 20], device), cu_seqlens_k=_offsets([12, 5, 24], device))
        else:
            page_size, num_pages = 16, 7
            leaves.update(q=rand(2, 3 if mode == "decode" else 18, heads, HEAD_DIM),
                          **{"kv_cache.k_pages": rand(num_pages, page_size, kv_heads, HEAD_DIM),
                             "kv_cache.v_pages": rand(num_pages, page_size, kv_heads, HEAD_DIM),
                             "kv_cache.block_table": torch.tensor([[4, 1, 6], [0, 5, 2]], dtype=torch.int32,
                                                                  device=device),
                             "kv_cache.seqlens": torch.tensor([40, 23], dtype=torch.int32, device=device),
                             "kv_cache.starts": torch.tensor([3, 0], dtype=torch.int32, device=device)})
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
            kv_cache = PagedKVCache(*(leaves[f"kv_cache.{field}"] for field in
                                      ("k_pages", "v_pages", "block_table", "seqlens", "starts")))
        ragged = "cu_seqlens_q" in leaves
        return lk.attention(
            leaves["q"], leaves.get("k"), leaves.get("v"), causal=mode != "ragged",
            mask=lk.SlidingWindow(12, 3) if mode == "ragged" else leaves.get("mask.tensor"),
            score_mod=lk.alibi(leaves["score_mod.slopes"]) if "score_mod.slopes" in leaves else None,
            sinks=leaves.get("sinks"), cu_seqlens_q=leaves.get("cu_seqlens_q"), cu_seqlens_k=leaves.get("cu_seqlens_k"),
            max_seqlen_q=20 if ragged else None, max_seqlen_k=24 if ragged else None, kv_cache=kv_cache,
            num_splits=3 if mode in ("decode", "dense-decode") else 1, return_lse=True, config=ATTENTION_CONFIG)

    return Call(f"attention[{mode}]", ("attention", "PagedKVCache", "alibi"), make, run)


# ----------------------------------------------------------------------------- MoE

def _route_call() -> Call:
    def make(device):
        return {"router_logits": torch.randn(6, 8, device=device), "correction_bias": torch.rand(8, device=device)}

    return Call("route[grouped, bias]", ("route",), make,
                lambda leaves: route(leaves["router_logits"], 2, scoring="sigmoid", num_groups=4, topk_groups=2,
                                     correction_bias=leaves["correction_bias"]))


def _select_call() -> Call:
    def make(device):
        return {"router_logits": torch.randn(6, 12, device=device), "correction_bias": torch.rand(12, device=device)}

    return Call("select_experts[sigmoid, bias]", ("select_experts",), make,
                lambda leaves: select_experts(leaves["router_logits"], 3, scoring="sigmoid",
                                              correction_bias=leaves["correction_bias"]))


def _dispatch_call() -> Call:
    return Call("dispatch", ("dispatch",), lambda device: {"expert_ids": torch.randint(0, 5, (7, 3), device=device)},
                lambda leaves: dispatch(leaves["expert_ids"], 5))


def _combine_call() -> Call:
    def make(device):
        return {"y": torch.randn(12, 40, dtype=torch.bfloat16, device=device),
                "row_of_copy": torch.randperm(12, device=device).view(6, 2),
                "weights": torch.rand(6, 2, device=device)}

    return Call("combine", ("combine",), make, lambda leaves: combine(leaves["y"], leaves["row_of_copy"], leaves["weights"]))


def _moe_call(weight_format: str, weight_layout: str = "row") -> Call:
    experts, hidden, intermediate = 4, 64, 32
    shapes = {"w_gate_up": (experts, 2 * intermediate, hidden), "w_down": (experts, hidden, intermediate)}

    def make(device):
        block = MoEFeedForward.from_float(torch.randn(experts, hidden, device=device),
                                          torch.randn(experts, 2 * intermediate, hidden, device=device) / 8,
                                          torch.randn(experts, hidden, intermediate, device=device) / 8, 2,
                                          weight_format=weight_format, weight_layout=weight_layout)
        leaves = {"router_weight": block.router_weight, "correction_bias": torch.rand(experts, device=device) / 8,
                  "hidden_states": torch.randn(5, hidden, dtype=torch.bfloat16, device=device)}
        for name in ("w_gate_up", "w_down"):
            weight = block.weight(name)
            leaves.update(scaled_leaves(name, weight) if weight_format != "bf16" else {name: weight})
        return leaves

    def run(leaves):
        weights = [leaves[name] if weight_format == "bf16" else
                   scaled_from(leaves, name, weight_format, weight_layout, shapes[name] if weight_layout == "hopper"
                               else None)
                   for name in ("w_gate_up", "w_down")]
        block = MoEFeedForward(leaves["router_weight"], *weights, 2, correction_bias=leaves["correction_bias"],
                               activation_format=weight_format if weight_format != "mxfp4" else "bf16")
        return block(leaves["hidden_states"])

    return Call(f"MoEFeedForward[{weight_format}{', hopper' if weight_layout == 'hopper' else ''}]", ("MoEFeedForward", "MoEFeedForward.forward", "ScaledTensor"),
                make, run)


CALLS = [
    _quantize_call("mxfp8", gather=False, grouped=False),
    _quantize_call("mxfp4", gather=True, grouped=False),
    _quantize_call("nvfp4", gather=True, grouped=True),
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
    _route_call(),
    _select_call(),
    _dispatch_call(),
    _combine_call(),
    _moe_call("mxfp8"),
    _moe_call("nvfp4"),
    _moe_call("mxfp4", "hopper"),
    _moe_call("nvfp4", "hopper"),
]
CALLS_BY_NAME = {call.name: call for call in CALLS}


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
    """Stands in for ``llmkernels._runtime.new_buffer``: every buffer a kernel writes starts "high"
    (:func:`fill`), so that elements a call leaves unwritten compare equal between two runs instead of
    holding whatever memory held."""
    return fill(torch.empty(shape, dtype=dtype, device=device), "high")


def outcome(call: Call, leaves: dict):
    """The call's result, or the TypeError / ValueError it raised."""
    try:
        return call.run(leaves)
    except (TypeError, ValueError) as error:
        return error


def flat_tensors(result) -> list[torch.Tensor]:
    """The tensors of a call's result, in a fixed order (tuples, ScaledTensors, plain tensors)."""
    if isinstance(result, torch.Tensor):
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
        if a.shape != e.shape or a.dtype != e.dtype:
            return f"result {i}: {a.dtype}{tuple(a.shape)} != {e.dtype}{tuple(e.shape)}"
        if not torch.equal(as_bits(a), as_bits(e)):
            differ = (as_bits(a) != as_bits(e)).sum().item()
            return f"result {i} ({e.dtype}{tuple(e.shape)}): {differ} bytes differ"
    return None
