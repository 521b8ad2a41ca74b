"""FA4Config: the seed's FA4Config fields, the FA4 switches, and the default per (head dim, dtype, GPU).

Seed field -> what it is here
-----------------------------
==================  ==========================================================================
``BM``              query rows per program (the seed: 256 = two tiles of 128)
``MMA_M``           rows of one Q tile: ``BM // num_q_tiles`` (read-only property)
``num_q_tiles``     1, or 2 for FA4's "2Q": two Q tiles per program share every K/V tile load
``BN``              keys per K/V tile
``depth``           head dim D (any multiple of 16 up to 256)
``padded_depth``    D rounded up to a power of two (``tl.arange`` needs one); padding is masked
``num_q_heads``     Hq; ``None`` = taken from the inputs, otherwise checked against them
``num_kv_heads``    Hkv; same
``group``           Hq // Hkv (read-only property)
``num_kv_stages``   software-pipeline depth of the K/V loop (Triton's ``num_stages``)
``num_warps``       warps per program (the seed's warp roles are Triton's business, see below)
``page_size``       paged-KV page size; ``None`` = taken from the cache (informational)
==================  ==========================================================================

FA4 switches
------------
``rescale_threshold``  log2 units. The O accumulator is rescaled only when some row's running max
                       grew by more than this (0 = rescale whenever the max grows: classic flash
                       attention). Exact either way: the final ``1/l`` uses the same stale max, and
                       ``p = exp2(s - stale_max) <= 2**threshold`` (at most 2**15 so fp16 P cannot
                       overflow).
``poly_exp2_fraction`` fraction of the score columns whose ``exp2`` is a Cody-Waite polynomial on the
                       FMA units instead of the MUFU ``ex2`` instruction: 0, 0.25, 0.5, 0.75 or 1.
``tma_kv``             load the K/V tiles of the fully visible band through tensor descriptors (TMA on
                       sm90+; the seed's TMA producer) where the layout allows it: dense or ragged K/V
                       (not paged), D a power of two, heads contiguous in a token row, 16-byte aligned
                       rows. Masked edge tiles keep pointer loads (they may reach past the sequence).
``pack_gqa_heads``     split-KV/decode only: q heads of one KV head packed into one tile (rows are
                       (query, head) pairs) so that K/V is read once per KV head. 0 = automatic.

Hopper's warp-specialized schedule
----------------------------------
``warp_specialized``     run the Gluon kernels where they apply (an sm_90 GPU, no score_mod or mask tensor;
                         sinks fold into the prefills' last step): ``gluon_hopper.py`` for fp16/bf16 prefill,
                         D 64/128/256, causal / a sliding window; ``gluon_fp8_prefill.py`` for e4m3 K/V
                         prefill (e4m3 or 16-bit q, dense, ragged or paged, D 64/128/256, causal / a sliding
                         window, three-stage rings): the
                         seed's warp roles made explicit, a TMA **load warp** (K and V through two-stage rings in
                         the bf16 kernel, the seed's ``num_kv_stages`` = 2) and consumer warpgroups
                         that each issue their own wgmmas and run their own softmax (on Hopper the warpgroup
                         that issues a wgmma owns its accumulator, so the seed's MMA and softmax roles merge;
                         the warp schedulers interleave the consumers, FA3's ping-pong without barriers). Its
                         tiles are fixed: 64 Q rows per consumer, 128 keys (64 at D = 256); the fields above
                         apply to the portable kernel, which runs every call the Gluon kernel does not take.
                         In split-KV decode, the Gluon split pass of ``gluon_decode.py`` where it applies (one
                         query token, dense or paged K/V TMA reads in place, D 64/128, few sequences x KV
                         heads: the latency-bound regime); the combine kernel merges its partials.
                         The default on sm_90 (prefill and decode); False elsewhere.
``consumer_warpgroups``  consumers per block with ``warp_specialized``: 2 (128 rows, 240 registers each) or 3
                         (192 rows, 160 registers; D = 64 only); None = the measured rule (3 at D = 64 except
                         masked calls of at most 4096 queries).

Seed fields fixed by the Triton compiler
-----------------------------------------
``BK0`` (K-chunk of QK^T: the whole ``padded_depth``; the compiler splits it into MMA instructions),
``BK1`` (``BN`` for PV), ``num_qk_stages`` / ``num_pv_stages`` (MMA pipelining inside one tile),
``swizzle_mode`` (shared-memory layouts are chosen by the compiler), and, in the portable kernel, the warp
roles (load / MMA / softmax / correction warpgroups): Triton schedules one program's warps itself (its
automatic warp specialization and a software-pipelined ``Q K^T`` both lost on the H100, ``lab/NOTES.md``);
the Gluon kernel's roles are explicit (``warp_specialized`` above).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..runtime import cdiv, cuda_capability, interpreting, next_power_of_2, per_device

__all__ = [
    "FA4Config",
    "default_config",
    "SUPPORTED_HEAD_DIMS",
    "Tiling",
    "tiling",
    "splits_kv",
    "split_count",
    "choose_num_splits",
    "fp8_kv_splits",
    "decode_tiling",
    "gluon_prefill_consumers",
    "gluon_prefill_block_n",
    "GLUON_PREFILL_MAX_REGS",
    "combine_block_splits",
    "MAX_DECODE_QUERIES",
    "runs_gluon",
]

SUPPORTED_HEAD_DIMS = tuple(range(16, 257, 16))
_POLY_FRACTIONS = (0.0, 0.25, 0.5, 0.75, 1.0)
_MAX_RESCALE_THRESHOLD = 15.0  # p <= 2**15 < 65504, the fp16 maximum
_NARROW_BAND = 4096  # keys visible per query up to which Hopper prefill takes 64 x 64 tiles (D = 128)


def _is_power_of_2(n: int) -> bool:
    return isinstance(n, int) and n > 0 and (n & (n - 1)) == 0


@dataclass(frozen=True)
class FA4Config:
    """Tiling and FA4 switches of one attention launch. Validated on construction.

    Raises:
        ValueError: naming the field that is out of range (see the module docstring for the fields).
    """

    BM: int = 128
    BN: int = 64
    num_q_tiles: int = 1
    depth: int | None = None
    padded_depth: int | None = None
    num_q_heads: int | None = None
    num_kv_heads: int | None = None
    num_kv_stages: int = 2
    num_warps: int = 4
    rescale_threshold: float = 8.0
    poly_exp2_fraction: float = 0.0
    pack_gqa_heads: int = 0
    tma_kv: bool = True
    page_size: int | None = None
    warp_specialized: bool = False
    consumer_warpgroups: int | None = None

    def __post_init__(self):
        if not _is_power_of_2(self.num_q_tiles) or self.num_q_tiles > 2:
            raise ValueError(f"num_q_tiles must be 1 or 2, got {self.num_q_tiles!r}")
        if not _is_power_of_2(self.BM) or self.BM < 16 * self.num_q_tiles:
            raise ValueError(f"BM must be a power of two >= 16 * num_q_tiles, got {self.BM!r}")
        if not _is_power_of_2(self.BN) or self.BN < 16:
            raise ValueError(f"BN must be a power of two >= 16, got {self.BN!r}")
        if self.depth is not None:
            if self.depth not in SUPPORTED_HEAD_DIMS:
                raise ValueError(f"depth must be a multiple of 16 in [16, 256], got {self.depth!r}")
            if self.padded_depth is None:
                object.__setattr__(self, "padded_depth", next_power_of_2(self.depth))
        if self.padded_depth is not None:
            if not _is_power_of_2(self.padded_depth) or (self.depth is not None and self.padded_depth < self.depth):
                raise ValueError(f"padded_depth must be a power of two >= depth, got {self.padded_depth!r}")
        for field in ("num_q_heads", "num_kv_heads"):
            value = getattr(self, field)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{field} must be a positive int, got {value!r}")
        if self.num_q_heads is not None and self.num_kv_heads is not None and self.num_q_heads % self.num_kv_heads:
            raise ValueError(
                f"num_q_heads ({self.num_q_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if not isinstance(self.num_kv_stages, int) or not 1 <= self.num_kv_stages <= 8:
            raise ValueError(f"num_kv_stages must be an int in [1, 8], got {self.num_kv_stages!r}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps must be 1, 2, 4, 8 or 16, got {self.num_warps!r}")
        threshold = self.rescale_threshold
        if not isinstance(threshold, (int, float)) or not 0.0 <= threshold <= _MAX_RESCALE_THRESHOLD:
            raise ValueError(
                f"rescale_threshold must be in [0, {_MAX_RESCALE_THRESHOLD}] (log2 units), got {threshold!r}"
            )
        object.__setattr__(self, "rescale_threshold", float(threshold))
        if self.poly_exp2_fraction not in _POLY_FRACTIONS:
            raise ValueError(f"poly_exp2_fraction must be one of {_POLY_FRACTIONS}, got {self.poly_exp2_fraction!r}")
        object.__setattr__(self, "poly_exp2_fraction", float(self.poly_exp2_fraction))
        if self.pack_gqa_heads != 0 and (not _is_power_of_2(self.pack_gqa_heads) or self.pack_gqa_heads > 128):
            raise ValueError(f"pack_gqa_heads must be 0 (auto) or a power of two <= 128, got {self.pack_gqa_heads!r}")
        if not isinstance(self.tma_kv, bool):
            raise ValueError(f"tma_kv must be a bool, got {self.tma_kv!r}")
        if self.page_size is not None and (not _is_power_of_2(self.page_size) or not 16 <= self.page_size <= 256):
            raise ValueError(f"page_size must be a power of two in [16, 256], got {self.page_size!r}")
        if not isinstance(self.warp_specialized, bool):
            raise ValueError(f"warp_specialized must be a bool, got {self.warp_specialized!r}")
        if (
            self.consumer_warpgroups not in (None, 2, 3)
            or isinstance(self.consumer_warpgroups, bool)
            or (self.consumer_warpgroups == 3 and self.depth is not None and self.depth != 64)
        ):
            raise ValueError(f"consumer_warpgroups must be None, 2, or 3 at depth 64, got {self.consumer_warpgroups!r}")

    # -- derived and compiler-fixed fields (the seed's names) ------------------------------------
    @property
    def MMA_M(self) -> int:
        return self.BM // self.num_q_tiles

    @property
    def two_q_tiles(self) -> bool:
        return self.num_q_tiles == 2

    @property
    def group(self) -> int | None:
        if self.num_q_heads is None or self.num_kv_heads is None:
            return None
        return self.num_q_heads // self.num_kv_heads

    def replace(self, **changes) -> FA4Config:
        return dataclasses.replace(self, **changes)


@per_device  # a pure function of hashable arguments and the device's properties; configs are frozen
def default_config(
    depth: int,
    dtype: torch.dtype,
    device: torch.device,
    *,
    decode: bool = False,
    num_q_heads: int | None = None,
    num_kv_heads: int | None = None,
    visible_band: int | None = None,
) -> FA4Config:
    """The default FA4Config for a head dim, dtype and device (``decode`` = the split-KV path;
    ``visible_band``: the most keys a query can see under a sliding window or chunk, None if unbounded).

    CPU (Triton interpreter): small tiles, both FA4 tiles on, so the default exercises the FA4 paths.
    Hopper (sm90): prefill ``warp_specialized`` (the Gluon kernel where it applies); for the portable kernel
    one Q tile of 128 rows (a warpgroup per 64 rows already gives the 2Q overlap), MUFU exp2 only, classic
    rescaling (all three measured faster there). Blackwell (sm100+): the seed's
    2 x 128 rows and a quarter of exp2 on FMA units.
    """
    common = dict(depth=depth, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads)
    capability = cuda_capability(device)
    if capability is None:
        if decode:
            return FA4Config(BM=16, BN=16, num_q_tiles=1, num_kv_stages=1, num_warps=4, rescale_threshold=8.0, **common)
        return FA4Config(
            BM=32,
            BN=16,
            num_q_tiles=2,
            num_kv_stages=1,
            num_warps=4,
            rescale_threshold=8.0,
            poly_exp2_fraction=0.0,
            **common,
        )
    major = capability[0]
    if decode:
        # Two warps per program at D <= 128: more programs resident per SM, which large batches need. On sm_90
        # ``warp_specialized`` lets the Gluon split pass take the latency-bound calls (gluon_decode.py).
        return FA4Config(
            BM=16,
            BN=64 if depth <= 128 else 32,
            num_q_tiles=1,
            num_kv_stages=3,
            num_warps=2 if depth <= 128 else 4,
            rescale_threshold=8.0,
            warp_specialized=major == 9,
            **common,
        )
    if major >= 10:
        # Compiled for sm_100a, never run on a Blackwell GPU (docs/blackwell.md). Each Q tile keeps S, P
        # and O in tensor memory (Triton does not alias P onto S as the seed does), so two tiles need
        # 2 * (BN + BN / 2 + D) of its 512 columns: BN = 128 at D = 128 over-subscribes it and Triton
        # compiles the kernel to a trap. BN = 64 fits every D <= 128 without register spills.
        if depth <= 128:
            return FA4Config(
                BM=256,
                BN=64,
                num_q_tiles=2,
                num_kv_stages=3,
                num_warps=8,
                rescale_threshold=8.0,
                poly_exp2_fraction=0.25,
                **common,
            )
        return FA4Config(
            BM=128,
            BN=64,
            num_q_tiles=2,
            num_kv_stages=2,
            num_warps=8,
            rescale_threshold=8.0,
            poly_exp2_fraction=0.25,
            **common,
        )
    if major == 9:
        # Prefill takes the warp-specialized Gluon kernel where it applies (0.68-1.16x cuDNN against the
        # portable kernel's 0.53-0.96x on the H100 grid, lab/NOTES.md); the tiles below are the
        # portable kernel's, the best of the H100 sweep, for every other call. The conditional rescale's
        # block-uniform branch splits the MMA pipeline here, so the threshold is 0; TMA loads of 512-byte
        # rows (D=256) lost to pointer loads, so they are off there.
        common["warp_specialized"] = True
        if depth <= 64:
            return FA4Config(
                BM=128, BN=64, num_q_tiles=1, num_kv_stages=3, num_warps=4, rescale_threshold=0.0, **common
            )
        if depth <= 128:
            if visible_band is not None and visible_band <= _NARROW_BAND and depth > 64:
                # Short windows and chunks: each 128-row Q block sees only a few K/V tiles, half of
                # them masked edge tiles; 64 x 64 tiles halve the masked work.
                return FA4Config(
                    BM=64, BN=64, num_q_tiles=1, num_kv_stages=3, num_warps=4, rescale_threshold=0.0, **common
                )
            return FA4Config(
                BM=128, BN=128, num_q_tiles=1, num_kv_stages=3, num_warps=8, rescale_threshold=0.0, **common
            )
        return FA4Config(
            BM=128, BN=64, num_q_tiles=1, num_kv_stages=2, num_warps=8, rescale_threshold=0.0, tma_kv=False, **common
        )
    # Ampere / Ada and anything else: smaller tiles, fewer registers.
    if depth <= 128:
        return FA4Config(BM=128, BN=64, num_q_tiles=1, num_kv_stages=2, num_warps=4, rescale_threshold=8.0, **common)
    return FA4Config(BM=64, BN=32, num_q_tiles=1, num_kv_stages=2, num_warps=4, rescale_threshold=8.0, **common)


# ---------------------------------------------------------------------------------------------
# Tiling: what one call launches, from its config and sizes (the backends' specs read these)
# ---------------------------------------------------------------------------------------------

MAX_DECODE_QUERIES = 16  # q tokens per sequence up to which the split-KV path is the default
COMBINE_MAX_BLOCK_SPLITS = 64  # splits the combine reads in one block (one round trip to L2: H100, lab/NOTES.md)
# Gluon prefill launch registers per thread (``maxnreg``) by consumer warpgroups: two consumers and the load warp's
# warpgroup are 12 warps sharing 64K registers (65536 / (12 * 32) rounded down to a multiple of 8), three are 16
GLUON_PREFILL_MAX_REGS = {2: 168, 3: 128}


def splits_kv(max_seqlen_q: int, num_splits: int | None) -> bool:
    """Whether a call takes the split-KV (decode) path: ``num_splits > 1`` asked for, or none given and at most
    ``MAX_DECODE_QUERIES`` queries per sequence."""
    return (num_splits is not None and num_splits > 1) or (num_splits is None and max_seqlen_q <= MAX_DECODE_QUERIES)


# Programs of the split pass resident per SM over an FP8 cache: two warps of ~240 registers a thread (sm_90a), so
# four fill the 64k registers of an SM.
FP8_KV_PROGRAMS_PER_SM = 4


def fp8_kv_splits(num_programs_without_split: int, num_kv_tiles_bound: int, num_sms: int) -> int:
    """Splits over an FP8 cache: as many as one wave of resident programs holds (never a partial second wave).

    Each key costs the bf16 pass's work for half its bytes, so the pass wants more programs in flight than the
    bf16 rule's two per SM, and a wave that spills over costs a third of the time. H100, Hq 32 / Hkv 8, D 128,
    page 16 (``lab/NOTES.md``): B = 8 x 32k 308 / 227 / 321 / 297 us at 4 / 8 / 9 / 10 splits; B = 32 x 8k 227 /
    279 / 237 at 2 / 3 / 4; B = 1 x 128k 164 at 33, 125-128 at 64-67.
    """
    wanted = FP8_KV_PROGRAMS_PER_SM * num_sms // max(num_programs_without_split, 1)
    return max(1, min(wanted, num_kv_tiles_bound, 256))


def choose_num_splits(num_programs_without_split: int, num_kv_tiles_bound: int, num_sms: int) -> int:
    """Splits so that ``programs * splits`` fills the GPU about twice (host-known bounds only, no sync).

    Never more splits than KV tiles of the longest possible sequence, never fewer than one: programs that
    already fill the GPU twice get one. Programs that fill it once but not twice still split in two
    (H100, 32 sequences x 8 KV heads at 8k: 375 vs 395 µs, ``lab/NOTES.md``).
    """
    wanted = cdiv(2 * num_sms, max(num_programs_without_split, 1))
    return max(1, min(wanted, num_kv_tiles_bound, 256))


def decode_tiling(max_seqlen_q: int, group: int, pack_gqa_heads: int = 0) -> tuple[int, int]:
    """(BLOCK_Q, HEADS_PER_TILE) of the split-KV path: rows are (query, head) pairs, at least 16 rows
    (the smallest ``tl.dot`` M), at most 128."""
    heads_per_tile = pack_gqa_heads or min(next_power_of_2(group), 64)
    block_q = next_power_of_2(max(max_seqlen_q, 1))
    while block_q * heads_per_tile > 128 and heads_per_tile > 1:
        heads_per_tile //= 2
    block_q = min(block_q, max(1, 128 // heads_per_tile))
    block_q = max(block_q, max(1, 16 // heads_per_tile))
    return block_q, heads_per_tile


def gluon_prefill_block_n(head_dim: int) -> int:
    """Keys per K/V tile of the Gluon prefill: S (block_n / 2 fp32 per thread), P and O (head_dim / 2) fit the
    consumers' 240 registers, and Q plus two stages of K and V the 227 KiB of shared memory."""
    return 64 if head_dim > 128 else 128


