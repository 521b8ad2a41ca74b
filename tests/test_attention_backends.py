"""The attention family's backend contract and plans: every backend says what it supports and gives the
:class:`~llmkernels.launch.KernelSpec` it launches; every launch goes through a bound kernel; a decode loop whose
cache grows by a token per call (transformers' DynamicCache) keeps its plan; flash_attn_with_kvcache checks a call
signature once."""

from __future__ import annotations

import inspect

import pytest
import torch
from public_calls import patch_launches

import llmkernels as lk
from llmkernels import flash_attn
from llmkernels.attention import layout, portable, split_kv
from llmkernels.attention.check import check_attention
from llmkernels.attention.config import default_config, split_count, tiling
from llmkernels.attention.plan import COMBINE, PASSES, PLANS
from llmkernels.integrations.transformers import attention_forward
from llmkernels.launch import BoundKernel, KernelSpec
from llmkernels.runtime import num_programs_hint
from llmkernels.testing import assert_close_relative

TOLERANCE = 2e-2  # bf16 / fp16 P and O against the float32 reference
SMALL = lk.FA4Config(BM=16, BN=16, num_kv_stages=1)


def _head_major(batch, kv_heads, seqlen, head_dim, dtype, device):
    """A new ``[B, Hkv, S, D]`` contiguous tensor, as DynamicCache's ``torch.cat`` makes each step."""
    return torch.randn(batch, kv_heads, seqlen, head_dim, dtype=dtype, device=device)


def test_every_backend_gives_a_spec_of_its_kernel(device):
    """Each backend (the passes in the plan's order, then the combine) names itself and its kernel; its spec for a
    call binds every constexpr of that kernel, and only those, and a grid of the call's programs."""
    assert [backend.name for backend in PASSES][-1] == "portable", "the portable kernel is the last resort"
    q = torch.randn(2, 1, 8, 64, dtype=torch.bfloat16, device=device)
    k = torch.randn(2, 40, 2, 64, dtype=torch.bfloat16, device=device)
    call = check_attention(
        q, k, k, False, None, None, None, None, None, None, None, None, None, None, True, None, False
    )
    config = default_config(64, q.dtype, q.device, decode=True)
    tiles = tiling(config, True, call.q_bound, call.group, call.batch, call.num_kv_heads, num_splits=3)
    for backend in (*PASSES, COMBINE):
        spec = backend.spec(call, tiles)
        assert isinstance(spec, KernelSpec) and spec.fn is backend.kernel, backend.name
        constexprs = {
            name
            for name, param in inspect.signature(backend.kernel.fn).parameters.items()
            if "constexpr" in str(param.annotation)
        }
        assert set(spec.constexprs) == constexprs, (backend.name, set(spec.constexprs) ^ constexprs)
        assert all(size >= 1 for size in spec.grid), (backend.name, spec.grid)
        assert set(spec.per_call) <= set(backend.kernel.arg_names) - constexprs
    assert portable.BACKEND.supports(call, tiles) and COMBINE.supports(call, tiles)
    assert portable.BACKEND.spec(call, tiles).grid == tiles.grid
    assert split_kv.BACKEND.spec(call, tiles).grid == (2 * 1, 8)  # (B * Sq rows, Hq)


