"""Many rows through resident Q4_K, Q6_K and Q8_0 experts on int8 tensor cores: the rows
quantized to int8 per 32 values, the weights' integers multiplied as stored, the scales
applied to each 32-column product.

expert_gemm.py decodes every weight to bf16 inside its K loop (about ten instructions a
value, then a layout change for the MMA), which bounds it far below the tensor cores: one
Qwen3-30B-A3B layer's experts at 512 tokens took 1.6 ms of kernel time, against 0.1 ms to
read its blocks (bench/diag_dequant.py --part moe --profile). Here a weight costs a byte
load and a mask or shift: the product of 32 columns is one int8 `tl.dot` into int32, and the
float work is per (row, output) and 32 columns, not per value:

- Q4_K (w = d * scale * q - dmin * min per 32): acc += dot * d_x (x) d*scale
  - s_x (x) dmin*min, where s_x = d_x * sum(q_x) (gemv_dp4a.quantize_x gives both);
- Q6_K (w = d * scale16 * (q - 32) per 16): q - 32 fits int8; the two 16-column halves
  are two dots (the other half of x zeroed), each times its scale;
- Q8_0 (w = d * q per 32): acc += dot * d_x (x) d.

This is llama.cpp's MMQ idea (int8 x, integer weights, per-block float scales), written for
Triton over the sorted rows that expert_gemm.py takes, with its M-tile schedule
(`expert_gemm._m_tile`: from the offsets on the device, no host sync, CUDA graph safe). x is
rounded to int8 per 32 values like the dp4a decode kernels round it (quantize_x), so results
differ from the bf16 path by that rounding (tests compare against the int8-rounded x).

Imported on first use (like kernels.py): importing it decorates Triton kernels.
"""

from __future__ import annotations

import torch

from strata.engine.core.kernels import launch
from strata.engine.core.quant import expert_gemm
from strata.engine.core.quant import gemv_dp4a
from strata.engine.core.quant.experts import QuantizedExperts

try:
    import triton
    import triton.language as tl

    from strata.engine.core.kernels.pdl import wait as pdl_wait
    from strata.engine.core.quant.gemv_planes import _k4_scales
except ImportError:
    triton = None

Q8_0, Q4_K, Q6_K = 8, 12, 14
MMQ_TYPES = frozenset({Q8_0, Q4_K, Q6_K})
BLOCK_BYTES = {Q8_0: 34, Q4_K: 144, Q6_K: 210}
SUBS_PER_BLOCK = {Q8_0: 1, Q4_K: 8, Q6_K: 8}  # 32-value sub-blocks of a block
# (BLOCK_N, num_warps, BLOCK_M, STAGES) candidates, autotuned on CUDA per shape, types and
# rows-per-expert bucket (expert_gemm._rows_hint). No M tile below 32 rows: few rows per
# expert waste MMA lanes, not decoding.
GATE_UP_CONFIGS = ((64, 4, 64, 3), (128, 8, 64, 3), (64, 4, 32, 3), (128, 8, 128, 2))
DOWN_CONFIGS = ((64, 4, 64, 3), (128, 8, 64, 3), (64, 4, 32, 3), (128, 8, 128, 2))
# The interpreter pays per program and op: wide output tiles, M small enough that the tests'
# experts span several tiles.
INTERPRETER_CONFIG = ((128, 4, 16, 1),)


def _candidates(configs) -> tuple:
    if launch.is_interpreting():
        configs = INTERPRETER_CONFIG
    # launch's (BLOCK_ROWS, BLOCK_COLS, warps, dict): BLOCK_COLS is the fixed 32-column step.
    return tuple((n, 32, w, {"BLOCK_M": m, "STAGES": s}) for n, w, m, s in configs)


