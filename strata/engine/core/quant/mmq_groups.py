"""GGML blocks as int8 groups of 32 values for int8 tensor-core products (expert_mmq.py).

`pair_dot(xq0, xd0, xs0, xq1, xd1, xs1, w_ptr, wh_ptr, w_row, n_ok, pair, num_groups,
QTYPE)` -> float32 [BM, BN]: two consecutive groups of 32 values (2 * pair, 2 * pair + 1)
of the weight rows at byte offsets w_row [BN, 1], times x's rows rounded to int8 (xq
[BM, 32] int8 in `x_columns(QTYPE)` order, scale xd [BM, 1], xs = xd * sum(xq) [BM, 1], as
gemv_dp4a.round_groups rounds them). Each group is decoded in registers to int8 values q
[BN, 32] with a scale and, where the type has one, an offset per group and row: w = scale *
q + offset. Then

    x . w = xd * scale * (xq . q) + offset * xs,

with xq . q one int8 `tl.dot` [BM, 32] x [32, BN] -> int32 (llama.cpp's MMQ idea: the
activations as q8_1, the weights never dequantized to floats). Per type:

- Q8_0 (34 bytes): q the int8 values, scale d.
- Q4_0 / Q5_0 (18 / 22 bytes): q = nibble (| fifth bit << 4) - 8 (16), scale d: signed, no
  offset. Q4_1 / Q5_1 (20 / 24): q the unsigned value, scale d, offset m. Each of the 16
  bytes is read once and its two nibbles (values j and 16 + j) lie side by side in the
  tile; x's group is read in that order (`x_columns`). qh is read as one word.
- Q4_K / Q5_K (144 / 176 bytes a 256-value block): a pair is sub-blocks 2p (low nibbles)
  and 2p + 1 (high) of one 32-byte run, read once; scale d * sc, offset -dmin * m.
- Q6_K (210 bytes): q = 6-bit value - 32; its scales change every 16 values, so a group is
  two products of the same int8 tile, each with the other half's x zeroed.

Bytes are read one a value or one a pair of nibbles; the tile's loads are masked per weight
row (n_ok) and per group (a 32-value type's last pair may have one group).
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl

    from strata.engine.core.quant.gemv_planes import _k4_scales
except ImportError:  # Triton is optional: without it no tensor stays quantized
    triton = None

# Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K
MMQ_TYPES = frozenset({2, 3, 6, 7, 8, 12, 13, 14})
NIBBLE_TYPES = frozenset({2, 3, 6, 7})  # Q4_0, Q4_1, Q5_0, Q5_1: x read interleaved

if triton is not None:

    @triton.jit
    def _bytes(w_ptr, offset, ok):
        return tl.load(w_ptr + offset, mask=ok, other=0).to(tl.int32)

    @triton.jit
    def _half(wh_ptr, offset, ok):
        """The fp16 at an even byte offset, as float32 (0 where masked)."""
        return tl.load(wh_ptr + offset // 2, mask=ok, other=0.0).to(tl.float32)

    @triton.jit
    def _u16(wh_ptr, offset, ok):
        """The uint16 at an even byte offset (of the fp16 view) as int32: [BN, 1]."""
        half = tl.load(wh_ptr + offset // 2, mask=ok, other=0.0)
        return half.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF

    @triton.jit
    def x_columns(QTYPE: tl.constexpr):
        """[1, 32]: the order in which a group's 32 x values meet the weights' int8 tile:
        as stored, or for the 32-value nibble types (Q4_0, Q4_1, Q5_0, Q5_1) 0, 16, 1, 17,
        .. (a byte's two nibbles side by side: no reordering of the decoded weights)."""
        lane = tl.arange(0, 32)[None, :]
        if QTYPE == 2 or QTYPE == 3 or QTYPE == 6 or QTYPE == 7:
            return (lane >> 1) + 16 * (lane & 1)
        else:
            return lane

    @triton.jit
    def group_ok(ok, g, num_groups):
        """ok [R, 1] where group g < num_groups: as a [1, 1] block, since Triton 3.9's
        interpreter refuses a mask made of a block and a scalar bool."""
        return ok & ((tl.zeros((1, 1), dtype=tl.int32) + g) < num_groups)

    @triton.jit
    def _dot(xq, q):
        """xq [BM, 32] int8 . q [BN, 32] (int32 holding -128..127) -> float32 [BM, BN]."""
        return tl.dot(xq, tl.trans(q.to(tl.int8)), out_dtype=tl.int32).to(tl.float32)

    @triton.jit
    def _block32(w_ptr, wh_ptr, w_row, ok, g, QTYPE: tl.constexpr):
        """Group g (one block) of Q8_0 or the nibble types: (q [BN, 32], scale [BN, 1],
        offset [BN, 1])."""
        lane = tl.arange(0, 32)[None, :]
        if QTYPE == 8:
            base = w_row + g * 34
            q = tl.load((w_ptr + (base + 2 + lane)).to(tl.pointer_type(tl.int8)), mask=ok,
                        other=0).to(tl.int32)
            d = _half(wh_ptr, base, ok)
            return q, d, tl.zeros_like(d)
        else:
            HAS_MIN: tl.constexpr = QTYPE == 3 or QTYPE == 7
            FIFTH: tl.constexpr = QTYPE == 6 or QTYPE == 7
            BLOCK_BYTES: tl.constexpr = (24 if HAS_MIN else 22) if FIFTH else (
                20 if HAS_MIN else 18)
            NIBBLES_AT: tl.constexpr = (8 if HAS_MIN else 6) if FIFTH else (
                4 if HAS_MIN else 2)
            j = tl.arange(0, 16)[None, :]
            base = w_row + g * BLOCK_BYTES
            d = _half(wh_ptr, base, ok)
            nibbles = _bytes(w_ptr, base + NIBBLES_AT + j, ok)  # byte j: values j and 16 + j
            q_lo = nibbles & 15
            q_hi = nibbles >> 4
            if FIFTH:  # qh, the 4 bytes before the nibbles (2-aligned): bit j, value j's
                qh = _u16(wh_ptr, base + NIBBLES_AT - 4, ok) | (
                    _u16(wh_ptr, base + NIBBLES_AT - 2, ok) << 16)  # [BN, 1]
                q_lo = q_lo | (((qh >> j) & 1) << 4)
                q_hi = q_hi | (((qh >> (j + 16)) & 1) << 4)
            # Interleaved (value j, then 16 + j): x is read in the same order (x_columns).
            q = tl.reshape(tl.join(q_lo, q_hi), (q_lo.shape[0], 32))
            if HAS_MIN:
                return q, d, _half(wh_ptr, base + 2, ok)
            else:
                return q - (16 if FIFTH else 8), d, tl.zeros_like(d)

    @triton.jit
    def _k_quant_pair(xq0, xd0, xs0, xq1, xd1, xs1, w_ptr, w_row, ok, pair,
                      FIFTH: tl.constexpr):
        """Sub-blocks 2p and 2p + 1 of Q4_K's (FIFTH: Q5_K's) block pair // 4, p = pair % 4:
        one 32-byte run of nibbles, low then high, and the qh bits 2p and 2p + 1."""
        BLOCK_BYTES: tl.constexpr = 176 if FIFTH else 144
        NIBBLES_AT: tl.constexpr = 48 if FIFTH else 16
        lane = tl.arange(0, 32)[None, :]
        base = w_row + (pair // 4) * BLOCK_BYTES
        p = pair % 4
        nibbles = _bytes(w_ptr, base + NIBBLES_AT + p * 32 + lane, ok)
        q0 = nibbles & 15
        q1 = nibbles >> 4
        if FIFTH:
            qh = _bytes(w_ptr, base + 16 + lane, ok) >> (2 * p)
            q0 = q0 | ((qh & 1) << 4)
            q1 = q1 | ((qh & 2) << 3)
        dl0, ml0, dl1, ml1 = _k4_scales(w_ptr, base, p, ok)  # [BN, 1] each
        return (xd0 * (_dot(xq0, q0) * tl.trans(dl0)) - xs0 * tl.trans(ml0)
                + xd1 * (_dot(xq1, q1) * tl.trans(dl1)) - xs1 * tl.trans(ml1))

    @triton.jit
    def _q6k_group(xq, xd, w_ptr, wh_ptr, w_row, ok, g):
        """Group g of Q6_K: quarter k = g % 4 of half h of block g // 8; values l of the
        quarter: ql byte l (+ 32 for odd k; high nibble for k >= 2), qh byte l's bits 2k.
        Scales: sc[8h + 2k] for l < 16, sc[8h + 2k + 1] for the rest."""
        lane = tl.arange(0, 32)[None, :]
        r = g % 8
        h = r // 4
        k = r % 4
        base = w_row + (g // 8) * 210
        ql = (_bytes(w_ptr, base + h * 64 + (k % 2) * 32 + lane, ok) >> (4 * (k // 2))) & 15
        qh = (_bytes(w_ptr, base + 128 + h * 32 + lane, ok) >> (2 * k)) & 3
        q = (ql | (qh << 4)) - 32
        sc_at = (w_ptr + (base + 192 + h * 8 + 2 * k)).to(tl.pointer_type(tl.int8))
        sc0 = tl.load(sc_at, mask=ok, other=0).to(tl.float32)
        sc1 = tl.load(sc_at + 1, mask=ok, other=0).to(tl.float32)
        d = _half(wh_ptr, base + 208, ok)
        first = tl.arange(0, 32)[None, :] < 16  # x's lanes of the first 16 values
        dot0 = _dot(tl.where(first, xq, 0).to(tl.int8), q)
        dot1 = _dot(tl.where(first, 0, xq).to(tl.int8), q)
        return xd * ((dot0 * tl.trans(sc0) + dot1 * tl.trans(sc1)) * tl.trans(d))

    @triton.jit
    def _group(xq, xd, xs, w_ptr, wh_ptr, w_row, ok, g, QTYPE: tl.constexpr):
        """One 32-value group's product [BM, BN] for the types other than Q4_K and Q5_K."""
        if QTYPE == 14:
            return _q6k_group(xq, xd, w_ptr, wh_ptr, w_row, ok, g)
        else:
            q, scale, offset = _block32(w_ptr, wh_ptr, w_row, ok, g, QTYPE)
            part = xd * (_dot(xq, q) * tl.trans(scale))
            if QTYPE == 3 or QTYPE == 7:
                part += xs * tl.trans(offset)
            return part

    @triton.jit
    def pair_dot(xq0, xd0, xs0, xq1, xd1, xs1, w_ptr, wh_ptr, w_row, n_ok, pair, num_groups,
                 QTYPE: tl.constexpr):
        """Groups 2 * pair and 2 * pair + 1 of the rows w_row [BN, 1] times x's: [BM, BN]
        float32 (the module docstring). A group at num_groups or past reads nothing and
        adds 0 (x's masked loads are 0 there too)."""
        g = 2 * pair
        ok = group_ok(n_ok, g, num_groups)  # a K step's pairs may run past the row
        if QTYPE == 12 or QTYPE == 13:  # K-quants: whole 256-value blocks, both or neither
            return _k_quant_pair(xq0, xd0, xs0, xq1, xd1, xs1, w_ptr, w_row, ok, pair,
                                 QTYPE == 13)
        else:
            part = _group(xq0, xd0, xs0, w_ptr, wh_ptr, w_row, ok, g, QTYPE)
            return part + _group(xq1, xd1, xs1, w_ptr, wh_ptr, w_row,
                                 group_ok(n_ok, g + 1, num_groups), g + 1, QTYPE)
