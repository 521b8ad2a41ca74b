"""The MoE block against a plain float32 PyTorch MoE with the same (dequantized) weights and a float64
routing written from its definition; routing and dispatch on their own; every argument of the block checked
before anything is quantized."""

import pytest
import torch
from test_fused_experts import _exactly_quantizable_problem, _reference, _TensorOps

import llmkernels as lk
from llmkernels.moe import MoEFeedForward, combine, dispatch, dispatch_reference, route
from llmkernels.testing import assert_close_relative, relative_error

# bf16 rounding of the intermediate and the output; with quantized activations the reference
# quantizes the same values, and a rounding flipped by a last-bit difference adds a little
TOLERANCE = {"bf16": 1.5e-2, "mxfp8": 5e-2, "nvfp4": 0.12}  # measured: <= 7e-3, 2.5e-2, 6.9e-2


def _route_reference(
    logits,
    top_k,
    scoring="softmax",
    renormalize=True,
    num_groups=None,
    topk_groups=None,
    correction_bias=None,
    group_top=2,
):
    """Top-k routing in float64, token by token, from its definition (DeepSeek-V3's for sigmoid scores with
    groups): scores (softmax or sigmoid of the logits); selection scores = scores + correction_bias; with groups,
    a group's score is the sum of its ``group_top`` best selection scores and only the ``topk_groups`` best
    groups stay; the ``top_k`` best selection scores among what stays, in decreasing order; their unbiased
    scores as weights, divided by their sum when ``renormalize``. Returns ``(float64 weights, int64 ids)``."""
    logits = logits.double()
    scores = logits.softmax(-1) if scoring == "softmax" else logits.sigmoid()
    selection = scores + (0 if correction_bias is None else correction_bias.double())
    num_tokens, num_experts = scores.shape
    weights = torch.zeros(num_tokens, top_k, dtype=torch.float64)
    ids = torch.zeros(num_tokens, top_k, dtype=torch.int64)
    for t in range(num_tokens):
        row = selection[t].tolist()
        candidates = list(range(num_experts))
        if num_groups is not None:
            size = num_experts // num_groups
            groups = [candidates[g * size : (g + 1) * size] for g in range(num_groups)]
            group_scores = [sum(sorted((row[e] for e in group), reverse=True)[:group_top]) for group in groups]
            kept = sorted(range(num_groups), key=lambda g: -group_scores[g])[:topk_groups]
            candidates = [e for g in kept for e in groups[g]]
        picked = sorted(candidates, key=lambda e: -row[e])[:top_k]
        picked_scores = scores[t, picked]
        weights[t] = picked_scores / picked_scores.sum() if renormalize else picked_scores
        ids[t] = torch.tensor(picked)
    return weights.to(logits.device), ids.to(logits.device)


def _weights(num_experts, hidden, intermediate, device):
    router = torch.randn(num_experts, hidden, device=device)
    w_gate_up = torch.randn(num_experts, 2 * intermediate, hidden, device=device) / hidden**0.5
    w_down = torch.randn(num_experts, hidden, intermediate, device=device) / intermediate**0.5
    return router, w_gate_up, w_down


def _float(w):
    return lk.dequantize(w) if isinstance(w, lk.ScaledTensor) else w.float()


def _activations(v, block: MoEFeedForward):
    """The block's activation rounding: bf16, then its activation format."""
    v = v.to(torch.bfloat16)
    return v.float() if block.activation_format == "bf16" else lk.dequantize(lk.quantize(v, block.activation_format))


