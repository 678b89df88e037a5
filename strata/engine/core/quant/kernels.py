"""Triton kernels over GGUF blocks: a skinny GEMM for decode and a dequantizer for prefill.

- `quant_matmul(x, w)`: x [M, K] (M <= MAX_DECODE_TOKENS) times the quantized W [N, K]^T.
  Each program owns BLOCK_N output rows and walks K in BLOCK_K columns, dequantizing each
  tile of blocks once in registers (dequant_tile.py) and reusing it for all M tokens: one
  token by a float32 multiply-and-sum, several by tl.dot on the compute dtype. Every block
  is read from memory once per call. The types decode reads most (Q4_K, Q5_K, Q6_K, Q8_0,
  Q4_0, Q4_1, Q5_0, Q5_1) take the planes kernel instead: whole groups of packed bytes per
  load and scales once per group (gemv_planes.py); the others dequant_tile.py's per value.
  `decode_kernel` says which of the two a type takes. One bf16/fp16 token times a dp4a type
  (dp4a_dots.DP4A_TYPES) takes gemv_dp4a.py's integer dot products instead (x rounded to int8
  per 32).
- `dequantize(raw, qtype, K, dtype)`: the whole matrix (or gathered rows: the embedding) in
  the compute dtype by dequant.py (planes for the planes types, autotuned), equal to gguf-py's
  dequantizer bit for bit before the final rounding; prefill multiplies it with cuBLAS.

On CUDA the tiles are autotuned per matrix shape (kernels/launch.py); under TRITON_INTERPRET=1
(the CPU tests) the first candidate runs: the same kernels, through the interpreter.
"""

from __future__ import annotations

import torch

from strata.engine.core.kernels import launch
from strata.engine.core.quant import dequant
from strata.engine.core.quant import dequant_tile as dt
from strata.engine.core.quant import gemv_dp4a as gp_dp4a
from strata.engine.core.quant import gemv_planes as gp
from strata.engine.core.quant.lookup import lookup_table

try:
    import triton
    import triton.language as tl

    from strata.engine.core.kernels.pdl import wait as pdl_wait
except ImportError:
    triton = None

MAX_DECODE_TOKENS = 16  # up to this many rows of x take the fused kernel (weight.py's too)
# (BLOCK_N, BLOCK_K, num_warps) candidates autotuned on CUDA. BLOCK_K is a multiple of every
# block size (256), so no block straddles two tiles. One token: few rows per program, so a
# small matrix still spreads over every SM; 2..16 tokens: tl.dot needs 16 rows or more.
MATMUL_CONFIGS = ((8, 256, 4), (4, 256, 4), (16, 256, 4), (4, 512, 4), (8, 512, 8))
DOT_MATMUL_CONFIGS = ((16, 256, 4), (32, 256, 4), (16, 512, 4), (64, 256, 8))
# The planes kernel (types in gemv_planes.ALL_PLANE_LANES): whole groups of packed bytes per
# program, so wider K tiles; a few rows per program keep every SM busy on a 4096-row matrix.
# The fourth field: pipeline stages of the K loop (1: none; 3: two tiles' loads in flight,
# which a few rows per program need to cover the memory latency).
PLANES_CONFIGS = ((2, 1024, 4, 1), (4, 1024, 4, 1), (2, 1024, 4, 3), (4, 1024, 4, 3),
                  (4, 2048, 8, 3), (8, 1024, 8, 3))
# 2..16 tokens: K tiles of 256 and 32 or 64 rows (wider tiles, or 16 rows, cost 1.3-3x the
# instructions per value for sm_90: bench/diag_quant_sass.py).
PLANES_DOT_CONFIGS = ((32, 256, 4, 3), (64, 256, 8, 3), (32, 256, 4, 1))
# The interpreter pays per program and per op, not per value: large tiles keep CPU tests fast.
INTERPRETER_MATMUL_CONFIG = (64, 256, 4)


def _candidates(configs) -> tuple:
    """launch.py's candidates: (rows, cols, warps) as is, (rows, cols, warps, stages) with
    the planes kernel's STAGES."""
    return tuple((n, k, w, None) if not extra else (n, k, w, {"STAGES": extra[0]})
                 for n, k, w, *extra in configs)


