"""The decode kernel's view of GGUF blocks: groups of packed bytes read once, two value planes.

`planes(w_ptr, wh_ptr, row_off, group, lane, ok, QTYPE)` reads, for [R, G] groups of a
matrix in GGML blocks, each group's run of `PLANE_LANES[QTYPE]` consecutive packed bytes
(one vectorizable load per row and group) and its scales (one load per group, not per value),
and returns two planes of float32 weights [R, G, L] with the columns [1, G, L] they multiply:
the low and high nibbles of a byte (4- and 5-bit types, Q6_K), two of a byte's four 2-bit
values (Q2_K), or the two halves of a Q8_0 block. A group covers 2 * L columns. Weights
equal dequant_tile.py's up to float rounding order; the tests compare products within a
tolerance, the dequantizer stays the bit-exact one.

Small integers become floats by the exponent trick (OR into 2**23's bits, subtract 2**23):
two full-rate instructions instead of an int-to-float conversion, which runs at a quarter of
the FMA rate on recent GPUs and would bound a 4-bit GEMV below the memory bandwidth.
"""

from __future__ import annotations

from strata.engine.core.quant import dequant_tile as dt
from strata.engine.core.quant.dequant_tile import LUT_IQ2_XXS, LUT_KSIGNS

try:
    import triton
    import triton.language as tl
except ImportError:  # Triton is optional: without it no tensor stays quantized
    triton = None

# Packed bytes per group (the plane length L) for each GGML type with a planes path; other
# types take dequant_tile.py's generic decode kernel. Q4_K/Q5_K: a pair of 32-value
# sub-blocks per 32 bytes; the others: 16 bytes (Q6_K: 16 of a 32-byte run; Q2_K: 16 bytes
# holding four 2-bit planes, two per group; MXFP4: a block's 16 code bytes).
PLANE_LANES = {2: 16, 3: 16, 6: 16, 7: 16, 8: 16, 10: 16, 12: 32, 13: 32, 14: 16, 39: 16}

