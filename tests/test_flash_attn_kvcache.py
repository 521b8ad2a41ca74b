"""``flash_attn_with_kvcache``: each score / mask / split argument against an independent float64 model
(``flash_attn_model.kvcache_model``), the cache after an append bit for bit, every bad call raising before
anything is written, canaries around the caches, and strided views giving the contiguous call's bits."""

import math

import pytest
import torch
from flash_attn_model import assert_cache_after, kvcache_model
from public_calls import forbid_launches

from llmkernels.flash_attn import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
from llmkernels.testing import relative_error

BATCH, SEQLEN_Q, NEW, HEADS, KV_HEADS, DIM, ROTARY_HALF = 2, 2, 3, 4, 2, 32, 8
DENSE_CAPACITY = 40  # not a multiple of 16: attention reads a page-aligned copy, whose padding it must not see
PAGE, PAGES_PER_SEQUENCE, NUM_PAGES = 16, 3, 8
# Relative error ‖out - model‖ / ‖model‖ of the cases of test_kvcache_matches_the_model (bf16 inputs, float64
# model, interpreter): 4.0e-3 to 5.8e-3 (num_splits_1); the bound is 2x the largest. Attending the zero keys that
# pad the dense cache to its pages gave 0.17.
TOLERANCE = 1.2e-2


def _randn(*shape, device, dtype=torch.bfloat16):
    return torch.randn(*shape, device=device).to(dtype)


def _call_args(device, layout, cache_seqlens, rotary=True, dense_capacity=DENSE_CAPACITY):
    """A valid call: q, caches (dense with cache_batch_idx, or shuffled pages), new keys, rotary tables; and
    ``logical(cache)``, the ``[B, capacity, Hkv, D]`` rows the call's sequences own."""
    args = dict(
        q=_randn(BATCH, SEQLEN_Q, HEADS, DIM, device=device),
        k=_randn(BATCH, NEW, KV_HEADS, DIM, device=device),
        v=_randn(BATCH, NEW, KV_HEADS, DIM, device=device),
        cache_seqlens=torch.tensor(cache_seqlens, dtype=torch.int32, device=device),
    )
    if layout == "dense":
        args.update(
            k_cache=_randn(BATCH + 1, dense_capacity, KV_HEADS, DIM, device=device),
            cache_batch_idx=torch.tensor([2, 0], dtype=torch.int32, device=device),
        )
        capacity = dense_capacity
        logical = lambda c: c[args["cache_batch_idx"].long()]  # noqa: E731
    else:
        args.update(
            k_cache=_randn(NUM_PAGES, PAGE, KV_HEADS, DIM, device=device),
            page_table=torch.randperm(NUM_PAGES, device=device)[: BATCH * PAGES_PER_SEQUENCE]
            .int()
            .view(BATCH, PAGES_PER_SEQUENCE),
        )
        capacity = PAGE * PAGES_PER_SEQUENCE
        logical = lambda c: c[args["page_table"].long()].flatten(1, 2)  # noqa: E731
    args["v_cache"] = _randn(*args["k_cache"].shape, device=device)
    if rotary:
        angle = torch.rand(capacity + SEQLEN_Q, ROTARY_HALF, device=device) * 2 * math.pi
        args.update(rotary_cos=angle.cos().bfloat16(), rotary_sin=angle.sin().bfloat16())
    return args, logical


# name: (layout, cache_seqlens, flash_attn_with_kvcache kwargs, kvcache_model kwargs). Sequence 0 appends past the
# capacity in the dense cases (positions 38, 39 written, 40 dropped): attention must see the 40 real keys only.
CASES = {
    "causal_rotary": ("dense", [38, 11], dict(causal=True), dict(causal=True)),
    "softcap": ("paged", [20, 45], dict(softcap=1.5), dict(softcap=1.5)),
    "alibi": ("dense", [38, 7], dict(causal=True, alibi=True), dict(causal=True, alibi=True)),
    "attention_chunk": ("paged", [29, 3], dict(causal=True, attention_chunk=8), dict(causal=True, chunk=8)),
    "learnable_sink": ("dense", [38, 0], dict(sink=True), dict(sink=True)),
    "window_leftpad": (
        "dense",
        [30, 12],
        dict(causal=True, window_size=(6, 0), leftpad=[4, 9]),
        dict(causal=True, window=(6, 0), leftpad=[4, 9]),
    ),
    "num_splits_1": ("paged", [40, 17], dict(causal=True, num_splits=1), dict(causal=True)),
    "num_splits_3": ("paged", [40, 17], dict(causal=True, num_splits=3), dict(causal=True)),
    "num_splits_past_keys": ("paged", [4, 1], dict(num_splits=64), dict()),
}