def gluon_prefill_consumers(head_dim: int, seqlen_q: int, masked: bool) -> int:
    """Consumer warpgroups per block of the Gluon prefill: three at D = 64 (FA3's choice; 160 registers fit S, P and
    O there), except for masked calls of at most 4096 queries, where a 192-row block's diagonal tiles waste more
    than three consumers gain (H100: 2k causal 0.89 against 0.77x cuDNN, 4k 0.97 against 0.94x, 8k 1.00 against
    1.04x; lab/NOTES.md); two elsewhere."""
    return 3 if head_dim == 64 and (not masked or seqlen_q > 4096) else 2


def combine_block_splits(num_splits: int) -> int:
    """Splits the combine kernel reads per block: all of them up to ``COMBINE_MAX_BLOCK_SPLITS`` (its
    ``ONE_BLOCK`` variant), else blocks of that many."""
    return min(next_power_of_2(num_splits), COMBINE_MAX_BLOCK_SPLITS)


@dataclass(frozen=True)
class Tiling:
    """What one call launches, decided from its :class:`FA4Config` and host-known sizes (no tensor).

    ``split``: the split-KV path (decode); ``num_splits``: programs per (Q block, head tile) along the keys (1
    without split); ``partials``: several splits, merged by the combine kernel (one split writes O directly).
    Portable kernel: Q tiles of ``block_q`` queries x ``heads_per_tile`` q heads (rows are (query, head) pairs),
    ``num_q_tiles`` per program, ``num_q_blocks`` x ``num_head_programs`` programs along grid axis 0.
    """

    config: FA4Config
    split: bool
    num_splits: int
    block_q: int
    heads_per_tile: int
    num_q_tiles: int
    num_q_blocks: int
    num_head_programs: int

    @property
    def partials(self) -> bool:
        return self.split and self.num_splits > 1

    @property
    def grid(self) -> tuple[int, int]:
        return (self.num_q_blocks * self.num_head_programs, self.num_splits)