def _reference_moe(x, block: MoEFeedForward):
    """Token by token, slot by slot, in float32 with the block's own (dequantized) weights and its
    activation rounding."""
    x = x.reshape(-1, block.hidden).float()
    x_rounded = _activations(x, block)
    logits = x @ block.router_weight.float().t()
    weights, experts = _route_reference(logits, block.top_k, correction_bias=block.correction_bias, **block.routing)
    weights = weights.float()
    w_gate_up, w_down = _float(block.w_gate_up), _float(block.w_down)
    hidden = torch.zeros(x.shape[0], block.top_k, block.intermediate, device=x.device)
    for t in range(x.shape[0]):
        for slot in range(block.top_k):
            gate_up = w_gate_up[experts[t, slot]] @ x_rounded[t]
            hidden[t, slot] = torch.nn.functional.silu(gate_up[: block.intermediate]) * gate_up[block.intermediate :]
    # all copies rounded together, as the block quantizes them (nvfp4's global scale spans them all)
    hidden = _activations(hidden.view(-1, block.intermediate), block).view_as(hidden)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for slot in range(block.top_k):
            out[t] += weights[t, slot] * (w_down[experts[t, slot]] @ hidden[t, slot])
    return out


@pytest.mark.parametrize("top_k", [1, 2, 4, 8])
@pytest.mark.parametrize(
    "formats", [("bf16", "bf16"), ("mxfp8", "mxfp8"), ("bf16", "mxfp4"), ("nvfp4", "nvfp4")], ids="x".join
)
def test_moe_block_matches_float_moe(top_k, formats, device):
    num_experts, hidden, intermediate = 8, 64, 32
    router, w_gate_up, w_down = _weights(num_experts, hidden, intermediate, device)
    block = MoEFeedForward.from_float(
        router, w_gate_up, w_down, top_k, weight_format=formats[1], activation_format=formats[0]
    )
    x = torch.randn(3, 5, hidden, device=device, dtype=torch.bfloat16)
    out = block(x)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert_close_relative(out.float().reshape(-1, hidden), _reference_moe(x, block), TOLERANCE[formats[0]], "moe")


@pytest.mark.parametrize("case", ["all_to_one", "single_token", "lonely_experts"])
def test_moe_block_routing_edges(case, device):
    num_experts, hidden, intermediate = 4, 64, 32
    router, w_gate_up, w_down = _weights(num_experts, hidden, intermediate, device)
    tokens = {"all_to_one": 9, "single_token": 1, "lonely_experts": 4}[case]
    x = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16)
    if case == "all_to_one":  # expert 2 wins every token
        router = torch.zeros_like(router)
        router[2] = x.float().sum(0) / x.float().norm() ** 2 * 1e3
    if case == "lonely_experts":  # token t prefers expert t: every expert has exactly one token
        router = x.float().clone() * 1e3
    block = MoEFeedForward.from_float(router, w_gate_up, w_down, 1, weight_format="bf16")
    weights, ids = route(x.float() @ router.float().t(), 1)
    if case == "all_to_one":
        assert (ids == 2).all()
    if case == "lonely_experts":
        assert torch.equal(ids.view(-1).sort().values, torch.arange(4, dtype=torch.int32, device=device))
    assert_close_relative(block(x).float(), _reference_moe(x, block), TOLERANCE["bf16"], case)


def test_dispatch_sorts_by_expert_and_inverts(device):
    ids = torch.tensor([[3, 0], [0, 2], [3, 3], [1, 0]], dtype=torch.int32, device=device)
    token_of_row, offsets, row_of_copy = dispatch(ids, 5)
    assert offsets.tolist() == [0, 3, 4, 5, 8, 8]
    sorted_ids = ids.view(-1)[torch.argsort(ids.view(-1).long(), stable=True)]
    assert torch.equal(ids.view(-1)[row_of_copy.view(-1).argsort()], sorted_ids)
    for t in range(4):
        for slot in range(2):
            row = row_of_copy[t, slot]
            assert token_of_row[row] == t
            assert offsets[ids[t, slot]] <= row < offsets[ids[t, slot] + 1]