@pytest.mark.parametrize("call_name", ["prefill", "decode", "paged", "kvcache"])
def test_every_launch_goes_through_a_bound_kernel(device, call_name):
    """No kernel of an attention call (nor of flash_attn_with_kvcache's cache append) is launched but by a
    :class:`BoundKernel` (one compiled launch per plan, called straight into the launcher on a GPU)."""
    inside = []

    def bound_call(original):
        def call(self, *values):
            inside.append(self)
            try:
                return original(self, *values)
            finally:
                inside.pop()

        return call

    def kernel_run(original):
        def run(*args, **kwargs):
            # a bound kernel compiles at bind time on a GPU (Triton's warmup: no launch)
            assert inside or kwargs.get("warmup"), "a kernel launched outside a bound launch"
            return original(*args, **kwargs)

        return run

    with pytest.MonkeyPatch.context() as monkeypatch:
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction

        monkeypatch.setattr(BoundKernel, "__call__", bound_call(BoundKernel.__call__))
        for owner in (JITFunction, InterpretedFunction):
            monkeypatch.setattr(owner, "run", kernel_run(owner.run))
        q = torch.randn(2, 20 if call_name == "prefill" else 1, 4, 16, dtype=torch.float16, device=device)
        k, v = (torch.randn(2, 33, 2, 16, dtype=torch.float16, device=device) for _ in range(2))
        pages = torch.randn(6, 16, 2, 16, dtype=torch.float16, device=device)
        table = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32, device=device)
        seqlens = torch.tensor([30, 17], dtype=torch.int32, device=device)
        for _ in range(2):  # the planning call, then the cached one
            if call_name in ("prefill", "decode"):
                lk.attention(q, k, v, causal=True, config=SMALL)
            elif call_name == "paged":
                lk.attention(
                    q,
                    None,
                    None,
                    kv_cache=lk.PagedKVCache(pages, pages, table, seqlens),
                    causal=True,
                    num_splits=2,
                    config=SMALL,
                )
            else:
                new = torch.randn(2, 1, 2, 16, dtype=torch.float16, device=device)
                flash_attn.flash_attn_with_kvcache(
                    q, pages.clone(), pages.clone(), new, new, cache_seqlens=seqlens, block_table=table, causal=True
                )


def _decode_step(module, query, keys, values, scale):
    return attention_forward(module, query, keys, values, None, scaling=scale)[0]


