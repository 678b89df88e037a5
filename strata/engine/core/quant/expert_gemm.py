"""Many rows through resident quantized experts: grouped GEMMs that decode GGML blocks in the
K loop, so a prefill chunk never writes (and re-reads) every expert dequantized.

The rows come sorted by expert (moe_prefill.sort_by_expert): expert e owns rows
offsets[e-1]..offsets[e]-1. Two launches a layer:

1. `gate_up`: act = silu(rows @ gate[e]^T) * (rows @ up[e]^T) * row_weight, [R, I]; gate and
   up in one program (two accumulators), with the rounding of moe_prefill._grouped followed
   by pointwise.silu_mul_scale: each product, the SiLU and every multiply rounded to the
   rows' dtype in that order.
2. `down`: act @ down[e]^T -> [R, H].

Each program owns one BLOCK_M tile of one expert's rows and BLOCK_ROWS outputs. The
schedule is worked out in the program from the offsets (device memory: no host sync, CUDA
graph safe): tile m of the grid's second axis belongs to the expert whose running count of
ceil(rows / BLOCK_M) tiles first exceeds m (vLLM's fused_moe aligns rows to blocks likewise,
with a separate sort kernel). The grid is a fixed upper bound, ceil(R / BLOCK_M) + E tiles;
programs past the last tile exit at once. Computing it in the program, not by torch ops
before the launch, lets the autotuner choose BLOCK_M: the right tile follows the rows per
expert (R*k/E: 32 for a 512-token chunk of Qwen3-30B-A3B).

In the K loop, each weight tile [BLOCK_ROWS, BLOCK_COLS] is decoded in registers once per M
tile and multiplied by tl.dot in the rows' dtype with float32 accumulation: the types
gemv_planes.planes_lut reads (Q4_K, Q6_K, Q8_0, IQ2_XXS, ...) by its planes (whole groups
of packed bytes, scales once per group), the other types dequant_tile.py decodes (Q3_K and
the other I-quants) value by value, reading a sub-block's scale and sign word again for
each value. Under the CPU interpreter tl.dot multiplies in float32 (Triton 3.9's
interpreter multiplies bf16 as raw bits: fast/moe_batch._precision).

Imported on first use (like kernels.py): importing it decorates Triton kernels, which must
wait until a test has chosen the CPU interpreter.
"""

from __future__ import annotations

import torch

from strata.engine.core.kernels import launch
from strata.engine.core.quant import dequant_tile as dt
from strata.engine.core.quant import expert_gemv
from strata.engine.core.quant import gemv_planes as gp
from strata.engine.core.quant import grouped_launch as gl
from strata.engine.core.quant.experts import QuantizedExperts, fp16_view
from strata.engine.core.quant.lookup import lookup_table

try:
    import triton
    import triton.language as tl

    from strata.engine.core.kernels.pdl import wait as pdl_wait
except ImportError:
    triton = None

# Every type dequant_tile.py decodes (its last branch takes IQ1_M for any other value).
TILE_TYPES = frozenset({dt.Q4_0, dt.Q4_1, dt.Q5_0, dt.Q5_1, dt.Q8_0, dt.Q2_K, dt.Q3_K,
                        dt.Q4_K, dt.Q5_K, dt.Q6_K, dt.IQ4_NL, dt.IQ4_XS, dt.IQ2_XXS,
                        dt.IQ2_XS, dt.IQ3_XXS, dt.IQ1_S, dt.IQ3_S, dt.IQ2_S, dt.IQ1_M})
# (BLOCK_ROWS, BLOCK_COLS, num_warps, BLOCK_M, STAGES) candidates, autotuned on CUDA per
# shape, types and rows-per-expert bucket. BLOCK_COLS is a multiple of 128, so a K tile
# covers the same columns in every planes type (a Q6_K group pair spans 128); tl.dot needs
# 16 or more along every side. Decoding, not the MMA, bounds these kernels (about 8-12 sm_90
# instructions per Q4_K value, 17-23 per Q6_K one, against 1/32 MMA per value and row), and
# each M tile decodes its expert's weights again: BLOCK_M up to 128 for long chunks.
# Compiled for sm_90 without a GPU: no spills for Q4_K and Q8_0; Q6_K's gate_up spills in
# the 4-warp tiles of 64 outputs, which leaves it the others.
# Few rows per expert (short prompts) waste MMA lanes on padding, not decoding: no tile
# below 32 rows. Four candidates each: every one costs a compile per type on first use.
# No 32-output tile at 4 warps: Triton 3.6's sm_90 code for it (wgmma m64n32, two dots a
# K step) faults with an illegal shared-memory read under the autotuner's repeated launches
# (Q2_K down at [2048, 768], run 18; triton-lang/triton#11366 is the same class). Launched
# and synchronized one at a time it ran clean 400 times: only the engine's load met it.
GATE_UP_CONFIGS = ((64, 128, 4, 64, 2), (64, 128, 4, 32, 2), (64, 128, 8, 128, 2),
                   (64, 128, 8, 32, 2))