@pytest.mark.parametrize(
    "tokens,top_k,experts", [(0, 2, 4), (1, 1, 1), (5, 3, 7), (300, 8, 256), (1000, 4, 128), (77, 2, 384), (2048, 1, 3)]
)
def test_dispatch_matches_reference(tokens, top_k, experts, device):
    """The counting-sort kernels give exactly the stable argsort's layout (several blocks of copies
    at the larger sizes, experts not a power of two, skewed routing)."""
    ids = torch.randint(0, experts, (tokens, top_k), device=device, dtype=torch.int32)
    if tokens > 100:  # most copies on a few experts, as a trained router does
        ids[: tokens // 2] = torch.randint(0, min(experts, 3), (tokens // 2, top_k), device=device, dtype=torch.int32)
    for got, want in zip(dispatch(ids, experts), dispatch_reference(ids, experts)):
        assert got.dtype == want.dtype and torch.equal(got, want)


def test_dispatch_ids_out_of_range_are_dropped(device):
    ids = torch.tensor([[2, -1], [7, 0], [1, 2]], dtype=torch.int32, device=device)
    token_of_row, offsets, row_of_copy = dispatch(ids, 3)
    assert offsets.tolist() == [0, 1, 2, 4]
    assert row_of_copy.tolist() == [[2, -1], [-1, 0], [1, 3]]
    assert token_of_row[:4].tolist() == [1, 2, 0, 2]
    # combine skips the dropped copies (row -1) rather than reading some other row
    y = torch.randn(6, 8, device=device)
    weights = torch.rand(3, 2, device=device)
    out = combine(y, row_of_copy, weights)
    expected = torch.stack([weights[0, 0] * y[2], weights[1, 1] * y[0], weights[2, 0] * y[1] + weights[2, 1] * y[3]])
    torch.testing.assert_close(out, expected)


def test_route_sigmoid_grouped_with_bias(device):
    logits = torch.randn(6, 16, device=device)
    bias = torch.zeros(16, device=device)
    bias[:4] = 10.0  # group 0 wins the selection; the weights ignore the bias
    weights, ids = route(logits, 2, scoring="sigmoid", num_groups=4, topk_groups=1, correction_bias=bias)
    assert (ids < 4).all()
    expected = logits.sigmoid().gather(1, ids.long())
    assert torch.allclose(weights, expected / expected.sum(-1, keepdim=True))
    with pytest.raises(ValueError, match="top_k"):
        route(logits, 17)
    with pytest.raises(ValueError, match="num_groups"):
        route(logits, 2, num_groups=5, topk_groups=1)


def test_moe_block_compiles_fullgraph(device):
    router, w_gate_up, w_down = _weights(4, 64, 32, device)
    block = MoEFeedForward.from_float(router, w_gate_up, w_down, 2, weight_format="mxfp8")
    x = torch.randn(7, 64, device=device, dtype=torch.bfloat16)
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x), block(x))


@pytest.mark.parametrize("weight_format", ["bf16", "mxfp8", "nvfp4"])
def test_moe_block_dtype_casts_leave_quantized_weights_alone(weight_format, device):
    router, w_gate_up, w_down = _weights(4, 64, 32, device)
    block = MoEFeedForward.from_float(router, w_gate_up, w_down, 2, weight_format=weight_format)
    before = {
        name: (lk.dequantize(w) if isinstance(w, lk.ScaledTensor) else w.float())
        for name, w in (("w_gate_up", block.w_gate_up), ("w_down", block.w_down))
    }
    block.half()
    block.to(device)
    for name, expected in before.items():
        w = getattr(block, name)
        actual = lk.dequantize(w) if isinstance(w, lk.ScaledTensor) else w.float()
        assert torch.equal(actual, expected), name
    assert block.router_weight.dtype == torch.float16


