"""One token times Q4_K blocks by integer dot products: x in int8, four products an instruction.

The planes kernel (gemv_planes.py) turns every 4-bit weight into a float and spends about ten
instructions a value: more than the H200 issues in the time its bytes take to arrive. Here,
as llama.cpp's mmvq does for its quantized matrix-vector products:

1. `quantize_x`: x [M, K] in int8 per 32 values, with the scale d_x (max |x| / 127) and the
   sum s_x = d_x * sum(q) of each 32 (one small launch, read once by every row's program).
2. The GEMV reads each weight block's packed nibbles as int32 words (four bytes, eight
   values), masks the low and the high nibbles (two sub-blocks of 32) and multiplies four
   nibbles by four int8 x values in one `dp4a`. Per sub-block: d * scale * d_x * sum(q_w q_x)
   - dmin * min * s_x, since w = d * scale * q - dmin * min.

The x rounding to int8 (about 0.4% of each 32's largest value) is the price: this path is
for the bf16/fp16 compute dtype only; float32 (the CPU interpreter's tests of the other
kernels, the verify mode) keeps the planes kernel. Q4_K's 144-byte blocks keep every word
4-aligned; Q6_K's (210) and Q8_0's (34) do not, so they stay with the planes kernel.

Under TRITON_INTERPRET=1 (CPU tests) dp4a is emulated by shifts and multiplies: the same
integer sums, so the tests check the layout and the scales of the compiled kernel.
"""

from __future__ import annotations

import os

import torch

from strata.engine.core.kernels import launch

try:
    import triton
    import triton.language as tl

    from strata.engine.core.kernels.pdl import wait as pdl_wait
    from strata.engine.core.quant.gemv_planes import _k4_scales
except ImportError:  # Triton is optional: without it no tensor stays quantized
    triton = None

DP4A_TYPES = frozenset({12})  # Q4_K
X_GROUP = 32  # x values per int8 scale: one Q4_K sub-block
QUANTIZE_SUBS = 32  # x groups per program of quantize_x
# (BLOCK_ROWS, BLOCK_COLS, num_warps, STAGES): rows per program, x values per K step. A
# step's loads are all a thread has in flight (the loop is not unrolled), so wide steps and
# several rows keep more bytes in flight per SM; STAGES 3 has cp.async pipeline the next.
CONFIGS = ((2, 2048, 4, 1), (4, 1024, 4, 1), (4, 2048, 4, 1), (4, 2048, 8, 1),
           (2, 4096, 4, 1), (4, 4096, 8, 1), (8, 2048, 8, 1), (8, 1024, 4, 1),
           (1, 4096, 4, 1), (2, 2048, 4, 3), (4, 2048, 8, 3), (2, 1024, 2, 1))
INTERPRETER_CONFIG = ((64, 512, 4, 1),)


def is_enabled(x: torch.Tensor, qtype: int) -> bool:
    """This kernel multiplies one token x by a weight of qtype: Q4_K, x in bf16/fp16 on CUDA
    (or the interpreter), and not switched off by STRATA_DP4A=0 (for measuring)."""
    return (triton is not None and int(qtype) in DP4A_TYPES and x.shape[0] == 1
            and x.dtype in (torch.bfloat16, torch.float16)
            and os.environ.get("STRATA_DP4A") != "0" and launch.is_usable(x.device))


