"""GGUF blocks to the compute dtype, whole matrices at memory speed: the one dequantizer.

`dequantize(raw, qtype, K, dtype)` serves the dense prefill scratch (weight.qlinear) and the
embedding's rows; `dequantize_experts(experts, first, out)` a run of an expert stack's
matrices (the MoE prefill's expert groups), into an output
whose matrices may sit further apart than N * K (gate and up side by side in one scratch).

The types gemv_planes.py reads (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q4_K, Q5_K, Q6_K, and
IQ2_XXS through the lookup table) take its `planes_lut`: each group's packed bytes in one
load, its scales once per group, small integers to floats by the 2**23 exponent trick, and
every plane stored as one run of LANES consecutive values (16 or 32: 32 or 64 bytes in
bf16), which the stores vectorize. The other types keep dequant_tile.py's decode value by
value. Both compute each value in gguf-py's order of float operations (d * sc, then * q,
then - m or + m, as its numpy code does), and the kernel is compiled with floating-point
contraction off, so the float32 values equal `gguf.quants.dequantize` bit for bit and the
cast rounds them once.

Tiles are autotuned on CUDA per (rows, K, type) through kernels/launch.py; gathered rows
(the embedding: a different count every call) tune once per (K, type), so a CUDA graph
never meets a new key. Under TRITON_INTERPRET=1 one tile sized to the matrix runs.

Imported on first use (like kernels.py): importing it decorates a Triton kernel, which must
wait until a test has chosen the CPU interpreter.
"""

from __future__ import annotations

import torch

from strata.engine.core.kernels import launch
from strata.engine.core.quant import dequant_tile as dt
from strata.engine.core.quant import gemv_planes as gp
from strata.engine.core.quant.lookup import lookup_table

try:
    import triton
    import triton.language as tl

    from strata.engine.core.kernels.pdl import wait as pdl_wait
except ImportError:
    triton = None

# (BLOCK_ROWS, BLOCK_COLS, num_warps) candidates. Planes: 32 values a thread (at 64, Triton
# moves every value through shared memory twice; at 16 the per-group scale decode doubles
# per value): 13.75 sm_90 instructions per Q4_K value, 18 per Q6_K one, against about 20
# an H200 can spend per value at its HBM bandwidth. Rows against columns: long strips for
# long rows, (16, 256) for the experts' K of 768 (no masked half tile). BLOCK_COLS is a
# multiple of 256, so every tile holds whole Q6_K group sets.
PLANES_CONFIGS = ((4, 1024, 4), (8, 1024, 8), (2, 2048, 4), (16, 256, 4), (8, 512, 4))
# The per-value decode: the old fixed tile (16, 256) first, then wider ones.
TILE_CONFIGS = ((16, 256, 4), (32, 256, 8), (8, 512, 4), (16, 512, 8))
INTERPRETER_VALUES = 1 << 16  # the interpreter's tile (see candidates)
MAX_UNIT = 16  # bytes (or values, for the output): alignment the kernel may assume
WORD_TYPES = frozenset({dt.Q4_K, dt.Q5_K})  # planes reads their scales as int32 words
SCALES_PER_LANE_TYPES = frozenset({dt.Q4_1, dt.Q5_0, dt.Q5_1})  # see the kernel


def _unit(*values: int) -> int:
    """The largest power of two <= MAX_UNIT dividing every value."""
    unit = MAX_UNIT
    while unit > 1 and any(v % unit for v in values):
        unit //= 2
    return unit