DOWN_CONFIGS = ((64, 128, 4, 64, 2), (128, 128, 8, 64, 2), (128, 128, 8, 128, 2),
                (64, 128, 4, 32, 2))
# The interpreter pays per program and per op, not per value: wide tiles, except BLOCK_M,
# which the tests want smaller than some experts' rows.
INTERPRETER_CONFIG = ((128, 256, 4, 16, 1),)


def _candidates(configs: tuple) -> tuple:
    return gl.candidates(configs, INTERPRETER_CONFIG)


if triton is not None:

    @triton.jit
    def _m_tile(offsets_ptr, pid_m, NUM_EXPERTS: tl.constexpr, BLOCK_E: tl.constexpr,
                BLOCK_M: tl.constexpr):
        """(expert, first row, end row) of M tile pid_m; expert >= NUM_EXPERTS past the last
        tile. Experts' tiles follow each other in expert order, ceil(rows / BLOCK_M) each."""
        e = tl.arange(0, BLOCK_E)
        valid = e < NUM_EXPERTS
        ends = tl.load(offsets_ptr + e, mask=valid, other=0)
        begins = tl.load(offsets_ptr + e - 1, mask=valid & (e > 0), other=0)
        tiles = (ends - begins + BLOCK_M - 1) // BLOCK_M
        tile_ends = tl.cumsum(tiles, 0)  # padding experts: the total, which no tile reaches
        expert = tl.sum((tile_ends <= pid_m).to(tl.int32), 0)
        pick = e == expert
        first_tile = tl.sum(tl.where(pick, tile_ends - tiles, 0), 0)
        first_row = tl.sum(tl.where(pick, begins, 0), 0) + (pid_m - first_tile) * BLOCK_M
        return expert, first_row, tl.sum(tl.where(pick, ends, 0), 0)

    @triton.jit
    def _dot(x, w, acc, PRECISION: tl.constexpr):
        """acc + x [M, C] @ w [N, C]^T: float32 exactly ("ieee"), else in x's dtype."""
        if PRECISION == "ieee":
            return tl.dot(x.to(tl.float32), tl.trans(w), acc, input_precision="ieee")
        else:
            return tl.dot(x, tl.trans(w.to(x.dtype)), acc)

    @triton.jit
    def _tile_dot(acc, x_ptr, x_row, row_ok, w_ptr, wh_ptr, lut_ptr, w_row, n_ok, k0, K,
                  QTYPE: tl.constexpr, LANES: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                  BLOCK_COLS: tl.constexpr, PRECISION: tl.constexpr):
        """acc [BM, BN] + x[rows, k0:k0+BLOCK_COLS] @ W[n, same columns]^T, W decoded from
        its blocks. x_row [BM, 1] element offsets of the rows, w_row [BN, 1] byte offsets of
        the weight rows; LANES > 0: the planes decoding, else dequant_tile's."""
        HALF: tl.constexpr = BLOCK_COLS // 2
        if LANES > 0:
            # Two planes of [BN, G, L], each multiplied by x gathered at its columns.
            GROUPS: tl.constexpr = BLOCK_COLS // (2 * LANES)
            group = k0 // (2 * LANES) + tl.arange(0, GROUPS)[None, :, None]  # [1, G, 1]
            lane = tl.arange(0, LANES)[None, None, :]  # [1, 1, L]
            ok = n_ok[:, :, None] & (group < K // (2 * LANES))
            w0, cols0, w1, cols1 = gp.planes_lut(w_ptr, wh_ptr, lut_ptr, w_row[:, :, None],
                                                 group, lane, ok, QTYPE)
            w0 = tl.reshape(w0, (BLOCK_ROWS, HALF))
            w1 = tl.reshape(w1, (BLOCK_ROWS, HALF))
            cols0 = tl.reshape(cols0, (1, HALF))
            cols1 = tl.reshape(cols1, (1, HALF))
        else:
            cols0 = k0 + tl.arange(0, HALF)[None, :]  # [1, C]
            cols1 = cols0 + HALF
            w0 = dt.dequant_tile(w_ptr, wh_ptr, lut_ptr, w_row, cols0, n_ok & (cols0 < K), QTYPE)
            w1 = dt.dequant_tile(w_ptr, wh_ptr, lut_ptr, w_row, cols1, n_ok & (cols1 < K), QTYPE)
        x0 = tl.load(x_ptr + (x_row + cols0), mask=row_ok & (cols0 < K), other=0.0)
        x1 = tl.load(x_ptr + (x_row + cols1), mask=row_ok & (cols1 < K), other=0.0)
        acc = _dot(x0, w0, acc, PRECISION)
        return _dot(x1, w1, acc, PRECISION)

    @triton.jit
    def _round(v, dtype: tl.constexpr):
        """v rounded to dtype, back in float32: where eager torch rounds an intermediate."""
        return v.to(dtype).to(tl.float32)

    # Runtime sizes are not specialized: a new chunk length or layer never compiles again
    # (a CUDA graph capture cannot hold a compile).
    @triton.jit(do_not_specialize=["num_rows", "rows_hint", "gate_stride", "up_stride"])
    def _gate_up_kernel(
        x_ptr, offsets_ptr, row_w_ptr, gate_ptr, gate_h_ptr, up_ptr, up_h_ptr, lut_ptr,
        out_ptr, num_rows, rows_hint, gate_stride, up_stride, N, K, gate_row_bytes,
        up_row_bytes,
        NUM_EXPERTS: tl.constexpr, BLOCK_E: tl.constexpr,
        GATE_QTYPE: tl.constexpr, GATE_LANES: tl.constexpr, GATE_UNIT: tl.constexpr,
        UP_QTYPE: tl.constexpr, UP_LANES: tl.constexpr, UP_UNIT: tl.constexpr,
        PRECISION: tl.constexpr, USE_PDL: tl.constexpr, BLOCK_ROWS: tl.constexpr,
        BLOCK_COLS: tl.constexpr, BLOCK_M: tl.constexpr, STAGES: tl.constexpr,
    ):
        pdl_wait(USE_PDL)  # launch.launch_meta passes it; launched without PDL for now
        expert, first_row, end_row = _m_tile(offsets_ptr, tl.program_id(1), NUM_EXPERTS,
                                             BLOCK_E, BLOCK_M)
        if expert >= NUM_EXPERTS:  # past the last tile of this chunk's routing
            return
        rows = first_row + tl.arange(0, BLOCK_M)
        row_ok = (rows < end_row)[:, None]  # [BM, 1]
        x_row = rows.to(tl.int64)[:, None] * K
        n = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        n_ok = (n < N)[:, None]  # [BN, 1]
        n64 = n.to(tl.int64)[:, None]
        e64 = expert.to(tl.int64)
        # Strides in units of UNIT bytes, times the constexpr: Triton knows the alignment.
        gate_row = e64 * gate_stride * GATE_UNIT + n64 * gate_row_bytes
        up_row = e64 * up_stride * UP_UNIT + n64 * up_row_bytes
        acc_gate = tl.zeros((BLOCK_M, BLOCK_ROWS), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_ROWS), dtype=tl.float32)
        for k0 in tl.range(0, K, BLOCK_COLS, num_stages=STAGES):
            acc_gate = _tile_dot(acc_gate, x_ptr, x_row, row_ok, gate_ptr, gate_h_ptr, lut_ptr,
                                 gate_row, n_ok, k0, K, GATE_QTYPE, GATE_LANES, BLOCK_ROWS,
                                 BLOCK_COLS, PRECISION)
            acc_up = _tile_dot(acc_up, x_ptr, x_row, row_ok, up_ptr, up_h_ptr, lut_ptr, up_row,
                               n_ok, k0, K, UP_QTYPE, UP_LANES, BLOCK_ROWS, BLOCK_COLS,
                               PRECISION)
        dtype: tl.constexpr = out_ptr.dtype.element_ty
        # _grouped's products in the rows' dtype, then silu_mul_scale's three roundings.
        g = _round(acc_gate, dtype)
        silu = _round(g / (1.0 + tl.exp(-g)), dtype)
        act = _round(silu * _round(acc_up, dtype), dtype)
        weight = tl.load(row_w_ptr + rows, mask=rows < end_row, other=0.0).to(tl.float32)
        act = act * weight[:, None]
        tl.store(out_ptr + (rows.to(tl.int64)[:, None] * N + n[None, :]), act.to(dtype),
                 mask=row_ok & (n < N)[None, :])

    @triton.jit(do_not_specialize=["num_rows", "rows_hint", "stride"])
    def _down_kernel(
        x_ptr, offsets_ptr, w_ptr, wh_ptr, lut_ptr, out_ptr, num_rows, rows_hint, stride, N,
        K, row_bytes,
        NUM_EXPERTS: tl.constexpr, BLOCK_E: tl.constexpr, QTYPE: tl.constexpr,
        LANES: tl.constexpr, UNIT: tl.constexpr, PRECISION: tl.constexpr,
        USE_PDL: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr,
        BLOCK_M: tl.constexpr, STAGES: tl.constexpr,
    ):
        pdl_wait(USE_PDL)
        expert, first_row, end_row = _m_tile(offsets_ptr, tl.program_id(1), NUM_EXPERTS,
                                             BLOCK_E, BLOCK_M)
        if expert >= NUM_EXPERTS:
            return
        rows = first_row + tl.arange(0, BLOCK_M)
        row_ok = (rows < end_row)[:, None]
        x_row = rows.to(tl.int64)[:, None] * K
        n = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        n_ok = (n < N)[:, None]
        w_row = expert.to(tl.int64) * stride * UNIT + n.to(tl.int64)[:, None] * row_bytes
        acc = tl.zeros((BLOCK_M, BLOCK_ROWS), dtype=tl.float32)
        for k0 in tl.range(0, K, BLOCK_COLS, num_stages=STAGES):
            acc = _tile_dot(acc, x_ptr, x_row, row_ok, w_ptr, wh_ptr, lut_ptr, w_row, n_ok, k0,
                            K, QTYPE, LANES, BLOCK_ROWS, BLOCK_COLS, PRECISION)
        tl.store(out_ptr + (rows.to(tl.int64)[:, None] * N + n[None, :]),
                 acc.to(out_ptr.dtype.element_ty), mask=row_ok & (n < N)[None, :])

    _gate_up_tuned = launch.tuned(_gate_up_kernel, _candidates(GATE_UP_CONFIGS),
                                  key=("N", "K", "GATE_QTYPE", "UP_QTYPE", "rows_hint"))
    _down_tuned = launch.tuned(_down_kernel, _candidates(DOWN_CONFIGS),
                               key=("N", "K", "QTYPE", "rows_hint"))


