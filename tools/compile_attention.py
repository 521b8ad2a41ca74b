"""The attention launches ``tools/compile_defaults.py`` compiles: prefill, windowed prefill, split-KV decode, combine."""
from __future__ import annotations

import torch

from compile_common import Case, _aligned_signature, _pretend_gpu, expected_mma
from llmkernels.attention import config as attn_config
from llmkernels.attention import kernel as attn_kernel
from llmkernels.attention import split_kv

# The attention calls: (label, head dim, decode, paged, visible band)
ATTENTION_CALLS = [(f"prefill d{d}", d, False, False, None) for d in (64, 128, 256)] + [
    ("prefill d128 window 1024", 128, False, False, 1024)] + [
    (f"decode d{d} paged gqa8", d, True, True, None) for d in (64, 128, 256)] + [
    ("decode d128 gqa8", 128, True, False, None)]


def attention_cases(arch: int, calls=tuple(ATTENTION_CALLS)) -> list[Case]:
    """The attention launches of ``default_config`` on ``arch``: prefill (causal; TMA K/V where the library
    takes it), a windowed prefill, split-KV decode of 8 q heads per KV head (paged and dense) and the
    split combine."""
    device = _pretend_gpu(arch)
    cases = []
    for label, depth, decode, paged, band in calls:
        config = attn_config.default_config(depth, torch.bfloat16, device, decode=decode, num_q_heads=32,
                                            num_kv_heads=4, visible_band=band)
        group = 8
        if decode:
            block_q, heads_per_tile = split_kv.decode_tiling(1, group, config.pack_gqa_heads)
            num_q_tiles = 1
        else:
            block_q, heads_per_tile, num_q_tiles = config.MMA_M, 1, config.num_q_tiles
        tma = config.tma_kv and not paged and depth == 1 << (depth - 1).bit_length()
        fn = attn_kernel.attention_fwd_kernel
        constexprs = dict(
            HEAD_DIM=depth, HEAD_DIM_PAD=depth, BLOCK_Q=block_q, HEADS_PER_TILE=heads_per_tile, BLOCK_N=config.BN,
            NUM_Q_TILES=num_q_tiles, RAGGED_Q=False, RAGGED_K=False, PAGED=paged, PAGE_SIZE=64 if paged else 16,
            HAS_WINDOW=band is not None, HAS_CHUNK=False, HAS_MASK_MOD=False, MASK_MOD=None,
            SCORE_MOD_KIND="none", SCORE_MOD=None, HAS_SINKS=False, SPLIT=decode, RETURN_LSE=False,
            REVERSE_Q_BLOCKS=band is not None and not decode, RESCALE_THRESHOLD=config.rescale_threshold,
            POLY_EXP2_FRACTION=config.poly_exp2_fraction, TMA_KV=tma, UPCAST=False, KV_STARTS=False,
            PAGE_OFFSETS_64=False,
            MASK_TENSOR="none")
        kinds = {name: "*i32" for name in fn.arg_names if name.endswith("_ptr")}
        kinds.update(q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", out_ptr="*fp32" if decode else "*bf16",
                     lse_ptr="*fp32", sinks_ptr="*fp32", alibi_slopes_ptr="*fp32", softmax_scale="fp32",
                     softcap_value="fp32", k_desc="*bf16", v_desc="*bf16")
        if tma:
            kinds.update(k_desc=f"tensordesc<bf16[{config.BN},{depth}]>", v_desc=f"tensordesc<bf16[{config.BN},{depth}]>")
        signature, attrs = _aligned_signature(fn, constexprs, kinds, unaligned=(
            "group", "num_splits", "num_kv_heads", "num_head_programs", "window_left", "window_right", "chunk_size",
            "num_pages"))
        tiles = f"{num_q_tiles}x{block_q * heads_per_tile}x{config.BN}"
        full = (f"{label:24s} q-tiles x rows x keys {tiles:9s} s{config.num_kv_stages} w{config.num_warps} "
                f"{'tma' if tma else '   '} rescale>{config.rescale_threshold:g} poly {config.poly_exp2_fraction:g}")
        mma_m = block_q * heads_per_tile
        cases.append(Case("attention", full, fn, signature, constexprs, attrs, config.num_warps,
                          config.num_kv_stages, mma_m, expected_mma(arch, mma_m)))
    fn = split_kv.combine_splits_kernel
    kinds = {"o_partial_ptr": "*fp32", "lse_partial_ptr": "*fp32", "out_ptr": "*bf16", "lse_ptr": "*fp32",
             "sinks_ptr": "*fp32"}
    for one_block in (True, False):
        constexprs = dict(HEAD_DIM=128, HEAD_DIM_PAD=128, BLOCK_SPLITS=64, HAS_SINKS=True, RETURN_LSE=True,
                          ONE_BLOCK=one_block)
        signature, attrs = _aligned_signature(fn, constexprs, kinds, unaligned=("num_splits",))
        label = "split-KV combine d128" + (" one block" if one_block else " blocks")
        cases.append(Case("attention", label, fn, signature, constexprs, attrs, 4, 3, 0, "none"))
    return cases