def candidates(kernel: str, num_rows: int = 1, num_cols: int = 1) -> tuple:
    """launch.py's candidates for "planes" or "tile". The interpreter's one tile: as many of
    INTERPRETER_VALUES as the matrix fills (it pays per program and per op on the whole
    tile, masked lanes included), at least 256 columns (whole Q6_K group sets)."""
    if launch.is_interpreting():
        cols = min(1024, max(256, triton.next_power_of_2(num_cols)))
        rows = min(INTERPRETER_VALUES // cols, triton.next_power_of_2(num_rows))
        return ((rows, cols, 4, None),)
    return tuple((n, k, w, None) for n, k, w in
                 (PLANES_CONFIGS if kernel == "planes" else TILE_CONFIGS))


if triton is not None:

    # Counts and strides vary per call (gathered rows) or per expert group: never
    # specialized, so none compiles again inside a CUDA graph capture. K and row_bytes stay
    # specialized: their divisibility by 16 is what lets the loads and stores vectorize.
    @triton.jit(do_not_specialize=["num_rows", "tune_rows", "rows_per_matrix",
                                   "matrix_stride", "out_matrix_stride"])
    def _dequant_kernel(
        w_ptr, wh_ptr, lut_ptr, out_ptr, num_rows, tune_rows, K, row_bytes, rows_per_matrix,
        matrix_stride, out_matrix_stride,
        QTYPE: tl.constexpr, LANES: tl.constexpr, SCALES_PER_LANE: tl.constexpr,
        UNIT: tl.constexpr, OUT_UNIT: tl.constexpr, USE_PDL: tl.constexpr,
        BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr,
    ):
        """Rows r of a stack of matrices: matrix r // rows_per_matrix (its blocks
        matrix_stride * UNIT bytes apart, its output out_matrix_stride * OUT_UNIT values
        apart), row r % rows_per_matrix. tune_rows: only the autotuner's key."""
        pdl_wait(USE_PDL)  # launch.launch_meta passes it; launched without PDL for now
        rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        row_ok = rows < num_rows
        matrix = (rows // rows_per_matrix).to(tl.int64)
        row = (rows % rows_per_matrix).to(tl.int64)
        # Strides as multiples of a constexpr unit: Triton then knows their alignment.
        row_off = matrix * matrix_stride * UNIT + row * row_bytes
        out_row = out_ptr + (matrix * out_matrix_stride * OUT_UNIT + row * K)
        dtype: tl.constexpr = out_ptr.dtype.element_ty
        if LANES > 0:
            GROUPS: tl.constexpr = BLOCK_COLS // (2 * LANES)
            # Runs of 8 lanes a thread: the bf16 stores' 16-byte vectors. Loads cut to the
            # same 8 bytes give loads, arithmetic and stores one layout (no shared-memory
            # round trip of the values; sm_90 SASS, at 32 values a thread).
            lane = tl.max_contiguous(tl.arange(0, LANES), 8)[None, None, :]  # [1, 1, L]
            group = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)[None, :, None]  # [1, G, 1]
            ok = row_ok[:, None, None] & (group < K // (2 * LANES))  # [R, G, 1]
            if SCALES_PER_LANE:
                # Two fp16 fields or a qh word per group (Q4_1, Q5_0, Q5_1): read at every
                # lane's address instead, or Triton moves all values to the scales' layout
                # and back through shared memory (4 conversions) rather than the scales.
                group = group + lane * 0  # [1, G, L]
            w0, cols0, w1, cols1 = gp.planes_lut(w_ptr, wh_ptr, lut_ptr, row_off[:, None, None],
                                                 group, lane, ok, QTYPE)  # [R, G, L] each
            # Each plane's L columns are consecutive: two stores of contiguous runs.
            out_at = out_row[:, None, None]
            tl.store(out_at + cols0, w0.to(dtype), mask=ok)
            tl.store(out_at + cols1, w1.to(dtype), mask=ok)
        else:
            cols = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
            ok = row_ok[:, None] & (cols < K)[None, :]
            v = dt.dequant_tile(w_ptr, wh_ptr, lut_ptr, row_off[:, None], cols[None, :], ok,
                                QTYPE)
            tl.store(out_row[:, None] + cols[None, :], v.to(dtype), mask=ok)

    # One tuned launcher per decoding: their candidates differ.
    _tuned = {kernel: launch.tuned(_dequant_kernel, candidates(kernel),
                                   key=("tune_rows", "K", "QTYPE"))
              for kernel in ("planes", "tile")}


def kernel_for(qtype: int, raw: torch.Tensor, matrix_stride: int = 0) -> str:
    """"planes" where gemv_planes.py reads the type and the blocks are aligned for its loads
    (even bytes; 4-aligned for the K-quants' int32 scale words), else "tile"."""
    qtype = int(qtype)
    if qtype not in gp.ALL_PLANE_LANES:
        return "tile"
    needed = 4 if qtype in WORD_TYPES else 2
    aligned = _unit(raw.data_ptr(), matrix_stride, raw.shape[-1]) >= needed
    return "planes" if aligned else "tile"


def _launch(raw: torch.Tensor, qtype: int, num_rows: int, num_cols: int, out: torch.Tensor,
            rows_per_matrix: int, matrix_stride: int, out_matrix_stride: int,
            tune_rows: int, fixed: tuple[str, tuple[int, int, int]] | None = None) -> None:
    """fixed: (kernel, (BLOCK_ROWS, BLOCK_COLS, num_warps)) bypasses the autotuner (tests of
    every candidate, benches of the old tile); None: kernel_for's kernel, autotuned."""
    if raw.data_ptr() % 2 or matrix_stride % 2:
        raise ValueError("GGML blocks must start at even bytes (their fp16 fields)")
    kernel = fixed[0] if fixed else kernel_for(qtype, raw, matrix_stride)
    lanes = gp.ALL_PLANE_LANES[int(qtype)] if kernel == "planes" else 0
    unit, out_unit = _unit(matrix_stride), _unit(out_matrix_stride)
    grid = lambda meta: (triton.cdiv(num_rows, meta["BLOCK_ROWS"]),  # noqa: E731
                         triton.cdiv(num_cols, meta["BLOCK_COLS"]))
    args = (raw, raw.view(torch.float16), lookup_table(raw.device), out, num_rows, tune_rows,
            num_cols, raw.shape[-1], rows_per_matrix, matrix_stride // unit,
            out_matrix_stride // out_unit)
    # No contraction: d * q - m rounds twice, as numpy does, so values equal gguf-py's.
    constexprs = {"QTYPE": int(qtype), "LANES": lanes,
                  "SCALES_PER_LANE": int(qtype) in SCALES_PER_LANE_TYPES, "UNIT": unit,
                  "OUT_UNIT": out_unit, "enable_fp_fusion": False}
    if fixed is None:
        launch.launch_meta(_tuned[kernel], grid, candidates(kernel, num_rows, num_cols), *args,
                           **constexprs)
        return
    rows, cols, warps = fixed[1]
    meta = {"BLOCK_ROWS": rows, "BLOCK_COLS": cols}
    _dequant_kernel[grid(meta)](*args, **constexprs, **meta, USE_PDL=False, num_warps=warps)


def dequantize(raw: torch.Tensor, qtype: int, num_cols: int, dtype: torch.dtype,
               out: torch.Tensor | None = None, gathered: bool = False,
               fixed: tuple[str, tuple[int, int, int]] | None = None) -> torch.Tensor:
    """W [rows, num_cols] in dtype from its blocks raw [rows, row_bytes] (contiguous uint8);
    into out if given. gathered: rows picked per call (an embedding lookup), tuned once.
    fixed: a kernel and tile instead of the autotuner's (see _launch)."""
    if raw.dtype != torch.uint8 or raw.dim() != 2 or not raw.is_contiguous():
        raise ValueError(f"quantized blocks must be a contiguous uint8 [rows, row_bytes] "
                         f"tensor, got {raw.dtype} {tuple(raw.shape)}")
    if raw.shape[1] % 2:
        raise ValueError(f"a row of {raw.shape[1]} bytes cannot hold whole GGML blocks")
    num_rows = raw.shape[0]
    if out is None:
        out = torch.empty(num_rows, num_cols, dtype=dtype, device=raw.device)
    if out.shape != (num_rows, num_cols) or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous [{num_rows}, {num_cols}] tensor, got "
                         f"{tuple(out.shape)}")
    if num_rows:
        _launch(raw, qtype, num_rows, num_cols, out, num_rows, 0, 0,
                0 if gathered else num_rows, fixed)
    return out


def dequantize_experts(experts, first: int, out: torch.Tensor,
                       fixed: tuple[str, tuple[int, int, int]] | None = None) -> torch.Tensor:
    """Experts first..first + out.shape[0] - 1 of a QuantizedExperts stack [E, N, K] (not
    imported here: experts.py imports weight.py, which imports this) into out [count, N, K]
    (rows contiguous; out.stride(0) may exceed N * K); returns out."""
    count, rows, cols = out.shape
    if (out.shape[1:] != experts.shape[1:] or out.stride()[1:] != (cols, 1)
            or not 0 <= first <= first + count <= experts.num_experts):
        raise ValueError(f"out {tuple(out.shape)} strides {out.stride()} cannot take experts "
                         f"{first}..{first + count - 1} of {experts.shape}")
    if count:
        raw = experts.raw[first:first + count]
        _launch(raw, experts.qtype, count * rows, cols, out, rows, experts.expert_stride,
                out.stride(0), count * rows, fixed)
    return out