if triton is not None:

    @triton.jit
    def _matmul_kernel(
        x_ptr, w_ptr, wh_ptr, table_ptr, b_ptr, out_ptr, num_tokens, stride_x, stride_out,
        N: tl.constexpr, K: tl.constexpr, ROW_BYTES: tl.constexpr, QTYPE: tl.constexpr,
        HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, USE_PDL: tl.constexpr,
        BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr,
    ):
        pdl_wait(USE_PDL)  # launch.launch passes it; launched without PDL for now
        rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        row_ok = rows < N
        row_off = (rows.to(tl.int64) * ROW_BYTES)[:, None]  # [BN, 1]
        toks = tl.arange(0, BLOCK_M)
        tok_ok = toks < num_tokens
        acc = tl.zeros((BLOCK_M, BLOCK_ROWS), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_COLS):
            cols = k0 + tl.arange(0, BLOCK_COLS)
            col_ok = cols < K
            w = dt.dequant_tile(w_ptr, wh_ptr, table_ptr, row_off, cols[None, :],
                                row_ok[:, None] & col_ok[None, :], QTYPE)  # [BN, BK]
            x = tl.load(x_ptr + toks[:, None] * stride_x + cols[None, :],
                        mask=tok_ok[:, None] & col_ok[None, :], other=0.0)  # [BM, BK]
            if BLOCK_M == 1:
                acc += tl.sum(w * x.to(tl.float32), axis=1)[None, :]
            else:
                acc += tl.dot(x, tl.trans(w.to(x_ptr.dtype.element_ty)))
        if HAS_BIAS:
            acc += tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + toks[:, None] * stride_out + rows[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=tok_ok[:, None] & row_ok[None, :])

    @triton.jit
    def _planes_kernel(
        x_ptr, w_ptr, wh_ptr, table_ptr, b_ptr, out_ptr, num_tokens, stride_x, stride_out, N, K,
        ROW_BYTES, QTYPE: tl.constexpr, LANES: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
        USE_PDL: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr,
        STAGES: tl.constexpr,
    ):
        """The decode GEMM over whole groups of packed bytes (gemv_planes.py): one token
        multiplies and adds in float32 into a [rows, groups, lanes] accumulator summed once
        at the end; 2..16 tokens take tl.dot on each plane rounded to the compute dtype.
        STAGES > 1 has Triton's pipeliner keep the next tiles' loads in flight (cp.async)."""
        pdl_wait(USE_PDL)
        # Shapes are runtime values (Triton still specializes multiples of 16, which gives
        # the loads their alignment): one compile per type and tile serves every matrix.
        GROUPS: tl.constexpr = BLOCK_COLS // (2 * LANES)
        num_groups = K // (2 * LANES)
        rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        row_ok = rows < N
        row_off = (rows.to(tl.int64) * ROW_BYTES)[:, None, None]  # [BN, 1, 1]
        lane = tl.arange(0, LANES)[None, None, :]  # [1, 1, L]
        if BLOCK_M == 1:
            acc = tl.zeros((BLOCK_ROWS, GROUPS, LANES), dtype=tl.float32)
            same_row = tl.zeros((BLOCK_ROWS, 1, 1), dtype=tl.int32)
        else:
            toks = tl.arange(0, BLOCK_M)
            tok_ok = (toks < num_tokens)[:, None, None]
            x_rows = x_ptr + toks[:, None, None] * stride_x  # [BM, 1, 1]
            acc = tl.zeros((BLOCK_M, BLOCK_ROWS), dtype=tl.float32)
        for g0 in tl.range(0, num_groups, GROUPS, num_stages=STAGES):
            group = g0 + tl.arange(0, GROUPS)[None, :, None]  # [1, G, 1]
            group_ok = group < num_groups
            w0, cols0, w1, cols1 = gp.planes_lut(w_ptr, wh_ptr, table_ptr, row_off, group,
                                                 lane, row_ok[:, None, None] & group_ok, QTYPE)
            if BLOCK_M == 1:
                # x read at the weights' full [BN, G, L] shape: Triton then gives both loads
                # one layout, instead of moving every weight through shared memory to x's.
                x_at = x_ptr + (cols0 + same_row)
                x0 = tl.load(x_at, mask=group_ok, other=0.0).to(tl.float32)
                x1 = tl.load(x_at + (cols1 - cols0), mask=group_ok, other=0.0).to(tl.float32)
                acc += w0 * x0  # two statements: two FMAs, not a multiply and two adds
                acc += w1 * x1
            else:
                x0 = tl.load(x_rows + cols0, mask=tok_ok & group_ok, other=0.0)
                x1 = tl.load(x_rows + cols1, mask=tok_ok & group_ok, other=0.0)
                dtype = x_ptr.dtype.element_ty
                acc += tl.dot(tl.reshape(x0, (BLOCK_M, GROUPS * LANES)),
                              tl.trans(tl.reshape(w0.to(dtype), (BLOCK_ROWS, GROUPS * LANES))))
                acc += tl.dot(tl.reshape(x1, (BLOCK_M, GROUPS * LANES)),
                              tl.trans(tl.reshape(w1.to(dtype), (BLOCK_ROWS, GROUPS * LANES))))
        if BLOCK_M == 1:
            total = tl.sum(tl.sum(acc, axis=2), axis=1)[None, :]  # [1, BN]
            toks = tl.arange(0, 1)
        else:
            total = acc
        if HAS_BIAS:
            total += tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + toks[:, None] * stride_out + rows[None, :],
                 total.to(out_ptr.dtype.element_ty), mask=(toks < num_tokens)[:, None]
                 & row_ok[None, :])

    # One tuned launcher per path: their candidate tiles differ (tl.dot's 16-row minimum).
    _matmul_tuned = {
        path: launch.tuned(_matmul_kernel, _candidates(configs), key=("N", "K", "QTYPE"))
        for path, configs in (("sum", MATMUL_CONFIGS), ("dot", DOT_MATMUL_CONFIGS))
    }
    _planes_tuned = {
        path: launch.tuned(_planes_kernel, _candidates(configs), key=("N", "K", "QTYPE"))
        for path, configs in (("sum", PLANES_CONFIGS), ("dot", PLANES_DOT_CONFIGS))
    }


