"""One Triton function that turns a tile of GGUF blocks into float32 values.

`dequant_tile(w_ptr, wh_ptr, table_ptr, row_off, cols, ok, QTYPE)` gives W[rows, cols] for a
[rows, cols] tile of a matrix stored as GGML blocks, each row `row_bytes` of blocks laid end to
end (the file's layout, unchanged). w_ptr reads the bytes, wh_ptr the same memory as float16
(every block's fp16 fields sit at even offsets), table_ptr the IQ4 non-linear grid (int8 [16]).
Each value is computed in float32 in the order gguf-py's numpy dequantizer uses, so with
floating-point contraction off (the dequantize kernel) the result equals it bit for bit.

Layouts follow ggml's block structs (ggml-common.h): QK elements per block, fields in order:
  Q4_0 [d, qs16] 18 B, Q4_1 [d, m, qs16] 20 B, Q5_0 [d, qh4, qs16] 22 B,
  Q5_1 [d, m, qh4, qs16] 24 B, Q8_0 [d, qs32] 34 B, IQ4_NL [d, qs16] 18 B (32 values each);
  Q2_K [scales16, qs64, d, dmin] 84 B, Q3_K [hmask32, qs64, scales12, d] 110 B,
  Q4_K [d, dmin, scales12, qs128] 144 B, Q5_K [d, dmin, scales12, qh32, qs128] 176 B,
  Q6_K [ql128, qh64, scales16, d] 210 B, IQ4_XS [d, scales_h2, scales_l4, qs128] 136 B (256).
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

if triton is not None:

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
        else:  # IQ4_XS (23): 8 sub-blocks of 32, 6-bit signed scales, IQ4_NL's grid
            blk = row_off + (cols // 256) * 136
            j = cols % 256
            s = j // 32
            low = (_byte(w_ptr, blk + 4 + s // 2, ok) >> ((s % 2) * 4)) & 15
            high_word = _byte(w_ptr, blk + 2, ok) | (_byte(w_ptr, blk + 3, ok) << 8)
            sc = (low | (((high_word >> (2 * s)) & 3) << 4)) - 32
            q = _nibble32(w_ptr, blk + 8 + s * 16, j % 32, ok)
            grid = tl.load(table_ptr + q, mask=ok, other=0).to(tl.float32)
            v = (_half(wh_ptr, blk, ok) * sc.to(tl.float32)) * grid
        return v
