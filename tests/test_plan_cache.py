"""The plan caches (validate → plan → launch): a cached call gives the bits of the first, every part of the
call signature re-plans, the caches are bounded, thread-safe and keep no tensor alive, and the checks that
depend on more than the signature (where ``out`` lies, grad mode) still run on cached calls."""

from __future__ import annotations

import gc
import sys
import threading
import weakref

import pytest
import torch
from public_calls import CALLS, bit_differences, outcome, poisoned_buffer

import llmkernels as lk
from llmkernels import launch, runtime
from llmkernels.attention.plan import PLANS as ATTENTION_PLANS
from llmkernels.formats import api as formats_api
from llmkernels.grouped_matmul import api as grouped_matmul_api
from llmkernels.moe import combine, dispatch
from llmkernels.routing.combine import PLANS as COMBINE_PLANS
from llmkernels.routing.dispatch import PLANS as DISPATCH_PLANS
from llmkernels.routing.select import PLANS as SELECT_PLANS

CACHES = {
    "quantize": formats_api.PLANS,
    "grouped_matmul": grouped_matmul_api.PLANS,
    "attention": ATTENTION_PLANS,
    "dispatch": DISPATCH_PLANS,
    "combine": COMBINE_PLANS,
    "select_experts": SELECT_PLANS,
}
ATTENTION_CONFIG = lk.FA4Config(BM=16, BN=16, num_kv_stages=1)


def _plan_counts() -> dict:
    return {name: len(cache) for name, cache in CACHES.items()}


def _copy_leaves(leaves: dict) -> dict:
    """The same values in new memory (same strides): a cached plan must read the new tensors."""
    return {name: t.clone() for name, t in leaves.items()}


@pytest.mark.parametrize("call", CALLS, ids=lambda call: call.name)
def test_cached_call_gives_the_bits_of_the_first(call, device, monkeypatch):
    """Every public call: the first call plans, the repeated call (same tensors, then copies of them in
    other memory) plans nothing and returns the same bytes."""
    monkeypatch.setattr(runtime, "new_buffer", poisoned_buffer)
    leaves = call.make(device)
    written = {name: leaves[name].clone() for name in call.written}

    def restored(leaves):  # the leaves an in-place call writes, back to their contents before the first call
        for name, contents in written.items():
            leaves[name].copy_(contents)
        return leaves

    first = outcome(call, restored(leaves))
    assert not isinstance(first, Exception), f"{call.name}: {first!r}"
    planned = _plan_counts()
    again = outcome(call, restored(leaves))
    moved = outcome(call, _copy_leaves(restored(leaves)))
    assert _plan_counts() == planned, f"{call.name}: a repeated call planned again"
    assert bit_differences(again, first) is None, f"{call.name} (same tensors): {bit_differences(again, first)}"
    assert bit_differences(moved, first) is None, f"{call.name} (copied tensors): {bit_differences(moved, first)}"


