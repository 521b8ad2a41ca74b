"""The attention launches ``tools/compile_defaults.py`` compiles: prefill, windowed prefill, split-KV decode, combine,
each the :class:`~llmkernels.launch.KernelSpec` its backend gives for a call of that layout."""

from __future__ import annotations

import dataclasses

import torch
from compile_common import Case, _pretend_gpu, expected_mma

from llmkernels.attention import portable, split_kv
from llmkernels.attention.check import CheckedCall
from llmkernels.attention.config import default_config, tiling
from llmkernels.attention.masks import MaskSpec, ScoreModSpec

# The attention calls: (label, head dim, decode, paged, visible band, FP8 inputs: None, "kv" or "qkv")
ATTENTION_CALLS = (
    [(f"prefill d{d}", d, False, False, None, None) for d in (64, 128, 256)]
    + [("prefill d128 window 1024", 128, False, False, 1024, None)]
    + [(f"decode d{d} paged gqa8", d, True, True, None, None) for d in (64, 128, 256)]
    + [("decode d128 gqa8", 128, True, False, None, None)]
    + [("prefill d128 fp8 qkv", 128, False, False, None, "qkv")]
    + [("decode d128 paged fp8 kv", 128, True, True, None, "kv")]
)
NUM_Q_HEADS, NUM_KV_HEADS, PAGE_SIZE = 32, 4, 64


def _call(
    depth: int, decode: bool, paged: bool, band: int | None, device: torch.device, fp8: str | None = None
) -> CheckedCall:
    """A bf16 call of one sequence (one query for decode), 8 q heads per KV head, K/V token rows TMA can read
    (dense) or pages of 64 keys; ``band``: a sliding window that shows each query that many keys; ``fp8``: e4m3
    K/V ("kv") or q, K and V ("qkv") with all their descales (FA3's)."""
    mask = MaskSpec(has_window=True, window_left=band - 1, window_right=0) if band else MaskSpec()
    return CheckedCall(
        False,
        paged,
        1,
        NUM_Q_HEADS,
        NUM_KV_HEADS,
        depth,
        NUM_Q_HEADS // NUM_KV_HEADS,
        1 if decode else 4096,
        4096,
        mask,
        ScoreModSpec(),
        depth**-0.5,
        device,
        dtype=torch.bfloat16,
        q_rows=1 if decode else 4096,
        kv_rows=4096,
        page_size=PAGE_SIZE if paged else 0,
        kv_token_rows=not paged,
        tma_ready=(True, True, True),
        fp8_q=fp8 == "qkv",
        fp8_kv=fp8 is not None,
        descales=(fp8 == "qkv", fp8 is not None, fp8 is not None),
    )


def _case(label: str, spec, mma_m: int, arch: int) -> Case:
    options = dict(spec.options)
    return Case(
        "attention",
        label,
        spec.fn,
        {},
        dict(spec.constexprs),
        {},
        options["num_warps"],
        options.get("num_stages", 3),
        mma_m,
        expected_mma(arch, mma_m),
        spec=spec,
    )


def attention_cases(arch: int, calls=tuple(ATTENTION_CALLS)) -> list[Case]:
    """The launches of the portable backend for ``default_config`` on ``arch``: prefill (TMA K/V where the library
    takes it), a windowed prefill, split-KV decode of 8 q heads per KV head (paged and dense), FP8 (e4m3 q, K, V
    prefill and e4m3 paged decode, with descales), and the combine backend's two variants (all splits in one block,
    and blocks of 64)."""
    device = _pretend_gpu(arch)
    cases = []
    for label, depth, decode, paged, band, fp8 in calls:
        call = _call(depth, decode, paged, band, device, fp8)
        config = default_config(
            depth,
            torch.bfloat16,
            device,
            decode=decode,
            num_q_heads=NUM_Q_HEADS,
            num_kv_heads=NUM_KV_HEADS,
            visible_band=band,
        )
        tiles = tiling(config, decode, call.q_bound, call.group, call.batch, call.num_kv_heads, num_splits=2)
        spec = portable.BACKEND.spec(call, tiles)
        rows = tiles.block_q * tiles.heads_per_tile
        tiles_label = f"{tiles.num_q_tiles}x{rows}x{config.BN}"
        full = (
            f"{label:24s} q-tiles x rows x keys {tiles_label:9s} s{config.num_kv_stages} w{config.num_warps} "
            f"{'tma' if spec.constexprs['TMA_KV'] else '   '} rescale>{config.rescale_threshold:g} "
            f"poly {config.poly_exp2_fraction:g}"
        )
        cases.append(_case(full, spec, rows, arch))
    call = _call(128, True, False, None, device)
    config = default_config(128, torch.bfloat16, device, decode=True)
    for num_splits, variant in ((64, "one block"), (100, "blocks")):
        tiles = tiling(config, True, 1, call.group, 1, call.num_kv_heads, num_splits=num_splits)
        call_with_sinks = dataclasses.replace(call, has_sinks=True, return_lse=True)
        cases.append(_case(f"split-KV combine d128 {variant}", split_kv.BACKEND.spec(call_with_sinks, tiles), 0, arch))
    return cases
