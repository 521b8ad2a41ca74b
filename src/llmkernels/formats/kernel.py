"""Triton code of the block-scaled formats: quantize, the element and scale decoders, and the tile loads and
dequantize that the matmul kernels share (with the A pre-pass, :func:`upcast_rows_kernel`). The device side of each
scale layout is its module's in ``formats/layouts/``."""

import triton
import triton.language as tl


@triton.jit
def decode_e2m1(codes):
    """uint8 e2m1 codes (low 4 bits) → float32.

    The code's exponent and mantissa bits land in float32's exponent and mantissa fields, which
    makes the value 2^-126 times too small (e = 0 becomes float32's subnormal 2^-127 · m, which is
    exactly what e2m1's own subnormal 0.5 · m needs), and one multiply by 2^126 rescales it.
    """
    codes = codes.to(tl.int32)
    bits = ((codes & 7) << 22) | ((codes & 8) << 28)
    return bits.to(tl.float32, bitcast=True) * 8.507059173023462e37  # 2^126


# Operands: $4 holds four packed bytes (eight e2m1 codes, low nibble first), $5 / $6 the bf16 scales of
# bytes 0-1 / 2-3; outputs $0 / $1 are the even elements of bytes 0-1 / 2-3 as bf16 pairs, $2 / $3 the
# odd ones. th* / tl* are prmt's 8-byte lookup tables: byte c holds the high (th) or low (tl) byte of the
# bf16 value of magnitude code c (0, 0.5, 1, 1.5 in word 0; 2, 3, 4, 6 in word 1). The lookups use the
# sign-cleared nibbles as selectors; selectors 0x6240 / 0x7351 pair low and high bytes into the even /
# odd bf16 lanes; 0x1100 / 0x3322 copy bytes 0-1 / 2-3 so that a nibble's sign bit lands on bit 15 or 31
# (the odd one directly, the even one after a shift by 4), and lop3 (a | b & c, 0xF8) ORs it in. The
# results go through temporaries: an output register may be one of the inputs, so none is written
# before every input has been read.
_E2M1_TO_BF16X2_PTX = tl.constexpr("""
{
.reg .b32 th0, th1, tl0, tl1, minus_zero, mag, mag_hi, hi0, lo0, hi1, lo1, e01, e23, o01, o23, s01, s23, t01, t23;
.reg .b32 r0, r1, r2, r3;
mov.b32 th0, 0x3F3F3F00;
mov.b32 th1, 0x40404040;
mov.b32 tl0, 0xC0800000;
mov.b32 tl1, 0xC0804000;
mov.b32 minus_zero, 0x80008000;
and.b32 mag, $4, 0x77777777;
shr.u32 mag_hi, mag, 16;
prmt.b32 hi0, th0, th1, mag;
prmt.b32 lo0, tl0, tl1, mag;
prmt.b32 hi1, th0, th1, mag_hi;
prmt.b32 lo1, tl0, tl1, mag_hi;
prmt.b32 e01, lo0, hi0, 0x6240;
prmt.b32 o01, lo0, hi0, 0x7351;
prmt.b32 e23, lo1, hi1, 0x6240;
prmt.b32 o23, lo1, hi1, 0x7351;
prmt.b32 s01, $4, $4, 0x1100;
prmt.b32 s23, $4, $4, 0x3322;
shl.b32 t01, s01, 4;
shl.b32 t23, s23, 4;
lop3.b32 e01, e01, t01, 0x80008000, 0xF8;
lop3.b32 e23, e23, t23, 0x80008000, 0xF8;
lop3.b32 o01, o01, s01, 0x80008000, 0xF8;
lop3.b32 o23, o23, s23, 0x80008000, 0xF8;
fma.rn.bf16x2 r0, e01, $5, minus_zero;
fma.rn.bf16x2 r1, e23, $6, minus_zero;
fma.rn.bf16x2 r2, o01, $5, minus_zero;
fma.rn.bf16x2 r3, o23, $6, minus_zero;
mov.b32 $0, r0;
mov.b32 $1, r1;
mov.b32 $2, r2;
mov.b32 $3, r3;
}
""")


