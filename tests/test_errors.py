"""Bad arguments raise TypeError / ValueError naming the argument, before any kernel launches; inputs that
require grad raise for the forward-only functions (and run under ``torch.no_grad()``).

Two walks: a table of hand-written cases (every public function that takes no tensor has its own), and a
data-driven one over every call of ``public_calls.py`` in which each tensor leaf in turn takes another
dtype, one more row, one dim fewer, or requires grad: whatever the call does with it, it either runs or
raises TypeError / ValueError naming the argument, before any launch and with every tensor (the ones it
writes in place included) byte-identical to before."""

import functools
import inspect

import pytest
import torch
from public_calls import (
    CALLS,
    CALLS_BY_NAME,
    NO_TENSOR_FUNCTIONS,
    PUBLIC,
    REFERENCES,
    InputRejected,
    as_bits,
    forbid_launches,
    patch_launches,
    poisoned_buffer,
)
from test_grouped_matmul import _bad_input_cases as _bad_grouped_matmul_cases

import llmkernels as lk
from llmkernels import runtime
from llmkernels.formats import FormatSpec, format_spec
from llmkernels.integrations import transformers as lk_transformers
from llmkernels.moe import MoEFeedForward, combine, dispatch, route

FORWARD_ONLY = (
    "quantize",
    "grouped_matmul",
    "attention",
    "combine",
    "select_experts",
    "MoEFeedForward.forward",
    "flash_attn_func",
    "flash_attn_varlen_func",
    "flash_attn_with_kvcache",
    "fused_experts",
)
MOE_WEIGHTS = ("router_weight", "correction_bias", "w_gate_up", "w_down")


def _cases(device):
    x = torch.randn(8, 64, device=device)
    a = lk.quantize(x, "mxfp8")
    q = torch.randn(1, 4, 2, 16, dtype=torch.float16, device=device)
    kv = torch.randn(1, 6, 2, 16, dtype=torch.float16, device=device)
    logits = torch.randn(4, 8, device=device)
    moe_args = (
        torch.randn(4, 64, device=device),
        torch.randn(4, 64, 64, device=device).bfloat16(),
        torch.randn(4, 64, 32, device=device).bfloat16(),
        2,
    )
    offsets = torch.tensor([0, 4, 8], dtype=torch.int32, device=device)
    grouped = {
        f"grouped_matmul case {i}": (error, message, functools.partial(lk.grouped_matmul, **kwargs))
        for i, (error, message, kwargs) in enumerate(_bad_grouped_matmul_cases(device))
    }
    return {
        **grouped,
        "dequantize, scales moved to another device after construction": (
            ValueError,
            "share one device",
            lambda: _moved_scales(lk.ScaledTensor(a.data, a.scales, "mxfp8")),
        ),
        # formats
        "quantize, unknown scale_layout": (
            ValueError,
            "scale_layout must be",
            lambda: lk.quantize(x, "mxfp8", scale_layout="col"),
        ),
        "quantize, group_offsets with row scales": (
            ValueError,
            "group_offsets pads 128x4",
            lambda: lk.quantize(x, "mxfp8", group_offsets=offsets),
        ),
        "quantize, float group_offsets": (
            TypeError,
            "group_offsets must be",
            lambda: lk.quantize(x, "mxfp8", scale_layout="128x4", group_offsets=offsets.float()),
        ),
        "quantize, float rows": (TypeError, "rows must be", lambda: lk.quantize(x, "mxfp8", rows=offsets.float())),
        "dequantize of a plain tensor": (TypeError, "dequantize takes a ScaledTensor", lambda: lk.dequantize(x)),
        "dequantize of None": (TypeError, "dequantize takes a ScaledTensor", lambda: lk.dequantize(None)),
        # attention
        "attention, alibi slopes of another length": (
            ValueError,
            "alibi slopes must be",
            lambda: lk.attention(q, kv, kv, score_mod=lk.alibi(torch.ones(3, device=device))),
        ),
        "attention, sinks of another dtype": (
            TypeError,
            "sinks must be",
            lambda: lk.attention(q, kv, kv, sinks=torch.ones(2, dtype=torch.float16, device=device)),
        ),
        "attention, a window of floats": (TypeError, "SlidingWindow.left", lambda: lk.SlidingWindow(1.5, 0)),
        # MoE
        "route, num_groups = 0": (ValueError, "num_groups", lambda: route(logits, 2, num_groups=0, topk_groups=1)),
        "route, correction_bias of another shape": (
            ValueError,
            "correction_bias must be",
            lambda: route(logits, 2, correction_bias=torch.zeros(4, device=device)),
        ),
        "route, integer logits": (TypeError, "router_logits must be", lambda: route(logits.int(), 2)),
        "MoEFeedForward, correction_bias of another shape": (
            ValueError,
            "correction_bias must be",
            lambda: MoEFeedForward(*moe_args, correction_bias=torch.zeros(3, device=device)),
        ),
        "combine, float row_of_copy": (
            TypeError,
            "row_of_copy must be",
            lambda: combine(
                torch.randn(8, 16, device=device), torch.zeros(4, 2, device=device), torch.ones(4, 2, device=device)
            ),
        ),
        "combine, float16 weights": (
            TypeError,
            "weights must be",
            lambda: combine(
                torch.randn(8, 16, device=device),
                torch.zeros(4, 2, dtype=torch.int64, device=device),
                torch.ones(4, 2, dtype=torch.float16, device=device),
            ),
        ),
        "dispatch, float ids": (TypeError, "expert_ids must be", lambda: dispatch(logits, 8)),
        **{f"{key}, bad argument": case for key, case in NO_TENSOR_CASES.items()},
    }


