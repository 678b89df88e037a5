"""Many rows through resident quantized experts by int8 tensor-core products (issue 52): the
weights' GGML blocks decoded in registers to int8 groups of 32, multiplied by the rows
rounded to int8 per 32 values; no dequantized copy of any expert, no float decode a value.

expert_gemm.py decodes each weight to a float in its K loop (about 8-23 instructions a value,
repeated per M tile: decode-bound); expert_grouped.py writes every expert dequantized and
reads it back (GLM-4.5-Air: 4.4 GB a layer per chunk). Here, as llama.cpp's MMQ does, the
rows become int8 with a scale per 32 values (gemv_dp4a.round_groups, the dp4a GEMV's rounding)
and each weight group becomes int8 values with its scale (and offset: mmq_groups.py), so a
group's product is one int8 `tl.dot` -> int32, scaled in float32 per row and output.
Three launches a layer, the same schedule as expert_gemm (`_m_tile`: from the offsets in
device memory, no host sync, CUDA-graph safe):

1. `quantize_rows`: the rows [R, H] (or the tokens, gathered after) to int8 per 32.
2. `gate_up`: silu(rows @ gate^T) * (rows @ up^T) * row weight, rounded as expert_gemm
   rounds it (the rows' dtype, silu_mul_scale's order), then to int8 per 32 in the epilogue.
3. `down`: that rounding @ down^T -> [R, H] in the rows' dtype.

The price is x's int8 rounding (about 0.4% of each 32's largest value, the dp4a GEMV's).
Opt-in until an H200 run measures it (STRATA_EXPERT_MMQ=1, fast/moe_prefill.py).
Imported on first use, like expert_gemm.py.
"""

from __future__ import annotations

import torch

from strata.engine.core.kernels import launch
from strata.engine.core.quant import expert_gemv
from strata.engine.core.quant import grouped_launch as gl
from strata.engine.core.quant.dp4a_dots import row_alignment
from strata.engine.core.quant.experts import QuantizedExperts, fp16_view
from strata.engine.core.quant.mmq_groups import MMQ_TYPES, NIBBLE_TYPES

try:
    import triton
    import triton.language as tl

    from strata.engine.core.kernels.pdl import wait as pdl_wait
    from strata.engine.core.quant.expert_gemm import _m_tile, _round
    from strata.engine.core.quant.gemv_dp4a import round_and_store, round_groups
    from strata.engine.core.quant.mmq_groups import group_ok, pair_dot, x_columns
except ImportError:
    triton = None

GROUP = 32  # values per int8 scale, x's and the weights'
QUANTIZE_SUBS = 64  # groups of 32 per program of quantize_rows
# (BLOCK_ROWS outputs, BLOCK_COLS values a K step (pairs of groups), num_warps, BLOCK_M,
# STAGES), autotuned on CUDA. Untimed so far: the first GPU run picks among these.
GATE_UP_CONFIGS = ((64, 128, 4, 32, 2), (128, 128, 4, 32, 2), (64, 128, 4, 64, 2),
                   (128, 128, 8, 64, 2), (128, 64, 8, 128, 2))
DOWN_CONFIGS = ((64, 128, 4, 32, 2), (128, 128, 4, 64, 2), (128, 128, 8, 128, 2),
                (64, 256, 4, 32, 2))
# The interpreter pays per program and per op: wide tiles, but BLOCK_M below some experts'
# rows (the tests' routing) and outputs split over programs.
INTERPRETER_CONFIG = ((128, 128, 4, 16, 1),)


def _candidates(configs: tuple) -> tuple:
    return gl.candidates(configs, INTERPRETER_CONFIG)


