"""Many routed rows through quantized experts: dequantize a group of experts at a time into a
bounded bf16 scratch, then torch._grouped_mm (cuBLAS/CUTLASS) over that group's rows.

expert_gemm.py decodes the blocks inside its GEMM's K loop, once per M tile: cheap while an
expert has few rows, but its decode, not the MMA, bounds it (19-22 TFLOP/s at 512 tokens of
Qwen3-30B-A3B). Past a few rows per expert, dequantizing every expert once at memory speed
(dequant.py) and multiplying at the grouped GEMM's rate wins; moe_prefill.py chooses by the
routed rows (DEQUANT_MIN_ROWS_PER_EXPERT).

VRAM stays bounded: EXPERT_SCRATCH_BYTES holds gate and up side by side ([G, 2I, H]) for G
experts, then their down projections; the experts go through in groups of G (32 for
Qwen3-30B-A3B: 192 MiB, against 1.1 GiB for every expert's three projections). The rows come
sorted by expert (offsets [E], cumulative ends, on the device), so a group's rows are one
contiguous run whose start only the device knows. Per group, without a host sync:

1. `_move_rows` gathers the group's rows of x (by their source token) to the front of a
   buffer of R rows; torch._grouped_mm reads only up to its last offset, so the rows past
   the group's count are never used;
2. gate and up of the group's experts are dequantized into the scratch, one grouped GEMM
   gives [count, 2I] (the rest of its R rows untouched);
3. `_act` applies SiLU, the product and the routing weight to the group's rows;
4. down is dequantized over gate/up (stream order: after the GEMM that read them), a grouped
   GEMM, and `_move_rows` puts its rows back at the group's place in y [R, H].

What the groups cost: a copy of each routed row in and out (2 R H values in all: a few
percent of the layer at 512 tokens), two row-move kernels and one activation kernel per group
whose surplus programs exit at once, and grouped GEMMs of 32 experts at a time instead of
128. Every launch has a fixed grid, so a CUDA graph replays any routing.

Imported on first use (like kernels.py): importing it decorates Triton kernels.
"""

from __future__ import annotations

import torch

from strata.engine.core.fast import expert_epilogue
from strata.engine.core.fast.expert_epilogue import Epilogue
from strata.engine.core.kernels import launch
from strata.engine.core.loader import quant_plan
from strata.engine.core.quant import dequant
from strata.engine.core.quant.experts import QuantizedExperts
from strata.engine.core.quant.weight import scratch_tensor

try:
    import triton
    import triton.language as tl

    from strata.engine.core.fast.moe_triton import activate
except ImportError:
    triton = None

# The dequantized experts of one group (quant_plan.py says why 192 MiB); a module global
# here so that a test or bench/diag_dequant.py can set another size.
EXPERT_SCRATCH_BYTES = quant_plan.EXPERT_SCRATCH_BYTES
# Routed rows per expert from which the dequantize-then-grouped path runs (below it
# expert_gemm.py). Measured on the H200 (bench/diag_dequant.py --part moe, Qwen3-30B-A3B's
# layer in Q4_K/Q4_K/Q6_K, twelfth session): expert_gemm against this path 1.65 / 6.87 ms
# at 128 tokens, 1.86 / 4.40 at 512, 4.87 / 6.21 at 2048, 9.09 / 7.67 at 4096 (256 rows per
# expert). The groups of 16 experts cost far more than the estimate of their copies and
# launches (the dequantization alone is 0.42 ms a layer); until that is understood the
# path runs only from 256 rows per expert: for Qwen3-30B-A3B a 4096-token chunk (the fast
# prefiller's own, which its load-time tuning runs; the scheduler's are 2048 at most). The
# load reserves the scratch only where some chunk can reach it.
DEQUANT_MIN_ROWS_PER_EXPERT = 256
# The same crossover where the path replays from CUDA graphs (fast/expert_graphs.py), which
# leaves only its GPU time: run 21a (bench/diag_dequant.py --part moe, the same layer) timed
# it faster than expert_gemm at every chunk measured, 128 to 4096 tokens (8 to 256 rows per
# expert): 1.41 / 1.68 ms at 128 tokens, 1.58 / 1.86 at 512, 2.48 / 9.15 at 4096. Below 8
# rows per expert, not measured; few rows leave experts without any, which expert_gemm
# skips and this path dequantizes all the same.
REPLAYED_MIN_ROWS_PER_EXPERT = 8
MOVE_BLOCK_ROWS, MOVE_BLOCK_COLS = 16, 1024  # 16K values a program: a plain copy
INTERPRETER_MOVE_BLOCK_ROWS = 256


def min_rows(num_experts: int, replayed: bool = False) -> int:
    """Routed rows from which prefill takes this path for num_experts experts, called or
    replayed from CUDA graphs."""
    per_expert = REPLAYED_MIN_ROWS_PER_EXPERT if replayed else DEQUANT_MIN_ROWS_PER_EXPERT
    return per_expert * num_experts