# Every public function that takes no tensor, with its bad arguments (test_any_strides checks the list).
NO_TENSOR_CASES = {
    "BlockScaledMatmulConfig": (ValueError, "block_m", lambda: lk.BlockScaledMatmulConfig(block_m=3)),
    "SwiGLU": (ValueError, "SwiGLU.alpha", lambda: lk.SwiGLU(alpha="x")),
    "FA4Config": (ValueError, "BM", lambda: lk.FA4Config(BM=3)),
    "FA4Config.replace": (ValueError, "BM", lambda: lk.FA4Config().replace(BM=7)),
    "SlidingWindow": (TypeError, "SlidingWindow.left", lambda: lk.SlidingWindow(1.5, 0)),
    "Chunked": (ValueError, "Chunked.size", lambda: lk.Chunked(0)),
    "softcap": (ValueError, "softcap", lambda: lk.softcap(-1.0)),
    "FormatSpec": (ValueError, "FormatSpec.element", lambda: FormatSpec("fp7", "e3m4", "e8m0", 32, 8, False)),
    "format_spec": (ValueError, "format must be", lambda: format_spec("fp7")),
    "register": (TypeError, "name must be", lambda: lk_transformers.register(7)),
}


def test_every_function_without_tensors_has_an_error_case():
    assert sorted(NO_TENSOR_CASES) == sorted(NO_TENSOR_FUNCTIONS)


def _moved_scales(tensor):
    tensor.scales = tensor.scales.to("meta")
    return lk.dequantize(tensor)


def test_errors_name_the_argument_before_any_launch(device, monkeypatch):
    cases = _cases(device)
    forbid_launches(monkeypatch)
    failures = []
    for name, (error, message, call) in cases.items():
        try:
            call()
        except error as raised:
            if message not in str(raised):
                failures.append(f"{name}: {type(raised).__name__}({raised}) does not say {message!r}")
        except Exception as raised:  # noqa: BLE001 - any other kind is the failure this test reports
            failures.append(f"{name}: raised {type(raised).__name__}({raised}), expected {error.__name__}")
        else:
            failures.append(f"{name}: raised nothing, expected {error.__name__}")
    assert not failures, "\n".join(failures)


def _floating_leaves(leaves):
    return [
        name
        for name, t in leaves.items()
        if t.dtype in (torch.float32, torch.float16, torch.bfloat16) and name != "out"
    ]


@pytest.mark.parametrize("call", [c for c in CALLS if set(c.functions) & set(FORWARD_ONLY)], ids=lambda c: c.name)
def test_forward_only_functions_refuse_inputs_that_require_grad(call, device, monkeypatch):
    monkeypatch.setattr(runtime, "new_buffer", poisoned_buffer)
    leaves = call.make(device)
    walked = 0
    for leaf in _floating_leaves(leaves):
        if call.name.startswith("MoE") and leaf.split(".")[0] in MOE_WEIGHTS:
            continue  # the constructor keeps its weights as buffers (documented: inference weights)
        trial = {**leaves, leaf: leaves[leaf].clone().requires_grad_(True)}
        with pytest.raises(ValueError, match="forward-only"):
            call.run(trial)
        walked += 1
    assert walked, f"{call.name} has no floating input"
    with torch.no_grad():  # the same inputs run without grad mode
        call.run({**leaves, leaf: leaves[leaf].clone().requires_grad_(True)})


