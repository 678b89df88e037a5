"""GGML blocks times int8 x by dp4a: the integer view of the DP4A_TYPES (DP4A_TYPE_NAMES) for
one token.

`row_dots(w_ptr, row_off, xq_ptr, xd_ptr, xs_ptr, lut_ptr, num_groups, QTYPE, ...)` ->
float32 [R]: rows at byte offsets row_off [R, 1, 1] times x as gemv_dp4a.quantize_x rounded
it (int8 words xq, scale per 32 values xd, d * sum(q) per 32 xs). The dense
GEMV (gemv_dp4a.py) and the routed-expert kernels (expert_gemv.py) share it. A group is
GROUP_VALUES[QTYPE] values of one row, and each thread should hold whole groups:

- Q4_K: 32 bytes of nibbles (sub-blocks 2p low, 2p + 1 high), d * scale * d_x * dot
  - dmin * min * s_x per sub-block (w = d * scale * q - dmin * min).
- Q5_K: Q4_K's group with each value's fifth bit from the block's 32 qh bytes (bit 2p for
  the low nibbles, 2p + 1 for the high), byte l of qh beside byte l of the nibbles: the same
  word and lane, so one mask and shift a word puts it at bit 4 of each byte (values 0-31).
- Q6_K: a unit of 32 values, 8 of each quarter of a block's half: 8-byte runs of ql (two)
  and qh at multiples of 4 bytes from one start, so the 8 threads of a half read its 32
  contiguous bytes of each run together. (Groups of 128 values, where each thread read
  16-byte runs 105 bytes from its neighbour's, took 8-13% longer on the 8B's head and
  downs: docs/benchmarks.md, run 27.) Each value's 6 bits come from a nibble and two bits
  of qh, merged by one bit-select. The values are q - 32: the unsigned byte goes into dp4a
  and a dp4a of x by bytes of -32 joins the same integer sum, where sign-extending the
  6-bit bytes would cost about four instructions a word.
- Q8_0: one block, 32 int8 against 32 int8, d * d_x * dot.
- Q4_0: one block, 16 bytes of nibbles (values 0-15 low, 16-31 high), w = d * (q - 8):
  d * (d_x * dot - 8 * s_x), the unsigned nibbles in dp4a and the 8 taken off by x's sum.
- Q5_0 (22 bytes: d, qh, nibbles), Q4_1 (20: d, m, nibbles), Q5_1 (24: d, m, qh, nibbles):
  Q4_0's block and decoder (_nibble_words). Q5's fifth bits (qh bit j: value j) reach bit 4
  of each nibble byte by one multiply a word (_nibble_dots says why it cannot carry); w =
  d * (q - 16): d * (d_x * dot - 16 * s_x); Q4_1, Q5_1: w = d * q + m: d * d_x * dot + m * s_x.
  sm_90: 2.7-2.9 instructions a value for Q5_0 and Q5_1, 1.6-1.9 for Q4_1 (Q4_0: 1.7-1.8).
- IQ2_XXS: one block (256 values, 66 bytes): per 32 values two words, four grid indices and
  four 7-bit sign indices with a 4-bit scale. Each index names 8 grid bytes (8, 25 or 43),
  read as two int32 words from lookup.py's table (lut_ptr, in L1); the sign byte
  (ksigns) negates bytes in place: (w ^ m) + t, t = 1 in each negated byte, m = 255 * t
  (no byte carries: every grid byte is at least 8). d * (0.5 + scale) / 4 * d_x * dot.
- MXFP4 (gpt-oss's experts): one block, an E8M0 exponent e and 16 code bytes in Q4_0's
  nibble order; each E2M1 code's doubled value (an integer: 0 1 2 3 4 6 8 12 and negatives)
  looked up by prmt (`byte_perm`, _mxfp4_dots says how), 2**(e - 128) * d_x * dot.

Q6_K's 210-byte, Q8_0's 34-byte, Q4_0's 18-byte and Q5_0's 22-byte blocks put every other
block at 2 mod 4 bytes, MXFP4's 17-byte blocks their codes at any byte (Q4_1's and Q5_1's keep
their row's alignment). Words are read aligned and realigned
by a funnel shift of each word and the next (`shf.r.wrap`, any shift: one instruction); the
next word of one lane is the word of the next, so a run of W words costs W + 1 loads.
Reading the aligned word around a valid byte never leaves its page; the one word that could
lie wholly past a tensor (Q8_0's last) is read only where needed. The base pointer must be
4-aligned, row and expert offsets only even (Q4_K, Q5_K: 4-aligned; MXFP4: any:
`row_alignment`).

Under TRITON_INTERPRET=1 dp4a, prmt and the funnel shift are emulated by shifts and masks:
the same integers, so the CPU tests check the compiled kernel's layout and scales.
"""