@triton.jit
def decode_e2m1_pairs_bf16(packed, scale):
    """Packed e2m1 bytes (uint8, low nibble = even element) times ``scale`` (bf16, one per byte) →
    ``(even, odd)`` bf16 tensors of packed's shape, on NVIDIA GPUs (PTX, sm_80+; not in the interpreter).

    Works on four bytes at once in 32-bit registers: ``prmt`` looks the magnitude codes up in an 8-byte
    table of bf16 high bytes and one of low bytes and interleaves them into bf16 pairs, ``lop3`` puts the
    signs back, and one packed ``fma`` per pair applies the scales: about 3 instructions per element,
    where the float32 decode takes about 10. Exact: an e2m1 value times a power of two or an e4m3 scale
    has at most 5 significant bits, and ``x·s + (−0)`` keeps the sign of a zero.
    """
    return tl.inline_asm_elementwise(
        _E2M1_TO_BF16X2_PTX,
        "=r,=r,=r,=r,r,r,r",
        [packed, scale],
        dtype=(tl.bfloat16, tl.bfloat16),
        is_pure=True,
        pack=4,
    )


@triton.jit
def decode_e8m0(bits):
    """uint8 biased exponents → float32 ``2^(bits - 127)``; 0 is the subnormal 2^-127, 255 NaN."""
    bits = bits.to(tl.int32)
    word = tl.where(bits == 0, 0x00400000, bits << 23)
    word = tl.where(bits == 255, 0x7FC00000, word)
    return word.to(tl.float32, bitcast=True)


@triton.jit
def decode_scale(bits, SCALE: tl.constexpr):
    """uint8 scale bits → float32, for ``SCALE`` ``"e8m0"`` or ``"e4m3"``."""
    if SCALE == "e8m0":
        return decode_e8m0(bits)
    else:  # 0x7F / 0xFF are NaN (the interpreter's cast reads them as 480)
        bits = bits.to(tl.uint8)
        return tl.where((bits & 0x7F) == 0x7F, float("nan"), bits.to(tl.float8e4nv, bitcast=True).to(tl.float32))