def _gm_inputs(device, tokens=24, experts=3, n=32, k=64, dtype=torch.bfloat16):
    a = torch.randn(tokens, k, device=device, dtype=dtype)
    b = torch.randn(experts, n, k, device=device, dtype=dtype) / 8
    offsets = torch.tensor([0, tokens // 3, tokens // 2, tokens], dtype=torch.int32, device=device)
    ids = torch.tensor([2, 0, 1], dtype=torch.int32, device=device)
    return a, b, offsets, ids


def _replans(cache, call) -> object:
    before = len(cache)
    result = call()
    assert len(cache) == before + 1, "this call should have made a new plan"
    return result


def test_each_signature_component_replans_grouped_matmul(device):
    """Shape, dtype, strides, alignment, a flag, out_dtype and config each make a new plan, whose result
    is the reference's (a stale plan would read the new tensors with the old sizes or strides)."""
    cache = grouped_matmul_api.PLANS
    a, b, offsets, ids = _gm_inputs(device)

    def reference(a, b, epilogue=None):
        out = torch.zeros(a.shape[0], b.shape[1], dtype=torch.float32, device=device)
        for g in range(ids.numel()):
            rows = slice(int(offsets[g]), int(offsets[g + 1]))
            out[rows] = a[rows].float() @ b[int(ids[g])].float().T
        if epilogue == "silu":
            out = torch.nn.functional.silu(out)
        return out

    def check(result, expected):
        torch.testing.assert_close(result.float(), expected, rtol=2e-2, atol=2e-2)

    check(_replans(cache, lambda: lk.grouped_matmul(a, b, offsets, ids)), reference(a, b))
    check(lk.grouped_matmul(a, b, offsets, ids), reference(a, b))  # cached
    wide = torch.randn(24, 96, device=device, dtype=torch.bfloat16)
    wide_b = torch.randn(3, 32, 96, device=device, dtype=torch.bfloat16) / 8
    check(_replans(cache, lambda: lk.grouped_matmul(wide, wide_b, offsets, ids)), reference(wide, wide_b))  # shape
    a16, b16 = a.half(), b.half()
    check(_replans(cache, lambda: lk.grouped_matmul(a16, b16, offsets, ids)), reference(a16, b16))  # dtype
    strided = torch.randn(24, 2 * 64, device=device, dtype=torch.bfloat16)[:, ::2]  # K not unit-stride
    check(_replans(cache, lambda: lk.grouped_matmul(strided, b, offsets, ids)), reference(strided, b))
    row_padded = torch.randn(24, 80, device=device, dtype=torch.bfloat16)[:, :64]  # another row stride
    check(_replans(cache, lambda: lk.grouped_matmul(row_padded, b, offsets, ids)), reference(row_padded, b))
    shifted = torch.randn(24 * 64 + 1, device=device, dtype=torch.bfloat16)[1:].view(24, 64)  # 2-byte aligned
    check(_replans(cache, lambda: lk.grouped_matmul(shifted, b, offsets, ids)), reference(shifted, b))
    check(
        _replans(cache, lambda: lk.grouped_matmul(a, b, offsets, ids, epilogue="silu")), reference(a, b, "silu")
    )  # a flag
    result = _replans(cache, lambda: lk.grouped_matmul(a, b, offsets, ids, out_dtype=torch.float32))
    assert result.dtype == torch.float32
    check(result, reference(a, b))
    config = lk.BlockScaledMatmulConfig(block_m=16, block_n=16, block_k=32, num_stages=1, num_warps=4)
    check(_replans(cache, lambda: lk.grouped_matmul(a, b, offsets, ids, config=config)), reference(a, b))


def test_each_signature_component_replans_attention(device):
    """Causal, return_lse, softmax_scale, a window and the sequence length each make a new plan."""
    cache = ATTENTION_PLANS
    q, k, v = (torch.randn(1, 20, 2, 16, device=device, dtype=torch.float16) for _ in range(3))

    def check(result, **kwargs):
        expected = lk.attention_reference(q, k, v, **kwargs)
        torch.testing.assert_close(result.float(), expected.float(), rtol=1e-2, atol=1e-2)

    check(_replans(cache, lambda: lk.attention(q, k, v, config=ATTENTION_CONFIG)))
    check(lk.attention(q, k, v, config=ATTENTION_CONFIG))
    check(_replans(cache, lambda: lk.attention(q, k, v, causal=True, config=ATTENTION_CONFIG)), causal=True)
    out, lse = _replans(cache, lambda: lk.attention(q, k, v, return_lse=True, config=ATTENTION_CONFIG))
    check(out)
    check(_replans(cache, lambda: lk.attention(q, k, v, softmax_scale=0.5, config=ATTENTION_CONFIG)), softmax_scale=0.5)
    window = lk.SlidingWindow(3, 0)
    check(_replans(cache, lambda: lk.attention(q, k, v, mask=window, config=ATTENTION_CONFIG)), mask=window)
    check(lk.attention(q, k, v, mask=lk.SlidingWindow(3, 0), config=ATTENTION_CONFIG), mask=window)  # equal mask
    short = q[:, :7]
    expected = lk.attention_reference(short, k, v)
    result = _replans(cache, lambda: lk.attention(short, k, v, config=ATTENTION_CONFIG))
    torch.testing.assert_close(result.float(), expected.float(), rtol=1e-2, atol=1e-2)


def test_quantize_dispatch_combine_replan_on_shape(device):
    x = torch.randn(4, 64, device=device)
    _replans(formats_api.PLANS, lambda: lk.quantize(x, "mxfp8"))
    _replans(formats_api.PLANS, lambda: lk.quantize(x, "nvfp4"))  # format
    _replans(formats_api.PLANS, lambda: lk.quantize(x[:3], "mxfp8"))  # shape
    ids = torch.randint(0, 4, (5, 2), device=device, dtype=torch.int32)
    _replans(DISPATCH_PLANS, lambda: dispatch(ids, 4))
    _replans(DISPATCH_PLANS, lambda: dispatch(ids, 6))  # num_experts
    _, _, rows = dispatch(ids, 4)
    y = torch.randn(10, 32, device=device)
    weights = torch.rand(5, 2, device=device)
    _replans(COMBINE_PLANS, lambda: combine(y, rows, weights))
    _replans(COMBINE_PLANS, lambda: combine(y, rows, weights, torch.bfloat16))  # out_dtype


def test_checks_beyond_the_signature_run_on_cached_calls(device):
    """Grad mode and where ``out`` lies are not in a tensor's signature: a cached plan still refuses an
    input that requires grad with grad enabled, and an ``out`` that overlaps an input."""
    a, b, offsets, ids = _gm_inputs(device)
    weights = b.clone().requires_grad_()
    with torch.no_grad():
        lk.grouped_matmul(a, weights, offsets, ids)
    with pytest.raises(ValueError, match="requires grad"):
        lk.grouped_matmul(a, weights, offsets, ids)
    out = torch.empty(24, 32, device=device, dtype=torch.bfloat16)
    lk.grouped_matmul(a, b, offsets, ids, out=out)
    storage = torch.empty(24 * 64, device=device, dtype=torch.bfloat16)
    aliased_a, aliased_out = storage.view(24, 64), storage[: 24 * 32].view(24, 32)
    with pytest.raises(ValueError, match="shares memory"):
        lk.grouped_matmul(aliased_a, b, offsets, ids, out=aliased_out)


def test_reassigned_scales_are_checked_again(device):
    """A ScaledTensor whose scales were replaced by a tensor too small for its data fails the checks, even
    after the same tensor ran through a cached plan."""
    a = lk.quantize(torch.randn(8, 64, device=device), "mxfp8")
    b = lk.quantize(torch.randn(2, 32, 64, device=device), "mxfp8")
    offsets = torch.tensor([0, 4, 8], dtype=torch.int32, device=device)
    ids = torch.tensor([0, 1], dtype=torch.int32, device=device)
    lk.grouped_matmul(a, b, offsets, ids)
    a.scales = a.scales[:4]
    with pytest.raises(ValueError, match="do not fit"):
        lk.grouped_matmul(a, b, offsets, ids)


def test_plans_keep_no_tensor_alive(device):
    a, b, offsets, ids = _gm_inputs(device)
    q = torch.randn(1, 20, 2, 16, device=device, dtype=torch.float16)
    lk.grouped_matmul(a, b, offsets, ids)
    lk.attention(q, q, q, config=ATTENTION_CONFIG)
    refs = [weakref.ref(t) for t in (a, b, offsets, ids, q)]
    del a, b, offsets, ids, q
    gc.collect()
    assert all(ref() is None for ref in refs), "a cached plan holds a tensor of the call that made it"


def test_plan_cache_is_bounded_and_evicts_the_oldest():
    cache = launch.PlanCache("test", max_size=2)
    try:
        for name in "abc":
            key, plan = cache.lookup(name)
            assert plan is None and cache.put(key, name.upper()) == name.upper()
        assert len(cache) == 2
        assert cache.lookup("a")[1] is None, "the oldest plan should have been evicted"
        assert cache.lookup("b")[1] == "B" and cache.lookup("c")[1] == "C"
    finally:
        launch._CACHES.remove(cache)


def test_unhashable_arguments_are_planned_every_time(device):
    """A value without a key (a mask given as a list) skips the cache: planned and checked every time,
    with the result of the cached form."""
    q = torch.randn(1, 8, 2, 16, device=device, dtype=torch.float16)
    key, plan = ATTENTION_PLANS.lookup(q, [lk.SlidingWindow(2, 0)])
    assert key is None and plan is None
    before = len(ATTENTION_PLANS)
    as_list = [lk.attention(q, q, q, mask=[lk.SlidingWindow(2, 0)], config=ATTENTION_CONFIG) for _ in range(2)]
    assert len(ATTENTION_PLANS) == before
    as_tuple = lk.attention(q, q, q, mask=(lk.SlidingWindow(2, 0),), config=ATTENTION_CONFIG)
    assert all(torch.equal(result, as_tuple) for result in as_list)


def test_signature_holds_what_a_plan_depends_on(device):
    t = torch.zeros(4, 8, device=device)
    dtype, shape, stride, alignment, tensor_device, requires_grad = launch.tensor_key(t)
    assert (dtype, shape, stride, tensor_device, requires_grad) == (t.dtype, t.shape, t.stride(), t.device, False)
    assert alignment == t.data_ptr() % 16
    assert launch.value_key(True) != launch.value_key(1) and launch.value_key(1.0) != launch.value_key(1)
    with torch.no_grad():
        no_grad_key, _ = ATTENTION_PLANS.lookup(t)
    assert no_grad_key != ATTENTION_PLANS.lookup(t)[0]


def test_threads_share_the_caches(device):
    """Four threads, each with its own shapes, call grouped_matmul and attention at once while the caches
    fill: every result equals the serial one."""
    problems = []
    for i in range(4):
        a, b, offsets, ids = _gm_inputs(device, tokens=24 + 8 * i)
        offsets[-1] = a.shape[0]
        q = torch.randn(1, 10 + i, 2, 16, device=device, dtype=torch.float16)
        problems.append((a, b, offsets, ids, q))

    def run(problem):
        a, b, offsets, ids, q = problem
        return lk.grouped_matmul(a, b, offsets, ids), lk.attention(q, q, q, causal=True, config=ATTENTION_CONFIG)

    launch.clear_plans()
    results = [None] * len(problems)
    errors = []

    def worker(i):
        try:
            for _ in range(3):
                results[i] = run(problems[i])
        except Exception as error:  # reported below: a thread's exception would otherwise vanish
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(problems))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    launch.clear_plans()
    for problem, result in zip(problems, results):
        expected = run(problem)
        assert all(torch.equal(x, y) for x, y in zip(result, expected))


def test_compiled_launches_skip_tritons_wrapper(device):
    """On a GPU whose Triton launcher has the layout ``_DirectLaunch`` was written for, every kernel of every
    public call launches through the launcher's C entry point (none of ours needs scratch memory), the
    tensor-descriptor ones included; the bit-equality test above checks what they compute."""
    if device.type != "cuda":
        pytest.skip("compiled launches need a GPU (the interpreter calls fn[grid])")
    for call in CALLS:
        assert not isinstance(outcome(call, call.make(device)), Exception), call.name
    kernels = [obj for obj in gc.get_objects() if type(obj) is launch.BoundKernel and obj.compiled is not None]
    launcher = kernels[0].compiled.run
    if getattr(sys.modules.get(type(launcher).__module__), "_BASE_ARGS_FORMAT", None) != launch.DIRECT_LAUNCHER_LAYOUT:
        pytest.skip(f"Triton's launcher has another layout: its wrapper runs ({type(launcher).__module__})")
    through_wrapper = sorted({repr(kernel) for kernel in kernels if not kernel.direct})
    assert not through_wrapper, f"launched through Triton's wrapper: {through_wrapper}"
    assert any(kernel.tma_maps for kernel in kernels), "no TMA-descriptor kernel among the public calls"