@pytest.mark.parametrize("name", list(CASES))
def test_kvcache_matches_the_model(name, device):
    layout, cache_seqlens, kwargs, model_kwargs = CASES[name]
    args, logical = _call_args(device, layout, cache_seqlens, rotary=name != "num_splits_past_keys")
    kwargs, model_kwargs = dict(kwargs), dict(model_kwargs)
    if kwargs.pop("alibi", False):
        slopes = torch.rand(HEADS, device=device)
        kwargs["alibi_slopes"] = model_kwargs["alibi_slopes"] = slopes
        model_kwargs.pop("alibi")
    if kwargs.pop("sink", False):
        sinks = torch.randn(HEADS, device=device).bfloat16()
        kwargs["learnable_sink"], model_kwargs["sinks"] = sinks, sinks.double()
        model_kwargs.pop("sink")
    if "leftpad" in kwargs:
        kwargs["cache_leftpad"] = torch.tensor(kwargs.pop("leftpad"), dtype=torch.int32, device=device)
    interleaved = layout == "dense"  # GPT-J pairs on the dense cases, GPT-NeoX halves on the paged ones
    caches_before = args["k_cache"].clone(), args["v_cache"].clone()
    expected, k_after, v_after = kvcache_model(
        args["q"],
        logical(args["k_cache"]),
        logical(args["v_cache"]),
        args["k"],
        args["v"],
        args["cache_seqlens"],
        cos=args.get("rotary_cos"),
        sin=args.get("rotary_sin"),
        interleaved=interleaved,
        **model_kwargs,
    )

    out, lse = flash_attn_with_kvcache(**args, rotary_interleaved=interleaved, return_softmax_lse=True, **kwargs)
    assert out.shape == args["q"].shape and lse.shape == (BATCH, HEADS, SEQLEN_Q)
    error = relative_error(out, expected)
    assert error <= TOLERANCE, f"{name}: relative error {error:.2e} > {TOLERANCE:.1e}"
    assert_cache_after(logical(args["k_cache"]), k_after, "k_cache")
    assert torch.equal(logical(args["v_cache"]), v_after), "v_cache"
    # the cache's other rows (the dense sequence no batch row maps to, the unused pages) keep their bits
    for after, before in zip((args["k_cache"], args["v_cache"]), caches_before):
        owned = torch.zeros(after.shape[0], dtype=torch.bool, device=device)
        owned[(args["cache_batch_idx"] if layout == "dense" else args["page_table"]).long().flatten()] = True
        assert torch.equal(after[~owned], before[~owned])


def test_validate_runs_a_sound_call_with_the_same_bits(device):
    """validate=True reads the metadata on the host and, when it is sound, gives the unvalidated call's bits."""
    args, _ = _call_args(device, "paged", [40, 17])
    results = []
    for validate in (False, True):
        call = {name: t.clone() for name, t in args.items()}
        results.append((flash_attn_with_kvcache(**call, causal=True, validate=validate), call["k_cache"]))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


# ----------------------------------------------------------------------------- errors before any write


def _int32(values, device):
    return torch.tensor(values, dtype=torch.int32, device=device)


def _requiring_grad(t):
    return t.clone().requires_grad_()