@pytest.mark.parametrize("top_k", [1, 3])
def test_combine_matches_weighted_gather(top_k, device):
    from llmkernels.moe import combine

    tokens, hidden = 5, 80  # hidden not a power of two: masked columns
    y = torch.randn(tokens * top_k + 2, hidden, device=device, dtype=torch.bfloat16)
    row_of_copy = torch.randperm(tokens * top_k, device=device).view(tokens, top_k)
    weights = torch.rand(tokens, top_k, device=device)
    expected = (y[row_of_copy].float() * weights[..., None]).sum(1)
    out = combine(y, row_of_copy, weights, torch.float32)
    assert_close_relative(out, expected, 1e-6, "combine")


def test_moe_block_deepseek_routing(device):
    router, w_gate_up, w_down = _weights(16, 64, 32, device)
    bias = torch.rand(16, device=device)
    block = MoEFeedForward.from_float(
        router,
        w_gate_up,
        w_down,
        4,
        weight_format="bf16",
        scoring="sigmoid",
        num_groups=4,
        topk_groups=2,
        correction_bias=bias,
    )
    x = torch.randn(6, 64, device=device, dtype=torch.bfloat16)
    assert_close_relative(block(x).float(), _reference_moe(x, block), TOLERANCE["bf16"], "deepseek routing")
    logits = x.float() @ router.t()
    groups = dict(scoring="sigmoid", num_groups=4, topk_groups=2, correction_bias=bias)
    best_only = _route_reference(logits, 4, **groups, group_top=1)[1]
    assert not torch.equal(_route_reference(logits, 4, **groups)[1], best_only), (
        "no token where scoring groups by their best expert picks other experts"
    )
    with pytest.raises(ValueError, match="top_k"):
        MoEFeedForward.from_float(router, w_gate_up, w_down, 17)


ROUTINGS = {
    "softmax": dict(scoring="softmax"),
    "sigmoid, bias": dict(scoring="sigmoid", correction_bias=True),
    "softmax, groups": dict(scoring="softmax", num_groups=4, topk_groups=2),
    "sigmoid, groups, bias": dict(scoring="sigmoid", num_groups=4, topk_groups=2, correction_bias=True),
}


def _logits_that_tell_group_scores_apart(num_tokens, scoring, device):
    """``[T, 16]`` logits (4 groups of 4 experts): random, and every other token planted with one group holding
    a single strong expert and two groups holding two slightly weaker ones each, so that groups scored by their
    two best experts keep the two pairs and groups scored by their best expert keep the single one (the
    margins exceed the ±0.1 correction bias of the tests)."""
    single, pair, lesser_pair, rest = (4.0, 3.6, 3.5, -4.0) if scoring == "softmax" else (2.0, 0.5, 0.4, -8.0)
    logits = torch.randn(num_tokens, 4, 4) * 2
    for t in range(0, num_tokens, 2):
        groups, experts = torch.randperm(4).tolist(), torch.randperm(4).tolist()
        logits[t] = rest
        logits[t, groups[0], experts[0]] = single
        logits[t, groups[1], experts[:2]] = pair
        logits[t, groups[2], experts[2:]] = lesser_pair
    return (logits.view(num_tokens, 16) + torch.randn(num_tokens, 16) * 0.01).to(device)


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("routing", ROUTINGS, ids=str)
def test_route_matches_the_definition(routing, renormalize, device):
    """route() against the float64 reference (DeepSeek-V3's grouped selection: groups scored by the sum of
    their two best biased scores), with and without renormalized weights. The logits are such that scoring
    groups by their best expert alone would pick other experts for half the tokens."""
    routing = dict(ROUTINGS[routing])
    if routing.pop("correction_bias", False):
        routing["correction_bias"] = torch.rand(16, device=device) * 0.1
    logits = _logits_that_tell_group_scores_apart(32, routing["scoring"], device)
    weights, ids = route(logits, 3, renormalize=renormalize, **routing)
    expected_weights, expected_ids = _route_reference(logits, 3, renormalize=renormalize, **routing)
    assert ids.dtype == torch.int32 and torch.equal(ids.long(), expected_ids)
    torch.testing.assert_close(weights.double(), expected_weights, rtol=1e-6, atol=1e-7)
    if renormalize:
        torch.testing.assert_close(weights.sum(-1), torch.ones(32, device=device))
    else:
        assert (weights.sum(-1) - 1).abs().min() > 1e-2, "weights that sum to 1 do not test renormalize=False"
    if "num_groups" in routing:
        _, best_only_ids = _route_reference(logits, 3, renormalize=renormalize, **routing, group_top=1)
        assert (best_only_ids != expected_ids).any(1).sum() >= 16, "the logits do not tell the group scores apart"
    with pytest.raises(ValueError, match="top_k"):
        route(logits, 9, num_groups=4, topk_groups=2)  # the two kept groups hold 8 experts