from __future__ import annotations

from gguf import GGMLQuantizationType

try:
    import triton
    import triton.language as tl

    from strata.engine.core.kernels.pdl import wait as pdl_wait
    from strata.engine.core.quant.dequant_tile import _KSIGNS, LUT_IQ2_XXS, _mxfp4_half_scale
    from strata.engine.core.quant.gemv_planes import _k4_scales
except ImportError:  # Triton is optional: without it no tensor stays quantized
    triton = None

# Q4_K, Q5_K, Q6_K, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ2_XXS, MXFP4
DP4A_TYPES = frozenset({12, 13, 14, 8, 2, 3, 6, 7, 16, 39})
DP4A_TYPE_NAMES = ", ".join(GGMLQuantizationType(t).name for t in sorted(DP4A_TYPES))
GROUP_VALUES = {12: 64, 13: 64, 14: 32, 8: 32, 2: 32, 3: 32, 6: 32, 7: 32, 16: 256,
                39: 32}  # x values a group
# Types whose words are read as they lie, never realigned (144- and 176-byte blocks): a run
# of their rows must start 4-aligned; MXFP4's (no fp16 field) may start at any byte; the
# others' rows need even addresses.
WORD_ALIGNED_TYPES = frozenset({12, 13})  # Q4_K, Q5_K
MXFP4 = 39


def row_alignment(qtype: int) -> int:
    """The alignment in bytes that rows (and experts) of qtype need here: 4, 2 or 1."""
    return 4 if int(qtype) in WORD_ALIGNED_TYPES else 1 if int(qtype) == MXFP4 else 2


