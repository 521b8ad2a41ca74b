"""``llmkernels.moe.fused_experts``: vLLM's call shape (``w1 [E, 2N, K]`` gate first, ``w2 [E, K, N]``) against a
float64 loop over tokens and their experts, for bf16 and quantized weights and activations, expert maps,
out-of-range ids and router weights on the input; every check before the first launch."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import llmkernels as lk
from llmkernels.moe import fused_experts
from llmkernels.testing import assert_close_relative, relative_error

TOLERANCE = {"bf16": 2e-2, "mxfp8": 3e-2, "mxfp4": 3e-2, "nvfp4": 3e-2}


def _swigluoai(h):
    """vLLM's / gpt-oss' activation on interleaved gate and up values."""
    gate, up = h[0::2].clamp(max=7.0), h[1::2].clamp(-7.0, 7.0)
    return gate * torch.sigmoid(1.702 * gate) * (up + 1)


def _quantized(v, fmt):
    """The values of a 1D ``v`` after bf16 rounding and ``fmt``'s quantization, float64 (quantize_reference: the
    same bits as torchao's, tested there)."""
    if fmt is None:
        return v
    return lk.dequantize(lk.quantize_reference(v.reshape(1, -1).to(torch.bfloat16), fmt)).double().reshape(-1)


def _reference(
    x,
    w1,
    w2,
    topk_weights,
    topk_ids,
    on_input=False,
    expert_map=None,
    b1=None,
    b2=None,
    activation="silu",
    activation_format=None,
):
    """float64: for each token and slot, the expert's gated MLP, weighted (on its input or its output). A copy
    whose id lies outside [0, G) (G: the map's length, or E) or whose mapped expert lies outside [0, E) adds
    nothing. With ``activation_format``, both activations are quantized (each row on its own, as MX blocks
    run along rows) and the expert outputs rounded to bf16, as the kernels write them."""
    x, w1, w2 = x.double(), w1.double(), w2.double()
    num_experts, n = w2.shape[0], w2.shape[2]
    num_global = num_experts if expert_map is None else len(expert_map)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for slot in range(topk_ids.shape[1]):
            e = int(topk_ids[t, slot])
            if not 0 <= e < num_global:
                continue
            if expert_map is not None:
                e = int(expert_map[e])
            if not 0 <= e < num_experts:
                continue
            weight = float(topk_weights[t, slot])
            token = _quantized(x[t] * weight if on_input else x[t], activation_format)
            h = w1[e] @ token + (0 if b1 is None else b1[e].double())
            act = _swigluoai(h) if activation == "swigluoai" else torch.nn.functional.silu(h[:n]) * h[n:]
            y = w2[e] @ _quantized(act, activation_format) + (0 if b2 is None else b2[e].double())
            if activation_format is not None:
                y = y.to(torch.bfloat16).double()
            out[t] += y if on_input else weight * y
    return out


def _problem(device, tokens=9, experts=4, k=64, n=32, top_k=2):
    x = torch.randn(tokens, k, device=device).bfloat16()
    w1 = (torch.randn(experts, 2 * n, k, device=device) / k**0.5).bfloat16()
    w2 = (torch.randn(experts, k, n, device=device) / n**0.5).bfloat16()
    topk_ids = torch.stack([torch.randperm(experts, device=device)[:top_k] for _ in range(tokens)]).int()
    topk_weights = torch.rand(tokens, top_k, device=device).softmax(-1)
    return x, w1, w2, topk_weights, topk_ids


@pytest.mark.parametrize("fmt", ["bf16", "mxfp8", "mxfp4", "nvfp4"])
def test_matches_the_reference(fmt, device):
    x, w1, w2, topk_weights, topk_ids = _problem(device)
    if fmt == "bf16":
        b1, b2, r1, r2 = w1, w2, w1, w2
    else:
        b1, b2 = lk.quantize(w1, fmt), lk.quantize(w2, fmt)
        r1, r2 = lk.dequantize(b1), lk.dequantize(b2)
    out = fused_experts(x, b1, b2, topk_weights, topk_ids)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert_close_relative(out.float(), _reference(x, r1, r2, topk_weights, topk_ids), TOLERANCE[fmt])


