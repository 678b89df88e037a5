"""One token's routed experts read straight from their GGML blocks by the shared tile decoder
(dequant_tile.py), in float: MXFP4 (GPT-OSS) and any type with an epilogue (GPT-OSS's expert
biases and clamped SwiGLU, fast/expert_epilogue.py) where expert_gemv's dp4a kernels do not
take them (expert_gemv.takes: float32 x, STRATA_DP4A=0, an epilogue over a planes-only
type). With bf16/fp16 x, MXFP4 goes by dp4a there (about 1.6 instructions a value against
this float decode's 5).

Before, such experts went through expert_kernels.dequantize_routed: the k routed experts
dequantized into a [k, N, K] buffer, then the float grouped kernels read it back, so each
value cost its block bits plus a 16-bit write and a 16-bit read (about 36 bits a value for
MXFP4's 4.25). Here each program decodes a [BLOCK_ROWS, BLOCK_COLS] tile of its expert's
blocks in registers and multiplies it by x at once: the blocks are read once, nothing is
written but the result. Two launches as in moe_triton.py: gate/up (+ biases, activation),
then down, its biases and the weighted sum over the k experts.

Hopper has no FP4 MMA and a matrix-vector product needs none: the decode is integer and
float arithmetic on the E2M1 codes and E8M0 exponents. A Blackwell path (sm_100/sm_120 FP4
tensor cores, for the batched and prefill products where an MMA pays) would be another
kernel chosen beside `supports`, with the same arguments.

Imported on first use (like kernels.py): importing it decorates Triton kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from strata.engine.core.fast import expert_epilogue
from strata.engine.core.fast.expert_epilogue import Epilogue
from strata.engine.core.kernels import launch
from strata.engine.core.kernels.launch import is_interpreting, slot_table_arg
from strata.engine.core.quant import dequant_tile as dt
from strata.engine.core.quant.experts import QuantizedExperts, fp16_view
from strata.engine.core.quant.lookup import lookup_table

try:
    import triton
    import triton.language as tl

    from strata.engine.core.fast.moe_triton import activate, expert_bias
except ImportError:
    triton = None



@dataclass(frozen=True)
class Tiles:
    """One launch's tiles, for a benchmark or test that picks them (routed_mlp's `tiles`):
    rows a program of each kernel takes, columns a step, warps, and whether MXFP4 is read a
    block at a time (_mxfp4_dots) or by the generic tile decoder."""

    gate_up_rows: int = 16
    down_rows: int = 16
    cols: int = 256
    by_block: bool = True
    num_warps: int = 4


# Autotuned candidates (rows, columns, warps, None) per kernel, timed once per shape on the
# GPU (kernels/launch.py): the down kernel's grid is its rows alone (the k experts are
# summed inside), so it also gets few-row tiles that keep every SM busy (gpt-oss: 2880 rows
# over 132 SMs). bench/diag_mxfp4_gemv.py times them one by one.
GATE_UP_CANDIDATES = ((16, 256, 4, None), (8, 256, 4, None), (4, 256, 4, None),
                      (8, 512, 4, None), (4, 512, 4, None), (16, 512, 8, None))
DOWN_CANDIDATES = ((16, 256, 4, None), (8, 256, 4, None), (4, 256, 4, None),
                   (2, 256, 2, None), (4, 512, 4, None), (2, 512, 2, None))
# The interpreter pays per program, not per value: one tile of many rows.
INTERPRETER_CANDIDATES = ((128, 256, 4, None),)

if triton is not None:

    @triton.jit
    def _expert_bytes(ids_ptr, j, table_ptr, host_offset, stride_expert, HAS_TABLE: tl.constexpr):
        """Byte offset of the j-th routed expert's blocks: its own, its slot's, or (table -1)
        the host copy's, host_offset bytes past the slots' base."""
        expert = tl.load(ids_ptr + j).to(tl.int64)
        base = expert * stride_expert
        if HAS_TABLE:
            slot = tl.load(table_ptr + expert).to(tl.int64)
            base = tl.where(slot >= 0, slot * stride_expert, host_offset + base)
        return base

    @triton.jit
    def _mxfp4_dots(w_ptr, base, rows, row_ok, v_ptr, ROW_BYTES: tl.constexpr, K: tl.constexpr,
                    BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
        """W[rows, :] @ v for rows of MXFP4 blocks, a block at a time: each step reads
        BLOCK_COLS // 32 whole blocks a row, each code byte once (its low nibble is value i,
        its high one value 16 + i) and each exponent once, where the generic decoder reads a
        byte and an exponent per value. Products accumulate element-wise and are summed once
        at the end: a sum inside the loop costs shuffles every step."""
        BLOCKS: tl.constexpr = BLOCK_COLS // 32
        NUM_BLOCKS: tl.constexpr = K // 32
        row_ptr = (w_ptr + base + rows.to(tl.int64) * ROW_BYTES)[:, None, None]
        lane = tl.arange(0, 16)
        acc = tl.zeros([BLOCK_ROWS, BLOCKS, 16], dtype=tl.float32)
        for first in range(0, NUM_BLOCKS, BLOCKS):
            b = first + tl.arange(0, BLOCKS)
            b_ok = b < NUM_BLOCKS
            ok = (row_ok[:, None] & b_ok[None, :])[:, :, None]
            at_block = (b * 17)[None, :, None]
            scale = dt._mxfp4_half_scale(
                tl.load(row_ptr + at_block, mask=ok, other=0).to(tl.int32))  # [rows, blocks, 1]
            q = tl.load(row_ptr + at_block + 1 + lane[None, None, :], mask=ok,
                        other=0).to(tl.int32)  # [rows, blocks, 16]
            at = (b * 32)[:, None] + lane[None, :]
            x_low = tl.load(v_ptr + at, mask=b_ok[:, None], other=0.0).to(tl.float32)
            x_high = tl.load(v_ptr + at + 16, mask=b_ok[:, None], other=0.0).to(tl.float32)
            acc += (dt._e2m1_doubled(q & 15) * x_low[None, :, :]
                    + dt._e2m1_doubled(q >> 4) * x_high[None, :, :]) * scale
        return tl.sum(tl.sum(acc, axis=2), axis=1)

    @triton.jit
    def _tile_dots(w_ptr, wh_ptr, lut_ptr, base, rows, row_ok, v_ptr, ROW_BYTES: tl.constexpr,
                   QTYPE: tl.constexpr, K: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                   BLOCK_COLS: tl.constexpr, BY_BLOCK: tl.constexpr):
        """W[rows, :] @ v for a matrix of GGML blocks at byte `base`: float32 [BLOCK_ROWS].
        BY_BLOCK: MXFP4 through _mxfp4_dots (the generic decoder stays for the comparison)."""
        if BY_BLOCK and QTYPE == 39:
            acc = _mxfp4_dots(w_ptr, base, rows, row_ok, v_ptr, ROW_BYTES, K, BLOCK_ROWS,
                              BLOCK_COLS)
        else:
            row_off = (base + rows.to(tl.int64) * ROW_BYTES)[:, None]
            acc = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
            for start in range(0, K, BLOCK_COLS):
                cols = start + tl.arange(0, BLOCK_COLS)
                col_ok = cols < K
                v = tl.load(v_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
                w = dt.dequant_tile(w_ptr, wh_ptr, lut_ptr, row_off, cols[None, :],
                                    row_ok[:, None] & col_ok[None, :], QTYPE)
                acc += tl.sum(w * v[None, :], axis=1)
        return acc

    # Offsets and strides per layer: never specialized, so a new layer never compiles again.
    @triton.jit(do_not_specialize=["gate_host_offset", "up_host_offset", "gate_stride",
                                   "up_stride"])
    def _gate_up_kernel(
        x_ptr, gate_ptr, gate_h_ptr, up_ptr, up_h_ptr, lut_ptr, ids_ptr, table_ptr,
        gate_host_offset, up_host_offset, gate_stride, up_stride, out_ptr,
        bias_ids_ptr, gate_bias_ptr, up_bias_ptr, down_bias_ptr,
        N: tl.constexpr, K: tl.constexpr, GATE_ROW_BYTES: tl.constexpr,
        UP_ROW_BYTES: tl.constexpr, GATE_QTYPE: tl.constexpr, UP_QTYPE: tl.constexpr,
        HAS_TABLE: tl.constexpr, HAS_BIAS: tl.constexpr, CLAMP: tl.constexpr,
        LIMIT: tl.constexpr, ALPHA: tl.constexpr, BLOCK_ROWS: tl.constexpr,
        BLOCK_COLS: tl.constexpr, BY_BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
    ):
        # USE_PDL: kernels/launch.py passes it; these kernels launch without PDL (False).
        j = tl.program_id(0)
        rows = tl.program_id(1) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        row_ok = rows < N
        gate_base = _expert_bytes(ids_ptr, j, table_ptr, gate_host_offset, gate_stride,
                                  HAS_TABLE)
        up_base = _expert_bytes(ids_ptr, j, table_ptr, up_host_offset, up_stride, HAS_TABLE)
        g = _tile_dots(gate_ptr, gate_h_ptr, lut_ptr, gate_base, rows, row_ok, x_ptr,
                       GATE_ROW_BYTES, GATE_QTYPE, K, BLOCK_ROWS, BLOCK_COLS, BY_BLOCK)
        u = _tile_dots(up_ptr, up_h_ptr, lut_ptr, up_base, rows, row_ok, x_ptr,
                       UP_ROW_BYTES, UP_QTYPE, K, BLOCK_ROWS, BLOCK_COLS, BY_BLOCK)
        if HAS_BIAS:
            g += expert_bias(bias_ids_ptr, j, gate_bias_ptr, rows, row_ok, N)
            u += expert_bias(bias_ids_ptr, j, up_bias_ptr, rows, row_ok, N)
        act = activate(g, u, CLAMP, LIMIT, ALPHA)
        tl.store(out_ptr + j * N + rows, act.to(out_ptr.dtype.element_ty), mask=row_ok)

    @triton.jit(do_not_specialize=["host_offset", "stride_expert"])
    def _down_sum_kernel(
        act_ptr, down_ptr, down_h_ptr, lut_ptr, ids_ptr, weights_ptr, table_ptr, host_offset,
        stride_expert, out_ptr, bias_ids_ptr, gate_bias_ptr, up_bias_ptr, down_bias_ptr,
        N: tl.constexpr, K: tl.constexpr, ROW_BYTES: tl.constexpr, QTYPE: tl.constexpr,
        TOP_K: tl.constexpr, HAS_TABLE: tl.constexpr, HAS_BIAS: tl.constexpr,
        CLAMP: tl.constexpr, LIMIT: tl.constexpr, ALPHA: tl.constexpr,
        BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr, BY_BLOCK: tl.constexpr,
        USE_PDL: tl.constexpr,
    ):
        rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        row_ok = rows < N
        acc = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
        for j in tl.static_range(TOP_K):
            base = _expert_bytes(ids_ptr, j, table_ptr, host_offset, stride_expert, HAS_TABLE)
            dot = _tile_dots(down_ptr, down_h_ptr, lut_ptr, base, rows, row_ok, act_ptr + j * K,
                             ROW_BYTES, QTYPE, K, BLOCK_ROWS, BLOCK_COLS, BY_BLOCK)
            if HAS_BIAS:
                dot += expert_bias(bias_ids_ptr, j, down_bias_ptr, rows, row_ok, N)
            acc += tl.load(weights_ptr + j).to(tl.float32) * dot
        tl.store(out_ptr + rows, acc.to(out_ptr.dtype.element_ty), mask=row_ok)

    _gate_up_tuned = launch.tuned(_gate_up_kernel, GATE_UP_CANDIDATES,
                                  key=("N", "K", "GATE_QTYPE", "UP_QTYPE", "HAS_BIAS"))
    _down_sum_tuned = launch.tuned(_down_sum_kernel, DOWN_CANDIDATES,
                                   key=("N", "K", "QTYPE", "TOP_K", "HAS_BIAS"))


def takes(gate: QuantizedExperts, epilogue: Epilogue | None) -> bool:
    """Whether these kernels can take one token's experts: an epilogue (whatever the type),
    or MXFP4 blocks; moe_grouped.routed_experts asks expert_gemv.takes first."""
    return triton is not None and (epilogue is not None or int(gate.qtype) == dt.MXFP4)


def routed_mlp(x: torch.Tensor, gate: QuantizedExperts, up: QuantizedExperts,
               down: QuantizedExperts, ids: torch.Tensor, weights: torch.Tensor,
               table: torch.Tensor | None = None,
               host_offsets: tuple[int, int, int] = (0, 0, 0),
               epilogue: Epilogue | None = None, tiles: Tiles | None = None) -> torch.Tensor:
    """sum_j weights[j] * down[ids[j]] @ act(gate[ids[j]] @ x, up[ids[j]] @ x) for one token
    x [H], ids and weights [k] on the device -> [H] in x's dtype. table and host_offsets
    (bytes) as for expert_gemv: a partial cache's slots, and where its host copy lies; the
    epilogue's biases are read by the real ids. tiles: the autotuner's pick (on CUDA; the
    interpreter's one tile on the CPU) unless a benchmark or test gives them."""
    num_experts_used = ids.shape[0]
    _, inter, hidden = gate.shape
    if any(offset % 2 for offset in host_offsets):
        raise ValueError("the host copy must sit an even number of bytes from the slots")
    ids = ids.contiguous()
    table_arg = slot_table_arg(table, ids)
    lut = lookup_table(x.device)
    bias_args, switches = expert_epilogue.kernel_args(epilogue, ids)
    act = torch.empty(num_experts_used, inter, dtype=x.dtype, device=x.device)
    gate_up_args = (
        x.contiguous(), gate.raw, fp16_view(gate.raw), up.raw, fp16_view(up.raw), lut, ids,
        table_arg,
        int(host_offsets[0]), int(host_offsets[1]), gate.expert_stride, up.expert_stride, act,
        *bias_args)
    gate_up_meta = dict(N=inter, K=hidden, GATE_ROW_BYTES=gate.raw.shape[2],
                        UP_ROW_BYTES=up.raw.shape[2], GATE_QTYPE=int(gate.qtype),
                        UP_QTYPE=int(up.qtype), HAS_TABLE=table is not None, **switches)
    out = torch.empty(hidden, dtype=x.dtype, device=x.device)
    down_args = (act, down.raw, fp16_view(down.raw), lut, ids, weights.contiguous(), table_arg,
                 int(host_offsets[2]), down.expert_stride, out, *bias_args)
    down_meta = dict(N=hidden, K=inter, ROW_BYTES=down.raw.shape[2], QTYPE=int(down.qtype),
                     TOP_K=num_experts_used, HAS_TABLE=table is not None, **switches)
    if tiles is not None:  # a benchmark's or test's pick, launched as given
        _gate_up_kernel[(num_experts_used, triton.cdiv(inter, tiles.gate_up_rows))](
            *gate_up_args, **gate_up_meta, BLOCK_ROWS=tiles.gate_up_rows, BLOCK_COLS=tiles.cols,
            BY_BLOCK=tiles.by_block, USE_PDL=False, num_warps=tiles.num_warps)
        _down_sum_kernel[(triton.cdiv(hidden, tiles.down_rows),)](
            *down_args, **down_meta, BLOCK_ROWS=tiles.down_rows, BLOCK_COLS=tiles.cols,
            BY_BLOCK=tiles.by_block, USE_PDL=False, num_warps=tiles.num_warps)
        return out
    interpreting = is_interpreting()
    launch.launch(_gate_up_tuned, lambda rows: (num_experts_used, triton.cdiv(inter, rows)),
                  INTERPRETER_CANDIDATES if interpreting else GATE_UP_CANDIDATES,
                  *gate_up_args, **gate_up_meta, BY_BLOCK=True)
    launch.launch(_down_sum_tuned, lambda rows: (triton.cdiv(hidden, rows),),
                  INTERPRETER_CANDIDATES if interpreting else DOWN_CANDIDATES,
                  *down_args, **down_meta, BY_BLOCK=True)
    return out