@triton.jit
def _round_to_e4m3(value):
    """float32 within ±448 → the nearest e4m3 value (ties to even), still as float32.

    Adding ``M = 1.5 · 2^23 · ulp`` moves ``value`` into a binade whose float32 spacing is the e4m3
    ulp, so the hardware's round-to-nearest-even addition does the rounding; subtracting M is exact.
    (The cast to fp8 then only sees representable values: Triton's interpreter does not round fp8
    casts to nearest even.) The rounding runs on the magnitude and the sign bit is put back, so that
    a negative value that rounds to zero gives -0, as the cast does.
    """
    exponent = ((value.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    exponent = tl.maximum(exponent, -6)  # e4m3 subnormals share the ulp of the lowest binade
    magic = (((exponent + 20 + 127) << 23) | 0x400000).to(tl.float32, bitcast=True)
    rounded = (tl.abs(value) + magic) - magic
    sign = value.to(tl.uint32, bitcast=True) & 0x80000000
    return (rounded.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _encode_e2m1(scaled):
    """float32 already clamped to ±6 → e2m1 codes (int32), round to nearest even.

    The magnitude is rounded onto e2m1's grid the way :func:`_round_to_e4m3` does it (adding
    ``1.5 · 2^23 · ulp`` lets the float adder round to nearest even; ulp 0.5 below 2, then 1, then 2),
    and the code read off the rounded value's bits: ``(exponent field << 1 | top mantissa bit) − 252``
    from 1.0 up (1.0 → 2 … 6.0 → 7), 0 or 1 below (0 → 0, 0.5 → 1). A NaN gives code 0.
    """
    magnitude = tl.abs(scaled)
    exponent = tl.maximum(((magnitude.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, 0)
    magic = (((exponent + 22 + 127) << 23) | 0x400000).to(tl.float32, bitcast=True)
    rounded = (magnitude + magic) - magic
    bits = rounded.to(tl.int32, bitcast=True)
    code = tl.where(rounded >= 1.0, (bits >> 22) - 252, (rounded > 0.0).to(tl.int32))
    sign = (scaled.to(tl.int32, bitcast=True) >> 31) & (scaled == scaled).to(tl.int32)
    return code | (sign << 3)


@triton.jit
def encode_e4m3(scaled):
    """float32 → ``float8_e4m3fn`` bits (uint8): clamped to ±448, rounded to nearest (ties to even) by
    :func:`_round_to_e4m3`; a NaN is written 0x7F, as torch's cast writes +NaN (not every backend's cast does)."""
    scaled = tl.clamp(scaled, -448.0, 448.0, propagate_nan=tl.PropagateNan.ALL)
    values = _round_to_e4m3(scaled).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    return tl.where(scaled == scaled, values, 0x7F).to(tl.uint8)


@triton.jit
def fp8_block_scale(amax, POWER_OF_TWO: tl.constexpr):
    """float32 ``amax`` of fp8 blocks → their float32 decode scales: ``max(amax / 448, 2^-126)`` correctly
    rounded (``div_rn``: the plain ``/`` is an approximate division on NVIDIA GPUs), with POWER_OF_TWO rounded up
    to a power of two; 1.0 where amax is 0, NaN where it is NaN."""
    scale = tl.maximum(tl.math.div_rn(amax, 448.0), 1.1754943508222875e-38, propagate_nan=tl.PropagateNan.ALL)
    if POWER_OF_TWO:
        # a carry out of a non-zero mantissa raises the exponent by one; a power of two has none to carry
        bits = scale.to(tl.uint32, bitcast=True)
        rounded = ((bits + 0x7FFFFF) & 0xFF800000).to(tl.float32, bitcast=True)
        scale = tl.where(scale == scale, rounded, scale)
    return tl.where(amax == 0.0, 1.0, scale)


@triton.jit
def quantize_kernel(
    x_ptr,
    data_ptr,
    scales_ptr,
    global_scale_ptr,
    source_rows_ptr,
    stride_x_row,
    num_rows,
    num_x_rows,
    num_cols,
    ELEMENT: tl.constexpr,
    SCALE: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
    EMAX: tl.constexpr,
    GATHER: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    POWER_OF_TWO: tl.constexpr = False,
):
    """Quantizes ``num_rows`` rows of x ``[num_x_rows, num_cols]`` (row stride ``stride_x_row``, unit
    column stride): row r of the output is x's row r, or with GATHER x's row ``source_rows[r]``
    (int64 ``[num_rows]``, clamped to x), so that a permutation costs no extra pass over x.

    Writes ``data`` ``[num_rows, num_cols]`` e4m3 or ``[num_rows, num_cols / 2]`` packed e2m1, and
    row-major ``scales`` ``[num_rows, ceil(num_cols / SCALE_BLOCK)]``: uint8 bits (SCALE ``"e8m0"``, ``"e4m3"``)
    or float32 (``"f32"``: fp8 ``(1, 128)`` blocks, :func:`fp8_block_scale` with POWER_OF_TWO; num_cols any, a
    partial last block holds the columns there are). One program per ``BLOCK_ROWS × BLOCK_COLS`` tile.
    """
    SCALES_PER_TILE: tl.constexpr = BLOCK_COLS // SCALE_BLOCK
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    rows64 = rows.to(tl.int64)
    row_ok = rows < num_rows
    x_rows = rows64
    if GATHER:
        x_rows = tl.load(source_rows_ptr + rows64, mask=row_ok, other=0).to(tl.int64)
        x_rows = tl.minimum(tl.maximum(x_rows, 0), num_x_rows - 1)
    x = tl.load(
        x_ptr + x_rows[:, None] * stride_x_row + cols[None, :],
        mask=row_ok[:, None] & (cols < num_cols)[None, :],
        other=0.0,
    ).to(tl.float32)
    blocks = tl.reshape(x, (BLOCK_ROWS, SCALES_PER_TILE, SCALE_BLOCK))
    # max over the magnitudes' bits: for non-negative floats integer order is float order, and a NaN
    # (bits above inf) wins, where a float max would skip it (the block's scale must become NaN).
    amax = tl.max(tl.abs(blocks).to(tl.int32, bitcast=True), axis=2).to(tl.float32, bitcast=True)

    if SCALE == "e8m0":
        # OCP MX: scale = 2^(floor(log2(amax)) - emax), read off amax's exponent bits.
        exponent = ((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
        scale_bits = tl.minimum(tl.maximum(exponent - EMAX, -127), 127) + 127
        scale_bits = tl.where(amax != amax, 255, scale_bits)
        # 1 / scale, exact; finite inputs keep scale_bits <= 253 so this stays a normal float.
        inverse_scale = ((254 - scale_bits) << 23).to(tl.float32, bitcast=True)
        inverse_scale = tl.where(scale_bits == 255, float("nan"), inverse_scale)  # a NaN block stays NaN
        scaled = blocks * inverse_scale[:, :, None]
    elif SCALE == "f32":
        scale = fp8_block_scale(amax, POWER_OF_TWO)
        scaled = tl.math.div_rn(blocks, scale[:, :, None])
    else:
        # NVFP4: e4m3 block scale of (amax / 6) relative to the per-tensor decode scale.
        global_scale = tl.load(global_scale_ptr)
        block_scale = tl.math.div_rn(tl.math.div_rn(amax, 6.0), global_scale)
        block_scale = tl.clamp(block_scale, 0.015625, 448.0, propagate_nan=tl.PropagateNan.ALL)
        scale_bits = _round_to_e4m3(block_scale).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        scale_bits = tl.where(block_scale == block_scale, scale_bits, 0x7F)  # NaN as the cast writes it
        block_scale = scale_bits.to(tl.float8e4nv, bitcast=True)  # (the interpreter's fp8 casts miss NaN)
        scale = tl.where(scale_bits == 0x7F, float("nan"), block_scale.to(tl.float32) * global_scale)
        scaled = tl.math.div_rn(blocks, scale[:, :, None])

    if ELEMENT == "e4m3":
        values = encode_e4m3(tl.reshape(scaled, (BLOCK_ROWS, BLOCK_COLS)))
        tl.store(
            data_ptr + rows64[:, None] * num_cols + cols[None, :],
            values,
            mask=row_ok[:, None] & (cols < num_cols)[None, :],
        )
    else:
        scaled = tl.clamp(scaled, -6.0, 6.0, propagate_nan=tl.PropagateNan.ALL)
        codes = tl.reshape(_encode_e2m1(scaled), (BLOCK_ROWS, BLOCK_COLS // 2, 2))
        even, odd = tl.split(codes)
        packed = (even | (odd << 4)).to(tl.uint8)
        byte_cols = tl.program_id(1) * (BLOCK_COLS // 2) + tl.arange(0, BLOCK_COLS // 2)
        tl.store(
            data_ptr + rows64[:, None] * (num_cols // 2) + byte_cols[None, :],
            packed,
            mask=row_ok[:, None] & (byte_cols < num_cols // 2)[None, :],
        )

    scale_cols = tl.program_id(1) * SCALES_PER_TILE + tl.arange(0, SCALES_PER_TILE)
    if SCALE == "f32":
        num_scale_cols = tl.cdiv(num_cols, SCALE_BLOCK)  # fp8: K any, a partial last block
    else:
        num_scale_cols = num_cols // SCALE_BLOCK
    tl.store(
        scales_ptr + rows64[:, None] * num_scale_cols + scale_cols[None, :],
        scale if SCALE == "f32" else scale_bits.to(tl.uint8),
        mask=row_ok[:, None] & (scale_cols < num_scale_cols)[None, :],
    )


@triton.jit
def quantize_tiles_kernel(
    x_ptr,
    data_ptr,
    scales_ptr,
    stride_x_matrix,
    stride_x_row,
    num_rows,
    num_cols,
    POWER_OF_TWO: tl.constexpr,
    TILE_ROWS: tl.constexpr,
    TILE_COLS: tl.constexpr,
):
    """fp8 with one float32 scale per ``TILE_ROWS × TILE_COLS`` tile (the ``(128, 128)`` blocks of weights): x
    ``[num_matrices, num_rows, num_cols]`` (strides ``stride_x_matrix``, ``stride_x_row``, unit column stride) →
    ``data`` e4m3 bits ``[num_matrices, num_rows, num_cols]`` and ``scales`` float32 ``[num_matrices,
    ceil(num_rows / TILE_ROWS), ceil(num_cols / TILE_COLS)]``, both contiguous; partial last tiles hold the
    elements there are. One program per tile (grid: row tiles, column tiles, matrices), which holds its tile in
    registers between the amax and the write: one read of x.
    """
    tile_row, tile_col = tl.program_id(0), tl.program_id(1)
    matrix = tl.program_id(2).to(tl.int64)
    rows = tile_row.to(tl.int64) * TILE_ROWS + tl.arange(0, TILE_ROWS)
    cols = tile_col * TILE_COLS + tl.arange(0, TILE_COLS)
    mask = (rows < num_rows)[:, None] & (cols < num_cols)[None, :]
    x = tl.load(
        x_ptr + matrix * stride_x_matrix + rows[:, None] * stride_x_row + cols[None, :], mask=mask, other=0.0
    ).to(tl.float32)
    # max over the magnitudes' bits, so that a NaN wins (see quantize_kernel)
    amax = tl.max(tl.max(tl.abs(x).to(tl.int32, bitcast=True), axis=1), axis=0).to(tl.float32, bitcast=True)
    scale = fp8_block_scale(amax, POWER_OF_TWO)
    values = encode_e4m3(tl.math.div_rn(x, scale))
    tl.store(data_ptr + (matrix * num_rows + rows)[:, None] * num_cols + cols[None, :], values, mask=mask)
    num_tile_rows, num_tile_cols = tl.cdiv(num_rows, TILE_ROWS), tl.cdiv(num_cols, TILE_COLS)
    tl.store(scales_ptr + (matrix * num_tile_rows + tile_row) * num_tile_cols + tile_col, scale)


@triton.jit
def gather_rows_kernel(
    source_rows_ptr,
    data_ptr,
    scales_ptr,
    data_out_ptr,
    scales_out_ptr,
    num_rows,
    num_source_rows,
    data_words,
    scale_words,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_WORDS: tl.constexpr,
):
    """Rows of a quantized tensor copied: ``data_out[r] = data[source_rows[r]]`` and ``scales_out[r] =
    scales[source_rows[r]]``, indices clamped to ``[0, num_source_rows)``; the four tensors contiguous, seen as
    rows of ``data_words`` / ``scale_words`` integer words. Grid: (row blocks, word blocks of a data row); the
    programs of word block 0 also copy the scale rows (at most ``BLOCK_WORDS`` words)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_ok = rows < num_rows
    source = tl.load(source_rows_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    source = tl.minimum(tl.maximum(source, 0), num_source_rows - 1)
    words = tl.program_id(1) * BLOCK_WORDS + tl.arange(0, BLOCK_WORDS)
    mask = row_ok[:, None] & (words < data_words)[None, :]
    values = tl.load(data_ptr + source[:, None] * data_words + words[None, :], mask=mask)
    tl.store(data_out_ptr + rows[:, None] * data_words + words[None, :], values, mask=mask)
    if tl.program_id(1) == 0:
        words = tl.arange(0, BLOCK_WORDS)
        mask = row_ok[:, None] & (words < scale_words)[None, :]
        values = tl.load(scales_ptr + source[:, None] * scale_words + words[None, :], mask=mask)
        tl.store(scales_out_ptr + rows[:, None] * scale_words + words[None, :], values, mask=mask)


# ---------------------------------------------------------------------------------------------
# Operand tiles, their scales and their dequantize (shared by the matmul kernels); each scale layout's device
# addressing is its module's (formats/layouts/), passed in as constexpr functions
# ---------------------------------------------------------------------------------------------


@triton.jit
def load_operand_tile(data_ptr, row_offsets, row_mask, k_start, K, ELEMENT: tl.constexpr, BLOCK_K: tl.constexpr):
    """Raw operand tile ``[rows, BLOCK_K]`` (``[rows, BLOCK_K / 2]`` bytes for packed e2m1)."""
    if ELEMENT == "e2m1":
        cols = k_start // 2 + tl.arange(0, BLOCK_K // 2)
        col_mask = cols < K // 2
    else:
        cols = k_start + tl.arange(0, BLOCK_K)
        col_mask = cols < K
    return tl.load(data_ptr + row_offsets[:, None] + cols[None, :], mask=row_mask[:, None] & col_mask[None, :], other=0)


@triton.jit
def load_scales(
    scales_ptr,
    scale_row_base,
    row_mask,
    k_start,
    K,
    SCALE: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
    SCALE_COLS: tl.constexpr,
    SCALE_WORDS: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Scale bits ``[rows, BLOCK_K / SCALE_BLOCK]`` (uint8); 1.0 where masked. ``scale_row_base``: each row's byte
    offset of its first scale; ``SCALE_COLS``: the layout's ``scale_cols`` (a column's offset from there).

    With SCALE_WORDS (the host checked that every group of four scale columns starts 4-byte aligned:
    ``K / SCALE_BLOCK`` and ``BLOCK_K / SCALE_BLOCK`` multiples of 4, aligned base) each row's scales are
    read as int32 words, four scale columns each, and split into bytes in registers: 32-bit loads,
    which Triton's pipeliner turns into asynchronous copies staged with the data, where byte loads
    stay synchronous loads inside the K loop.
    """
    if SCALE == "e8m0":
        one_bits = 127
    else:
        one_bits = 0x38
    if SCALE_WORDS:
        NUM_WORDS: tl.constexpr = BLOCK_K // SCALE_BLOCK // 4
        first_cols = k_start // SCALE_BLOCK + 4 * tl.arange(0, NUM_WORDS)  # first scale column of each word
        offsets = scale_row_base[:, None] + SCALE_COLS(first_cols)[None, :]
        mask = row_mask[:, None] & (first_cols < K // SCALE_BLOCK)[None, :]
        words = tl.load((scales_ptr + offsets).to(tl.pointer_type(tl.int32)), mask=mask, other=one_bits * 0x01010101)
        shifts = 8 * tl.arange(0, 4)
        scale_bytes = (words[:, :, None] >> shifts[None, None, :]) & 0xFF  # little-endian: byte c is column c
        return tl.reshape(scale_bytes, (scale_row_base.shape[0], BLOCK_K // SCALE_BLOCK)).to(tl.uint8)
    else:
        scale_cols = k_start // SCALE_BLOCK + tl.arange(0, BLOCK_K // SCALE_BLOCK)
        offsets = scale_row_base[:, None] + SCALE_COLS(scale_cols)[None, :]
        mask = row_mask[:, None] & (scale_cols < K // SCALE_BLOCK)[None, :]
        return tl.load(scales_ptr + offsets, mask=mask, other=one_bits)


@triton.jit
def dequantize_tile(
    data,
    scale_bits,
    ELEMENT: tl.constexpr,
    SCALE: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    COMPUTE_DTYPE: tl.constexpr,
    PACKED_DECODE: tl.constexpr,
):
    """Raw tile → ``[ROWS, BLOCK_K]`` in COMPUTE_DTYPE. Exact: an e2m1 or e4m3 value times an e8m0 or
    e4m3 scale has at most 6 significant bits, which bf16 and fp16 hold. With PACKED_DECODE (bf16 on an
    NVIDIA GPU) e2m1 bytes are decoded and scaled in bf16 pairs by :func:`decode_e2m1_pairs_bf16`."""
    if SCALE == "none":
        values = data
    elif ELEMENT == "e2m1" and PACKED_DECODE:
        # the bytes of each scale block along a row, each with its block's scale
        data = tl.reshape(data, (ROWS, BLOCK_K // SCALE_BLOCK, SCALE_BLOCK // 2))
        scale = decode_scale(scale_bits, SCALE).to(tl.bfloat16)
        scale = tl.broadcast_to(scale[:, :, None], (ROWS, BLOCK_K // SCALE_BLOCK, SCALE_BLOCK // 2))
        even, odd = decode_e2m1_pairs_bf16(data, scale)
        values = tl.reshape(tl.join(even, odd), (ROWS, BLOCK_K))
    else:
        if ELEMENT == "e4m3":
            # Decoding through fp32 measured 1.4x faster on H200 than fp8 -> bf16 with a bf16 multiply.
            values = data.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        else:
            even = decode_e2m1(data & 0xF)
            odd = decode_e2m1(data >> 4)
            values = tl.reshape(tl.join(even, odd), (ROWS, BLOCK_K))
        scale = decode_scale(scale_bits, SCALE)
        values = tl.reshape(values, (ROWS, BLOCK_K // SCALE_BLOCK, SCALE_BLOCK)) * scale[:, :, None]
        values = tl.reshape(values, (ROWS, BLOCK_K))
    return values.to(COMPUTE_DTYPE)


@triton.jit
def upcast_rows_kernel(
    data_ptr,
    scales_ptr,
    out_ptr,
    stride_data_row,
    stride_scale_row,
    stride_out_row,
    num_rows,
    K,
    ELEMENT: tl.constexpr,
    SCALE: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
    SCALE_ROWS: tl.constexpr,
    SCALE_COLS: tl.constexpr,
    PACKED_DECODE: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """The grouped matmul's A pre-pass: quantized A ``[num_rows, K]`` (e4m3 data, or packed e2m1 bytes
    ``[num_rows, K / 2]``; scales in a layout of ungrouped rows, whose ``token_scale_rows`` and ``scale_cols`` are
    SCALE_ROWS and SCALE_COLS) → out ``[num_rows, K]`` in out's dtype, each element times its block scale (not the
    global scale: the matmul applies that). Exact in bf16/fp16 (the same decode as the fused path). One program per
    ``BLOCK_ROWS × BLOCK_K`` tile.
    """
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_mask = rows < num_rows
    k_start = tl.program_id(1) * BLOCK_K
    scale_rows, _ = SCALE_ROWS(rows, row_mask, 0, 0, scales_ptr, stride_scale_row, 0, K, SCALE_BLOCK)
    data = load_operand_tile(data_ptr, rows * stride_data_row, row_mask, k_start, K, ELEMENT, BLOCK_K)
    scale_bits = load_scales(
        scales_ptr, scale_rows, row_mask, k_start, K, SCALE, SCALE_BLOCK, SCALE_COLS, False, BLOCK_K
    )
    values = dequantize_tile(
        data, scale_bits, ELEMENT, SCALE, SCALE_BLOCK, BLOCK_ROWS, BLOCK_K, out_ptr.dtype.element_ty, PACKED_DECODE
    )
    cols = k_start + tl.arange(0, BLOCK_K)
    tl.store(
        out_ptr + rows[:, None] * stride_out_row + cols[None, :], values, mask=row_mask[:, None] & (cols < K)[None, :]
    )