def _kvcache_error_cases(device):
    """(name, error, what the message says, function, kwargs): each a valid call with one thing wrong."""
    dense, _ = _call_args(device, "dense", [5, 9])
    paged, _ = _call_args(device, "paged", [5, 9])
    paged["block_table"] = paged.pop("page_table")
    rand = lambda *shape, dtype=torch.bfloat16: _randn(*shape, device=device, dtype=dtype)  # noqa: E731
    d24 = dict(
        q=rand(BATCH, 1, HEADS, 24),
        k_cache=rand(BATCH, 32, KV_HEADS, 24),
        v_cache=rand(BATCH, 32, KV_HEADS, 24),
        k=rand(BATCH, 1, KV_HEADS, 24),
        v=rand(BATCH, 1, KV_HEADS, 24),
        cache_seqlens=_int32([1, 2], device),
    )
    cases = {
        "q float32": (TypeError, "q must be", dict(dense, q=dense["q"].float())),
        "q 3-D": (ValueError, "q must be", dict(dense, q=dense["q"][0])),
        "head dim 24": (ValueError, "head dim 24", d24),
        "Hq not a multiple of Hkv": (ValueError, "multiple", dict(dense, q=rand(BATCH, SEQLEN_Q, 3, DIM))),
        "cache_seqlens too long": (ValueError, "cache_seqlens", dict(dense, cache_seqlens=_int32([1, 2, 3], device))),
        "cache_seqlens int64": (TypeError, "cache_seqlens", dict(dense, cache_seqlens=dense["cache_seqlens"].long())),
        "cache_seqlens negative int": (ValueError, "cache_seqlens", dict(dense, cache_seqlens=-1)),
        "cache_leftpad too short": (ValueError, "cache_leftpad", dict(dense, cache_leftpad=_int32([0], device))),
        "cache_batch_idx int64": (
            TypeError,
            "cache_batch_idx",
            dict(dense, cache_batch_idx=_int32([2, 0], device).long()),
        ),
        "cache_batch_idx too short": (ValueError, "cache_batch_idx", dict(dense, cache_batch_idx=_int32([2], device))),
        "cache_batch_idx with block_table": (
            ValueError,
            "cache_batch_idx",
            dict(paged, cache_batch_idx=_int32([0, 1], device)),
        ),
        "dense cache smaller than the batch": (
            ValueError,
            "cache_batch_idx",
            dict(
                {n: t for n, t in dense.items() if n != "cache_batch_idx"},
                k_cache=dense["k_cache"][:1],
                v_cache=dense["v_cache"][:1],
            ),
        ),
        "v_cache float16": (TypeError, "v_cache", dict(dense, v_cache=dense["v_cache"].half())),
        "v_cache shorter": (ValueError, "v_cache", dict(dense, v_cache=dense["v_cache"][:, :20])),
        "expanded k_cache": (ValueError, "k_cache", dict(dense, k_cache=dense["k_cache"][:1].expand(3, -1, -1, -1))),
        "k with more heads": (
            ValueError,
            "k must be",
            dict(dense, k=rand(BATCH, NEW, KV_HEADS + 1, DIM), v=rand(BATCH, NEW, KV_HEADS + 1, DIM)),
        ),
        "k with a larger head dim": (
            ValueError,
            "k must be",
            dict(dense, k=rand(BATCH, NEW, KV_HEADS, DIM + 16), v=rand(BATCH, NEW, KV_HEADS, DIM + 16)),
        ),
        "k with a larger batch": (
            ValueError,
            "k must be",
            dict(dense, k=rand(BATCH + 1, NEW, KV_HEADS, DIM), v=rand(BATCH + 1, NEW, KV_HEADS, DIM)),
        ),
        "k 3-D": (ValueError, "k must be", dict(dense, k=dense["k"][0], v=dense["v"][0])),
        "v with more new tokens": (ValueError, "v shape", dict(dense, v=rand(BATCH, NEW + 1, KV_HEADS, DIM))),
        "k float16 into a bf16 cache": (TypeError, "k dtype", dict(dense, k=dense["k"].half())),
        "v float16 into a bf16 cache": (TypeError, "v dtype", dict(paged, v=paged["v"].half())),
        "k without v": (ValueError, "k and v", dict(dense, v=None)),
        "rotary_dim past the head dim": (
            ValueError,
            "rotary_dim",
            dict(dense, rotary_cos=rand(48, DIM // 2 + 1), rotary_sin=rand(48, DIM // 2 + 1)),
        ),
        "rotary_sin shorter": (ValueError, "rotary_sin", dict(dense, rotary_sin=dense["rotary_sin"][:10])),
        "rotary_sin narrower": (ValueError, "rotary_sin", dict(dense, rotary_sin=dense["rotary_sin"][:, :4])),
        "rotary_cos int": (TypeError, "rotary_cos", dict(dense, rotary_cos=dense["rotary_cos"].int())),
        "rotary tables shorter than the cache": (
            ValueError,
            "rotary_cos",
            dict(dense, rotary_cos=dense["rotary_cos"][:20], rotary_sin=dense["rotary_sin"][:20]),
        ),
        "rotary_cos without sin": (ValueError, "rotary_sin", dict(dense, rotary_sin=None)),
        "block_table int64": (TypeError, "block_table", dict(paged, block_table=paged["block_table"].long())),
        "block_table rows": (ValueError, "block_table", dict(paged, block_table=paged["block_table"][:1])),
        "block_table and page_table": (ValueError, "page_table", dict(paged, page_table=paged["block_table"])),
        "page size 24": (
            ValueError,
            "page size",
            dict(paged, k_cache=rand(4, 24, KV_HEADS, DIM), v_cache=rand(4, 24, KV_HEADS, DIM)),
        ),
        "learnable_sink length": (
            ValueError,
            "learnable_sink",
            dict(dense, learnable_sink=torch.zeros(3, device=device)),
        ),
        "alibi_slopes length": (ValueError, "alibi", dict(dense, alibi_slopes=torch.rand(3, device=device))),
        "softcap with alibi": (
            NotImplementedError,
            "softcap",
            dict(dense, softcap=1.0, alibi_slopes=torch.rand(HEADS, device=device)),
        ),
        "window_size not a pair": (ValueError, "window_size", dict(dense, window_size=3)),
        "validate not a bool": (TypeError, "validate", dict(dense, validate="yes")),
        # validate=True: values read on the host, before any write
        "validate: cache_batch_idx outside": (
            ValueError,
            "cache_batch_idx[1] = 3",
            dict(dense, cache_batch_idx=_int32([0, 3], device), validate=True),
        ),
        "validate: cache_batch_idx repeated": (
            ValueError,
            "cache_batch_idx[1] = 2 repeats",
            dict(dense, cache_batch_idx=_int32([2, 2], device), validate=True),
        ),
        "validate: cache_seqlens negative": (
            ValueError,
            "cache_seqlens[0] = -1",
            dict(dense, cache_seqlens=_int32([-1, 3], device), validate=True),
        ),
        "validate: cache_leftpad past the keys": (
            ValueError,
            "cache_leftpad[1] = 30",
            dict(dense, cache_leftpad=_int32([0, 30], device), validate=True),
        ),
        "validate: block_table entry outside": (
            ValueError,
            "block_table[1, 0] = 8",
            dict(paged, block_table=_int32([[0, 1, 2], [8, 4, 5]], device), validate=True),
        ),
        "validate: two sequences append into one page slot": (
            ValueError,
            "page 3, slot 5",
            dict(
                paged,
                block_table=_int32([[3, 1, 2], [3, 4, 5]], device),
                cache_seqlens=_int32([5, 5], device),
                validate=True,
            ),
        ),
    }
    for name in ("q", "k", "v", "k_cache", "v_cache", "rotary_cos"):
        cases[f"{name} requires grad"] = (
            ValueError,
            "forward-only",
            dict(dense, **{name: _requiring_grad(dense[name])}),
        )
    cases["learnable_sink requires grad"] = (
        ValueError,
        "forward-only",
        dict(dense, learnable_sink=_requiring_grad(torch.zeros(HEADS, device=device))),
    )
    return [(name, error, message, flash_attn_with_kvcache, kwargs) for name, (error, message, kwargs) in cases.items()]


def _func_error_cases(device):
    q, k = _randn(BATCH, 3, HEADS, DIM, device=device), _randn(BATCH, 5, KV_HEADS, DIM, device=device)
    ragged_q, ragged_k = _randn(6, HEADS, DIM, device=device), _randn(10, KV_HEADS, DIM, device=device)
    cu_q, cu_k = _int32([0, 2, 6], device), _int32([0, 4, 10], device)
    varlen = dict(
        q=ragged_q, k=ragged_k, v=ragged_k.clone(), cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=4, max_seqlen_k=6
    )
    cases = [
        (
            "func: q requires grad",
            ValueError,
            "forward-only",
            flash_attn_func,
            dict(q=_requiring_grad(q), k=k, v=k.clone()),
        ),
        (
            "func: learnable_sink length",
            ValueError,
            "learnable_sink",
            flash_attn_func,
            dict(q=q, k=k, v=k.clone(), learnable_sink=torch.zeros(HEADS + 1, device=device)),
        ),
        (
            "varlen: seqused_k length",
            ValueError,
            "seqused_k",
            flash_attn_varlen_func,
            dict(varlen, seqused_k=_int32([4, 5, 6], device)),
        ),
        (
            "varlen: seqused_k int64",
            TypeError,
            "seqused_k",
            flash_attn_varlen_func,
            dict(varlen, seqused_k=_int32([4, 5], device).long()),
        ),
        (
            "varlen: cu_seqlens_k length with seqused_k",
            ValueError,
            "cu_seqlens_k",
            flash_attn_varlen_func,
            dict(varlen, cu_seqlens_k=_int32([0, 4], device), seqused_k=_int32([4, 5], device)),
        ),
        (
            "varlen: k requires grad",
            ValueError,
            "forward-only",
            flash_attn_varlen_func,
            dict(varlen, k=_requiring_grad(ragged_k)),
        ),
    ]
    return cases


def _tensors(kwargs):
    return {name: t for name, t in kwargs.items() if isinstance(t, torch.Tensor)}


def test_bad_calls_raise_before_any_launch_and_change_nothing(device, monkeypatch):
    """Each bad call raises the expected error naming the argument, with every kernel launch forbidden, and leaves
    every tensor it was given (the caches included) byte-identical."""
    cases = _kvcache_error_cases(device) + _func_error_cases(device)
    forbid_launches(monkeypatch)
    failures = []
    for name, error, message, function, kwargs in cases:
        before = {n: t.detach().clone() for n, t in _tensors(kwargs).items()}
        try:
            function(**kwargs)
        except error as raised:
            if message not in str(raised):
                failures.append(f"{name}: {type(raised).__name__}({raised}) does not say {message!r}")
        except Exception as raised:  # noqa: BLE001 - any other kind is the failure this test reports
            failures.append(f"{name}: raised {type(raised).__name__}({raised}), expected {error.__name__}")
        else:
            failures.append(f"{name}: raised nothing, expected {error.__name__}")
        changed = [n for n, t in _tensors(kwargs).items() if not torch.equal(t.detach(), before[n])]
        if changed:
            failures.append(f"{name}: changed {changed}")
    assert not failures, "\n".join(failures)


# ----------------------------------------------------------------------------- canaries around the caches


def _in_canary_buffer(shape, guard, device):
    """A random bf16 tensor of ``shape`` inside a buffer whose ``guard`` elements before and after are NaN."""
    numel = math.prod(shape)
    buffer = torch.full((numel + 2 * guard,), float("nan"), dtype=torch.bfloat16, device=device)
    inner = buffer[guard : guard + numel].view(shape)
    inner.copy_(torch.randn(shape, device=device))
    return buffer, inner


def test_canaries_around_the_caches_survive(device):
    """Bad k / v shapes raise before writing; calls whose positions, cache_batch_idx or block-table entries point
    past the cache write nothing outside it and read nothing outside it (the output stays finite)."""
    guard = 32 * KV_HEADS * DIM  # a dense sequence, two pages
    dense_shape, paged_shape = (BATCH, 32, KV_HEADS, DIM), (4, PAGE, KV_HEADS, DIM)
    buffers = {
        name: _in_canary_buffer(shape, guard, device)
        for name, shape in (
            ("k_dense", dense_shape),
            ("v_dense", dense_shape),
            ("k_paged", paged_shape),
            ("v_paged", paged_shape),
        )
    }
    canaries = {name: (buffer[:guard].clone(), buffer[-guard:].clone()) for name, (buffer, _) in buffers.items()}
    q = _randn(BATCH, 2, HEADS, DIM, device=device)
    dense = dict(q=q, k_cache=buffers["k_dense"][1], v_cache=buffers["v_dense"][1])
    paged = dict(q=q, k_cache=buffers["k_paged"][1], v_cache=buffers["v_paged"][1])
    new = lambda *shape: _randn(*shape, device=device)  # noqa: E731
    for k, v in (
        (new(BATCH, 2, KV_HEADS + 2, DIM), new(BATCH, 2, KV_HEADS + 2, DIM)),
        (new(BATCH, 2, KV_HEADS, 2 * DIM), new(BATCH, 2, KV_HEADS, 2 * DIM)),
        (new(BATCH + 3, 2, KV_HEADS, DIM), new(BATCH + 3, 2, KV_HEADS, DIM)),
        (new(BATCH, 2, KV_HEADS, DIM), new(BATCH, 40, KV_HEADS, DIM)),
    ):
        for caches in (dense, paged):
            before = caches["k_cache"].clone(), caches["v_cache"].clone()
            with pytest.raises(ValueError):
                flash_attn_with_kvcache(
                    **caches,
                    k=k,
                    v=v,
                    cache_seqlens=_int32([30, 31], device),
                    block_table=_int32([[0, 1], [2, 3]], device) if caches is paged else None,
                )
            assert torch.equal(caches["k_cache"], before[0]) and torch.equal(caches["v_cache"], before[1])
    # entries one past either end would land in the canaries if they were not clamped
    k, v = new(BATCH, 3, KV_HEADS, DIM), new(BATCH, 3, KV_HEADS, DIM)
    outs = [
        flash_attn_with_kvcache(
            **dense, k=k, v=v, cache_seqlens=_int32([31, 0], device), cache_batch_idx=_int32([2, -1], device)
        ),
        flash_attn_with_kvcache(**dense, k=k, v=v, cache_seqlens=_int32([30, 2**31 - 2], device)),
        flash_attn_with_kvcache(
            **paged,
            k=k,
            v=v,
            cache_seqlens=_int32([14, 45], device),
            block_table=_int32([[-1, 4, 1], [7, 0, 2**31 - 1]], device),
        ),
    ]
    assert all(torch.isfinite(out).all() for out in outs)
    for name, (buffer, _) in buffers.items():
        head, tail = canaries[name]
        assert torch.equal(buffer[:guard].view(torch.int16), head.view(torch.int16)), f"{name}: canary before"
        assert torch.equal(buffer[-guard:].view(torch.int16), tail.view(torch.int16)), f"{name}: canary after"


# ----------------------------------------------------------------------------- any strides


def _gapped(t, step=2):
    """The values of t in a view whose last dim has stride ``step`` (not unit)."""
    # the gaps hold other values (NaN, or 1): a kernel reading them gives other bits
    holder = torch.full(
        (*t.shape[:-1], t.shape[-1] * step),
        float("nan") if t.is_floating_point() else 1,
        dtype=t.dtype,
        device=t.device,
    )
    view = holder[..., ::step]
    view.copy_(t)
    return view


def _transposed(t):
    """The values of t stored with its last two dims swapped (column-major rows)."""
    return t.transpose(-1, -2).contiguous().transpose(-1, -2)


def _every_other(t):
    """The values of a vector in a view of stride 2."""
    return _gapped(t[None], 2)[0] if t.dim() == 1 else _gapped(t)


@pytest.mark.parametrize("layout", ["dense_padded_copy", "dense_batch_gap", "paged"])
def test_strided_views_give_the_contiguous_bits(layout, device):
    """Every tensor argument as a strided, transposed, expanded or offset view: the output, LSE and both caches
    after the append have the contiguous call's bits. dense_padded_copy: S = 40, read through a page-aligned copy;
    dense_batch_gap: S = 48 (three pages of 16) sliced from a longer cache, so that its pages are a copy too, where
    the contiguous call's are a view."""
    if layout == "paged":
        args, _ = _call_args(device, "paged", [20, 40])
        args["block_table"] = args.pop("page_table")
    else:
        args, _ = _call_args(device, "dense", [37, 11], dense_capacity=48 if layout == "dense_batch_gap" else 40)
        args["cache_leftpad"] = _int32([3, 0], device)
    args["learnable_sink"] = torch.randn(HEADS, device=device)
    args["k"] = args["k"][:1].expand(BATCH, -1, -1, -1).contiguous()
    views = {
        "q": _transposed(args["q"]),
        "k": args["k"][:1].expand(BATCH, -1, -1, -1),
        "v": _gapped(args["v"]),
        "cache_seqlens": _every_other(args["cache_seqlens"]),
        "rotary_cos": _gapped(args["rotary_cos"], 3),
        "rotary_sin": _transposed(args["rotary_sin"]),
        "learnable_sink": _every_other(args["learnable_sink"]),
        "k_cache": _gapped(args["k_cache"]),
        "v_cache": args["v_cache"].transpose(1, 2).contiguous().transpose(1, 2),
    }
    if layout == "dense_batch_gap":
        for name in ("k_cache", "v_cache"):
            longer = torch.zeros(BATCH + 1, 64, KV_HEADS, DIM, dtype=torch.bfloat16, device=device)
            views[name] = longer[:, 8:56]
            views[name].copy_(args[name])
    for name in ("cache_batch_idx", "cache_leftpad"):
        if name in args:
            views[name] = _every_other(args[name])
    if "block_table" in args:
        views["block_table"] = _transposed(args["block_table"])
    strided = dict(args, **views)
    results = []
    for call in (args, strided):
        out, lse = flash_attn_with_kvcache(**call, causal=True, return_softmax_lse=True)
        results.append((out, lse, call["k_cache"], call["v_cache"]))
    for what, contiguous, from_views in zip(("out", "lse", "k_cache", "v_cache"), *results):
        assert torch.equal(contiguous, from_views), what