def test_moe_block_quantizes_both_activations(device):
    """mxfp8 weights and activations against float64 routing and experts that quantize the tokens and the hidden
    activations (both lossy, on integers exact in bf16: ``_exactly_quantizable_problem``). Measured 3.7e-3 on
    the CPU (the bf16 rounding of the expert outputs, which the interpreter truncates and the reference rounds
    to nearest); skipping the quantization of the down projection's input: 3.4e-2."""
    x, w_gate_up, w_down, _, _ = _exactly_quantizable_problem(device, tokens=8, experts=4, k=64, n=32)
    router = torch.randn(4, 64, device=device) / 200  # logits of about 1: top-2 weights of both sizes
    block = MoEFeedForward.from_float(router, w_gate_up, w_down, 2, weight_format="mxfp8")
    assert block.activation_format == "mxfp8"
    logits = x @ router.t()
    margin = logits.sort(-1, descending=True).values
    assert (margin[:, 1] - margin[:, 2]).min() > 1e-3, "a near-tie of the routing"
    weights, ids = _route_reference(logits, 2)
    out = block(x)
    assert out.dtype == torch.float32
    expected = _reference(x, w_gate_up, w_down, weights, ids, activation_format="mxfp8")
    assert_close_relative(out, expected, 8e-3, "mxfp8 block")
    assert relative_error(_reference(x, w_gate_up, w_down, weights, ids), expected) > 2e-2


def _block_arguments(device, experts=4, hidden=64, intermediate=32):
    router, w_gate_up, w_down = _weights(experts, hidden, intermediate, device)
    return router, w_gate_up, w_down, 2