@pytest.mark.parametrize("fmt", ["bf16", "mxfp4"])
def test_swigluoai_with_biases(fmt, device):
    """gpt-oss through vLLM's call: interleaved w1 rows, ``activation="swigluoai"``, ``w1_bias`` / ``w2_bias``; values
    large enough that the clamp at 7 bites."""
    x, w1, w2, topk_weights, topk_ids = _problem(device, top_k=3)
    w1 = w1 * 8
    b1, b2 = torch.randn(w1.shape[:2], device=device), torch.randn(w2.shape[:2], device=device)
    q1, q2 = (w1, w2) if fmt == "bf16" else (lk.quantize(w1, fmt), lk.quantize(w2, fmt))
    out = fused_experts(x, q1, q2, topk_weights, topk_ids, activation="swigluoai", w1_bias=b1, w2_bias=b2)
    r1, r2 = (w1, w2) if fmt == "bf16" else (lk.dequantize(q1), lk.dequantize(q2))
    h = r1.float() @ x.float().T
    assert (h.abs() > 7).any(), "the clamp never bites"
    expected = _reference(x, r1, r2, topk_weights, topk_ids, b1=b1, b2=b2, activation="swigluoai")
    assert_close_relative(out.float(), expected, TOLERANCE[fmt])


def test_expert_map_inplace_and_weights_on_input(device):
    x, w1, w2, topk_weights, topk_ids = _problem(device, experts=4, top_k=1)
    # 6 global experts, this rank holds global 1, 3, 4, 5 as local 0..3 (0 and 2 live elsewhere)
    expert_map = torch.tensor([-1, 0, -1, 1, 2, 3], dtype=torch.int32, device=device)
    global_ids = torch.randint(0, 6, topk_ids.shape, device=device).int()
    out = fused_experts(x, w1, w2, topk_weights, global_ids, global_num_experts=6, expert_map=expert_map)
    expected = _reference(x, w1, w2, topk_weights, global_ids, expert_map=expert_map)
    assert_close_relative(out.float(), expected, TOLERANCE["bf16"])
    remote = (expert_map[global_ids.long()] < 0).all(1)
    assert (out[remote] == 0).all()
    on_input = fused_experts(x, w1, w2, topk_weights, topk_ids, apply_router_weight_on_input=True)
    assert_close_relative(
        on_input.float(), _reference(x, w1, w2, topk_weights, topk_ids, on_input=True), TOLERANCE["bf16"]
    )
    y = x.clone()
    assert fused_experts(y, w1, w2, topk_weights, topk_ids, inplace=True) is y
    assert torch.equal(y, fused_experts(x, w1, w2, topk_weights, topk_ids))


def test_errors(device):
    x, w1, w2, topk_weights, topk_ids = _problem(device)
    with pytest.raises(NotImplementedError, match="activation"):
        fused_experts(x, w1, w2, topk_weights, topk_ids, activation="gelu")
    with pytest.raises(ValueError, match="w2"):
        fused_experts(x, w1, w2.transpose(1, 2), topk_weights, topk_ids)
    with pytest.raises(ValueError, match="topk_ids"):
        fused_experts(x, w1, w2, topk_weights, topk_ids[:, :1])
    with pytest.raises(TypeError, match="topk_ids"):
        fused_experts(x, w1, w2, topk_weights, topk_ids.float())
    with pytest.raises(ValueError, match="w1_bias must be a \\[E, 64\\]"):
        fused_experts(x, w1, w2, topk_weights, topk_ids, w1_bias=torch.zeros(4, 32, device=device))
    with pytest.raises(ValueError, match="interleaved"):
        fused_experts(
            x, lk.quantize(w1, "mxfp4", scale_layout="hopper"), w2, topk_weights, topk_ids, activation="swigluoai"
        )


def test_router_weights_on_input_with_top_k_above_one(device):
    """Each copy's input scaled by its own weight, with three copies per token and weights that neither are 1
    nor sum to 1: dropping them (or applying one to all) is far outside the bound. Measured 8.7e-3 (bf16
    rounding of the scaled inputs, the hidden activations and the outputs); weights dropped: 0.67."""
    x, w1, w2, _, topk_ids = _problem(device, top_k=3)
    topk_weights = torch.rand(topk_ids.shape, device=device) * 2
    out = fused_experts(x, w1, w2, topk_weights, topk_ids, apply_router_weight_on_input=True)
    expected = _reference(x, w1, w2, topk_weights, topk_ids, on_input=True)
    assert_close_relative(out.float(), expected, 2e-2, "weights on the input")