if triton is not None:

    @triton.jit
    def _quantize_rows_kernel(x_ptr, q_ptr, d_ptr, s_ptr, num_subs,
                              BLOCK_SUBS: tl.constexpr):
        """Contiguous rows as one run of groups of 32: one grid axis, any row count."""
        sub = tl.program_id(0).to(tl.int64) * BLOCK_SUBS + tl.arange(0, BLOCK_SUBS)
        cols = sub[:, None] * 32 + tl.arange(0, 32)[None, :]
        v = tl.load(x_ptr + cols, mask=(sub < num_subs)[:, None], other=0.0).to(tl.float32)
        round_and_store(v, sub, num_subs, q_ptr, d_ptr, s_ptr)

    @triton.jit
    def _x_group(xq_ptr, xd_ptr, xs_ptr, x_row, xg_row, row_ok, g, num_groups,
                 QTYPE: tl.constexpr):
        """Group g of the rows: (int8 [BM, 32] in the order QTYPE's tile wants
        (mmq_groups.x_columns), scale [BM, 1], scale * sum [BM, 1])."""
        ok = group_ok(row_ok, g, num_groups)
        q = tl.load(xq_ptr + (x_row + g * 32 + x_columns(QTYPE)), mask=ok, other=0)
        return (q, tl.load(xd_ptr + (xg_row + g), mask=ok, other=0.0),
                tl.load(xs_ptr + (xg_row + g), mask=ok, other=0.0))

    @triton.jit
    def _tile(offsets_ptr, K, NUM_EXPERTS: tl.constexpr, BLOCK_E: tl.constexpr,
              BLOCK_M: tl.constexpr):
        """(expert, rows [BM], row_ok [BM, 1], x_row, xg_row [BM, 1] int64) of this program's
        M tile: x's element and group offsets of its rows."""
        expert, first_row, end_row = _m_tile(offsets_ptr, tl.program_id(1), NUM_EXPERTS,
                                             BLOCK_E, BLOCK_M)
        rows = first_row + tl.arange(0, BLOCK_M)
        rows64 = rows.to(tl.int64)[:, None]
        return expert, rows, (rows < end_row)[:, None], rows64 * K, rows64 * (K // 32)

    @triton.jit(do_not_specialize=["num_rows", "rows_hint", "gate_stride", "up_stride"])
    def _gate_up_kernel(
        xq_ptr, xd_ptr, xs_ptr, offsets_ptr, row_w_ptr, gate_ptr, gate_h_ptr, up_ptr,
        up_h_ptr, out_q_ptr, out_d_ptr, out_s_ptr, num_rows, rows_hint, gate_stride,
        up_stride, N, K, gate_row_bytes, up_row_bytes,
        NUM_EXPERTS: tl.constexpr, BLOCK_E: tl.constexpr, GATE_QTYPE: tl.constexpr,
        GATE_UNIT: tl.constexpr, UP_QTYPE: tl.constexpr, UP_UNIT: tl.constexpr,
        SHARE_X: tl.constexpr, INT8_OUT: tl.constexpr, USE_PDL: tl.constexpr,
        BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr, BLOCK_M: tl.constexpr,
        STAGES: tl.constexpr,
    ):
        pdl_wait(USE_PDL)
        expert, rows, row_ok, x_row, xg_row = _tile(offsets_ptr, K, NUM_EXPERTS, BLOCK_E,
                                                    BLOCK_M)
        if expert >= NUM_EXPERTS:  # past the last tile of this chunk's routing
            return
        n = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        n_ok = (n < N)[:, None]  # [BN, 1]
        n64 = n.to(tl.int64)[:, None]
        e64 = expert.to(tl.int64)
        gate_row = e64 * gate_stride * GATE_UNIT + n64 * gate_row_bytes
        up_row = e64 * up_stride * UP_UNIT + n64 * up_row_bytes
        acc_gate = tl.zeros((BLOCK_M, BLOCK_ROWS), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_ROWS), dtype=tl.float32)
        num_groups = K // 32
        PAIRS: tl.constexpr = BLOCK_COLS // 64
        for p0 in tl.range(0, tl.cdiv(num_groups, 2), PAIRS, num_stages=STAGES):
            for i in tl.static_range(PAIRS):
                pair = p0 + i
                xq0, xd0, xs0 = _x_group(xq_ptr, xd_ptr, xs_ptr, x_row, xg_row, row_ok,
                                         2 * pair, num_groups, GATE_QTYPE)
                xq1, xd1, xs1 = _x_group(xq_ptr, xd_ptr, xs_ptr, x_row, xg_row, row_ok,
                                         2 * pair + 1, num_groups, GATE_QTYPE)
                acc_gate += pair_dot(xq0, xd0, xs0, xq1, xd1, xs1, gate_ptr, gate_h_ptr,
                                     gate_row, n_ok, pair, num_groups, GATE_QTYPE)
                if not SHARE_X:  # up's tile wants x in another order
                    xq0 = tl.load(xq_ptr + (x_row + 2 * pair * 32 + x_columns(UP_QTYPE)),
                                  mask=group_ok(row_ok, 2 * pair, num_groups), other=0)
                    xq1 = tl.load(xq_ptr + (x_row + 2 * pair * 32 + 32 + x_columns(UP_QTYPE)),
                                  mask=group_ok(row_ok, 2 * pair + 1, num_groups), other=0)
                acc_up += pair_dot(xq0, xd0, xs0, xq1, xd1, xs1, up_ptr, up_h_ptr, up_row,
                                   n_ok, pair, num_groups, UP_QTYPE)
        # expert_gemm's roundings (the rows' dtype, silu_mul_scale's order), then int8.
        dtype: tl.constexpr = row_w_ptr.dtype.element_ty
        g = _round(acc_gate, dtype)
        silu = _round(g / (1.0 + tl.exp(-g)), dtype)
        act = _round(silu * _round(acc_up, dtype), dtype)
        weight = tl.load(row_w_ptr + rows[:, None], mask=row_ok, other=0.0).to(tl.float32)
        act = _round(act * weight, dtype)
        out_row = rows.to(tl.int64)[:, None]
        out_ok = row_ok & (n < N)[None, :]
        if INT8_OUT:  # for this module's down
            SUBS: tl.constexpr = BLOCK_ROWS // 32  # groups of 32 outputs a row of the tile
            q, d, s = round_groups(tl.reshape(act, (BLOCK_M * SUBS, 32)))
            tl.store(out_q_ptr + (out_row * N + n[None, :]),
                     tl.reshape(q, (BLOCK_M, BLOCK_ROWS)).to(tl.int8), mask=out_ok)
            sub = tl.program_id(0) * SUBS + tl.arange(0, SUBS)[None, :]
            at = out_row * (N // 32) + sub
            sub_ok = row_ok & (sub < N // 32)
            tl.store(out_d_ptr + at, tl.reshape(d, (BLOCK_M, SUBS)), mask=sub_ok)
            tl.store(out_s_ptr + at, tl.reshape(s, (BLOCK_M, SUBS)), mask=sub_ok)
        else:  # the rows' dtype, as expert_gemm.gate_up writes it, for expert_gemm's down
            tl.store(out_q_ptr + (out_row * N + n[None, :]), act.to(dtype), mask=out_ok)

    @triton.jit(do_not_specialize=["num_rows", "rows_hint", "stride"])
    def _down_kernel(
        xq_ptr, xd_ptr, xs_ptr, offsets_ptr, w_ptr, wh_ptr, out_ptr, num_rows, rows_hint,
        stride, N, K, row_bytes,
        NUM_EXPERTS: tl.constexpr, BLOCK_E: tl.constexpr, QTYPE: tl.constexpr,
        UNIT: tl.constexpr, USE_PDL: tl.constexpr, BLOCK_ROWS: tl.constexpr,
        BLOCK_COLS: tl.constexpr, BLOCK_M: tl.constexpr, STAGES: tl.constexpr,
    ):
        pdl_wait(USE_PDL)
        expert, rows, row_ok, x_row, xg_row = _tile(offsets_ptr, K, NUM_EXPERTS, BLOCK_E,
                                                    BLOCK_M)
        if expert >= NUM_EXPERTS:
            return
        n = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        n_ok = (n < N)[:, None]
        w_row = expert.to(tl.int64) * stride * UNIT + n.to(tl.int64)[:, None] * row_bytes
        acc = tl.zeros((BLOCK_M, BLOCK_ROWS), dtype=tl.float32)
        num_groups = K // 32
        PAIRS: tl.constexpr = BLOCK_COLS // 64
        for p0 in tl.range(0, tl.cdiv(num_groups, 2), PAIRS, num_stages=STAGES):
            for i in tl.static_range(PAIRS):
                pair = p0 + i
                xq0, xd0, xs0 = _x_group(xq_ptr, xd_ptr, xs_ptr, x_row, xg_row, row_ok,
                                         2 * pair, num_groups, QTYPE)
                xq1, xd1, xs1 = _x_group(xq_ptr, xd_ptr, xs_ptr, x_row, xg_row, row_ok,
                                         2 * pair + 1, num_groups, QTYPE)
                acc += pair_dot(xq0, xd0, xs0, xq1, xd1, xs1, w_ptr, wh_ptr, w_row, n_ok,
                                pair, num_groups, QTYPE)
        tl.store(out_ptr + (rows.to(tl.int64)[:, None] * N + n[None, :]),
                 acc.to(out_ptr.dtype.element_ty), mask=row_ok & (n < N)[None, :])

    _gate_up_tuned = launch.tuned(_gate_up_kernel, _candidates(GATE_UP_CONFIGS),
                                  key=("N", "K", "GATE_QTYPE", "UP_QTYPE", "INT8_OUT",
                                       "rows_hint"))
    _down_tuned = launch.tuned(_down_kernel, _candidates(DOWN_CONFIGS),
                               key=("N", "K", "QTYPE", "rows_hint"))


def is_supported(experts: QuantizedExperts) -> bool:
    """Whether these kernels read this projection: an MMQ type (mmq_groups.MMQ_TYPES) whose
    blocks lie at the alignment its scale reads need, in rows of whole groups of 32."""
    qtype = int(experts.qtype)
    if triton is None or qtype not in MMQ_TYPES:
        return False
    needed = row_alignment(qtype)  # Q4_K, Q5_K: scales read as words; others: fp16 fields
    return (expert_gemv.alignment_unit(experts) >= needed
            and experts.raw.data_ptr() % needed == 0 and experts.shape[1] % GROUP == 0)


def supports(gate: QuantizedExperts, up: QuantizedExperts, down: QuantizedExperts) -> bool:
    """Whether `experts_mlp` takes these three projections (else the caller's other paths)."""
    return all(is_supported(w) for w in (gate, up, down))


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q int8 [R, K], d float32 [R, K/32], s = d * sum(q) [R, K/32]) of x [R, K]
    contiguous: gemv_dp4a.quantize_x's rounding, for any number of rows."""
    num_rows, num_cols = x.shape
    if num_cols % GROUP or not x.is_contiguous():
        raise ValueError(f"rows must be contiguous [R, K] with K a multiple of {GROUP}, got "
                         f"{tuple(x.shape)} strides {x.stride()}")
    q = torch.empty(num_rows, num_cols, dtype=torch.int8, device=x.device)
    d = torch.empty(num_rows, num_cols // GROUP, dtype=torch.float32, device=x.device)
    s = torch.empty_like(d)
    num_subs = d.numel()
    if num_subs:
        _quantize_rows_kernel[(triton.cdiv(num_subs, QUANTIZE_SUBS),)](
            x, q, d, s, num_subs, BLOCK_SUBS=QUANTIZE_SUBS)
    return q, d, s


def _check(rounded: tuple, offsets: torch.Tensor, experts: QuantizedExperts) -> None:
    num_experts, _, num_cols = experts.shape
    q, d, s = rounded
    if (q.dim() != 2 or q.shape[1] != num_cols or q.dtype != torch.int8
            or d.shape != (q.shape[0], num_cols // GROUP) or s.shape != d.shape):
        raise ValueError(f"rows must be rounded to int8 [R, {num_cols}] with scales "
                         f"[R, {num_cols // GROUP}], got {q.dtype} {tuple(q.shape)}, "
                         f"{tuple(d.shape)}")
    if (offsets.shape != (num_experts,) or offsets.dtype != torch.int32
            or not offsets.is_contiguous()):
        raise ValueError(f"offsets must be contiguous int32 [{num_experts}], got "
                         f"{offsets.dtype} {tuple(offsets.shape)}")
    if not is_supported(experts):
        raise ValueError(f"no int8 kernel reads these {experts.qtype.name} experts")


def gate_up(rounded: tuple, offsets: torch.Tensor, gate: QuantizedExperts,
            up: QuantizedExperts, row_weights: torch.Tensor, int8_out: bool = True):
    """silu(x @ gate[e]^T) * (x @ up[e]^T) * row_weights[:, None], rounded to
    row_weights' dtype as expert_gemm.gate_up rounds it, for the rows x each expert e owns
    (offsets [E] int32: cumulative ends) given as quantize_rows(x). int8_out: its int8
    rounding (q [R, I], d, s [R, I/32]) for `down`; else [R, I] in row_weights' dtype, for
    expert_gemm.down (the per-projection choice: `experts_mlp`'s down_by)."""
    _check(rounded, offsets, gate)
    _check(rounded, offsets, up)
    num_experts, num_outputs, num_cols = gate.shape
    num_rows = rounded[0].shape[0]
    if up.shape != gate.shape or row_weights.shape != (num_rows,):
        raise ValueError(f"gate {gate.shape}, up {up.shape} and row weights "
                         f"{tuple(row_weights.shape)} disagree")
    if int8_out:
        q = torch.empty(num_rows, num_outputs, dtype=torch.int8, device=offsets.device)
        d = torch.empty(num_rows, num_outputs // GROUP, dtype=torch.float32, device=q.device)
        out: tuple = (q, d, torch.empty_like(d))
    else:  # d and s are not written: the activation stands in for their pointers
        act = torch.empty(num_rows, num_outputs, dtype=row_weights.dtype,
                          device=offsets.device)
        out = (act, act, act)
    if num_rows:
        launch.launch_meta(
            _gate_up_tuned, gl.grid(num_rows, num_experts, num_outputs),
            _candidates(GATE_UP_CONFIGS), *rounded, offsets, row_weights.contiguous(),
            gate.raw, fp16_view(gate.raw), up.raw, fp16_view(up.raw), *out, num_rows,
            gl.rows_hint(num_rows, num_experts), gate.expert_stride // _unit(gate),
            up.expert_stride // _unit(up), num_outputs, num_cols, gate.raw.shape[2],
            up.raw.shape[2],
            NUM_EXPERTS=num_experts, BLOCK_E=triton.next_power_of_2(num_experts),
            GATE_QTYPE=int(gate.qtype), GATE_UNIT=_unit(gate), UP_QTYPE=int(up.qtype),
            UP_UNIT=_unit(up), SHARE_X=_x_order(gate) == _x_order(up), INT8_OUT=int8_out,
        )
    return out if int8_out else out[0]


def _x_order(experts: QuantizedExperts) -> bool:
    """Whether the kernels read x's groups interleaved for this type (mmq_groups.x_columns)."""
    return int(experts.qtype) in NIBBLE_TYPES


def _unit(experts: QuantizedExperts) -> int:
    return expert_gemv.alignment_unit(experts)


def down(rounded: tuple, offsets: torch.Tensor, down_proj: QuantizedExperts,
         dtype: torch.dtype) -> torch.Tensor:
    """act @ down[e]^T for the rows each expert e owns, act given as its int8 rounding
    (`gate_up`'s); [R, H] in dtype."""
    _check(rounded, offsets, down_proj)
    num_experts, num_outputs, num_cols = down_proj.shape
    num_rows = rounded[0].shape[0]
    out = torch.empty(num_rows, num_outputs, dtype=dtype, device=offsets.device)
    if num_rows == 0:
        return out
    raw = down_proj.raw
    launch.launch_meta(
        _down_tuned, gl.grid(num_rows, num_experts, num_outputs), _candidates(DOWN_CONFIGS),
        *rounded, offsets, raw, fp16_view(raw), out, num_rows,
        gl.rows_hint(num_rows, num_experts), down_proj.expert_stride // _unit(down_proj),
        num_outputs, num_cols, raw.shape[2],
        NUM_EXPERTS=num_experts, BLOCK_E=triton.next_power_of_2(num_experts),
        QTYPE=int(down_proj.qtype), UNIT=_unit(down_proj),
    )
    return out


DOWN_BY = ("mmq", "gemm")


def experts_mlp(rows: torch.Tensor, gate: QuantizedExperts, up: QuantizedExperts,
                down_proj: QuantizedExperts, offsets: torch.Tensor, row_weights: torch.Tensor,
                source: torch.Tensor | None = None, down_by: str = "mmq") -> torch.Tensor:
    """expert_gemm.experts_mlp by int8 products: the routed experts' weighted SwiGLU of rows
    [R, H] sorted by expert, [R, H] in the rows' dtype. With source [R], rows are the
    tokens [T, H] and sorted row r is token source[r]: the T tokens are rounded, then
    gathered (T * H values rounded where the gathered rows would take R * H). down_by
    "gemm": the down projection by expert_gemm.down from the activation in the rows' dtype
    (run 39: the int8 products win Q4_K's gate/up and lose Q5_0's down), which only needs
    expert_gemm to decode down's type."""
    if down_by not in DOWN_BY:
        raise ValueError(f"down_by must be one of {DOWN_BY}, got {down_by!r}")
    q, d, s = quantize_rows(rows.contiguous())
    if source is not None:
        q, d, s = (t.index_select(0, source) for t in (q, d, s))
    weights = row_weights.to(rows.dtype)
    if down_by == "gemm":
        from strata.engine.core.quant import expert_gemm

        act = gate_up((q, d, s), offsets, gate, up, weights, int8_out=False)
        return expert_gemm.down(act, offsets, down_proj)
    return down(gate_up((q, d, s), offsets, gate, up, weights), offsets, down_proj,
                rows.dtype)