def test_from_float_checks_every_argument_before_quantizing(device):
    """Each bad argument of from_float (and of the constructor) raises, naming it, before any tensor
    operation: no weight is quantized or copied first."""
    router, w_gate_up, w_down, top_k = _block_arguments(device)
    w_down_40 = torch.randn(4, 64, 40, device=device)  # I = 40: not a multiple of mxfp8's 32
    cases = {
        "process_group": (
            TypeError,
            "process_group must be None or a torch.distributed ProcessGroup",
            dict(process_group="world"),
        ),
        "correction_bias": (ValueError, "correction_bias must be", dict(correction_bias=torch.zeros(3, device=device))),
        "correction_bias elsewhere": (
            ValueError,
            "correction_bias is on meta",
            dict(correction_bias=torch.zeros(4, device="meta")),
        ),
        "weight_format": (ValueError, "weight_format", dict(weight_format="fp6")),
        "activation_format": (ValueError, "activation_format", dict(activation_format="fp6")),
        "format pair": (ValueError, "does not pair", dict(activation_format="nvfp4")),
        "weight_layout": (ValueError, "weight_layout", dict(weight_layout="hopper")),
        "routing keyword": (TypeError, "num_group", dict(num_group=2)),
        "scoring": (ValueError, "scoring", dict(scoring="softplus")),
        "groups": (ValueError, "num_groups", dict(scoring="sigmoid", num_groups=3, topk_groups=1)),
        "top_k above the kept groups": (ValueError, "top_k", dict(num_groups=4, topk_groups=1)),
        "top_k": (ValueError, "top_k", dict(top_k=5)),
        "capacity": (ValueError, "capacity", dict(capacity=2)),
        "I not a multiple of the block": (
            ValueError,
            "blocks of 32",
            dict(w_gate_up=torch.randn(4, 80, 64, device=device), w_down=w_down_40),
        ),
        "float64 weights": (TypeError, "w_down", dict(w_down=w_down.double())),
        "w_down of another shape": (ValueError, "w_down", dict(w_down=w_down.transpose(1, 2))),
    }
    for name, (error, message, changes) in cases.items():
        arguments = {**dict(router_weight=router, w_gate_up=w_gate_up, w_down=w_down, top_k=top_k), **changes}
        with _TensorOps() as recorded, pytest.raises(error, match=message):
            MoEFeedForward.from_float(**arguments)
        assert recorded.ops == [], f"{name}: ran {recorded.ops} before raising"
    bf16 = (w_gate_up.bfloat16(), w_down.bfloat16())
    scaled = (lk.quantize(w_gate_up, "mxfp8"), lk.quantize(w_down, "mxfp8"))
    tiled = lk.quantize(w_down, "mxfp8", scale_layout="128x4")
    for name, (error, message, call) in {
        "bf16 weights under mxfp8 activations": (
            ValueError,
            "does not pair",
            lambda: MoEFeedForward(router, *bf16, 2, activation_format="mxfp8"),
        ),
        "128x4 scales": (
            ValueError,
            "w_down must have row-major scales",
            lambda: MoEFeedForward(router, scaled[0], tiled, 2),
        ),
        "a group that is not a group": (
            TypeError,
            "process_group",
            lambda: MoEFeedForward(router, *scaled, 2, process_group=object()),
        ),
    }.items():
        with _TensorOps() as recorded, pytest.raises(error, match=message):
            call()
        assert recorded.ops == [], f"{name}: ran {recorded.ops} before raising"


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("num_experts, top_k", [(1, 1), (6, 2), (40, 8), (128, 8)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_select_experts_matches_route(scoring, num_experts, top_k, renormalize, device):
    """The one-launch selection of the MoE block picks route()'s experts in its order, with its weights;
    the logits are a strided view, and the correction bias only steers the pick."""
    from llmkernels.moe import select_experts

    logits = torch.randn(9, 2 * num_experts, device=device)[:, ::2] * 3
    bias = torch.randn(num_experts, device=device) if num_experts > 1 else None
    for correction_bias in (None, bias):
        expected_weights, expected_ids = route(
            logits, top_k, scoring=scoring, renormalize=renormalize, correction_bias=correction_bias
        )
        weights, ids = select_experts(
            logits, top_k, scoring=scoring, renormalize=renormalize, correction_bias=correction_bias
        )
        assert ids.dtype == torch.int32 and weights.dtype == torch.float32
        assert torch.equal(ids, expected_ids)
        torch.testing.assert_close(weights, expected_weights, rtol=1e-6, atol=1e-7)


def test_select_experts_edge_rows(device):
    """No tokens; a NaN logit gives NaN weights (as route's softmax would), the other rows stay exact."""
    from llmkernels.moe import select_experts

    weights, ids = select_experts(torch.randn(0, 8, device=device), 2)
    assert weights.shape == (0, 2) and ids.shape == (0, 2)
    logits = torch.randn(3, 8, device=device)
    logits[1, 5] = float("nan")
    weights, ids = select_experts(logits, 2)
    assert torch.isnan(weights[1]).all() and ((ids[1] >= 0) & (ids[1] < 8)).all()
    expected_weights, expected_ids = route(logits[[0, 2]], 2)
    assert torch.equal(ids[[0, 2]], expected_ids)
    torch.testing.assert_close(weights[[0, 2]], expected_weights, rtol=1e-6, atol=1e-7)
