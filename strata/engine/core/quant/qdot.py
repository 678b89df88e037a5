"""The int8 decode kernel: W [N, K] in GGUF blocks times x [M, K]^T by integer dot products.

Each program owns BLOCK_ROWS output rows and walks K in units of 256 columns (int8_blocks.py):
per 32 columns it quantizes its slice of x to int8 (x is tiny and stays in L1/L2, so every
program quantizes its own copy: no second kernel, no buffer, nothing that differs per call
under a CUDA graph), unpacks the weight's sub-block to int8, multiplies on the tensor cores
(tl.dot int8 -> int32, [rows, tokens]) and applies the scales once per 32 columns.

The products differ from torch's on the dequantized weight by x's rounding to 8 bits (about
0.4% of each 32 values' largest, relative), as llama.cpp's q8_1 activations do.
"""

from __future__ import annotations

from strata.engine.core.quant import int8_blocks as ib

try:
    import triton
    import triton.language as tl

    from strata.engine.core.kernels.pdl import wait as pdl_wait
except ImportError:
    triton = None

if triton is not None:

    @triton.jit
    def qdot_kernel(
        x_ptr, w_ptr, wh_ptr, b_ptr, out_ptr, num_tokens, stride_x, stride_out, N, K,
        ROW_BYTES, QTYPE: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
        USE_PDL: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr,
        STAGES: tl.constexpr,
    ):
        """out[:M] = x @ W^T (+ bias); BLOCK_M >= M tokens share each weight tile's reads.
        BLOCK_COLS is the unit of 256 columns (launch.py passes one)."""
        tl.static_assert(BLOCK_COLS == 256)
        pdl_wait(USE_PDL)
        rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        row_ok = (rows < N)[:, None]  # [R, 1]
        row_off = (rows.to(tl.int64) * ROW_BYTES)[:, None]  # [R, 1]
        toks = tl.arange(0, BLOCK_M)
        tok_ok = (toks < num_tokens)[None, :]  # [1, M]
        x_rows = x_ptr + toks[None, :] * stride_x  # [1, M]
        # Groups per half unit: 32-column sub-blocks (Q4_K, Q5_K, Q8_0) or 16 (Q6_K's
        # scales, and the half blocks the nibbles of Q4_0..Q5_1 split into).
        G: tl.constexpr = 4 if (QTYPE == 12 or QTYPE == 13 or QTYPE == 8) else 8
        HAS_MIN: tl.constexpr = QTYPE == 12 or QTYPE == 13 or QTYPE == 3 or QTYPE == 7
        acc = tl.zeros((BLOCK_ROWS, G, BLOCK_M), dtype=tl.float32)
        for unit in tl.range(0, tl.cdiv(K, 256), num_stages=STAGES):
            for h in tl.static_range(2):
                wq, x_cols, x_ok, w_scale, w_min = ib.half_weights(
                    w_ptr, wh_ptr, row_off, unit, row_ok, h, K, G, QTYPE)
                acc = ib.half_dot(acc, wq, x_cols, x_ok, w_scale, w_min, x_rows, tok_ok,
                                  HAS_MIN)
        total = tl.sum(acc, axis=1)  # [R, M]
        if HAS_BIAS:
            total += tl.load(b_ptr + rows, mask=rows < N, other=0.0).to(tl.float32)[:, None]
        tl.store(out_ptr + toks[None, :] * stride_out + rows[:, None],
                 total.to(out_ptr.dtype.element_ty), mask=row_ok & tok_ok)