def _matmul_candidates(configs: tuple) -> tuple:
    if launch.is_interpreting():
        stages = (1,) if len(configs[0]) == 4 else ()
        return _candidates(((*INTERPRETER_MATMUL_CONFIG, *stages),))
    return _candidates(configs)


def decode_kernel(qtype: int) -> str:
    """Which kernel multiplies 1..16 tokens by a weight of qtype: "planes" (gemv_planes.py)
    or "tile" (dequant_tile.py), both on values dequantized in float."""
    return "planes" if int(qtype) in gp.ALL_PLANE_LANES else "tile"


def _check(raw: torch.Tensor, num_cols: int) -> None:
    if raw.dtype != torch.uint8 or raw.dim() != 2 or not raw.is_contiguous():
        raise ValueError(f"quantized blocks must be a contiguous uint8 [rows, row_bytes] "
                         f"tensor, got {raw.dtype} {tuple(raw.shape)}")
    if raw.shape[1] % 2:
        raise ValueError(f"a row of {raw.shape[1]} bytes cannot hold whole GGML blocks")
    del num_cols


def dequantize(raw: torch.Tensor, qtype: int, num_cols: int, dtype: torch.dtype,
               out: torch.Tensor | None = None, gathered: bool = False) -> torch.Tensor:
    """W [rows, num_cols] in dtype from its blocks raw [rows, row_bytes]; into out if given
    (dequant.py: gathered rows, an embedding's, are tuned once per shape, not per count)."""
    return dequant.dequantize(raw, qtype, num_cols, dtype, out, gathered=gathered)


def quant_matmul(x: torch.Tensor, raw: torch.Tensor, qtype: int, num_rows: int,
                 bias: torch.Tensor | None = None, use_pdl: bool = False,
                 rounded: tuple | None = None) -> torch.Tensor:
    """x [M, K] @ W^T (+ bias) for W [num_rows, K] in blocks raw; [M, num_rows] in x's dtype.
    M <= MAX_DECODE_TOKENS. use_pdl: the dp4a path (one token) launches as a PDL secondary;
    the others ignore it (they wait as usual). rounded: x's int8 rounding made with x, which
    the dp4a path reads instead of rounding x again (gemv_dp4a.rounded_words); others read x."""
    num_tokens, num_cols = x.shape
    _check(raw, num_cols)
    if not 0 < num_tokens <= MAX_DECODE_TOKENS or raw.shape[0] != num_rows:
        raise ValueError(f"quant_matmul takes 1..{MAX_DECODE_TOKENS} tokens and a weight of "
                         f"{num_rows} rows; got x {tuple(x.shape)}, blocks {tuple(raw.shape)}")
    if gp_dp4a.is_enabled(x, qtype, raw):
        return gp_dp4a.matmul(x, raw, qtype, num_rows, bias, use_pdl, rounded)
    kernel = decode_kernel(qtype)
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(num_tokens, num_rows, dtype=x.dtype, device=x.device)
    # tl.dot needs 16 rows; one token keeps the float32 multiply-and-sum.
    block_m = 1 if num_tokens == 1 else 16
    path = "sum" if block_m == 1 else "dot"
    grid = lambda rows: (triton.cdiv(num_rows, rows),)  # noqa: E731
    if kernel == "planes":
        lanes = gp.ALL_PLANE_LANES[int(qtype)]
        launch.launch(
            _planes_tuned[path], grid,
            _matmul_candidates(PLANES_CONFIGS if path == "sum" else PLANES_DOT_CONFIGS),
            x, raw, raw.view(torch.float16), lookup_table(raw.device),
            bias if bias is not None else x, out, num_tokens,
            x.stride(0), out.stride(0), N=num_rows, K=num_cols, ROW_BYTES=raw.shape[1],
            QTYPE=int(qtype), LANES=lanes, HAS_BIAS=bias is not None, BLOCK_M=block_m,
        )
        return out
    launch.launch(
        _matmul_tuned[path], grid,
        _matmul_candidates(MATMUL_CONFIGS if path == "sum" else DOT_MATMUL_CONFIGS),
        x, raw, raw.view(torch.float16), lookup_table(raw.device),
        bias if bias is not None else x, out, num_tokens, x.stride(0), out.stride(0),
        N=num_rows, K=num_cols, ROW_BYTES=raw.shape[1], QTYPE=int(qtype),
        HAS_BIAS=bias is not None, BLOCK_M=block_m,
    )
    return out