if triton is not None:
    _MAGIC = tl.constexpr(0x4B000000)  # float32 bits of 2**23

    @triton.jit
    def _float(q, offset: tl.constexpr):
        """q - offset as float32, exactly, for int32 0 <= q < 2**23."""
        return (q | _MAGIC).to(tl.float32, bitcast=True) - (8388608.0 + offset)

    @triton.jit
    def _bytes(w_ptr, offset, ok):
        return tl.load(w_ptr + offset, mask=ok, other=0).to(tl.int32)

    @triton.jit
    def _half(wh_ptr, offset, ok):
        return tl.load(wh_ptr + offset // 2, mask=ok, other=0.0).to(tl.float32)

    @triton.jit
    def _word(w_ptr, offset, ok):
        """The little-endian int32 at a 4-aligned byte offset."""
        return tl.load((w_ptr + offset).to(tl.pointer_type(tl.int32)), mask=ok, other=0)

    @triton.jit
    def _k4_scales(w_ptr, block, p, ok):
        """(d * scale, dmin * min) of sub-blocks 2p and 2p + 1 of the Q4_K/Q5_K blocks at
        `block`: d and dmin in one word, the 12 packed 6-bit scales and mins in three."""
        dm = _word(w_ptr, block, ok)
        d = (dm & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        dmin = ((dm >> 16) & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        shift = 16 * (p % 2)  # sub-block 2p's byte in each word: 2p % 4 (low), 2p - 4 (high)
        a = _word(w_ptr, block + 4, ok) >> shift  # scales 0..3 (+ top bits of 4..7's)
        b = _word(w_ptr, block + 8, ok) >> shift  # mins 0..3 (+ top bits of 4..7's)
        c = _word(w_ptr, block + 12, ok) >> shift  # low nibbles of scales and mins 4..7
        high = p >= 2
        sc0 = tl.where(high, (c & 15) | ((a >> 2) & 48), a & 63)
        mn0 = tl.where(high, ((c >> 4) & 15) | ((b >> 2) & 48), b & 63)
        sc1 = tl.where(high, ((c >> 8) & 15) | ((a >> 10) & 48), (a >> 8) & 63)
        mn1 = tl.where(high, ((c >> 12) & 15) | ((b >> 10) & 48), (b >> 8) & 63)
        return (d * _float(sc0, 0), dmin * _float(mn0, 0),
                d * _float(sc1, 0), dmin * _float(mn1, 0))

    @triton.jit
    def planes(w_ptr, wh_ptr, row_off, group, lane, ok, QTYPE: tl.constexpr):
        """(w0, cols0, w1, cols1): row_off [R, 1, 1] int64 byte offsets of the rows, group
        [1, G, 1] group indices within a row, lane [1, 1, L], ok [R, G, 1] the mask."""
        if QTYPE == 12 or QTYPE == 13:  # Q4_K, Q5_K: group = sub-blocks 2p (low), 2p+1 (high)
            blk = group // 4
            p = group % 4
            if QTYPE == 12:
                base = row_off + blk * 144
                q = _bytes(w_ptr, base + 16 + p * 32 + lane, ok)
                q0 = q & 15
                q1 = q >> 4
            else:
                base = row_off + blk * 176
                q = _bytes(w_ptr, base + 48 + p * 32 + lane, ok)
                qh = _bytes(w_ptr, base + 16 + lane, ok)
                q0 = (q & 15) | (((qh >> (2 * p)) & 1) << 4)
                q1 = (q >> 4) | (((qh >> (2 * p + 1)) & 1) << 4)
            dl0, ml0, dl1, ml1 = _k4_scales(w_ptr, base, p, ok)
            w0 = dl0 * _float(q0, 0) - ml0
            w1 = dl1 * _float(q1, 0) - ml1
            cols0 = blk * 256 + p * 64 + lane
            cols1 = cols0 + 32
        elif QTYPE == 14:  # Q6_K: group = (half h, 32-byte run c, 16-lane u); k = c and c + 2
            blk = group // 8
            r = group % 8
            h = r // 4
            c = (r // 2) % 2
            u = r % 2
            base = row_off + blk * 210
            ql = _bytes(w_ptr, base + h * 64 + c * 32 + u * 16 + lane, ok)
            qh = _bytes(w_ptr, base + 128 + h * 32 + u * 16 + lane, ok)
            q0 = (ql & 15) | (((qh >> (2 * c)) & 3) << 4)
            q1 = (ql >> 4) | (((qh >> (2 * c + 4)) & 3) << 4)
            d = _half(wh_ptr, base + 208, ok)
            sc0 = _bytes(w_ptr, base + 192 + h * 8 + c * 2 + u, ok)
            sc1 = _bytes(w_ptr, base + 196 + h * 8 + c * 2 + u, ok)
            sc0 = (sc0 - ((sc0 >> 7) << 8)).to(tl.float32)  # int8
            sc1 = (sc1 - ((sc1 >> 7) << 8)).to(tl.float32)
            w0 = (d * sc0) * _float(q0, 32)
            w1 = (d * sc1) * _float(q1, 32)
            cols0 = blk * 256 + h * 128 + c * 32 + u * 16 + lane
            cols1 = cols0 + 64
        elif QTYPE == 10:  # Q2_K: group = (half h, shift pair p, 16-byte run u)
            blk = group // 8
            r = group % 8
            h = r // 4
            p = (r // 2) % 2
            u = r % 2
            base = row_off + blk * 84
            q = _bytes(w_ptr, base + 16 + h * 32 + u * 16 + lane, ok)
            q0 = (q >> (4 * p)) & 3  # value h*128 + 32*(2p) + 16u + lane
            q1 = (q >> (4 * p + 2)) & 3  # 32 values further
            sc0 = _bytes(w_ptr, base + h * 8 + 4 * p + u, ok)  # its sub-block of 16
            sc1 = _bytes(w_ptr, base + h * 8 + 4 * p + 2 + u, ok)
            d = _half(wh_ptr, base + 80, ok)
            dmin = _half(wh_ptr, base + 82, ok)
            w0 = (d * _float(sc0 & 15, 0)) * _float(q0, 0) - dmin * _float(sc0 >> 4, 0)
            w1 = (d * _float(sc1 & 15, 0)) * _float(q1, 0) - dmin * _float(sc1 >> 4, 0)
            cols0 = blk * 256 + h * 128 + p * 64 + u * 16 + lane
            cols1 = cols0 + 32
        elif QTYPE == 39:  # MXFP4: group = block, an E8M0 exponent then 16 code bytes
            base = row_off + group * 17
            q = _bytes(w_ptr, base + 1 + lane, ok)
            scale = dt._mxfp4_half_scale(_bytes(w_ptr, base, ok))
            w0 = scale * dt._e2m1_doubled(q & 15)
            w1 = scale * dt._e2m1_doubled(q >> 4)
            cols0 = group * 32 + lane
            cols1 = cols0 + 16
        elif QTYPE == 8:  # Q8_0: group = block, the two 16-byte halves of its 32 int8
            base = row_off + group * 34
            d = _half(wh_ptr, base, ok)
            w0 = d * _float(_bytes(w_ptr, base + 2 + lane, ok) ^ 128, 128)
            w1 = d * _float(_bytes(w_ptr, base + 18 + lane, ok) ^ 128, 128)
            cols0 = group * 32 + lane
            cols1 = cols0 + 16
        else:  # Q4_0, Q4_1, Q5_0, Q5_1: group = block, low nibbles then high nibbles
            if QTYPE == 2:
                base = row_off + group * 18
                qs = base + 2
            elif QTYPE == 3:
                base = row_off + group * 20
                qs = base + 4
            elif QTYPE == 6:
                base = row_off + group * 22
                qs = base + 6
            else:
                base = row_off + group * 24
                qs = base + 8
            q = _bytes(w_ptr, qs + lane, ok)
            q0 = q & 15
            q1 = q >> 4
            if QTYPE == 6 or QTYPE == 7:  # the fifth bits: a little-endian uint32 before qs
                qh = (_bytes(w_ptr, qs - 4, ok) | (_bytes(w_ptr, qs - 3, ok) << 8)
                      | (_bytes(w_ptr, qs - 2, ok) << 16) | (_bytes(w_ptr, qs - 1, ok) << 24))
                q0 = q0 | (((qh >> lane) & 1) << 4)
                q1 = q1 | (((qh >> (lane + 16)) & 1) << 4)
            d = _half(wh_ptr, base, ok)
            if QTYPE == 2:
                w0 = d * _float(q0, 8)
                w1 = d * _float(q1, 8)
            elif QTYPE == 6:
                w0 = d * _float(q0, 16)
                w1 = d * _float(q1, 16)
            else:
                m = _half(wh_ptr, base + 2, ok)
                w0 = d * _float(q0, 0) + m
                w1 = d * _float(q1, 0) + m
            cols0 = group * 32 + lane
            cols1 = cols0 + 16
        return w0, cols0, w1, cols1


# Types whose planes need the lookup table of lookup.py (their grids and sign patterns):
# kernels that pass a table_ptr call `planes_lut`, which takes these and every planes type.
LUT_PLANE_LANES = {16: 16}  # IQ2_XXS: a group is one 32-value sub-block
ALL_PLANE_LANES = {**PLANE_LANES, **LUT_PLANE_LANES}  # what planes_lut decodes

if triton is not None:
    _LUT_KSIGNS = tl.constexpr(LUT_KSIGNS)
    _LUT_IQ2_XXS = tl.constexpr(LUT_IQ2_XXS)

    @triton.jit
    def _ushort(wh_ptr, offset, ok):
        """The little-endian uint16 at an even byte offset, as int32."""
        raw = tl.load(wh_ptr + offset // 2, mask=ok, other=0.0)
        return raw.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF

    @triton.jit
    def _iq2xxs_plane(w_ptr, table_ptr, sub, signs, db, lane, ok, HALF: tl.constexpr):
        """Values 16 * HALF + lane of the IQ2_XXS sub-block at byte offset sub: grid byte
        2 * HALF + lane // 8 names 8 grid values, sign pattern 2 * HALF + lane // 8 their
        signs; (db * grid) * sign, gguf-py's order."""
        eighth = 2 * HALF + lane // 8  # [1, 1, L]
        bit = lane % 8
        index = _bytes(w_ptr, sub + eighth, ok)
        grid = tl.load(table_ptr + (_LUT_IQ2_XXS + index * 8 + bit), mask=ok,
                       other=0).to(tl.float32)
        pattern = tl.load(table_ptr + (_LUT_KSIGNS + ((signs >> (7 * eighth)) & 127)),
                          mask=ok, other=0).to(tl.int32)  # int8: bits 0..7 are the byte's
        v = db * grid
        return tl.where(((pattern >> bit) & 1) != 0, -v, v)

    @triton.jit
    def planes_lut(w_ptr, wh_ptr, table_ptr, row_off, group, lane, ok, QTYPE: tl.constexpr):
        """`planes` for the types of LUT_PLANE_LANES too; table_ptr: lookup.lookup_table."""
        if QTYPE == 16:  # IQ2_XXS: 4 grid bytes, then 4 x 7 sign-pattern bits + a 4-bit scale
            blk = group // 8
            base = row_off + blk * 66
            sub = base + 2 + (group % 8) * 8  # [R, G, 1]
            # 66-byte blocks keep only 2-alignment: the sign word is read as two uint16.
            lo = _ushort(wh_ptr, sub + 4, ok)
            hi = _ushort(wh_ptr, sub + 6, ok)
            signs = lo | (hi << 16)  # bits 7l..7l+6: pattern of values 8l..8l+7; 28..31: scale
            db = (_half(wh_ptr, base, ok) * (0.5 + _float(hi >> 12, 0))) * 0.25
            w0 = _iq2xxs_plane(w_ptr, table_ptr, sub, signs, db, lane, ok, 0)
            w1 = _iq2xxs_plane(w_ptr, table_ptr, sub, signs, db, lane, ok, 1)
            cols0 = blk * 256 + (group % 8) * 32 + lane
            return w0, cols0, w1, cols0 + 16
        else:
            return planes(w_ptr, wh_ptr, row_off, group, lane, ok, QTYPE)