if triton is not None:

    @triton.jit
    def _f16(w_ptr, at):
        """The little-endian fp16 at byte offsets `at` (any alignment), as float32."""
        lo = tl.load(w_ptr + at).to(tl.int32)
        hi = tl.load(w_ptr + at + 1).to(tl.int32)
        return (lo | (hi << 8)).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _sub_dot(acc, xq, xd, xs, w_ptr, w_row, k, QTYPE: tl.constexpr):
        """acc [BM, BN] + the 32 columns of sub-block k: xq [BM, 32] int8 rows with their
        scale xd [BM, 1] and xd * sum(xq) xs [BM, 1]; w_row [1, BN] byte offsets of the
        weight rows."""
        lane = tl.arange(0, 32)[:, None]  # [32, 1]: the sub-block's columns, down the tile
        if QTYPE == 12:  # Q4_K: sub-block j of a block: nibbles (j % 2) of bytes 32 (j // 2)..
            base = w_row + (k // 8) * 144  # [1, BN]
            j = k % 8
            q = tl.load(w_ptr + base + 16 + (j // 2) * 32 + lane)  # [32, BN] uint8
            wq = ((q >> (4 * (j % 2))) & 15).to(tl.int8)
            dot = tl.dot(xq, wq).to(tl.float32)  # int32 [BM, BN]
            sc0, mn0, sc1, mn1 = _k4_scales(w_ptr, base, j // 2, w_row >= 0)
            odd = (j % 2) == 1
            scale = tl.where(odd, sc1, sc0)  # [1, BN]
            low = tl.where(odd, mn1, mn0)
            return acc + dot * (xd * scale) - xs * low
        elif QTYPE == 14:  # Q6_K: sub-block j: half j // 4, quarter s = j % 4
            base = w_row + (k // 8) * 210
            j = k % 8
            half = j // 4
            s = j % 4
            ql = tl.load(w_ptr + base + half * 64 + (s % 2) * 32 + lane).to(tl.int32)
            qh = tl.load(w_ptr + base + 128 + half * 32 + lane).to(tl.int32)
            q = ((ql >> (4 * (s // 2))) & 15) | (((qh >> (2 * s)) & 3) << 4)
            wq = (q - 32).to(tl.int8)  # [32, BN]
            cols = tl.arange(0, 32)[None, :]  # [1, 32]
            x_lo = tl.where(cols < 16, xq, 0).to(tl.int8)
            x_hi = tl.where(cols < 16, 0, xq).to(tl.int8)
            dot_lo = tl.dot(x_lo, wq).to(tl.float32)
            dot_hi = tl.dot(x_hi, wq).to(tl.float32)
            sc_lo = tl.load(w_ptr + base + 192 + 2 * j).to(tl.int8, bitcast=True)
            sc_hi = tl.load(w_ptr + base + 193 + 2 * j).to(tl.int8, bitcast=True)
            d = _f16(w_ptr, base + 208)  # [1, BN]
            both = dot_lo * sc_lo.to(tl.float32) + dot_hi * sc_hi.to(tl.float32)
            return acc + both * (xd * d)
        else:  # Q8_0: block k is the sub-block
            base = w_row + k * 34
            wq = tl.load(w_ptr + base + 2 + lane).to(tl.int8, bitcast=True)  # [32, BN]
            dot = tl.dot(xq, wq).to(tl.float32)
            return acc + dot * (xd * _f16(w_ptr, base))

    @triton.jit
    def _x_sub(xq_ptr, xd_ptr, xs_ptr, rows, row_ok, k, K):
        """Sub-block k of the int8 rows: (xq [BM, 32], xd [BM, 1], xs [BM, 1]); zero past
        the tile's rows."""
        r64 = rows.to(tl.int64)[:, None]  # [BM, 1]
        subs = K // 32
        cols = k * 32 + tl.arange(0, 32)[None, :]
        xq = tl.load(xq_ptr + r64 * K + cols, mask=row_ok, other=0)
        xd = tl.load(xd_ptr + r64 * subs + k, mask=row_ok, other=0.0)
        xs = tl.load(xs_ptr + r64 * subs + k, mask=row_ok, other=0.0)
        return xq, xd, xs

    @triton.jit
    def _weight_rows(pid_n, expert, stride, row_bytes, N, BLOCK_N: tl.constexpr):
        """(output columns n [BN], byte offsets [1, BN] of their weight rows): rows past N
        read the last row, never stored."""
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        read = tl.minimum(n, N - 1).to(tl.int64)
        return n, (expert.to(tl.int64) * stride + read * row_bytes)[None, :]

    # Runtime sizes are not specialized: a new chunk length never compiles again.
    @triton.jit(do_not_specialize=["num_rows", "rows_hint", "gate_stride", "up_stride"])
    def _gate_up_kernel(
        xq_ptr, xd_ptr, xs_ptr, offsets_ptr, row_w_ptr, gate_ptr, up_ptr, out_ptr, num_rows,
        rows_hint, gate_stride, up_stride, N, K, gate_row_bytes, up_row_bytes,
        NUM_EXPERTS: tl.constexpr, BLOCK_E: tl.constexpr, GATE_QTYPE: tl.constexpr,
        UP_QTYPE: tl.constexpr, USE_PDL: tl.constexpr, BLOCK_ROWS: tl.constexpr,
        BLOCK_COLS: tl.constexpr, BLOCK_M: tl.constexpr, STAGES: tl.constexpr,
    ):
        pdl_wait(USE_PDL)
        expert, first_row, end_row = expert_gemm._m_tile(offsets_ptr, tl.program_id(1),
                                                         NUM_EXPERTS, BLOCK_E, BLOCK_M)
        if expert >= NUM_EXPERTS:  # past the last tile of this chunk's routing
            return
        rows = first_row + tl.arange(0, BLOCK_M)
        row_ok = (rows < end_row)[:, None]  # [BM, 1]
        n, gate_row = _weight_rows(tl.program_id(0), expert, gate_stride, gate_row_bytes, N,
                                   BLOCK_ROWS)
        _, up_row = _weight_rows(tl.program_id(0), expert, up_stride, up_row_bytes, N,
                                 BLOCK_ROWS)
        acc_gate = tl.zeros((BLOCK_M, BLOCK_ROWS), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_ROWS), dtype=tl.float32)
        for k in tl.range(0, K // 32, num_stages=STAGES):
            xq, xd, xs = _x_sub(xq_ptr, xd_ptr, xs_ptr, rows, row_ok, k, K)
            acc_gate = _sub_dot(acc_gate, xq, xd, xs, gate_ptr, gate_row, k, GATE_QTYPE)
            acc_up = _sub_dot(acc_up, xq, xd, xs, up_ptr, up_row, k, UP_QTYPE)
        dtype: tl.constexpr = out_ptr.dtype.element_ty
        # expert_gemm's roundings: each product, the SiLU and every multiply in the rows'
        # dtype, in moe_prefill._grouped's order.
        g = expert_gemm._round(acc_gate, dtype)
        silu = expert_gemm._round(g / (1.0 + tl.exp(-g)), dtype)
        act = expert_gemm._round(silu * expert_gemm._round(acc_up, dtype), dtype)
        weight = tl.load(row_w_ptr + rows, mask=rows < end_row, other=0.0).to(tl.float32)
        act = act * weight[:, None]
        tl.store(out_ptr + (rows.to(tl.int64)[:, None] * N + n[None, :]), act.to(dtype),
                 mask=row_ok & (n < N)[None, :])

    @triton.jit(do_not_specialize=["num_rows", "rows_hint", "stride"])
    def _down_kernel(
        xq_ptr, xd_ptr, xs_ptr, offsets_ptr, w_ptr, out_ptr, num_rows, rows_hint, stride, N,
        K, row_bytes,
        NUM_EXPERTS: tl.constexpr, BLOCK_E: tl.constexpr, QTYPE: tl.constexpr,
        USE_PDL: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr,
        BLOCK_M: tl.constexpr, STAGES: tl.constexpr,
    ):
        pdl_wait(USE_PDL)
        expert, first_row, end_row = expert_gemm._m_tile(offsets_ptr, tl.program_id(1),
                                                         NUM_EXPERTS, BLOCK_E, BLOCK_M)
        if expert >= NUM_EXPERTS:
            return
        rows = first_row + tl.arange(0, BLOCK_M)
        row_ok = (rows < end_row)[:, None]
        n, w_row = _weight_rows(tl.program_id(0), expert, stride, row_bytes, N, BLOCK_ROWS)
        acc = tl.zeros((BLOCK_M, BLOCK_ROWS), dtype=tl.float32)
        for k in tl.range(0, K // 32, num_stages=STAGES):
            xq, xd, xs = _x_sub(xq_ptr, xd_ptr, xs_ptr, rows, row_ok, k, K)
            acc = _sub_dot(acc, xq, xd, xs, w_ptr, w_row, k, QTYPE)
        tl.store(out_ptr + (rows.to(tl.int64)[:, None] * N + n[None, :]),
                 acc.to(out_ptr.dtype.element_ty), mask=row_ok & (n < N)[None, :])

    _gate_up_tuned = launch.tuned(_gate_up_kernel, _candidates(GATE_UP_CONFIGS),
                                  key=("N", "K", "GATE_QTYPE", "UP_QTYPE", "rows_hint"))
    _down_tuned = launch.tuned(_down_kernel, _candidates(DOWN_CONFIGS),
                               key=("N", "K", "QTYPE", "rows_hint"))


def is_supported(experts: QuantizedExperts) -> bool:
    """Whether these kernels read this projection: Q4_K (4-aligned: its scales are read as
    words), Q6_K or Q8_0 (read by bytes), over a multiple of 32 columns."""
    qtype = int(experts.qtype)
    if triton is None or qtype not in MMQ_TYPES or experts.shape[2] % 32:
        return False
    if qtype == Q4_K:
        return experts.expert_stride % 4 == 0 and experts.raw.data_ptr() % 4 == 0
    return True


def supports(gate: QuantizedExperts, up: QuantizedExperts, down: QuantizedExperts) -> bool:
    """Whether `experts_mlp` takes these three projections."""
    return all(is_supported(w) for w in (gate, up, down))


def _grid(num_rows: int, num_experts: int, num_outputs: int):
    def grid(meta):  # expert_gemm's: at most ceil(R / BLOCK_M) + E tiles
        return (triton.cdiv(num_outputs, meta["BLOCK_ROWS"]),
                triton.cdiv(num_rows, meta["BLOCK_M"]) + num_experts)
    return grid


def _quantized_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    xq, xd, xs, _ = gemv_dp4a.quantize_x(rows)
    return xq, xd, xs


def gate_up(rows: torch.Tensor, offsets: torch.Tensor, gate: QuantizedExperts,
            up: QuantizedExperts, row_weights: torch.Tensor) -> torch.Tensor:
    """expert_gemm.gate_up's [R, I] with the rows rounded to int8 per 32 values."""
    num_experts, num_outputs, num_cols = gate.shape
    num_rows = rows.shape[0]
    if up.shape != gate.shape or row_weights.shape != (num_rows,) or rows.shape[1] != num_cols:
        raise ValueError(f"rows {tuple(rows.shape)}, gate {gate.shape}, up {up.shape} and "
                         f"row weights {tuple(row_weights.shape)} disagree")
    if not (is_supported(gate) and is_supported(up)):
        raise ValueError(f"no int8 kernel reads {gate.qtype.name}/{up.qtype.name} experts")
    out = torch.empty(num_rows, num_outputs, dtype=rows.dtype, device=rows.device)
    if num_rows == 0:
        return out
    xq, xd, xs = _quantized_rows(rows.contiguous())
    launch.launch_meta(
        _gate_up_tuned, _grid(num_rows, num_experts, num_outputs),
        _candidates(GATE_UP_CONFIGS),
        xq, xd, xs, offsets, row_weights.contiguous(), gate.raw, up.raw, out, num_rows,
        expert_gemm._rows_hint(num_rows, num_experts), gate.expert_stride, up.expert_stride,
        num_outputs, num_cols, gate.raw.shape[2], up.raw.shape[2],
        NUM_EXPERTS=num_experts, BLOCK_E=triton.next_power_of_2(num_experts),
        GATE_QTYPE=int(gate.qtype), UP_QTYPE=int(up.qtype),
    )
    return out


def down(act: torch.Tensor, offsets: torch.Tensor, down_proj: QuantizedExperts) -> torch.Tensor:
    """expert_gemm.down's [R, H] with act rounded to int8 per 32 values."""
    num_experts, num_outputs, num_cols = down_proj.shape
    num_rows = act.shape[0]
    if act.shape[1] != num_cols or not is_supported(down_proj):
        raise ValueError(f"act {tuple(act.shape)} cannot go through {down_proj.qtype.name} "
                         f"experts {down_proj.shape} here")
    out = torch.empty(num_rows, num_outputs, dtype=act.dtype, device=act.device)
    if num_rows == 0:
        return out
    xq, xd, xs = _quantized_rows(act.contiguous())
    launch.launch_meta(
        _down_tuned, _grid(num_rows, num_experts, num_outputs), _candidates(DOWN_CONFIGS),
        xq, xd, xs, offsets, down_proj.raw, out, num_rows,
        expert_gemm._rows_hint(num_rows, num_experts), down_proj.expert_stride, num_outputs,
        num_cols, down_proj.raw.shape[2],
        NUM_EXPERTS=num_experts, BLOCK_E=triton.next_power_of_2(num_experts),
        QTYPE=int(down_proj.qtype),
    )
    return out


def experts_mlp(rows: torch.Tensor, gate: QuantizedExperts, up: QuantizedExperts,
                down_proj: QuantizedExperts, offsets: torch.Tensor,
                row_weights: torch.Tensor) -> torch.Tensor:
    """expert_gemm.experts_mlp's [R, H] for rows [R, H] sorted by expert, on int8 MMA."""
    act = gate_up(rows, offsets, gate, up, row_weights)  # [R, I]
    return down(act, offsets, down_proj)  # [R, H]
