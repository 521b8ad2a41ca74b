"""Bad arguments raise TypeError / ValueError naming the argument, before any kernel launches; inputs that
require grad raise for the forward-only functions (and run under ``torch.no_grad()``)."""
import functools

import pytest
import torch
import triton
from triton.runtime.interpreter import InterpretedFunction

import llmkernels as lk
from llmkernels import _launch, _runtime
from llmkernels.moe import MoEFeedForward, combine, dispatch, route
from public_calls import CALLS, poisoned_buffer
from test_grouped_matmul import _bad_input_cases as _bad_grouped_matmul_cases

FORWARD_ONLY = ("quantize", "grouped_matmul", "attention", "combine", "select_experts", "MoEFeedForward.forward")
MOE_WEIGHTS = ("router_weight", "correction_bias", "w_gate_up", "w_down")


def forbid_launches(monkeypatch):
    """From here on any kernel launch fails the test: the errors must come first."""
    def launched(*args, **kwargs):
        raise AssertionError("a kernel was launched before the error")

    monkeypatch.setattr(triton.runtime.jit.JITFunction, "run", launched)
    monkeypatch.setattr(InterpretedFunction, "run", launched)
    monkeypatch.setattr(_launch.BoundKernel, "__call__", launched)  # cached plans launch without the JIT


def _cases(device):
    x = torch.randn(8, 64, device=device)
    a = lk.quantize(x, "mxfp8")
    q = torch.randn(1, 4, 2, 16, dtype=torch.float16, device=device)
    kv = torch.randn(1, 6, 2, 16, dtype=torch.float16, device=device)
    logits = torch.randn(4, 8, device=device)
    moe_args = (torch.randn(4, 64, device=device), torch.randn(4, 64, 64, device=device).bfloat16(),
                torch.randn(4, 64, 32, device=device).bfloat16(), 2)
    offsets = torch.tensor([0, 4, 8], dtype=torch.int32, device=device)
    grouped = {f"grouped_matmul case {i}": (error, message, functools.partial(lk.grouped_matmul, **kwargs))
               for i, (error, message, kwargs) in enumerate(_bad_grouped_matmul_cases(device))}
    return {
        **grouped,
        "dequantize, scales moved to another device after construction": (
            ValueError, "share one device", lambda: _moved_scales(lk.ScaledTensor(a.data, a.scales, "mxfp8"))),
        # formats
        "quantize, unknown scale_layout": (ValueError, "scale_layout must be", lambda: lk.quantize(x, "mxfp8",
                                                                                                 scale_layout="col")),
        "quantize, group_offsets with row scales": (ValueError, "group_offsets pads 128x4",
                                                    lambda: lk.quantize(x, "mxfp8", group_offsets=offsets)),
        "quantize, float group_offsets": (TypeError, "group_offsets must be", lambda: lk.quantize(
            x, "mxfp8", scale_layout="128x4", group_offsets=offsets.float())),
        "quantize, float rows": (TypeError, "rows must be", lambda: lk.quantize(x, "mxfp8", rows=offsets.float())),
        "dequantize of a plain tensor": (TypeError, "dequantize takes a ScaledTensor", lambda: lk.dequantize(x)),
        "dequantize of None": (TypeError, "dequantize takes a ScaledTensor", lambda: lk.dequantize(None)),
        # attention
        "attention, alibi slopes of another length": (ValueError, "alibi slopes must be", lambda: lk.attention(
            q, kv, kv, score_mod=lk.alibi(torch.ones(3, device=device)))),
        "attention, sinks of another dtype": (TypeError, "sinks must be", lambda: lk.attention(
            q, kv, kv, sinks=torch.ones(2, dtype=torch.float16, device=device))),
        "attention, a window of floats": (TypeError, "SlidingWindow.left", lambda: lk.SlidingWindow(1.5, 0)),
        # MoE
        "route, num_groups = 0": (ValueError, "num_groups", lambda: route(logits, 2, num_groups=0, topk_groups=1)),
        "route, correction_bias of another shape": (ValueError, "correction_bias must be", lambda: route(
            logits, 2, correction_bias=torch.zeros(4, device=device))),
        "route, integer logits": (TypeError, "router_logits must be", lambda: route(logits.int(), 2)),
        "MoEFeedForward, correction_bias of another shape": (ValueError, "correction_bias must be", lambda:
            MoEFeedForward(*moe_args, correction_bias=torch.zeros(3, device=device))),
        "combine, float row_of_copy": (TypeError, "row_of_copy must be", lambda: combine(
            torch.randn(8, 16, device=device), torch.zeros(4, 2, device=device), torch.ones(4, 2, device=device))),
        "combine, float16 weights": (TypeError, "weights must be", lambda: combine(
            torch.randn(8, 16, device=device), torch.zeros(4, 2, dtype=torch.int64, device=device),
            torch.ones(4, 2, dtype=torch.float16, device=device))),
        "dispatch, float ids": (TypeError, "expert_ids must be", lambda: dispatch(logits, 8)),
    }


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
    return [name for name, t in leaves.items() if t.dtype in (torch.float32, torch.float16, torch.bfloat16)
            and name != "out"]


@pytest.mark.parametrize("call", [c for c in CALLS if set(c.functions) & set(FORWARD_ONLY)], ids=lambda c: c.name)
def test_forward_only_functions_refuse_inputs_that_require_grad(call, device, monkeypatch):
    monkeypatch.setattr(_runtime, "new_buffer", poisoned_buffer)
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