if triton is not None:
    _GRID_IQ2_XXS_WORDS = tl.constexpr(LUT_IQ2_XXS // 4)  # the table's grid, 2 words an entry

    @triton.jit
    def dp4a(a, b, EMULATE: tl.constexpr):
        """Per element: the sum of the four signed byte products of int32 a and b."""
        if EMULATE:
            total = tl.zeros_like(a)
            for i in tl.static_range(4):  # << then >>: sign-extend byte i
                total += ((a << (24 - 8 * i)) >> 24) * ((b << (24 - 8 * i)) >> 24)
            return total
        else:
            return tl.inline_asm_elementwise(
                "dp4a.s32.s32 $0, $1, $2, 0;", "=r,r,r", [a, b], dtype=tl.int32,
                is_pure=True, pack=1)

    @triton.jit
    def funnel(lo, hi, shift, EMULATE: tl.constexpr):
        """The low 32 bits of hi:lo >> shift, for shift 0..31 (0, 8, 16 or 24 here)."""
        if EMULATE:  # logical shifts on the unsigned view; hi << 32 written as two steps
            low = lo.to(tl.uint32, bitcast=True) >> shift.to(tl.uint32)
            high = (hi.to(tl.uint32, bitcast=True) << (31 - shift).to(tl.uint32)) << 1
            return tl.where(shift == 0, lo, (low | high).to(tl.int32, bitcast=True))
        else:
            return tl.inline_asm_elementwise(
                "shf.r.wrap.b32 $0, $1, $2, $3;", "=r,r,r,r", [lo, hi, shift],
                dtype=tl.int32, is_pure=True, pack=1)

    @triton.jit
    def byte_perm(a, b, selector, EMULATE: tl.constexpr):
        """PTX prmt.b32 (its default mode): byte i of the result is byte s & 7 of the eight
        bytes b:a (a's are 0-3), s the selector's nibble i; where s & 8, that byte's sign
        bit instead, copied into all eight bits. Only the selector's low 16 bits count."""
        if EMULATE:
            out = tl.zeros_like(a)
            for i in tl.static_range(4):
                s = (selector >> (4 * i)) & 15
                src = tl.where((s & 4) != 0, b, a)
                byte = (src >> ((s & 3) * 8)) & 255
                byte = tl.where((s & 8) != 0, tl.where(byte >= 128, 255, 0), byte)
                out = out | (byte << (8 * i))
            return out
        else:
            return tl.inline_asm_elementwise(
                "prmt.b32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, selector], dtype=tl.int32,
                is_pure=True, pack=1)

    @triton.jit
    def dp4a_acc(a, b, c, EMULATE: tl.constexpr):
        """c + dp4a(a, b): the accumulating form, one instruction."""
        if EMULATE:
            return c + dp4a(a, b, EMULATE)
        else:
            return tl.inline_asm_elementwise(
                "dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.int32,
                is_pure=True, pack=1)

    @triton.jit
    def realigned(ptr, shift, EMULATE: tl.constexpr, LAST_OK: tl.constexpr = True):
        """The int32 words of runs starting shift / 8 bytes into the aligned words ptr
        [R, G, W] (shift [R, G, 1]: 0, 8, 16 or 24): each word and the next, funnel-shifted.
        The next word of lane w is lane w + 1's word (one load for both); LAST_OK False: the
        last lane's next word may lie past the tensor, so it is read only where needed."""
        lo = tl.load(ptr)
        if LAST_OK:
            hi = tl.load(ptr + 1)
        else:
            lane = tl.arange(0, ptr.shape[2])[None, None, :]
            hi = tl.load(ptr + 1, mask=(lane < ptr.shape[2] - 1) | (shift != 0), other=0)
        return funnel(lo, hi, tl.broadcast_to(shift, lo.shape), EMULATE)

    @triton.jit
    def _dots4(a, b, x_at, EMULATE: tl.constexpr):
        """Sum over the last axis of dp4a(a, x) + dp4a(b, x + 4 words): [R, G, 1] int32."""
        return tl.sum(dp4a_acc(b, tl.load(x_at + 4), dp4a(a, tl.load(x_at), EMULATE), EMULATE),
                      axis=2, keep_dims=True)

    @triton.jit
    def _k4_words(row_bytes, row_words, group, FIFTH_BIT: tl.constexpr):
        """The weight side of sub-blocks 2p (low nibbles) and 2p + 1 (high) of block
        group // 4, p = group % 4, of Q4_K (144 bytes, the nibbles at 16) or with FIFTH_BIT
        of Q5_K (176 bytes, qh at 16, the nibbles at 48): (qa, qb, ha, hb, dl0, ml0, dl1,
        ml1), the nibble words, the qh words shifted to bit 2p (qa, qb without FIFTH_BIT)
        and the two sub-blocks' d * scale and dmin * min."""
        BLOCK_WORDS: tl.constexpr = 44 if FIFTH_BIT else 36
        NIBBLE_WORD: tl.constexpr = 12 if FIFTH_BIT else 4
        word = tl.arange(0, 4)[None, None, :]
        blk = group // 4
        p = group % 4
        at = row_words + (blk * BLOCK_WORDS + NIBBLE_WORD + p * 8) + word  # [R, G, 4], + 4
        qa = tl.load(at)
        qb = tl.load(at + 4)
        if FIFTH_BIT:
            h_at = row_words + (blk * BLOCK_WORDS + 4) + word  # the 32 qh bytes: 0-3, + 4
            ha = tl.load(h_at) >> (2 * p)  # bit 0 of each byte: 2p's, bit 1: 2p + 1's
            hb = tl.load(h_at + 4) >> (2 * p)
        else:
            ha = qa
            hb = qb
        dl0, ml0, dl1, ml1 = _k4_scales(row_bytes, blk * (4 * BLOCK_WORDS), p, True)
        return qa, qb, ha, hb, dl0, ml0, dl1, ml1

    @triton.jit
    def _k4_dots(qa, qb, ha, hb, dl0, ml0, dl1, ml1, group, same_row, xq_ptr, xd_ptr, xs_ptr,
                 FIFTH_BIT: tl.constexpr, EMULATE: tl.constexpr):
        """_k4_words' group times x: each value's fifth bit (FIFTH_BIT) is bit 2p (low) or
        2p + 1 (high) of its qh byte, which shares the nibbles' word and lane."""
        low = 0x0F0F0F0F
        word = tl.arange(0, 4)[None, None, :]
        x_lo = xq_ptr + (group * 16 + same_row) + word  # x at the weights' full shape
        if FIFTH_BIT:
            one, two = 0x01010101, 0x02020202
            lo = _dots4((qa & low) | ((ha & one) << 4), (qb & low) | ((hb & one) << 4), x_lo,
                        EMULATE)
            hi = _dots4(((qa >> 4) & low) | ((ha & two) << 3),
                        ((qb >> 4) & low) | ((hb & two) << 3), x_lo + 8, EMULATE)
        else:  # as written before Q5_K joined: the same sm_90 code (diag_quant_sass --dp4a)
            lo = _dots4(qa & low, qb & low, x_lo, EMULATE)
            hi = _dots4((qa >> 4) & low, (qb >> 4) & low, x_lo + 8, EMULATE)
        return (dl0 * tl.load(xd_ptr + 2 * group) * lo.to(tl.float32)
                - ml0 * tl.load(xs_ptr + 2 * group)
                + dl1 * tl.load(xd_ptr + 2 * group + 1) * hi.to(tl.float32)
                - ml1 * tl.load(xs_ptr + 2 * group + 1))

    @triton.jit
    def _q6k_words(row_bytes, row_words, row_mis, unit, EMULATE: tl.constexpr):
        """The weight side of 32 values of a Q6_K block: unit u = 8 b + 4 h + j of a row is,
        in half h of block b, the values l = 8j .. 8j + 7 of each quarter k (value 128 h +
        32 k + l), from three 8-byte runs: ql bytes l and 32 + l of the half and its qh bytes
        l. Neighbouring threads read a half's 32 contiguous bytes of each run (the module's
        docstring). (ql_a, ql_b, qh, the four quarters' scales, d)."""
        word = tl.arange(0, 2)[None, None, :]
        blk = unit // 8
        h = (unit // 4) % 2
        j = unit % 4
        start = row_mis + blk * 210 + h * 64 + j * 8  # [R, G, 1]: ql bytes l of the half
        at = row_words + (start >> 2) + word  # [R, G, 2]; ql + 32 at + 8, qh at + 32 - 8 h
        shift = (start & 2) * 8  # qh lies a multiple of 4 bytes from ql: the same shift
        ql_a = realigned(at, shift, EMULATE)
        ql_b = realigned(at + 8, shift, EMULATE)
        qh = realigned(at + (32 - 8 * h), shift, EMULATE)
        sc_at = (row_bytes + (blk * 210 + 192 + h * 8 + j // 2)).to(tl.pointer_type(tl.int8))
        d = tl.load((row_bytes + (blk * 210 + 208)).to(tl.pointer_type(tl.float16)))
        return (ql_a, ql_b, qh, tl.load(sc_at), tl.load(sc_at + 2), tl.load(sc_at + 4),
                tl.load(sc_at + 6), d)

    @triton.jit
    def _q6k_dots(ql_a, ql_b, qh, sc0, sc1, sc2, sc3, d, unit, same_row, xq_ptr, xd_ptr,
                  EMULATE: tl.constexpr):
        """_q6k_words' unit times x. Each value's 6 bits come from a nibble and two bits of
        qh, merged by one bit-select."""
        word = tl.arange(0, 2)[None, None, :]
        blk = unit // 8
        h = (unit // 4) % 2
        j = unit % 4
        even = qh & 0x33333333  # the high bits of quarters 0 (bits 0-1) and 2 (bits 4-5)
        odd = (qh >> 2) & 0x33333333  # of quarters 1 and 3
        low = 0x0F0F0F0F
        x_at = xq_ptr + (blk * 64 + h * 32 + j * 2 + same_row) + word  # quarter k: + 8 k
        minus_32 = tl.full(x_at.shape, -522133280, tl.int32)  # 0xE0E0E0E0: bytes of -32
        xd_at = xd_ptr + (blk * 8 + h * 4)
        acc = tl.zeros((x_at.shape[0], x_at.shape[1], 1), dtype=tl.float32)
        for k in tl.static_range(4):
            if k == 0:
                bits = (ql_a & low) | ((even << 4) & ~low)
                scale = sc0
            elif k == 1:
                bits = (ql_b & low) | ((odd << 4) & ~low)
                scale = sc1
            elif k == 2:
                bits = ((ql_a >> 4) & low) | (even & ~low)
                scale = sc2
            else:
                bits = ((ql_b >> 4) & low) | (odd & ~low)
                scale = sc3
            x = tl.load(x_at + 8 * k)
            dot = tl.sum(dp4a_acc(bits, x, dp4a(minus_32, x, EMULATE), EMULATE), axis=2,
                         keep_dims=True)  # [R, G, 1]: the 8 values' q - 32 times x
            acc += scale.to(tl.float32) * tl.load(xd_at + k) * dot.to(tl.float32)
        return d.to(tl.float32) * acc

    @triton.jit
    def _q8_0_words(row_bytes, row_words, row_mis, group, EMULATE: tl.constexpr):
        """Block `group`'s 32 int8 as two runs of 4 words, and its d."""
        word = tl.arange(0, 4)[None, None, :]
        start = row_mis + group * 34 + 2  # [R, G, 1]: the 32 int8 after d
        at = row_words + (start >> 2) + word  # [R, G, 4]
        shift = (start & 2) * 8
        d = tl.load((row_bytes + group * 34).to(tl.pointer_type(tl.float16)))
        return realigned(at, shift, EMULATE), realigned(at + 4, shift, EMULATE, False), d

    @triton.jit
    def _q8_0_dots(a, b, d, group, same_row, xq_ptr, xd_ptr, EMULATE: tl.constexpr):
        word = tl.arange(0, 4)[None, None, :]
        x_at = xq_ptr + (group * 8 + same_row) + word
        dot = _dots4(a, b, x_at, EMULATE)
        return (d.to(tl.float32) * tl.load(xd_ptr + group)) * dot.to(tl.float32)

    @triton.jit
    def _nibble_words(row_bytes, row_words, row_mis, group, HAS_MIN: tl.constexpr,
                      FIFTH_BIT: tl.constexpr, EMULATE: tl.constexpr):
        """Block `group` of Q4_0 (18 bytes: d, 16 nibble bytes), Q4_1 (HAS_MIN, 20: d, m,
        nibbles), Q5_0 (FIFTH_BIT, 22: d, qh, nibbles) or Q5_1 (both, 24: d, m, qh,
        nibbles): (q, qh, d, m), the nibbles as 4 words (byte i: value i low, 16 + i high),
        the qh word (bit j: value j's fifth bit; q without FIFTH_BIT), d and m (d without
        HAS_MIN). qh lies just before the nibbles: the same shift realigns both."""
        BLOCK_BYTES: tl.constexpr = (24 if HAS_MIN else 22) if FIFTH_BIT else (
            20 if HAS_MIN else 18)
        NIBBLES_AT: tl.constexpr = (8 if HAS_MIN else 6) if FIFTH_BIT else (4 if HAS_MIN else 2)
        word = tl.arange(0, 4)[None, None, :]
        start = row_mis + group * BLOCK_BYTES + NIBBLES_AT  # [R, G, 1]: the nibbles
        shift = (start & 3) * 8
        half_at = (row_bytes + group * BLOCK_BYTES).to(tl.pointer_type(tl.float16))
        d = tl.load(half_at)
        q = realigned(row_words + (start >> 2) + word, shift, EMULATE, False)
        # qh's next word is the nibbles' first: inside the block
        qh = realigned(row_words + (start >> 2) - 1, shift, EMULATE) if FIFTH_BIT else q
        m = tl.load(half_at + 1) if HAS_MIN else d
        return q, qh, d, m

    @triton.jit
    def _nibble_dots(q, qh, d, m, group, same_row, xq_ptr, xd_ptr, xs_ptr,
                     HAS_MIN: tl.constexpr, FIFTH_BIT: tl.constexpr, EMULATE: tl.constexpr):
        """_nibble_words' block times x: w = d * (q - 8) (Q4_0), d * (q - 16) (Q5_0) or
        d * q + m (Q4_1, Q5_1), the unsigned values in dp4a and the offset or min applied to
        x's sum: d * (d_x * dot - 8 * s_x), or d * d_x * dot + m * s_x.
        Q5's fifth bits: lane w's nibble bytes hold values 4w..4w + 3 (low) and 16 + 4w..
        (high), whose bits are 4 contiguous bits n of qh >> 4w (0-3 and 16-19). n *
        0x02040810 is four copies of n shifted by 4, 11, 18 and 25 bits: their 4-bit spans
        never overlap, so nothing carries, and copy k puts bit k at 4 + 8k, bit 4 of byte
        k; & 0x10101010 keeps those. One multiply and one and-or per word, where a lookup
        (MXFP4's prmt) would take two prmt for a 16-entry table."""
        low = 0x0F0F0F0F
        word = tl.arange(0, 4)[None, None, :]
        x_at = xq_ptr + (group * 8 + same_row) + word  # values 0-15; 16-31 at + 4
        if FIFTH_BIT:
            bits = qh >> (4 * word)  # [R, G, 4]
            fifth = 0x10101010
            dot = _dots4((q & low) | (((bits & 15) * 0x02040810) & fifth),
                         ((q >> 4) & low) | ((((bits >> 16) & 15) * 0x02040810) & fifth),
                         x_at, EMULATE)
        else:  # as written when Q4_0 came alone (the same sm_90 code)
            dot = _dots4(q & low, (q >> 4) & low, x_at, EMULATE)
        if HAS_MIN:
            return (d.to(tl.float32) * tl.load(xd_ptr + group) * dot.to(tl.float32)
                    + m.to(tl.float32) * tl.load(xs_ptr + group))
        else:
            OFFSET: tl.constexpr = 16.0 if FIFTH_BIT else 8.0
            return d.to(tl.float32) * (tl.load(xd_ptr + group) * dot.to(tl.float32)
                                       - OFFSET * tl.load(xs_ptr + group))

    @triton.jit
    def _mxfp4_words(row_bytes, row_words, row_mis, group, EMULATE: tl.constexpr):
        """Block `group`'s 16 code bytes as 4 words (byte i: value i's code low, 16 + i's
        high) and its E8M0 exponent. 17-byte blocks: the codes start at any byte."""
        word = tl.arange(0, 4)[None, None, :]
        start = row_mis + group * 17 + 1  # [R, G, 1]: the codes after the exponent
        shift = (start & 3) * 8
        e = tl.load(row_bytes + group * 17).to(tl.int32)
        return realigned(row_words + (start >> 2) + word, shift, EMULATE, False), e

    @triton.jit
    def _mxfp4_dots(q, e, group, same_row, xq_ptr, xd_ptr, EMULATE: tl.constexpr):
        """_mxfp4_words' block times x. A code's doubled E2M1 value (0 1 2 3 4 6 8 12, code
        8-15 negated) is looked up by prmt: with the code as selector nibble, a table of the
        8 magnitudes gives the magnitude where the sign bit is clear and 0 where it is set
        (prmt then copies the sign of a byte below 128); with the sign bit flipped, the
        opposite. So the positive and negative parts are two lookups, and dot = dp4a(pos, x)
        - dp4a(neg, x): no per-byte negation, which would carry across bytes at -0. A
        selector's 4 nibbles are 2 code bytes (values i, 16 + i, i + 1, 17 + i), so x's
        bytes are put in that order (2 prmt a word, shared by both parts).
        Per word (8 values): 1 xor, 2 shifts, 6 prmt, 4 dp4a, 13 instructions, about 1.6 a
        value against about 5 for the float decode (two nibble extractions, a magnitude
        shift, a select, a convert, an FMA each). Measured at gpt-oss-20b's experts (run 36,
        bench/diag_mxfp4_gemv.py): 33 us a layer, 0.53 of the copy bandwidth, against the
        float block reader's 92.5."""
        word = tl.arange(0, 4)[None, None, :]
        x_at = xq_ptr + (group * 8 + same_row) + word
        xa = tl.load(x_at)  # values 4w .. 4w + 3
        xb = tl.load(x_at + 4)  # values 16 + 4w .. 19 + 4w
        x_lo = byte_perm(xa, xb, tl.full(xa.shape, 0x5140, tl.int32), EMULATE)  # 4w, 16 + 4w, ..
        x_hi = byte_perm(xa, xb, tl.full(xa.shape, 0x7362, tl.int32), EMULATE)  # 4w + 2, ..
        mag_lo = tl.full(q.shape, 0x03020100, tl.int32)  # the magnitudes 0 1 2 3
        mag_hi = tl.full(q.shape, 0x0C080604, tl.int32)  # 4 6 8 12
        flipped = q ^ -0x77777778  # 0x88888888: every code's sign bit flipped
        pos = dp4a_acc(byte_perm(mag_lo, mag_hi, q >> 16, EMULATE), x_hi,
                       dp4a(byte_perm(mag_lo, mag_hi, q, EMULATE), x_lo, EMULATE), EMULATE)
        neg = dp4a_acc(byte_perm(mag_lo, mag_hi, flipped >> 16, EMULATE), x_hi,
                       dp4a(byte_perm(mag_lo, mag_hi, flipped, EMULATE), x_lo, EMULATE),
                       EMULATE)
        dot = tl.sum(pos - neg, axis=2, keep_dims=True)  # [R, G, 1]
        return _mxfp4_half_scale(e) * tl.load(xd_ptr + group) * dot.to(tl.float32)

    @triton.jit
    def _signed_bytes(grid_word, signs):
        """grid_word's four bytes, each negated where its bit of signs (the low 4) is set."""
        t = ((signs & 15) * 0x00204081) & 0x01010101  # bit i -> the low bit of byte i
        return (grid_word ^ (t * 255)) + t

    @triton.jit
    def _iq2xxs_words(row_bytes, row_words, row_mis, group, EMULATE: tl.constexpr):
        """Block `group`'s (256 values) 16 words, 2 a sub-block of 32, and its d."""
        start = row_mis + group * 66 + 2  # [R, G, 1]: qs after d
        shift = (start & 2) * 8
        word = tl.arange(0, 16)[None, None, :]
        q = realigned(row_words + (start >> 2) + word, shift, EMULATE, False)  # [R, G, 16]
        return q, tl.load((row_bytes + group * 66).to(tl.pointer_type(tl.float16)))

    @triton.jit
    def _iq2xxs_dots(q, d, group, same_row, xq_ptr, xd_ptr, lut_ptr, EMULATE: tl.constexpr):
        """_iq2xxs_words' block times x: its 8 sub-blocks of 32 on the last axis."""
        grids, signs = tl.split(tl.reshape(q, (q.shape[0], q.shape[1], 8, 2)))  # [R, G, 8]
        sub = tl.arange(0, 8)[None, None, :]
        x_at = xq_ptr + (group * 64 + sub * 8 + same_row)  # [R, G, 8]: 8 words a sub-block
        lut_words = lut_ptr.to(tl.pointer_type(tl.int32)) + _GRID_IQ2_XXS_WORDS
        dot = tl.zeros(grids.shape, dtype=tl.int32)
        for part in tl.static_range(4):  # 8 values each
            entry = lut_words + 2 * ((grids >> (8 * part)) & 255)
            sign = tl.load(lut_ptr + _KSIGNS + ((signs >> (7 * part)) & 127)).to(tl.int32)
            dot = dp4a_acc(_signed_bytes(tl.load(entry), sign), tl.load(x_at + 2 * part), dot,
                           EMULATE)
            dot = dp4a_acc(_signed_bytes(tl.load(entry + 1), sign >> 4),
                           tl.load(x_at + 2 * part + 1), dot, EMULATE)
        scale = (0.5 + ((signs >> 28) & 15).to(tl.float32)) * 0.25
        xd = tl.load(xd_ptr + group * 8 + sub)
        return d.to(tl.float32) * tl.sum(scale * xd * dot.to(tl.float32), axis=2,
                                         keep_dims=True)

    @triton.jit
    def _wait_first(first, WAIT: tl.constexpr):
        """The PDL wait in the K loop's first step (first: a scalar, true once). A branch
        in the loop, not a peeled first step: peeling took more registers a thread (sm_90,
        Q4_K's 2-row tile 40 -> 44), and fewer warps fit an SM."""
        if WAIT:  # noqa: SIM102 - compile-time; the inner test is at run time
            if first:
                pdl_wait(WAIT)

    @triton.jit
    def _step(row_bytes, row_words, row_mis, group, same_row, xq_ptr, xd_ptr, xs_ptr, lut_ptr,
              first, QTYPE: tl.constexpr, WAIT: tl.constexpr, EMULATE: tl.constexpr):
        """One K step's groups [R, G, 1]: their weight words, then (WAIT) the PDL wait, then
        their products with x. Weights are not written by any kernel of a step, so the first
        step's loads are in flight while the kernel before still runs (pdl.py's contract)."""
        if QTYPE == 12 or QTYPE == 13:  # Q4_K, Q5_K
            qa, qb, ha, hb, dl0, ml0, dl1, ml1 = _k4_words(row_bytes, row_words, group,
                                                           QTYPE == 13)
            _wait_first(first, WAIT)
            part = _k4_dots(qa, qb, ha, hb, dl0, ml0, dl1, ml1, group, same_row, xq_ptr,
                            xd_ptr, xs_ptr, QTYPE == 13, EMULATE)
        elif QTYPE == 14:
            ql_a, ql_b, qh, sc0, sc1, sc2, sc3, d = _q6k_words(row_bytes, row_words, row_mis,
                                                               group, EMULATE)
            _wait_first(first, WAIT)
            part = _q6k_dots(ql_a, ql_b, qh, sc0, sc1, sc2, sc3, d, group, same_row, xq_ptr,
                             xd_ptr, EMULATE)
        elif QTYPE == 2 or QTYPE == 3 or QTYPE == 6 or QTYPE == 7:  # Q4_0, Q4_1, Q5_0, Q5_1
            q, qh, d, m = _nibble_words(row_bytes, row_words, row_mis, group,
                                        QTYPE == 3 or QTYPE == 7, QTYPE >= 6, EMULATE)
            _wait_first(first, WAIT)
            part = _nibble_dots(q, qh, d, m, group, same_row, xq_ptr, xd_ptr, xs_ptr,
                                QTYPE == 3 or QTYPE == 7, QTYPE >= 6, EMULATE)
        elif QTYPE == 39:
            q, e = _mxfp4_words(row_bytes, row_words, row_mis, group, EMULATE)
            _wait_first(first, WAIT)
            part = _mxfp4_dots(q, e, group, same_row, xq_ptr, xd_ptr, EMULATE)
        elif QTYPE == 16:
            q, d = _iq2xxs_words(row_bytes, row_words, row_mis, group, EMULATE)
            _wait_first(first, WAIT)
            part = _iq2xxs_dots(q, d, group, same_row, xq_ptr, xd_ptr, lut_ptr, EMULATE)
        else:
            a, b, d = _q8_0_words(row_bytes, row_words, row_mis, group, EMULATE)
            _wait_first(first, WAIT)
            part = _q8_0_dots(a, b, d, group, same_row, xq_ptr, xd_ptr, EMULATE)
        return part

    @triton.jit
    def row_dots(w_ptr, row_off, xq_ptr, xd_ptr, xs_ptr, lut_ptr, num_groups,
                 QTYPE: tl.constexpr, GROUP: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                 BLOCK_COLS: tl.constexpr, STAGES: tl.constexpr, EMULATE: tl.constexpr,
                 WAIT: tl.constexpr = False):
        """W[rows, :] @ x in float32 [BLOCK_ROWS] for rows at even byte offsets (MXFP4: any)
        row_off [R, 1, 1] (int64, every one a real row: callers clamp) from w_ptr (uint8, 4-aligned)
        of num_groups groups of GROUP (= GROUP_VALUES[QTYPE]) values; xq_ptr: x's int8 as
        int32 words; lut_ptr: lookup.py's table (int8, 4-aligned; read for IQ2_XXS). No load
        is masked: the last step's groups past the row reread the last group and count zero.
        WAIT: the kernel's PDL wait (pdl.wait) is here, after the first step's weight loads."""
        GROUPS: tl.constexpr = BLOCK_COLS // GROUP
        row_bytes = w_ptr + row_off  # [R, 1, 1] uint8 pointers
        row_words = w_ptr.to(tl.pointer_type(tl.int32)) + (row_off >> 2)  # aligned at or before
        row_mis = (row_off & 3).to(tl.int32)  # 0 or 2; MXFP4's rows: any
        same_row = tl.zeros((BLOCK_ROWS, 1, 1), dtype=tl.int32)
        acc = tl.zeros((BLOCK_ROWS, GROUPS, 1), dtype=tl.float32)
        for g0 in tl.range(0, num_groups, GROUPS, num_stages=STAGES):
            group = g0 + tl.arange(0, GROUPS)[None, :, None]  # [1, G, 1]
            part = _step(row_bytes, row_words, row_mis, tl.minimum(group, num_groups - 1),
                         same_row, xq_ptr, xd_ptr, xs_ptr, lut_ptr, g0 == 0, QTYPE, WAIT,
                         EMULATE)
            acc += tl.where(group < num_groups, part, 0.0)
        return tl.sum(tl.sum(acc, axis=2), axis=1)  # [R]