def tiling(
    config: FA4Config, split: bool, max_seqlen_q: int, group: int, batch: int, num_kv_heads: int, num_splits: int = 1
) -> Tiling:
    """The :class:`Tiling` of a call of ``batch`` sequences of at most ``max_seqlen_q`` queries, ``group`` q heads
    per KV head: the split path packs the q heads of a KV head into a tile (:func:`decode_tiling`), one pass takes
    ``config.MMA_M`` rows and ``config.num_q_tiles`` tiles per program."""
    if split:
        block_q, heads_per_tile = decode_tiling(max_seqlen_q, group, config.pack_gqa_heads)
        num_q_tiles = 1
    else:
        block_q, heads_per_tile, num_q_tiles, num_splits = config.MMA_M, 1, config.num_q_tiles, 1
    return Tiling(
        config,
        split,
        num_splits,
        block_q,
        heads_per_tile,
        num_q_tiles,
        cdiv(max_seqlen_q, block_q * num_q_tiles),
        batch * num_kv_heads * cdiv(group, heads_per_tile),
    )


def split_count(
    tiles: Tiling, num_kv_tiles_bound: int, num_splits: int | None, num_sms: int, fp8_kv: bool = False
) -> int:
    """Splits of a split-KV call: ``num_splits`` when given, else :func:`choose_num_splits` (over an FP8 cache:
    :func:`fp8_kv_splits`); never more than the KV tiles of the longest possible sequence (extra splits would only
    see empty ranges)."""
    if num_splits is None:
        programs = tiles.num_q_blocks * tiles.num_head_programs
        if fp8_kv:
            num_splits = fp8_kv_splits(programs, num_kv_tiles_bound, num_sms)
        else:
            num_splits = choose_num_splits(programs, num_kv_tiles_bound, num_sms)
    return min(num_splits, num_kv_tiles_bound)


def runs_gluon(device: torch.device) -> bool:
    """Whether the Gluon kernels for Hopper (``gluon_hopper``, ``gluon_decode``) can run on ``device``: an sm_90
    GPU, not the interpreter (the backends that launch them ask)."""
    return not interpreting() and cuda_capability(device) == (9, 0)