def _exactly_quantizable_problem(device, tokens=6, experts=4, k=64, n=64, top_k=2):
    """Integers all the way to the down projection, so that the one rounding a kernel may do differently from
    the reference (bf16: the interpreter truncates, the GPU rounds to nearest) never moves an mxfp8 rounding.

    Weights of small integers (mxfp8 holds them exactly); tokens of integers up to 40, whose mxfp8 values (4
    significant bits) are integers too; gate rows that read the constant input column 0 only, so that every
    gate is 32 or 64, where silu is the identity in float32 (the sigmoid rounds to 1); up rows of six ±1
    entries, so that ``h = gate · up`` is an integer of at most 8 significant bits, exact in bf16. Both
    quantizations are lossy; a reference that models them agrees up to the bf16 rounding of the expert outputs.
    """
    x = torch.randint(-40, 41, (tokens, k), device=device).float()
    x[:, 0] = 1
    w1 = torch.zeros(experts, 2 * n, k, device=device)
    w1[:, :n, 0] = 32.0 * 2 ** torch.randint(0, 2, (experts, n), device=device).float()
    columns = torch.rand(experts, n, k, device=device).argsort(-1)[..., :6]
    signs = torch.randint(0, 2, columns.shape, device=device).float() * 2 - 1
    w1[:, n:].scatter_(-1, columns, signs)
    w2 = torch.randint(-2, 3, (experts, k, n), device=device).float()
    topk_ids = torch.stack([torch.randperm(experts, device=device)[:top_k] for _ in range(tokens)]).int()
    return x, w1, w2, torch.rand(tokens, top_k, device=device), topk_ids


def test_activation_format_quantizes_both_activations(device):
    """mxfp8 activations against a reference that quantizes the tokens and the hidden activations. Measured
    4.0e-3 on the CPU (3.4e-3 to 3.9e-3 over four other seeds: the bf16 rounding of the expert outputs, which
    the interpreter truncates and the reference rounds to nearest); activation_format ignored: 4e-2 to 5e-2,
    the tokens' quantization skipped: 4.3e-2, the hidden activations': 2.9e-2."""
    x, w1, w2, topk_weights, topk_ids = _exactly_quantizable_problem(device)
    q1, q2 = lk.quantize(w1, "mxfp8"), lk.quantize(w2, "mxfp8")
    assert torch.equal(lk.dequantize(q1), w1) and torch.equal(lk.dequantize(q2), w2), "weights not exact in mxfp8"
    out = fused_experts(x, q1, q2, topk_weights, topk_ids, activation_format="mxfp8")
    assert out.dtype == torch.float32
    expected = _reference(x, w1, w2, topk_weights, topk_ids, activation_format="mxfp8")
    assert_close_relative(out, expected, 8e-3, "mxfp8 activations")
    unquantized = _reference(x, w1, w2, topk_weights, topk_ids)
    assert relative_error(unquantized, expected) > 2e-2, "the problem does not tell quantized activations apart"


def test_out_of_range_ids_contribute_nothing(device):
    """Ids outside [0, G) and -1 drop their copy, with and without an expert map (no device assert, no
    ``expert_map[-1]``), and so do map entries outside [0, E); ``validate=True`` names the first bad index
    (-1 stays allowed: it means no expert)."""
    x, w1, w2, topk_weights, _ = _problem(device, top_k=3)
    expert_map = torch.tensor([-1, 0, 1, -1, 2, 3], dtype=torch.int32, device=device)  # G = 6, E = 4
    for mapping, num_global, id_dtype in ((None, 4, torch.int32), (expert_map, 6, torch.int64)):
        huge, tiny = torch.iinfo(id_dtype).max, torch.iinfo(id_dtype).min
        ids = torch.randint(0, num_global, (x.shape[0], 3), device=device).to(id_dtype)
        ids[0] = torch.tensor([-1, num_global, huge])  # every copy of token 0 dropped
        ids[1, 0], ids[2, 1], ids[3, 2] = -1, tiny, num_global + 3
        out = fused_experts(x, w1, w2, topk_weights, ids, expert_map=mapping)
        assert (out[0] == 0).all()
        expected = _reference(x, w1, w2, topk_weights, ids, expert_map=mapping)
        assert_close_relative(out.float(), expected, TOLERANCE["bf16"], f"map {mapping is not None}")
        with pytest.raises(ValueError, match=rf"topk_ids\[0, 1\] = {num_global}"):
            fused_experts(x, w1, w2, topk_weights, ids, expert_map=mapping, validate=True)
        ids[0, 1:] = -1
        ids[2:4] = 0
        assert torch.equal(
            fused_experts(x, w1, w2, topk_weights, ids, expert_map=mapping, validate=True),
            fused_experts(x, w1, w2, topk_weights, ids, expert_map=mapping),
        )
    bad_map = torch.tensor([0, 1, 9, -3], dtype=torch.int64, device=device)  # entries past E = 4 and below -1
    ids = torch.randint(0, 4, (x.shape[0], 3), device=device, dtype=torch.int32)
    out = fused_experts(x, w1, w2, topk_weights, ids, global_num_experts=4, expert_map=bad_map)
    assert_close_relative(
        out.float(), _reference(x, w1, w2, topk_weights, ids, expert_map=bad_map), TOLERANCE["bf16"], "bad map entries"
    )
    with pytest.raises(ValueError, match=r"expert_map\[2\] = 9"):
        fused_experts(x, w1, w2, topk_weights, ids, expert_map=bad_map, validate=True)
    with pytest.raises(ValueError, match="global_num_experts must be -1 or len"):
        fused_experts(x, w1, w2, topk_weights, ids, global_num_experts=6, expert_map=bad_map)
    with pytest.raises(ValueError, match="global_num_experts must be -1 or w1's E = 4"):
        fused_experts(x, w1, w2, topk_weights, ids, global_num_experts=6)