if triton is not None:

    @triton.jit
    def _dp4a(a, b, EMULATE: tl.constexpr):
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
    def _quantize_x_kernel(x_ptr, q_ptr, d_ptr, s_ptr, stride_x, num_cols,
                           BLOCK_SUBS: tl.constexpr):
        token = tl.program_id(1)
        num_subs = num_cols // 32
        sub = tl.program_id(0) * BLOCK_SUBS + tl.arange(0, BLOCK_SUBS)
        cols = sub[:, None] * 32 + tl.arange(0, 32)[None, :]  # [S, 32]
        ok = (sub < num_subs)[:, None]
        v = tl.load(x_ptr + token * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(v), axis=1)  # [S]
        scaled = v * tl.where(amax > 0, 127.0 / amax, 0.0)[:, None]
        q = (scaled + tl.where(scaled >= 0, 0.5, -0.5)).to(tl.int32)  # to nearest, ties away
        q = tl.minimum(tl.maximum(q, -127), 127)
        tl.store(q_ptr + token * num_cols + cols, q.to(tl.int8), mask=ok)
        d = amax / 127.0
        tl.store(d_ptr + token * num_subs + sub, d, mask=sub < num_subs)
        tl.store(s_ptr + token * num_subs + sub, d * tl.sum(q, axis=1).to(tl.float32),
                 mask=sub < num_subs)

    @triton.jit
    def _q4k_kernel(
        xq_ptr, xd_ptr, xs_ptr, w_ptr, w32_ptr, b_ptr, out_ptr, N, ROW_WORDS, num_groups,
        HAS_BIAS: tl.constexpr, USE_PDL: tl.constexpr, EMULATE: tl.constexpr,
        BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr, STAGES: tl.constexpr,
    ):
        """Group g of a row: the 32 bytes (8 words) of Q4_K block g // 4 holding sub-blocks
        2p (low nibbles) and 2p + 1 (high), p = g % 4; x sub-blocks 2g and 2g + 1."""
        pdl_wait(USE_PDL)
        GROUPS: tl.constexpr = BLOCK_COLS // 64
        rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        row_ok = (rows < N)[:, None, None]
        row_w = (rows.to(tl.int64) * ROW_WORDS)[:, None, None]  # [R, 1, 1] words
        word = tl.arange(0, 8)[None, None, :]  # [1, 1, 8]
        same_row = tl.zeros((BLOCK_ROWS, 1, 1), dtype=tl.int32)
        acc = tl.zeros((BLOCK_ROWS, GROUPS, 1), dtype=tl.float32)
        for g0 in tl.range(0, num_groups, GROUPS, num_stages=STAGES):
            group = g0 + tl.arange(0, GROUPS)[None, :, None]  # [1, G, 1]
            group_ok = group < num_groups
            ok = row_ok & group_ok
            blk = group // 4
            p = group % 4
            block_w = row_w + blk * 36  # 144 bytes
            q = tl.load(w32_ptr + block_w + 4 + p * 8 + word, mask=ok, other=0)  # [R, G, 8]
            # x at the weights' full shape: one layout for both loads (kernels.py).
            x_lo = xq_ptr + (group * 16 + same_row) + word
            lo = tl.sum(_dp4a(q & 0x0F0F0F0F, tl.load(x_lo, mask=group_ok, other=0), EMULATE),
                        axis=2, keep_dims=True)  # [R, G, 1]
            hi = tl.sum(_dp4a((q >> 4) & 0x0F0F0F0F, tl.load(x_lo + 8, mask=group_ok, other=0),
                              EMULATE), axis=2, keep_dims=True)
            dl0, ml0, dl1, ml1 = _k4_scales(w_ptr, block_w * 4, p, ok)
            d_lo = tl.load(xd_ptr + 2 * group, mask=group_ok, other=0.0)
            d_hi = tl.load(xd_ptr + 2 * group + 1, mask=group_ok, other=0.0)
            s_lo = tl.load(xs_ptr + 2 * group, mask=group_ok, other=0.0)
            s_hi = tl.load(xs_ptr + 2 * group + 1, mask=group_ok, other=0.0)
            acc += dl0 * d_lo * lo.to(tl.float32) - ml0 * s_lo
            acc += dl1 * d_hi * hi.to(tl.float32) - ml1 * s_hi
        total = tl.sum(tl.sum(acc, axis=2), axis=1)  # [R]
        rows_ok = rows < N
        if HAS_BIAS:
            total += tl.load(b_ptr + rows, mask=rows_ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + rows, total.to(out_ptr.dtype.element_ty), mask=rows_ok)

    _q4k_tuned = launch.tuned(_q4k_kernel, tuple(
        (n, k, w, {"STAGES": s}) for n, k, w, s in CONFIGS), key=("N", "num_groups"))


def quantize_x(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q int8 [M, K], d float32 [M, K/32], s float32 [M, K/32]) for x [M, K] (K % 32 == 0):
    x ~ d * q per 32 values, s = d * sum(q)."""
    num_tokens, num_cols = x.shape
    if num_cols % X_GROUP or x.stride(-1) != 1:
        raise ValueError(f"quantize_x takes rows of a multiple of {X_GROUP} contiguous values, "
                         f"got {tuple(x.shape)} strides {x.stride()}")
    num_subs = num_cols // X_GROUP
    q = torch.empty(num_tokens, num_cols, dtype=torch.int8, device=x.device)
    d = torch.empty(num_tokens, num_subs, dtype=torch.float32, device=x.device)
    s = torch.empty_like(d)
    _quantize_x_kernel[(triton.cdiv(num_subs, QUANTIZE_SUBS), num_tokens)](
        x, q, d, s, x.stride(0), num_cols, BLOCK_SUBS=QUANTIZE_SUBS)
    return q, d, s


def matmul(x: torch.Tensor, raw: torch.Tensor, qtype: int, num_rows: int,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [1, K] @ W^T (+ bias) for W [num_rows, K] in Q4_K blocks raw [num_rows, row_bytes];
    [1, num_rows] in x's dtype."""
    num_tokens, num_cols = x.shape
    if int(qtype) not in DP4A_TYPES or num_tokens != 1:
        raise ValueError(f"the dp4a kernel takes one token and Q4_K, got {tuple(x.shape)} "
                         f"and type {int(qtype)}")
    if raw.shape[1] % 4 or raw.shape[0] != num_rows or num_cols % 256:
        raise ValueError(f"Q4_K blocks of {num_rows} rows of {num_cols} columns must be "
                         f"uint8 [{num_rows}, 144 * {num_cols} / 256], got {tuple(raw.shape)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    xq, xd, xs = quantize_x(x)
    out = torch.empty(num_tokens, num_rows, dtype=x.dtype, device=x.device)
    candidates = (INTERPRETER_CONFIG if launch.is_interpreting() else CONFIGS)
    launch.launch(
        _q4k_tuned, lambda rows: (triton.cdiv(num_rows, rows),),
        tuple((n, k, w, {"STAGES": s}) for n, k, w, s in candidates),
        xq.view(torch.int32), xd, xs, raw, raw.view(torch.int32),
        bias if bias is not None else x, out, N=num_rows, ROW_WORDS=raw.shape[1] // 4,
        num_groups=num_cols // 64, HAS_BIAS=bias is not None,
        EMULATE=launch.is_interpreting(),
    )
    return out