def decoding(experts: QuantizedExperts) -> tuple[int, int]:
    """(planes lanes, or 0 for dequant_tile's decoding; alignment unit in bytes)."""
    lanes = gp.ALL_PLANE_LANES.get(int(experts.qtype), 0)
    if lanes and not expert_gemv.is_supported(experts):  # misaligned for the planes loads
        lanes = 0
    return lanes, expert_gemv.alignment_unit(experts)


def is_supported(experts: QuantizedExperts) -> bool:
    """Whether the kernels decode this projection's blocks (every dequant_tile.py type)."""
    return (triton is not None and int(experts.qtype) in TILE_TYPES
            and experts.raw.data_ptr() % 2 == 0)


def supports(gate: QuantizedExperts, up: QuantizedExperts, down: QuantizedExperts) -> bool:
    """Whether `experts_mlp` takes these three projections (else dequantize-then-GEMM)."""
    return all(is_supported(w) for w in (gate, up, down))


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 or launch.is_interpreting() else "native"


def _check(rows: torch.Tensor, offsets: torch.Tensor, experts: QuantizedExperts) -> None:
    num_experts, _, num_cols = experts.shape
    if rows.dim() != 2 or rows.shape[1] != num_cols or not rows.is_contiguous():
        raise ValueError(f"rows must be contiguous [R, {num_cols}], got {tuple(rows.shape)}")
    if (offsets.shape != (num_experts,) or offsets.dtype != torch.int32
            or not offsets.is_contiguous()):
        raise ValueError(f"offsets must be contiguous int32 [{num_experts}], got "
                         f"{offsets.dtype} {tuple(offsets.shape)}")
    if not is_supported(experts):
        raise ValueError(f"no grouped kernel decodes {experts.qtype.name} experts")