@pytest.mark.parametrize("kv_layout", ["head_major", "token_rows"])
def test_a_growing_cache_keeps_its_plan(device, kv_layout):
    """A decode loop whose K/V grow by one key per call, new tensors each step (transformers' DynamicCache: Skv and
    the strides change): 20 steps plan at most twice (Skv a multiple of 16 or not: what Triton specializes on), the
    split count follows the key count inside the plan, and every step matches the reference. ``token_rows``: K/V
    ``[B, Skv, Hkv, D]`` contiguous, read through tensor descriptors whose rows change per call."""
    batch, heads, kv_heads, head_dim = 2, 4, 2, 16
    module = torch.nn.Module()
    module.is_causal = True
    query = torch.randn(batch, heads, 1, head_dim, dtype=torch.bfloat16, device=device)
    PLANS.clear()
    for seqlen in range(9, 29):
        keys, values = (_head_major(batch, kv_heads, seqlen, head_dim, torch.bfloat16, device) for _ in range(2))
        if kv_layout == "token_rows":  # contiguous [B, S, H, D], seen head-major as transformers passes them
            keys, values = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (keys, values))
            assert layout.kv_token_rows(keys.transpose(1, 2), values.transpose(1, 2), False)
        out = _decode_step(module, query, keys, values, head_dim**-0.5)
        expected = lk.attention_reference(*(t.transpose(1, 2) for t in (query, keys, values)))
        assert_close_relative(out, expected, TOLERANCE, f"{seqlen} keys")
    assert len(PLANS) <= 2, f"{len(PLANS)} plans for 20 steps of a growing cache"
    plans = PLANS.plans()
    splits = {num_splits for plan in plans for num_splits, _ in plan.by_splits}
    tiles = plans[0].tiles  # the device's tiling (the GPU's decode tiles differ from the interpreter's)
    expected = {
        split_count(tiles, max(1, -(-seqlen // tiles.config.BN)), None, num_programs_hint(device))
        for seqlen in range(9, 29)
    }
    assert splits == expected, "the split count should follow the key count"


def test_a_growing_cache_keeps_its_plan_in_prefill_and_under_a_window(device):
    """Chunks of 20 queries over a growing cache (one pass, K/V token rows through descriptors of per-call rows) and
    decode steps under a sliding window (whether a query sees every key changes with Skv): few plans, every result
    the reference's."""
    PLANS.clear()
    for seqlen in range(20, 36, 3):
        q = torch.randn(1, 20, 4, 16, dtype=torch.float16, device=device)
        k, v = (torch.randn(1, seqlen, 2, 16, dtype=torch.float16, device=device) for _ in range(2))
        assert_close_relative(
            lk.attention(q, k, v, causal=True, config=SMALL),
            lk.attention_reference(q, k, v, causal=True),
            TOLERANCE,
            f"prefill {seqlen}",
        )
    assert len(PLANS) == 2  # 32 keys: a multiple of 16
    window = lk.SlidingWindow(12, 0)
    for seqlen in range(5, 21):
        q = torch.randn(1, 1, 4, 16, dtype=torch.float16, device=device)
        k, v = (torch.randn(1, seqlen, 2, 16, dtype=torch.float16, device=device) for _ in range(2))
        assert_close_relative(
            lk.attention(q, k, v, mask=window),
            lk.attention_reference(q, k, v, mask=window),
            TOLERANCE,
            f"window {seqlen}",
        )
    assert len(PLANS) == 4  # and two for the window (16 keys)


def test_a_cached_plan_still_refuses_what_its_key_does_not_fix(device):
    """Dense K/V plans hold Skv abstractly: a v of another length than k is still refused (the key records that
    they agree), and a mask tensor's shape keeps an exact key (its last dim is checked against Skv)."""
    q = torch.randn(1, 1, 4, 16, dtype=torch.float16, device=device)
    k = torch.randn(1, 20, 2, 16, dtype=torch.float16, device=device)
    lk.attention(q, k, k)
    with pytest.raises(ValueError, match="v shape"):
        lk.attention(q, k, k[:, :19])
    mask = torch.ones(1, 1, 1, 20, dtype=torch.bool, device=device)
    lk.attention(q, k, k, mask=mask)
    longer = torch.randn(1, 21, 2, 16, dtype=torch.float16, device=device)
    with pytest.raises(ValueError, match="does not broadcast"):
        lk.attention(q, longer, longer, mask=mask)


def test_flash_attn_with_kvcache_checks_a_signature_once(device, monkeypatch):
    """The attention checks of flash_attn_with_kvcache run on the first call of a signature, not on its repeats;
    a call of another signature is checked (and a bad one still refused before any write)."""
    checks = []

    def counting(*args, **kwargs):
        checks.append(args)
        return check_attention(*args, **kwargs)

    monkeypatch.setattr(flash_attn, "check_attention", counting)
    q = torch.randn(2, 1, 4, 16, dtype=torch.float16, device=device)
    k_cache, v_cache = (torch.zeros(2, 32, 2, 16, dtype=torch.float16, device=device) for _ in range(2))
    seqlens = torch.tensor([3, 7], dtype=torch.int32, device=device)
    for step in range(3):
        new = torch.randn(2, 1, 2, 16, dtype=torch.float16, device=device)
        flash_attn.flash_attn_with_kvcache(q, k_cache, v_cache, new, new, cache_seqlens=seqlens + step, causal=True)
    assert len(checks) == 1
    with pytest.raises(ValueError):
        flash_attn.flash_attn_with_kvcache(
            q,
            k_cache,
            v_cache,
            torch.randn(2, 1, 3, 16, dtype=torch.float16, device=device),
            torch.randn(2, 1, 3, 16, dtype=torch.float16, device=device),
            cache_seqlens=seqlens,
        )


def test_cached_paths_launch_without_checking(device):
    """With launches stubbed out, a cached dense decode step, prefill and paged decode call no check function
    (the plan key fixes what they check)."""
    q1 = torch.randn(1, 1, 4, 16, dtype=torch.float16, device=device)
    q = torch.randn(1, 20, 4, 16, dtype=torch.float16, device=device)
    k = torch.randn(1, 33, 2, 16, dtype=torch.float16, device=device)
    calls = [lambda: lk.attention(q, k, k, causal=True), lambda: lk.attention(q1, k, k)]
    for call in calls:  # planned (and on a GPU compiled) for real
        call()
    with pytest.MonkeyPatch.context() as monkeypatch:
        patch_launches(monkeypatch, lambda original: lambda *args, **kwargs: None)
        from llmkernels.attention import api

        monkeypatch.setattr(api, "check_attention", lambda *args: pytest.fail("checked a cached call"))
        for call in calls:
            call()