class _TensorOps(TorchDispatchMode):
    """Records every tensor operation run under it: a launch (and every buffer it writes) needs one."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_inplace_checks_every_argument_before_any_launch(device):
    """With inplace=True, each bad argument raises before any tensor operation: hidden_states keeps its bits."""
    x, w1, w2, topk_weights, topk_ids = _problem(device)
    q1, q2 = lk.quantize(w1, "mxfp8"), lk.quantize(w2, "mxfp8")
    experts, two_n, k = w1.shape
    cases = {
        "w2_bias of ints": (
            TypeError,
            "w2_bias",
            dict(w2_bias=torch.zeros(experts, k, dtype=torch.int32, device=device)),
        ),
        "w1_bias of another shape": (ValueError, "w1_bias", dict(w1_bias=torch.zeros(experts, 3, device=device))),
        "topk_weights requiring grad": (
            ValueError,
            "forward-only",
            dict(topk_weights=topk_weights.clone().requires_grad_(True)),
        ),
        "w1 requiring grad": (ValueError, "forward-only", dict(w1=w1.float().requires_grad_(True).bfloat16())),
        "bf16 weights under mxfp8 activations": (TypeError, "activation_format", dict(activation_format="mxfp8")),
        "nvfp4 activations, mxfp8 weights": (TypeError, "nvfp4", dict(w1=q1, w2=q2, activation_format="nvfp4")),
        "unknown activation_format": (ValueError, "activation_format", dict(activation_format="fp6")),
        "global_num_experts": (ValueError, "global_num_experts", dict(global_num_experts=experts + 1)),
        "float expert_map": (TypeError, "expert_map", dict(expert_map=torch.zeros(6, device=device))),
        "topk_ids elsewhere": (ValueError, "topk_ids is on meta", dict(topk_ids=topk_ids.to("meta"))),
        "topk_ids of other tokens": (ValueError, "topk_ids", dict(topk_ids=topk_ids[1:])),
        "validate not a bool": (TypeError, "validate", dict(validate="yes")),
        "interleaved rows in the hopper layout": (
            ValueError,
            "interleaved",
            dict(w1=lk.quantize(w1, "mxfp4", scale_layout="hopper"), activation="swigluoai"),
        ),
        "w2 of another shape": (ValueError, "w2", dict(w2=w2.transpose(1, 2))),
    }
    arguments = dict(w1=w1, w2=w2, topk_weights=topk_weights, topk_ids=topk_ids)
    for name, (error, message, changes) in cases.items():
        hidden_states = x.clone()
        call = {**arguments, **changes}
        with _TensorOps() as recorded, pytest.raises(error, match=message):
            fused_experts(
                hidden_states,
                call.pop("w1"),
                call.pop("w2"),
                call.pop("topk_weights"),
                call.pop("topk_ids"),
                inplace=True,
                **call,
            )
        assert recorded.ops == [], f"{name}: ran {recorded.ops} before raising"
        assert torch.equal(hidden_states, x), name
    for hidden_states, error, message in (
        (x[:1].expand_as(x), ValueError, "share memory"),
        (x.double(), TypeError, "hidden_states"),
    ):
        with _TensorOps() as recorded, pytest.raises(error, match=message):
            fused_experts(hidden_states, w1, w2, topk_weights, topk_ids, inplace=True)
        assert recorded.ops == [], f"{message}: ran {recorded.ops} before raising"
    with torch.no_grad():  # the forward-only refusal is grad mode's
        fused_experts(x, w1, w2, topk_weights.clone().requires_grad_(True), topk_ids)
