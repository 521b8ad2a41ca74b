"""Triton kernels for the block-scaled formats: quantize, and the element/scale decoders that the
matmul kernels share."""
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
    else:
        return bits.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)


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
def quantize_kernel(
    x_ptr, data_ptr, scales_ptr, global_scale_ptr, source_rows_ptr,
    stride_x_row, num_rows, num_x_rows, num_cols,
    ELEMENT: tl.constexpr, SCALE: tl.constexpr, SCALE_BLOCK: tl.constexpr, EMAX: tl.constexpr,
    GATHER: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr,
):
    """Quantizes ``num_rows`` rows of x ``[num_x_rows, num_cols]`` (row stride ``stride_x_row``, unit
    column stride): row r of the output is x's row r, or with GATHER x's row ``source_rows[r]``
    (int64 ``[num_rows]``, clamped to x), so that a permutation costs no extra pass over x.

    Writes ``data`` ``[num_rows, num_cols]`` e4m3 or ``[num_rows, num_cols / 2]`` packed e2m1, and
    row-major ``scales`` ``[num_rows, num_cols / SCALE_BLOCK]`` (uint8 bits). One program per
    ``BLOCK_ROWS × BLOCK_COLS`` tile.
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
    x = tl.load(x_ptr + x_rows[:, None] * stride_x_row + cols[None, :],
                mask=row_ok[:, None] & (cols < num_cols)[None, :], other=0.0).to(tl.float32)
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
        scaled = tl.clamp(scaled, -448.0, 448.0, propagate_nan=tl.PropagateNan.ALL)
        scaled = tl.reshape(scaled, (BLOCK_ROWS, BLOCK_COLS))
        values = _round_to_e4m3(scaled).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        values = tl.where(scaled == scaled, values, 0x7F)  # NaN as the cast writes it (not every backend does)
        tl.store(data_ptr + rows64[:, None] * num_cols + cols[None, :], values,
                 mask=row_ok[:, None] & (cols < num_cols)[None, :])
    else:
        scaled = tl.clamp(scaled, -6.0, 6.0, propagate_nan=tl.PropagateNan.ALL)
        codes = tl.reshape(_encode_e2m1(scaled), (BLOCK_ROWS, BLOCK_COLS // 2, 2))
        even, odd = tl.split(codes)
        packed = (even | (odd << 4)).to(tl.uint8)
        byte_cols = tl.program_id(1) * (BLOCK_COLS // 2) + tl.arange(0, BLOCK_COLS // 2)
        tl.store(data_ptr + rows64[:, None] * (num_cols // 2) + byte_cols[None, :], packed,
                 mask=row_ok[:, None] & (byte_cols < num_cols // 2)[None, :])

    scale_cols = tl.program_id(1) * SCALES_PER_TILE + tl.arange(0, SCALES_PER_TILE)
    num_scale_cols = num_cols // SCALE_BLOCK
    tl.store(scales_ptr + rows64[:, None] * num_scale_cols + scale_cols[None, :], scale_bits.to(tl.uint8),
             mask=row_ok[:, None] & (scale_cols < num_scale_cols)[None, :])