def gate_up(rows: torch.Tensor, offsets: torch.Tensor, gate: QuantizedExperts,
            up: QuantizedExperts, row_weights: torch.Tensor) -> torch.Tensor:
    """silu(rows @ gate[e]^T) * (rows @ up[e]^T) * row_weights[:, None] for the rows [R, H]
    each expert e owns (offsets [E] int32: cumulative ends); [R, I] in the rows' dtype."""
    _check(rows, offsets, gate)
    _check(rows, offsets, up)
    num_experts, num_outputs, num_cols = gate.shape
    num_rows = rows.shape[0]
    if up.shape != gate.shape or row_weights.shape != (num_rows,):
        raise ValueError(f"gate {gate.shape}, up {up.shape} and row weights "
                         f"{tuple(row_weights.shape)} disagree")
    out = torch.empty(num_rows, num_outputs, dtype=rows.dtype, device=rows.device)
    if num_rows == 0:
        return out
    (gate_lanes, gate_unit), (up_lanes, up_unit) = decoding(gate), decoding(up)
    launch.launch_meta(
        _gate_up_tuned, gl.grid(num_rows, num_experts, num_outputs),
        _candidates(GATE_UP_CONFIGS),
        rows, offsets, row_weights.contiguous(), gate.raw, fp16_view(gate.raw),
        up.raw, fp16_view(up.raw), lookup_table(rows.device), out, num_rows,
        gl.rows_hint(num_rows, num_experts), gate.expert_stride // gate_unit,
        up.expert_stride // up_unit, num_outputs, num_cols, gate.raw.shape[2],
        up.raw.shape[2],
        NUM_EXPERTS=num_experts, BLOCK_E=triton.next_power_of_2(num_experts),
        GATE_QTYPE=int(gate.qtype), GATE_LANES=gate_lanes, GATE_UNIT=gate_unit,
        UP_QTYPE=int(up.qtype), UP_LANES=up_lanes, UP_UNIT=up_unit,
        PRECISION=_precision(rows.dtype),
    )
    return out