@pytest.mark.parametrize("format", ["mxfp8", "mxfp4", "nvfp4"])
@pytest.mark.parametrize("shape", [(3, 0), (0, 2, 32), (2, 0, 16 * 4)])
def test_empty_shapes_quantize_and_dequantize(format, shape, device):
    x = torch.randn(shape, device=device)
    q = lk.quantize(x, format)
    assert q.shape == x.shape and lk.dequantize(q).shape == x.shape


# ----------------------------------------------------------------------------- validate, then write


def _bad_values(tensor: torch.Tensor):
    """``(what, bad tensor)``: the tensor in another dtype, with one more row, with one dim fewer, and
    (floating) requiring grad."""
    if tensor.element_size() == 1:
        other = tensor.view(torch.uint8).to(torch.int16)
    elif tensor.is_floating_point():
        other = tensor.to(torch.float16 if tensor.dtype != torch.float16 else torch.float32)
    else:
        other = tensor.float()
    yield "in another dtype", other
    if tensor.dim() >= 1 and tensor.shape[0] > 0:
        yield "with one more row", torch.cat([tensor, tensor[:1]])
        yield "with one dim fewer", tensor[0]
    if tensor.is_floating_point() and tensor.element_size() > 1:
        yield "requiring grad", tensor.detach().clone().requires_grad_(True)


def _count_launches(monkeypatch) -> list:
    """Every kernel launch from here on appends to the returned list (and launches)."""
    launches = []

    def counted(original):
        def run(*args, **kwargs):
            launches.append(original)
            return original(*args, **kwargs)

        return run

    patch_launches(monkeypatch, counted)
    return launches


def _argument_names(call, leaves: dict) -> set:
    """The names a message may use for the call's arguments: its leaves' parts and its functions' parameters
    (``alibi_slopes`` also as ``alibi slopes``)."""
    names = {part for leaf in leaves for part in leaf.split(".")} | {name for _, name in call.aliases}
    for key in call.functions:
        names |= set(inspect.signature(PUBLIC[key]).parameters)
    return names | {name.replace("_", " ") for name in names}


@pytest.mark.parametrize(
    "name", [name for name, call in CALLS_BY_NAME.items() if not set(call.functions) & set(REFERENCES)]
)
def test_a_call_that_raises_leaves_every_tensor_as_it_was(name, device, monkeypatch):
    """A bad tensor argument: the call runs, or raises TypeError / ValueError naming one of its arguments before
    any launch and with every tensor unchanged (a shape mismatch may name either side)."""
    call = CALLS_BY_NAME[name]
    monkeypatch.setattr(runtime, "new_buffer", poisoned_buffer)
    leaves = call.make(device)
    names = _argument_names(call, leaves)
    launches = _count_launches(monkeypatch)
    failures = []
    for leaf, tensor in leaves.items():
        for what, bad in _bad_values(tensor):
            trial = {name: t.clone() if name in call.written else t for name, t in leaves.items()}
            trial[leaf] = bad
            before = {name: as_bits(t).clone() for name, t in trial.items()}
            launches.clear()
            try:
                call.run(trial)
            except InputRejected:
                continue
            except (TypeError, ValueError) as error:
                problem = f"{leaf} {what}: {type(error).__name__}({str(error)[:200]})"
                if launches:
                    failures.append(f"{problem} came after {len(launches)} kernel launches")
                changed = [name for name, t in trial.items() if not torch.equal(as_bits(t), before[name])]
                if changed:
                    failures.append(f"{problem} came after writing {changed}")
                if not any(argument in str(error) for argument in names):
                    failures.append(f"{problem} names no argument")
            except Exception as error:  # noqa: BLE001 - any other kind is the failure this test reports
                failures.append(
                    f"{leaf} {what}: {type(error).__name__}({str(error)[:200]}), not a TypeError / "
                    f"ValueError naming the argument"
                )
    assert not failures, f"{name}:\n" + "\n".join(failures)
