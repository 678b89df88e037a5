"""One Triton function that turns a tile of GGUF blocks into float32 values.

`dequant_tile(w_ptr, wh_ptr, table_ptr, row_off, cols, ok, QTYPE)` gives W[rows, cols] for a
[rows, cols] tile of a matrix stored as GGML blocks, each row `row_bytes` of blocks laid end to
end (the file's layout, unchanged). w_ptr reads the bytes, wh_ptr the same memory as float16
(every block's fp16 fields sit at even offsets), table_ptr the lookup table of lookup.py (int8:
IQ4 levels, sign patterns and the I-quant grids at the LUT_* offsets below).
Each value is computed in float32 in the order gguf-py's numpy dequantizer uses, so with
floating-point contraction off (the dequantize kernel) the result equals it bit for bit.

Layouts follow ggml's block structs (ggml-common.h): QK elements per block, fields in order:
  Q4_0 [d, qs16] 18 B, Q4_1 [d, m, qs16] 20 B, Q5_0 [d, qh4, qs16] 22 B,
  Q5_1 [d, m, qh4, qs16] 24 B, Q8_0 [d, qs32] 34 B, IQ4_NL [d, qs16] 18 B,
  MXFP4 [e8m0 exponent, qs16] 17 B (32 values each: its blocks sit at odd offsets, read
  byte by byte; it has no fp16 field);
  Q2_K [scales16, qs64, d, dmin] 84 B, Q3_K [hmask32, qs64, scales12, d] 110 B,
  Q4_K [d, dmin, scales12, qs128] 144 B, Q5_K [d, dmin, scales12, qh32, qs128] 176 B,
  Q6_K [ql128, qh64, scales16, d] 210 B, IQ4_XS [d, scales_h2, scales_l4, qs128] 136 B,
  IQ2_XXS [d, qs64] 66 B, IQ2_XS [d, qs64, scales8] 74 B, IQ2_S [d, qs32, signs32, qh8,
  scales8] 82 B, IQ3_XXS [d, qs64, scales_signs32] 98 B, IQ3_S [d, qs64, qh8, signs32,
  scales4] 110 B, IQ1_S [d, qs32, qh16] 50 B, IQ1_M [qs32, qh16, scales8 (d in their top
  nibbles)] 56 B (256 values each).
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # Triton is optional: without it no tensor stays quantized
    triton = None

# GGMLQuantizationType values, as the kernels' QTYPE constexpr.
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = 2, 3, 6, 7, 8
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K = 10, 11, 12, 13, 14
IQ4_NL, IQ4_XS = 20, 23
MXFP4 = 39
IQ2_XXS, IQ2_XS, IQ3_XXS, IQ1_S, IQ3_S, IQ2_S, IQ1_M = 16, 17, 18, 19, 21, 22, 29

# Offsets into the lookup table (lookup.py builds it; int8 entries).
LUT_IQ4 = 0  # 16 levels
LUT_KSIGNS = 16  # 128 sign patterns (bytes: mask with 255)
LUT_IQ2_XXS = 144  # 256 x 8
LUT_IQ2_XS = 2192  # 512 x 8
LUT_IQ2_S = 6288  # 1024 x 8
LUT_IQ3_XXS = 14480  # 256 x 4
LUT_IQ3_S = 15504  # 512 x 4
LUT_IQ1_S = 17552  # 2048 x 8, shared by IQ1_M
LUT_SIZE = 33936
IQ1_DELTA = 0.125

if triton is not None:
    # Globals a jitted function reads must be constexpr.
    _KSIGNS = tl.constexpr(LUT_KSIGNS)
    _GRID_IQ2_XXS = tl.constexpr(LUT_IQ2_XXS)
    _GRID_IQ2_XS = tl.constexpr(LUT_IQ2_XS)
    _GRID_IQ2_S = tl.constexpr(LUT_IQ2_S)
    _GRID_IQ3_XXS = tl.constexpr(LUT_IQ3_XXS)
    _GRID_IQ3_S = tl.constexpr(LUT_IQ3_S)
    _GRID_IQ1_S = tl.constexpr(LUT_IQ1_S)
    _DELTA = tl.constexpr(IQ1_DELTA)

    @triton.jit
    def _byte(w_ptr, offset, ok):
        return tl.load(w_ptr + offset, mask=ok, other=0).to(tl.int32)

    @triton.jit
    def _half(wh_ptr, offset, ok):
        """The fp16 field at an even byte offset, as float32."""
        return tl.load(wh_ptr + offset // 2, mask=ok, other=0.0).to(tl.float32)

    @triton.jit
    def _signed(byte):
        return byte - ((byte >> 7) << 8)  # uint8 -> int8 value

    @triton.jit
    def _nibble32(w_ptr, qs, j, ok):
        """Value j of a 32-value block's 16 packed bytes: low nibbles first, then high."""
        return (_byte(w_ptr, qs + (j % 16), ok) >> ((j // 16) * 4)) & 15

    @triton.jit
    def _lut(table_ptr, index, ok):
        return tl.load(table_ptr + index, mask=ok, other=0).to(tl.int32)

    @triton.jit
    def _sign(flag):
        """-1.0 where a sign bit is set, else 1.0."""
        return tl.where(flag != 0, -1.0, 1.0)

    @triton.jit
    def _ksign_bit(w_ptr, table_ptr, packed, l, j, ok):  # noqa: E741 - l: the paper-style index
        """Value j's sign bit from the l-th 7-bit pattern index packed in the 4 bytes at
        `packed` (IQ2_XXS, IQ3_XXS); the two bytes holding bits 7l..7l+6 are read."""
        bit = 7 * l
        word = _byte(w_ptr, packed + bit // 8, ok) | (_byte(w_ptr, packed + bit // 8 + 1, ok) << 8)
        pattern = _lut(table_ptr, _KSIGNS + ((word >> (bit % 8)) & 127), ok) & 255
        return (pattern >> (j % 8)) & 1

    @triton.jit
    def _iquant(w_ptr, wh_ptr, table_ptr, row_off, cols, ok, QTYPE: tl.constexpr):
        """The 256-value I-quants, each in gguf-py's order of float operations."""
        j = cols % 256
        e = j % 8
        if QTYPE == 16:  # IQ2_XXS: per 32 values 4 grid bytes, then 4 x 7 sign bits + scale
            blk = row_off + (cols // 256) * 66
            sub = blk + 2 + (j // 32) * 8
            grid = _lut(table_ptr, _GRID_IQ2_XXS + _byte(w_ptr, sub + (j % 32) // 8, ok) * 8 + e, ok)
            scale = _byte(w_ptr, sub + 7, ok) >> 4
            db = (_half(wh_ptr, blk, ok) * (0.5 + scale.to(tl.float32))) * 0.25
            sign = _ksign_bit(w_ptr, table_ptr, sub + 4, (j % 32) // 8, j, ok)
            v = (db * grid.to(tl.float32)) * _sign(sign)
        elif QTYPE == 17:  # IQ2_XS: uint16 per 8 values (9-bit grid, 7-bit signs), 4-bit scales
            blk = row_off + (cols // 256) * 74
            q_at = blk + 2 + (j // 8) * 2
            q = _byte(w_ptr, q_at, ok) | (_byte(w_ptr, q_at + 1, ok) << 8)
            grid = _lut(table_ptr, _GRID_IQ2_XS + (q & 511) * 8 + e, ok)
            pattern = _lut(table_ptr, _KSIGNS + (q >> 9), ok) & 255
            scale = (_byte(w_ptr, blk + 66 + j // 32, ok) >> (((j // 16) % 2) * 4)) & 15
            db = (_half(wh_ptr, blk, ok) * (0.5 + scale.to(tl.float32))) * 0.25
            v = (db * grid.to(tl.float32)) * _sign((pattern >> e) & 1)
        elif QTYPE == 22:  # IQ2_S: 10-bit grid index (qs + 2 bits of qh), explicit sign bits
            blk = row_off + (cols // 256) * 82
            g = j // 8
            high = (_byte(w_ptr, blk + 66 + g // 4, ok) >> ((g % 4) * 2)) & 3
            index = _byte(w_ptr, blk + 2 + g, ok) | (high << 8)
            grid = _lut(table_ptr, _GRID_IQ2_S + index * 8 + e, ok)
            sign = (_byte(w_ptr, blk + 34 + g, ok) >> e) & 1
            scale = (_byte(w_ptr, blk + 74 + j // 32, ok) >> (((j // 16) % 2) * 4)) & 15
            db = (_half(wh_ptr, blk, ok) * (0.5 + scale.to(tl.float32))) * 0.25
            v = (db * grid.to(tl.float32)) * _sign(sign)
        elif QTYPE == 18:  # IQ3_XXS: a grid byte per 4 values; per 32, signs + scale in 4 bytes
            blk = row_off + (cols // 256) * 98
            grid = _lut(table_ptr, _GRID_IQ3_XXS + _byte(w_ptr, blk + 2 + j // 4, ok) * 4 + j % 4,
                        ok)
            packed = blk + 66 + (j // 32) * 4
            scale = _byte(w_ptr, packed + 3, ok) >> 4
            db = (_half(wh_ptr, blk, ok) * (0.5 + scale.to(tl.float32))) * 0.5
            sign = _ksign_bit(w_ptr, table_ptr, packed, (j % 32) // 8, j, ok)
            v = (db * grid.to(tl.float32)) * _sign(sign)
        elif QTYPE == 21:  # IQ3_S: 9-bit grid index per 4 values, sign bits, odd scales
            blk = row_off + (cols // 256) * 110
            g = j // 4
            high = (_byte(w_ptr, blk + 66 + g // 8, ok) >> (g % 8)) & 1
            index = _byte(w_ptr, blk + 2 + g, ok) | (high << 8)
            grid = _lut(table_ptr, _GRID_IQ3_S + index * 4 + j % 4, ok)
            sign = (_byte(w_ptr, blk + 74 + j // 8, ok) >> e) & 1
            scale = (_byte(w_ptr, blk + 106 + j // 64, ok) >> (((j // 32) % 2) * 4)) & 15
            db = _half(wh_ptr, blk, ok) * (1 + 2 * scale).to(tl.float32)
            v = (db * grid.to(tl.float32)) * _sign(sign)
        elif QTYPE == 19:  # IQ1_S: 11-bit grid index of {-1, 0, 1}, a shared +-delta per 32
            blk = row_off + (cols // 256) * 50
            qh_at = blk + 34 + (j // 32) * 2
            qh = _byte(w_ptr, qh_at, ok) | (_byte(w_ptr, qh_at + 1, ok) << 8)
            dl = _half(wh_ptr, blk, ok) * (2 * ((qh >> 12) & 7) + 1).to(tl.float32)
            delta = tl.where((qh & 0x8000) != 0, -_DELTA, _DELTA)
            g = j // 8
            index = _byte(w_ptr, blk + 2 + g, ok) | (((qh >> ((g % 4) * 3)) & 7) << 8)
            grid = _lut(table_ptr, _GRID_IQ1_S + index * 8 + e, ok)
            v = dl * (grid.to(tl.float32) + delta)
        else:  # IQ1_M (29): IQ1_S's grid, 3-bit scales per 16, d split over 4 nibbles
            blk = row_off + (cols // 256) * 56
            sc = blk + 48
            bits = (((_byte(w_ptr, sc + 1, ok) >> 4)) | ((_byte(w_ptr, sc + 3, ok) >> 4) << 4)
                    | ((_byte(w_ptr, sc + 5, ok) >> 4) << 8) | ((_byte(w_ptr, sc + 7, ok) >> 4) << 12))
            d = bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
            s = j // 16
            word_at = sc + (s // 4) * 2
            word = _byte(w_ptr, word_at, ok) | (_byte(w_ptr, word_at + 1, ok) << 8)
            dl = d * (2 * ((word >> ((s % 4) * 3)) & 7) + 1).to(tl.float32)
            g = j // 8
            qh = (_byte(w_ptr, blk + 32 + g // 2, ok) >> ((g % 2) * 4)) & 15
            index = _byte(w_ptr, blk + g, ok) | ((qh & 7) << 8)
            grid = _lut(table_ptr, _GRID_IQ1_S + index * 8 + e, ok)
            delta = tl.where((qh & 8) != 0, -_DELTA, _DELTA)
            v = dl * (grid.to(tl.float32) + delta)
        return v

    @triton.jit
    def _mxfp4_half_scale(e):
        """Half of 2**(e - 127) as float32 (ggml's e8m0_to_fp32_half): the codes below are
        doubled so that every E2M1 value is an integer; e < 2 gives subnormals."""
        bits = tl.where(e < 2, 0x00200000 << e, (e - 1) << 23)
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def _e2m1_doubled(q):
        """Twice an E2M1 code's value as float32: 0, 1, 2, 3, 4, 6, 8, 12, and the negatives
        for codes 8..15 (ggml's kvalues_mxfp4). The magnitudes are the nibbles of 0xC8643210
        (3 integer ops), written as an int32: Triton takes no larger literal, and the mask
        undoes the sign the shift brings in. The float by the exponent trick (or into
        2**23's bits, subtract 2**23: no int-to-float conversion, which runs at a quarter
        of the FMA rate), the sign bit or-ed in."""
        magnitude = (-0x379BCDF0 >> ((q & 7) * 4)) & 15
        value = (magnitude | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
        return (value.to(tl.int32, bitcast=True) | ((q & 8) << 28)).to(tl.float32,
                                                                        bitcast=True)

    @triton.jit
    def _k4_scale_min(w_ptr, scales, s, ok):
        """Sub-block s's 6-bit scale and min of a Q4_K/Q5_K block (12 packed bytes)."""
        low = s < 4
        a = _byte(w_ptr, scales + s, ok)
        b = _byte(w_ptr, scales + s + 4, ok)
        c = _byte(w_ptr, scales + tl.where(low, s, s - 4), ok)
        sc = tl.where(low, a & 63, (b & 15) | ((c >> 6) << 4))
        mn = tl.where(low, b & 63, (b >> 4) | ((a >> 6) << 4))
        return sc, mn

    @triton.jit
    def dequant_tile(w_ptr, wh_ptr, table_ptr, row_off, cols, ok, QTYPE: tl.constexpr):
        """float32 values of a tile; row_off [R, 1] int64 byte offsets of the rows, cols
        [1, C] column indices, ok [R, C] the mask."""
        if QTYPE == 8:  # Q8_0
            blk = row_off + (cols // 32) * 34
            d = _half(wh_ptr, blk, ok)
            q = _signed(_byte(w_ptr, blk + 2 + cols % 32, ok))
            v = q.to(tl.float32) * d
        elif QTYPE == 2:  # Q4_0
            blk = row_off + (cols // 32) * 18
            q = _nibble32(w_ptr, blk + 2, cols % 32, ok)
            v = _half(wh_ptr, blk, ok) * (q - 8).to(tl.float32)
        elif QTYPE == 3:  # Q4_1
            blk = row_off + (cols // 32) * 20
            q = _nibble32(w_ptr, blk + 4, cols % 32, ok)
            v = _half(wh_ptr, blk, ok) * q.to(tl.float32) + _half(wh_ptr, blk + 2, ok)
        elif QTYPE == 6 or QTYPE == 7:  # Q5_0, Q5_1: a fifth bit from the 32-bit qh
            j = cols % 32
            if QTYPE == 6:
                blk = row_off + (cols // 32) * 22
                qh = blk + 2
            else:
                blk = row_off + (cols // 32) * 24
                qh = blk + 4
            high = (_byte(w_ptr, qh + j // 8, ok) >> (j % 8)) & 1
            q = _nibble32(w_ptr, qh + 4, j, ok) | (high << 4)
            d = _half(wh_ptr, blk, ok)
            if QTYPE == 6:
                v = d * (q - 16).to(tl.float32)
            else:
                v = d * q.to(tl.float32) + _half(wh_ptr, blk + 2, ok)
        elif QTYPE == 20:  # IQ4_NL: Q4_0's layout, values from a non-linear grid
            blk = row_off + (cols // 32) * 18
            q = _nibble32(w_ptr, blk + 2, cols % 32, ok)
            grid = tl.load(table_ptr + q, mask=ok, other=0).to(tl.float32)
            v = _half(wh_ptr, blk, ok) * grid
        elif QTYPE == 39:  # MXFP4: E2M1 codes in Q4_0's nibble order, an E8M0 exponent
            blk = row_off + (cols // 32) * 17
            v = _mxfp4_half_scale(_byte(w_ptr, blk, ok)) * _e2m1_doubled(
                _nibble32(w_ptr, blk + 1, cols % 32, ok))
        elif QTYPE == 12 or QTYPE == 13:  # Q4_K, Q5_K: 8 sub-blocks of 32, 6-bit scale/min
            j = cols % 256
            s = j // 32
            if QTYPE == 12:
                blk = row_off + (cols // 256) * 144
                qs = blk + 16
            else:
                blk = row_off + (cols // 256) * 176
                qs = blk + 48
            sc, mn = _k4_scale_min(w_ptr, blk + 4, s, ok)
            q = (_byte(w_ptr, qs + (s // 2) * 32 + j % 32, ok) >> ((s % 2) * 4)) & 15
            if QTYPE == 13:
                q = q | (((_byte(w_ptr, blk + 16 + j % 32, ok) >> s) & 1) << 4)
            dl = _half(wh_ptr, blk, ok) * sc.to(tl.float32)
            ml = _half(wh_ptr, blk + 2, ok) * mn.to(tl.float32)
            v = dl * q.to(tl.float32) - ml
        elif QTYPE == 14:  # Q6_K: 16 sub-blocks of 16, int8 scales, 4 + 2 bits
            blk = row_off + (cols // 256) * 210
            j = cols % 256
            half = j // 128
            k = (j % 128) // 32
            lane = j % 32
            low = (_byte(w_ptr, blk + half * 64 + (k % 2) * 32 + lane, ok) >> ((k // 2) * 4)) & 15
            high = (_byte(w_ptr, blk + 128 + half * 32 + lane, ok) >> (k * 2)) & 3
            q = (low | (high << 4)) - 32
            sc = _signed(_byte(w_ptr, blk + 192 + j // 16, ok))
            v = (_half(wh_ptr, blk + 208, ok) * sc.to(tl.float32)) * q.to(tl.float32)
        elif QTYPE == 10:  # Q2_K: 16 sub-blocks of 16, 4-bit scale and min, 2 bits
            blk = row_off + (cols // 256) * 84
            j = cols % 256
            packed = _byte(w_ptr, blk + j // 16, ok)
            q = (_byte(w_ptr, blk + 16 + (j // 128) * 32 + j % 32, ok) >> (((j % 128) // 32) * 2)) & 3
            dl = _half(wh_ptr, blk + 80, ok) * (packed & 15).to(tl.float32)
            ml = _half(wh_ptr, blk + 82, ok) * (packed >> 4).to(tl.float32)
            v = dl * q.to(tl.float32) - ml
        elif QTYPE == 11:  # Q3_K: 16 sub-blocks of 16, 6-bit signed scales, 2 + 1 bits
            blk = row_off + (cols // 256) * 110
            j = cols % 256
            s = j // 16
            low = (_byte(w_ptr, blk + 96 + s % 8, ok) >> ((s // 8) * 4)) & 15
            high = (_byte(w_ptr, blk + 104 + s % 4, ok) >> ((s // 4) * 2)) & 3
            sc = (low | (high << 4)) - 32
            q = (_byte(w_ptr, blk + 32 + (j // 128) * 32 + j % 32, ok) >> (((j % 128) // 32) * 2)) & 3
            hbit = (_byte(w_ptr, blk + j % 32, ok) >> (j // 32)) & 1
            q = q - ((1 - hbit) << 2)  # a clear mask bit subtracts 4
            v = (_half(wh_ptr, blk + 108, ok) * sc.to(tl.float32)) * q.to(tl.float32)
        elif QTYPE == 23:  # IQ4_XS: 8 sub-blocks of 32, 6-bit signed scales, IQ4_NL's grid
            blk = row_off + (cols // 256) * 136
            j = cols % 256
            s = j // 32
            low = (_byte(w_ptr, blk + 4 + s // 2, ok) >> ((s % 2) * 4)) & 15
            high_word = _byte(w_ptr, blk + 2, ok) | (_byte(w_ptr, blk + 3, ok) << 8)
            sc = (low | (((high_word >> (2 * s)) & 3) << 4)) - 32
            q = _nibble32(w_ptr, blk + 8 + s * 16, j % 32, ok)
            grid = tl.load(table_ptr + q, mask=ok, other=0).to(tl.float32)
            v = (_half(wh_ptr, blk, ok) * sc.to(tl.float32)) * grid
        else:
            v = _iquant(w_ptr, wh_ptr, table_ptr, row_off, cols, ok, QTYPE)
        return v