def down(act: torch.Tensor, offsets: torch.Tensor, down_proj: QuantizedExperts) -> torch.Tensor:
    """act @ down[e]^T for the rows [R, I] each expert e owns; [R, H] in act's dtype."""
    _check(act, offsets, down_proj)
    num_experts, num_outputs, num_cols = down_proj.shape
    num_rows = act.shape[0]
    out = torch.empty(num_rows, num_outputs, dtype=act.dtype, device=act.device)
    if num_rows == 0:
        return out
    lanes, unit = decoding(down_proj)
    raw = down_proj.raw
    launch.launch_meta(
        _down_tuned, gl.grid(num_rows, num_experts, num_outputs), _candidates(DOWN_CONFIGS),
        act, offsets, raw, fp16_view(raw), lookup_table(act.device), out, num_rows,
        gl.rows_hint(num_rows, num_experts), down_proj.expert_stride // unit, num_outputs,
        num_cols, raw.shape[2],
        NUM_EXPERTS=num_experts, BLOCK_E=triton.next_power_of_2(num_experts),
        QTYPE=int(down_proj.qtype), LANES=lanes, UNIT=unit, PRECISION=_precision(act.dtype),
    )
    return out


def experts_mlp(rows: torch.Tensor, gate: QuantizedExperts, up: QuantizedExperts,
                down_proj: QuantizedExperts, offsets: torch.Tensor,
                row_weights: torch.Tensor) -> torch.Tensor:
    """The routed experts of rows [R, H] sorted by expert (see `gate_up`): each row's
    weighted SwiGLU through its expert, [R, H]; what moe_prefill._grouped computes."""
    act = gate_up(rows, offsets, gate, up, row_weights)  # [R, I]
    return down(act, offsets, down_proj)  # [R, H]