def experts_per_group(gate: QuantizedExperts, up: QuantizedExperts,
                      down: QuantizedExperts) -> int:
    """How many experts' dequantized projections the scratch holds at once (at least one)."""
    num_experts = gate.num_experts
    per_expert = max(gate.numel() + up.numel(), down.numel()) // num_experts
    return quant_plan.experts_per_group(num_experts, per_expert, gate.dtype.itemsize,
                                        EXPERT_SCRATCH_BYTES)


def scratch_numel(gate: QuantizedExperts, up: QuantizedExperts,
                  down: QuantizedExperts) -> int:
    """Values of the prefill scratch this path needs (weight.reserve_scratch, at load)."""
    group = experts_per_group(gate, up, down)
    return group * max(gate.numel() + up.numel(), down.numel()) // gate.num_experts


if triton is not None:

    @triton.jit
    def _group_rows(offsets_ptr, first, last):
        """(start, end) of the sorted rows experts first..last-1 own."""
        start = tl.load(offsets_ptr + tl.maximum(first - 1, 0))
        start = tl.where(first > 0, start, 0)
        return start, tl.load(offsets_ptr + last - 1)

    # The group bounds and row counts change per layer and chunk: never specialized.
    @triton.jit(do_not_specialize=["first", "last"])
    def _move_rows_kernel(src_ptr, index_ptr, offsets_ptr, dst_ptr, first, last, H,
                          GATHER: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                          BLOCK_COLS: tl.constexpr):
        """GATHER: dst[i] = src[index[start + i]]; else dst[start + i] = src[i]; for the
        group's rows i < end - start."""
        start, end = _group_rows(offsets_ptr, first, last)
        if tl.program_id(0) * BLOCK_ROWS >= end - start:
            return  # past the group's rows
        i = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        ok = i < end - start
        if GATHER:
            src_row = tl.load(index_ptr + start + i, mask=ok, other=0).to(tl.int64)
            dst_row = i.to(tl.int64)
        else:
            src_row = i.to(tl.int64)
            dst_row = (start + i).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
        mask = ok[:, None] & (cols < H)[None, :]
        values = tl.load(src_ptr + src_row[:, None] * H + cols[None, :], mask=mask)
        tl.store(dst_ptr + dst_row[:, None] * H + cols[None, :], values, mask=mask)

    @triton.jit(do_not_specialize=["first", "last"])
    def _act_kernel(gate_up_ptr, weights_ptr, offsets_ptr, out_ptr, first, last, inter,
                    row_experts_ptr, gate_bias_ptr, up_bias_ptr,
                    HAS_BIAS: tl.constexpr, CLAMP: tl.constexpr, LIMIT: tl.constexpr,
                    ALPHA: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
        """out[i] = silu(gate) * up * weight[start + i] for the group's rows, gate and up
        the two halves of gate_up[i]; rounded where pointwise.silu_mul_scale rounds (the
        SiLU, the product, the scaled product, each to the rows' dtype). An epilogue
        (GPT-OSS): gate and up add the biases of row start + i's expert (row_experts), then
        its activation (moe_triton.activate), rounded once."""
        start, end = _group_rows(offsets_ptr, first, last)
        if tl.program_id(0) * BLOCK_ROWS >= end - start:
            return
        i = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        ok = i < end - start
        cols = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
        mask = ok[:, None] & (cols < inter)[None, :]
        at = gate_up_ptr + i.to(tl.int64)[:, None] * (2 * inter) + cols[None, :]
        dtype: tl.constexpr = out_ptr.dtype.element_ty
        g = tl.load(at, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(at + inter, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS or CLAMP:
            if HAS_BIAS:
                expert = tl.load(row_experts_ptr + start + i, mask=ok, other=0).to(tl.int64)
                at_bias = expert[:, None] * inter + cols[None, :]
                g += tl.load(gate_bias_ptr + at_bias, mask=mask, other=0.0).to(tl.float32)
                u += tl.load(up_bias_ptr + at_bias, mask=mask, other=0.0).to(tl.float32)
            act = activate(g, u, CLAMP, LIMIT, ALPHA).to(dtype).to(tl.float32)
        else:
            silu = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
            act = (silu * u).to(dtype).to(tl.float32)
        weight = tl.load(weights_ptr + start + i, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + i.to(tl.int64)[:, None] * inter + cols[None, :],
                 (act * weight[:, None]).to(dtype), mask=mask)


def _grid(num_rows: int, num_cols: int) -> tuple[tuple[int, int], int, int]:
    """(grid, BLOCK_ROWS, BLOCK_COLS); the interpreter's tile fits the columns (it pays for
    masked lanes too)."""
    rows, cols = MOVE_BLOCK_ROWS, MOVE_BLOCK_COLS
    if launch.is_interpreting():
        rows, cols = INTERPRETER_MOVE_BLOCK_ROWS, min(cols, triton.next_power_of_2(num_cols))
    return (triton.cdiv(num_rows, rows), triton.cdiv(num_cols, cols)), rows, cols


def _move_rows(src: torch.Tensor, index: torch.Tensor, offsets: torch.Tensor,
               dst: torch.Tensor, first: int, last: int, gather: bool) -> None:
    grid, block_rows, block_cols = _grid(index.shape[0], src.shape[1])
    _move_rows_kernel[grid](src, index, offsets, dst, first, last, src.shape[1], GATHER=gather,
                            BLOCK_ROWS=block_rows, BLOCK_COLS=block_cols)


def _act(gate_up: torch.Tensor, row_weights: torch.Tensor, offsets: torch.Tensor,
         first: int, last: int, epilogue: Epilogue | None,
         row_experts: torch.Tensor | None) -> torch.Tensor:
    num_rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(num_rows, inter, dtype=gate_up.dtype, device=gate_up.device)
    grid, block_rows, block_cols = _grid(num_rows, inter)
    (experts_arg, gate_bias, up_bias, _), switches = expert_epilogue.kernel_args(
        epilogue, offsets, row_experts)
    _act_kernel[grid](gate_up, row_weights, offsets, out, first, last, inter, experts_arg,
                      gate_bias, up_bias, HAS_BIAS=switches["HAS_BIAS"],
                      CLAMP=switches["CLAMP"], LIMIT=switches["LIMIT"],
                      ALPHA=switches["ALPHA"], BLOCK_ROWS=block_rows, BLOCK_COLS=block_cols)
    return out


def _group_offsets(offsets: torch.Tensor, group: int) -> torch.Tensor:
    """offsets [E] with each expert's group's start subtracted: the offsets torch's grouped
    GEMM takes for the group's rows brought to the front (device ops, no sync)."""
    first = torch.arange(offsets.shape[0], device=offsets.device) // group * group  # [E]
    padded = torch.cat([offsets.new_zeros(1), offsets])  # [E + 1]: row ends, 0 first
    return (offsets - padded.index_select(0, first)).to(torch.int32)


def experts_mlp(x: torch.Tensor, source: torch.Tensor, offsets: torch.Tensor,
                row_weights: torch.Tensor, gate: QuantizedExperts, up: QuantizedExperts,
                down: QuantizedExperts, out: torch.Tensor | None = None,
                epilogue: Epilogue | None = None,
                row_experts: torch.Tensor | None = None) -> torch.Tensor:
    """Sorted row r, token source[r] of x [T, H], through its expert e (offsets [E] int32
    cumulative ends): silu(x @ gate[e]^T) * (x @ up[e]^T) * row_weights[r] @ down[e]^T;
    [R, H] in x's dtype, the rows in sorted order (what expert_gemm.experts_mlp returns for
    x[source]). Rows past offsets[-1] (padding) are neither read nor written. out: [R, H]
    to write into (a CUDA graph's static output, fast/expert_graphs.py). epilogue (GPT-OSS):
    gate/up biases of each row's expert row_experts[r] and its activation; the down bias is
    the caller's (moe_prefill.experts_sorted adds it to every path's rows)."""
    if epilogue is not None and row_experts is None:
        raise ValueError("an epilogue's biases need each sorted row's expert (row_experts)")
    num_experts, inter, hidden = gate.shape
    num_rows = source.shape[0]
    if out is not None and (out.shape != (num_rows, hidden) or out.dtype != x.dtype):
        raise ValueError(f"out must be {x.dtype} [{num_rows}, {hidden}], got {out.dtype} "
                         f"{tuple(out.shape)}")
    y = torch.empty(num_rows, hidden, dtype=x.dtype, device=x.device) if out is None else out
    if num_rows == 0:
        return y
    x = x.contiguous()  # the row moves read rows H values apart
    group = experts_per_group(gate, up, down)
    scratch = scratch_tensor(x.device, gate.dtype, (scratch_numel(gate, up, down),))
    rel = _group_offsets(offsets, group)
    rows = torch.empty(num_rows, hidden, dtype=x.dtype, device=x.device)
    for first in range(0, num_experts, group):
        last = min(first + group, num_experts)
        count = last - first
        gate_up = scratch[: count * 2 * inter * hidden].view(count, 2 * inter, hidden)
        dequant.dequantize_experts(gate, first, gate_up[:, :inter])
        dequant.dequantize_experts(up, first, gate_up[:, inter:])
        _move_rows(x, source, offsets, rows, first, last, gather=True)
        offs = rel[first:last]
        gate_up_rows = torch._grouped_mm(rows, gate_up.transpose(-2, -1), offs=offs)  # [R, 2I]
        act = _act(gate_up_rows, row_weights, offsets, first, last, epilogue,
                   row_experts)  # [R, I]
        down_w = scratch[: count * hidden * inter].view(count, hidden, inter)
        dequant.dequantize_experts(down, first, down_w)
        down_rows = torch._grouped_mm(act, down_w.transpose(-2, -1), offs=offs)  # [R, H]
        if group == num_experts and out is None:
            return down_rows  # one group: its rows are all the rows, in place
        _move_rows(down_rows, source, offsets, y, first, last, gather=False)
    return y
