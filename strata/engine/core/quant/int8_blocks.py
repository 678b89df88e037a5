"""GGUF blocks as int8 tiles for integer dot products, and x quantized to int8 to meet them.

The int8 decode kernel (qdot.py) multiplies a weight's integers by x's on the tensor cores,
as llama.cpp's mmvq/mmq do with dp4a and int8 MMA: x is quantized per 32 columns to int8
with one float scale (amax / 127), each weight sub-block is unpacked to int8 by masks and
shifts (no float conversion per value), one tl.dot per 32 columns gives int32 [rows,
tokens], and the block scales (and mins) apply once per 32 columns, not per value.

`half_weights(...)` reads half of a 256-column unit of a row tile (one nibble of a K-quant
super-block, or half its blocks) as int8 [rows, 128] with the x columns each multiplies and
the scales of its G groups; `half_dot(acc, ...)` quantizes those x columns per group and adds
the products into the float32 accumulator [rows, G, tokens]. A dot's columns may be taken in
any order as long as x's are the same: the 32-value types split each block into its low and
high nibbles, so a group is half a block.

Integers become floats by the exponent trick (add to 1.5 * 2**23's bits, subtract it): two
full-rate instructions instead of a conversion that runs at a quarter of the FMA rate.
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # Triton is optional: without it no tensor stays quantized
    triton = None

# GGML types this kernel reads (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K).
INT8_TYPES = frozenset({2, 3, 6, 7, 8, 12, 13, 14})
UNIT_COLS = 256  # columns per K step: one K-quant super-block, or 8 blocks of 32

if triton is not None:
    _ROUND = tl.constexpr(12582912.0)  # 1.5 * 2**23: x + it rounds to an integer in its bits
    _ROUND_BITS = tl.constexpr(0x4B400000)

    @triton.jit
    def _to_float(d):
        """int32 d as float32, exactly, for |d| < 2**22."""
        return (d + _ROUND_BITS).to(tl.float32, bitcast=True) - _ROUND

    @triton.jit
    def _bytes(w_ptr, offset, ok):
        return tl.load(w_ptr + offset, mask=ok, other=0)

    @triton.jit
    def _half(wh_ptr, offset, ok):
        """The fp16 field at an even byte offset, as float32 [R]."""
        return tl.load(wh_ptr + offset // 2, mask=ok, other=0.0).to(tl.float32)

    @triton.jit
    def _word(w_ptr, offset, ok):
        """The little-endian int32 at a 4-aligned byte offset."""
        return tl.load((w_ptr + offset).to(tl.pointer_type(tl.int32)), mask=ok, other=0)

    @triton.jit
    def half_dot(acc, wq, x_cols, x_ok, w_scale, w_min, x_rows, tok_ok, HAS_MIN: tl.constexpr):
        """acc [R, G, M] plus one half unit's products: wq [R, 128] int8 weights whose column
        i multiplies x column x_cols[i] ([128, 1]); consecutive runs of 128 // G columns form
        G groups, each with one weight scale (and min) per row, w_scale [R, G], and one x
        scale per token. x is quantized per group and laid out block-diagonally, [128, G * M]
        (group g's values in columns g * M..g * M + M - 1, zeros elsewhere), so ONE tl.dot
        gives every group's integer dot [R, G, M]: no per-group dots, no slicing."""
        R: tl.constexpr = acc.shape[0]
        G: tl.constexpr = acc.shape[1]
        M: tl.constexpr = acc.shape[2]
        GS: tl.constexpr = 128 // G
        x = tl.load(x_rows + x_cols, mask=tok_ok & x_ok, other=0.0).to(tl.float32)  # [128, M]
        x3 = tl.reshape(x, (G, GS, M))
        amax = tl.max(tl.abs(x3), axis=1)  # [G, M]
        inv = 127.0 / tl.maximum(amax, 1e-30)  # a zero group rounds to zeros
        q3 = ((x3 * inv[:, None, :] + _ROUND).to(tl.int32, bitcast=True) - _ROUND_BITS)
        q3 = q3.to(tl.int8)
        g = tl.arange(0, G)
        diagonal = tl.where(g[:, None, None, None] == g[None, None, :, None], q3[:, :, None, :],
                            tl.zeros((1, 1, 1, 1), tl.int8))  # [G, GS, G, M]
        xd = tl.reshape(diagonal, (128, G * M))
        d = tl.reshape(tl.dot(wq, xd, out_dtype=tl.int32), (R, G, M))
        acc += _to_float(d) * (w_scale[:, :, None] * (amax * (1.0 / 127.0))[None, :, :])
        if HAS_MIN:
            acc += w_min[:, :, None] * tl.sum(x3, axis=1)[None, :, :]
        return acc

    @triton.jit
    def _k4_scale_min(w_ptr, scales, s, ok):
        """Sub-block s's 6-bit scale and min of a Q4_K/Q5_K block (12 packed bytes)."""
        low = s < 4
        a = _bytes(w_ptr, scales + s, ok).to(tl.int32)
        b = _bytes(w_ptr, scales + s + 4, ok).to(tl.int32)
        c = _bytes(w_ptr, scales + tl.where(low, s, s - 4), ok).to(tl.int32)
        sc = tl.where(low, a & 63, (b & 15) | ((c >> 6) << 4))
        mn = tl.where(low, b & 63, (b >> 4) | ((a >> 6) << 4))
        return sc.to(tl.float32), mn.to(tl.float32)

    @triton.jit
    def half_weights(w_ptr, wh_ptr, row_off, unit, row_ok, h: tl.constexpr, K, G: tl.constexpr,
                     QTYPE: tl.constexpr):
        """Half h of a 256-column unit: (wq [R, 128] int8, x_cols [128, 1], x_ok [128, 1],
        w_scale [R, G], w_min [R, G]) in half_dot's layout."""
        i = tl.arange(0, 128)
        gi = tl.arange(0, G)[None, :]  # [1, G]
        if QTYPE == 12 or QTYPE == 13:  # Q4_K, Q5_K: h = nibble; byte i of qs, sub-block
            # 2 * (i // 32) + h; groups of 32 (G = 4)
            if QTYPE == 12:
                base = row_off + unit * 144
                q = _bytes(w_ptr, base + 16 + i[None, :], row_ok)
            else:
                base = row_off + unit * 176
                q = _bytes(w_ptr, base + 48 + i[None, :], row_ok)
            q = (q >> (4 * h)) & 15
            if QTYPE == 13:
                qh = _bytes(w_ptr, base + 16 + (i % 32)[None, :], row_ok)
                q = q | (((qh >> (2 * (i // 32) + h)[None, :]) & 1) << 4)
            wq = q.to(tl.int8)
            x_cols = (unit * 256 + (i // 32) * 64 + h * 32 + i % 32)[:, None]
            x_ok = x_cols >= 0
            d = _half(wh_ptr, base, row_ok)
            dmin = _half(wh_ptr, base + 2, row_ok)
            sc, mn = _k4_scale_min(w_ptr, base + 4, 2 * gi + h, row_ok)
            w_scale = d * sc
            w_min = -(dmin * mn)
        elif QTYPE == 14:  # Q6_K: h = nibble (k // 2); ql byte i = (hh, k % 2, l); groups of 16
            base = row_off + unit * 210
            hh = i // 64
            k = 2 * h + (i // 32) % 2
            ql = _bytes(w_ptr, base + i[None, :], row_ok)
            qh = _bytes(w_ptr, base + 128 + (hh * 32 + i % 32)[None, :], row_ok)
            q = ((ql >> (4 * h)) & 15) | (((qh >> (2 * k)[None, :]) & 3) << 4)
            wq = (q.to(tl.int8) - 32).to(tl.int8)
            x_cols = (unit * 256 + hh * 128 + k * 32 + i % 32)[:, None]
            x_ok = x_cols >= 0
            g_hh = gi // 4
            g_k = 2 * h + (gi // 2) % 2
            sc = _bytes(w_ptr, base + 192 + g_hh * 8 + g_k * 2 + gi % 2, row_ok)
            w_scale = _half(wh_ptr, base + 208, row_ok) * sc.to(tl.int8, bitcast=True).to(
                tl.float32)
            w_min = w_scale
        elif QTYPE == 8:  # Q8_0: half h = blocks 4h..4h + 3 of the unit's 8; groups of 32
            block = unit * 8 + 4 * h + i // 32
            ok = row_ok & (block < K // 32)[None, :]
            wq = _bytes(w_ptr, row_off + block[None, :] * 34 + 2 + (i % 32)[None, :], ok)
            wq = wq.to(tl.int8, bitcast=True)
            x_cols = (block * 32 + i % 32)[:, None]
            x_ok = x_cols < K
            g_block = unit * 8 + 4 * h + gi
            w_scale = _half(wh_ptr, row_off + g_block * 34, row_ok & (g_block < K // 32))
            w_min = w_scale
        else:  # Q4_0, Q4_1, Q5_0, Q5_1: h = nibble; i = (block b, byte l); groups of 16 (a block)
            block = unit * 8 + i // 16
            ok = row_ok & (block < K // 32)[None, :]
            g_block = unit * 8 + gi
            g_ok = row_ok & (g_block < K // 32)
            if QTYPE == 2:
                g_base = row_off + g_block * 18
                qs = row_off + block[None, :] * 18 + 2
            elif QTYPE == 3:
                g_base = row_off + g_block * 20
                qs = row_off + block[None, :] * 20 + 4
            elif QTYPE == 6:
                g_base = row_off + g_block * 22
                qs = row_off + block[None, :] * 22 + 6
            else:
                g_base = row_off + g_block * 24
                qs = row_off + block[None, :] * 24 + 8
            lane = (i % 16)[None, :]
            q = (_bytes(w_ptr, qs + lane, ok) >> (4 * h)) & 15
            if QTYPE == 6 or QTYPE == 7:  # the fifth bit of value j: bit j of qh (before qs)
                j = lane + 16 * h
                qh = _bytes(w_ptr, qs - 4 + j // 8, ok)
                q = q | (((qh >> (j % 8)) & 1) << 4)
            q = q.to(tl.int8)
            if QTYPE == 2:
                q = (q - 8).to(tl.int8)
            elif QTYPE == 6:
                q = (q - 16).to(tl.int8)
            wq = q
            x_cols = (block * 32 + 16 * h + i % 16)[:, None]
            x_ok = x_cols < K
            w_scale = _half(wh_ptr, g_base, g_ok)
            if QTYPE == 3 or QTYPE == 7:  # noqa: SIM108 - a constexpr branch for Triton
                w_min = _half(wh_ptr, g_base + 2, g_ok)
            else:
                w_min = w_scale
        return wq, x_cols, x_ok, w_scale, w_min
