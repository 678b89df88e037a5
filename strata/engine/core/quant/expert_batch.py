"""B rows' routed experts straight from their GGML blocks: moe_batch.py's pair kernels, quantized.

A batch step of B = 2..16 rows (fast/batch_graph.py) has B*k (row, expert) pairs, routed by
moe_batch.router_topk_rows. expert_gemv.py's one-token kernels would take B times the
launches and read an expert once per row that routed to it. Here, three launches a layer:

1. `gate_up_rows`: silu(gate[e] @ x_b) * (up[e] @ x_b) for every pair (b, e). The first pair
   of each expert (its leader) decodes each weight tile once (gemv_planes.planes_lut) and
   multiplies it with all rows routed there by tl.dot over 16 rows, as kernels._planes_kernel
   does for 2..16 tokens, or, for an expert only one row routed to (most of them at small B
   with spread routing), by float32 multiply-and-add as expert_gemv does; the other pairs
   skip their loops (a bound of 0) and store nothing.
2. `down_rows`: weights[b, j] * down[e] @ act[b, j] for every pair, by the leaders likewise,
   into a float32 scratch [B*k, H].
3. moe_batch's in-order sum: each row's k parts summed in float32, rounded once (no atomics).

Ids stay in device memory and the grid is fixed for the bucket (B*k pairs x row tiles), so a
CUDA graph holds it. A partial expert cache's slot table sends a -1 expert to the host copy,
read in place (expert_gemv._expert_base's addressing). The row count is a runtime argument:
one compile per type serves every bucket. The types and layouts are expert_gemv's
(`supports`); others keep the one-token kernels row by row (fast/batch_experts.experts_rows).

Imported on first use (like kernels.py): a test must choose the CPU interpreter first.
"""

from __future__ import annotations

import torch

from strata.engine.core.fast.moe_batch import SUM_COLS, _precision, _sum_pairs_kernel
from strata.engine.core.kernels import launch
from strata.engine.core.quant import expert_gemv
from strata.engine.core.quant import gemv_planes as gp
from strata.engine.core.quant.experts import QuantizedExperts, fp16_view
from strata.engine.core.quant.lookup import lookup_table

try:
    import triton
    import triton.language as tl

    from strata.engine.core.kernels.pdl import wait as pdl_wait
    from strata.engine.core.quant.expert_gemv import _expert_base
except ImportError:
    triton = None

MAX_ROWS = 16  # rows a leader multiplies in one tl.dot (16: tl.dot's minimum; bucket 16)
# (BLOCK_ROWS, BLOCK_COLS, num_warps, STAGES), autotuned per shape, type and row count on
# CUDA. tl.dot needs 16 rows or more in every candidate. As for kernels._planes_kernel's
# 2..16 tokens: K tiles of 256 and 32 or 64 rows; 16 rows and wider K for the one-row loop,
# which most leaders take at small B.
PAIR_CONFIGS = ((32, 256, 4, 3), (16, 256, 4, 3), (64, 256, 8, 3), (32, 256, 4, 1),
                (16, 512, 4, 3))
# The interpreter pays per program and per op, not per value: one wide tile.
INTERPRETER_CONFIG = ((256, 256, 4, 1),)


def _candidates() -> tuple:
    configs = INTERPRETER_CONFIG if launch.is_interpreting() else PAIR_CONFIGS
    return tuple((n, k, w, {"STAGES": s}) for n, k, w, s in configs)


if triton is not None:

    @triton.jit
    def _leader(ids_ptr, pair, num_tokens, TOP_K: tl.constexpr, BLOCK_T: tl.constexpr,
                BLOCK_K: tl.constexpr):
        """(is this pair its expert's first, rows using the expert [BLOCK_T] (none unless
        this pair leads), each row's pair with that expert [BLOCK_T])."""
        expert = tl.load(ids_ptr + pair)
        tokens = tl.arange(0, BLOCK_T)
        slots = tl.arange(0, BLOCK_K)
        flat = tokens[:, None] * TOP_K + slots[None, :]  # [BLOCK_T, BLOCK_K]
        valid = (tokens < num_tokens)[:, None] & (slots < TOP_K)[None, :]
        ids = tl.load(ids_ptr + flat, mask=valid, other=-1)
        match = valid & (ids == expert)
        num_earlier = tl.sum((match & (flat < pair)).to(tl.int32))
        # Masks broadcast from the count: the interpreter refuses a 0-d boolean in a mask.
        uses = (tl.sum(match.to(tl.int32), axis=1) > 0) & (tokens * 0 + num_earlier == 0)
        token_pair = tl.sum(tl.where(match, flat, 0), axis=1)  # top-k ids differ per row
        return num_earlier == 0, uses, token_pair

    @triton.jit
    def _rows_dot(w_ptr, wh_ptr, lut_ptr, row_off, row_ok, v_ptr, v_index, v_ok, num_groups,
                  num_cols,
                  QTYPE: tl.constexpr, LANES: tl.constexpr, PRECISION: tl.constexpr,
                  BLOCK_T: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr,
                  STAGES: tl.constexpr):
        """v @ W[rows]^T in float32 [BLOCK_T, BLOCK_ROWS]: W's rows at byte offsets row_off
        [R, 1, 1] (mask row_ok [R]), num_groups planes groups each (0: nothing read); slot t
        multiplies v's row v_index[t] (v_ptr [*, num_cols], mask v_ok [BLOCK_T]). Each tile
        is decoded once for every row: by tl.dot over the 16 slots for two rows or more; for
        one, by float32 multiply-and-add as the one-token kernels do, which takes fewer
        instructions per value than tl.dot's operand shuffles (docs/benchmarks.md: the
        dense planes kernel reads 1.5-4x slower at 16 tokens than at one)."""
        GROUPS: tl.constexpr = BLOCK_COLS // (2 * LANES)
        lane = tl.arange(0, LANES)[None, None, :]  # [1, 1, L]
        num_used = tl.sum(v_ok.to(tl.int32))
        acc = tl.zeros((BLOCK_T, BLOCK_ROWS), dtype=tl.float32)
        v_rows = v_ptr + v_index.to(tl.int64)[:, None, None] * num_cols  # [T, 1, 1]
        for g0 in tl.range(0, tl.where(num_used > 1, num_groups, 0), GROUPS,
                           num_stages=STAGES):
            group = g0 + tl.arange(0, GROUPS)[None, :, None]  # [1, G, 1]
            group_ok = group < num_groups
            w0, cols0, w1, cols1 = gp.planes_lut(w_ptr, wh_ptr, lut_ptr, row_off, group,
                                                 lane, row_ok[:, None, None] & group_ok, QTYPE)
            ok = v_ok[:, None, None] & group_ok
            v0 = tl.reshape(tl.load(v_rows + cols0, mask=ok, other=0.0),
                            (BLOCK_T, GROUPS * LANES))  # [T, G*L]
            v1 = tl.reshape(tl.load(v_rows + cols1, mask=ok, other=0.0),
                            (BLOCK_T, GROUPS * LANES))
            w0 = tl.reshape(w0, (BLOCK_ROWS, GROUPS * LANES))
            w1 = tl.reshape(w1, (BLOCK_ROWS, GROUPS * LANES))
            if PRECISION == "ieee":  # float32 (and the interpreter: moe_batch._precision)
                acc = tl.dot(v0.to(tl.float32), tl.trans(w0), acc, input_precision="ieee")
                acc = tl.dot(v1.to(tl.float32), tl.trans(w1), acc, input_precision="ieee")
            else:  # the weights rounded to the compute dtype, as _planes_kernel's tl.dot
                acc = tl.dot(v0, tl.trans(w0.to(v0.dtype)), acc)
                acc = tl.dot(v1, tl.trans(w1.to(v1.dtype)), acc)
        # One row: its v read at the weights' [R, G, L] shape (one layout for both loads, as
        # expert_gemv._row_dots), one fp32 accumulator per value summed once at the end.
        v_one = v_ptr + tl.sum(tl.where(v_ok, v_index, 0)).to(tl.int64) * num_cols
        same_row = tl.zeros((BLOCK_ROWS, 1, 1), dtype=tl.int32)
        acc_one = tl.zeros((BLOCK_ROWS, GROUPS, LANES), dtype=tl.float32)
        for g0 in tl.range(0, tl.where(num_used == 1, num_groups, 0), GROUPS,
                           num_stages=STAGES):
            group = g0 + tl.arange(0, GROUPS)[None, :, None]  # [1, G, 1]
            group_ok = group < num_groups
            w0, cols0, w1, cols1 = gp.planes_lut(w_ptr, wh_ptr, lut_ptr, row_off, group,
                                                 lane, row_ok[:, None, None] & group_ok, QTYPE)
            v_at = v_one + (cols0 + same_row)
            v0 = tl.load(v_at, mask=group_ok, other=0.0).to(tl.float32)
            v1 = tl.load(v_at + (cols1 - cols0), mask=group_ok, other=0.0).to(tl.float32)
            acc_one += w0 * v0  # two statements: two FMAs
            acc_one += w1 * v1
        one = tl.sum(tl.sum(acc_one, axis=2), axis=1)  # [R]
        # (Masks broadcast from the count: the interpreter refuses a 0-d boolean in a mask.)
        is_one = v_ok & (v_index * 0 + num_used == 1)
        return tl.where(is_one[:, None], one[None, :], acc)

    @triton.jit(do_not_specialize=["num_tokens", "gate_host", "up_host", "gate_stride",
                                   "up_stride"])
    def _gate_up_kernel(
        x_ptr, gate_ptr, gate_h_ptr, up_ptr, up_h_ptr, ids_ptr, table_ptr, lut_ptr, out_ptr,
        num_tokens, gate_host, up_host, gate_stride, up_stride, num_rows, num_cols,
        gate_row_bytes, up_row_bytes,
        TOP_K: tl.constexpr, GATE_QTYPE: tl.constexpr, GATE_LANES: tl.constexpr,
        GATE_UNIT: tl.constexpr, UP_QTYPE: tl.constexpr, UP_LANES: tl.constexpr,
        UP_UNIT: tl.constexpr, HAS_TABLE: tl.constexpr, PRECISION: tl.constexpr,
        BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
        BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr, STAGES: tl.constexpr,
    ):
        pair = tl.program_id(0)
        rows = tl.program_id(1) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        pdl_wait(USE_PDL)  # the ids come from the router, the kernel just before
        is_leader, uses, token_pair = _leader(ids_ptr, pair, num_tokens, TOP_K, BLOCK_T,
                                              BLOCK_K)
        row_ok = rows < num_rows
        rows64 = rows.to(tl.int64)[:, None, None]
        tokens = tl.arange(0, BLOCK_T)
        gate_off = _expert_base(ids_ptr, pair, table_ptr, gate_host, gate_stride, GATE_UNIT,
                                HAS_TABLE) + rows64 * gate_row_bytes
        g = _rows_dot(gate_ptr, gate_h_ptr, lut_ptr, gate_off, row_ok, x_ptr, tokens, uses,
                      tl.where(is_leader, num_cols // (2 * GATE_LANES), 0), num_cols,
                      GATE_QTYPE, GATE_LANES, PRECISION, BLOCK_T, BLOCK_ROWS, BLOCK_COLS,
                      STAGES)
        up_off = _expert_base(ids_ptr, pair, table_ptr, up_host, up_stride, UP_UNIT,
                              HAS_TABLE) + rows64 * up_row_bytes
        u = _rows_dot(up_ptr, up_h_ptr, lut_ptr, up_off, row_ok, x_ptr, tokens, uses,
                      tl.where(is_leader, num_cols // (2 * UP_LANES), 0), num_cols, UP_QTYPE,
                      UP_LANES, PRECISION, BLOCK_T, BLOCK_ROWS, BLOCK_COLS, STAGES)
        act = g / (1.0 + tl.exp(-g)) * u  # silu(gate) * up, [BLOCK_T, BLOCK_ROWS]
        out = out_ptr + token_pair[:, None].to(tl.int64) * num_rows + rows[None, :]
        tl.store(out, act.to(out_ptr.dtype.element_ty), mask=uses[:, None] & row_ok[None, :])

    @triton.jit(do_not_specialize=["num_tokens", "host_units", "stride_units"])
    def _down_kernel(
        act_ptr, w_ptr, wh_ptr, ids_ptr, weights_ptr, table_ptr, lut_ptr, out_ptr,
        num_tokens, host_units, stride_units, num_rows, num_cols, row_bytes,
        TOP_K: tl.constexpr, QTYPE: tl.constexpr, LANES: tl.constexpr, UNIT: tl.constexpr,
        HAS_TABLE: tl.constexpr, PRECISION: tl.constexpr, BLOCK_T: tl.constexpr,
        BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
        BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr, STAGES: tl.constexpr,
    ):
        pair = tl.program_id(0)
        rows = tl.program_id(1) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        pdl_wait(USE_PDL)  # for the activations of gate_up, the kernel just before
        is_leader, uses, token_pair = _leader(ids_ptr, pair, num_tokens, TOP_K, BLOCK_T,
                                              BLOCK_K)
        row_ok = rows < num_rows
        off = _expert_base(ids_ptr, pair, table_ptr, host_units, stride_units, UNIT,
                           HAS_TABLE) + rows.to(tl.int64)[:, None, None] * row_bytes
        # Each row multiplies its own pair's activations.
        acc = _rows_dot(w_ptr, wh_ptr, lut_ptr, off, row_ok, act_ptr, token_pair, uses,
                        tl.where(is_leader, num_cols // (2 * LANES), 0), num_cols, QTYPE,
                        LANES, PRECISION, BLOCK_T, BLOCK_ROWS, BLOCK_COLS, STAGES)
        weight = tl.load(weights_ptr + token_pair, mask=uses, other=0.0).to(tl.float32)
        out = out_ptr + token_pair[:, None].to(tl.int64) * num_rows + rows[None, :]
        tl.store(out, acc * weight[:, None], mask=uses[:, None] & row_ok[None, :])

    _gate_up_tuned = launch.tuned(
        _gate_up_kernel, _candidates(),
        key=("num_tokens", "num_rows", "num_cols", "GATE_QTYPE", "UP_QTYPE", "TOP_K"))
    _down_tuned = launch.tuned(
        _down_kernel, _candidates(),
        key=("num_tokens", "num_rows", "num_cols", "QTYPE", "TOP_K"))


def supports(gate: QuantizedExperts, up: QuantizedExperts, down: QuantizedExperts,
             table: torch.Tensor | None = None,
             host_offsets: tuple[int, int, int] = (0, 0, 0)) -> bool:
    """Whether `routed_rows` takes these projections: the one-token kernels' types and
    layouts (expert_gemv.supports); else the rows go one at a time."""
    return expert_gemv.supports(gate, up, down, table, host_offsets)


def _check_rows(ids: torch.Tensor) -> tuple[int, int]:
    if ids.dim() != 2 or not 0 < ids.shape[0] <= MAX_ROWS:
        raise ValueError(f"ids must be [rows, k] with 1..{MAX_ROWS} rows, got "
                         f"{tuple(ids.shape)}")
    return ids.shape[0], ids.shape[1]


def _blocks(top_k: int, dtype: torch.dtype) -> dict:
    return {"TOP_K": top_k, "BLOCK_T": MAX_ROWS, "BLOCK_K": triton.next_power_of_2(top_k),
            "PRECISION": _precision(dtype)}


def gate_up_rows(x: torch.Tensor, gate: QuantizedExperts, up: QuantizedExperts,
                 ids: torch.Tensor, table: torch.Tensor | None = None,
                 host_offsets: tuple[int, int] = (0, 0), use_pdl: bool = False) -> torch.Tensor:
    """silu(gate[ids[t, j]] @ x[t]) * (up[ids[t, j]] @ x[t]): x [T, H], ids [T, k] on the
    device -> [T*k, I] (pair t*k + j) in x's dtype. table and host_offsets (bytes) as for
    expert_gemv.gate_up: a partial cache's slots, and where its host copy lies."""
    num_tokens, top_k = _check_rows(ids)
    _, num_rows, num_cols = gate.shape
    if up.shape[1:] != gate.shape[1:] or x.shape != (num_tokens, num_cols):
        raise ValueError(f"gate {gate.shape}, up {up.shape}, x {tuple(x.shape)} and ids "
                         f"{tuple(ids.shape)} disagree")
    has_table = table is not None
    ids = ids.contiguous()
    table_arg = launch.slot_table_arg(table, ids)
    gate_unit = expert_gemv.alignment_unit(gate, host_offsets[0], has_table)
    up_unit = expert_gemv.alignment_unit(up, host_offsets[1], has_table)
    out = torch.empty(num_tokens * top_k, num_rows, dtype=x.dtype, device=x.device)
    launch.launch(
        _gate_up_tuned, lambda rows: (num_tokens * top_k, triton.cdiv(num_rows, rows)),
        _candidates(),
        x.contiguous(), gate.raw, fp16_view(gate.raw), up.raw,
        fp16_view(up.raw), ids, table_arg, lookup_table(x.device), out, num_tokens,
        int(host_offsets[0]) // gate_unit if has_table else 0,
        int(host_offsets[1]) // up_unit if has_table else 0,
        gate.expert_stride // gate_unit, up.expert_stride // up_unit, num_rows, num_cols,
        gate.raw.shape[2], up.raw.shape[2],
        GATE_QTYPE=int(gate.qtype), GATE_LANES=gp.ALL_PLANE_LANES[int(gate.qtype)],
        GATE_UNIT=gate_unit, UP_QTYPE=int(up.qtype), UP_LANES=gp.ALL_PLANE_LANES[int(up.qtype)],
        UP_UNIT=up_unit, HAS_TABLE=has_table, use_pdl=use_pdl, **_blocks(top_k, x.dtype),
    )
    return out


def down_rows(act: torch.Tensor, down: QuantizedExperts, ids: torch.Tensor,
              weights: torch.Tensor, table: torch.Tensor | None = None, host_offset: int = 0,
              use_pdl: bool = False) -> torch.Tensor:
    """weights[t, j] * (down[ids[t, j]] @ act[t*k + j]): act [T*k, I] -> float32 parts
    [T*k, H], one per pair (summed by `routed_rows`)."""
    num_tokens, top_k = _check_rows(ids)
    _, num_rows, num_cols = down.shape
    if act.shape != (num_tokens * top_k, num_cols) or weights.shape != ids.shape:
        raise ValueError(f"act {tuple(act.shape)}, weights {tuple(weights.shape)} and ids "
                         f"{tuple(ids.shape)} do not fit down {down.shape}")
    has_table = table is not None
    ids = ids.contiguous()
    table_arg = launch.slot_table_arg(table, ids)
    unit = expert_gemv.alignment_unit(down, host_offset, has_table)
    parts = torch.empty(num_tokens * top_k, num_rows, dtype=torch.float32, device=act.device)
    launch.launch(
        _down_tuned, lambda rows: (num_tokens * top_k, triton.cdiv(num_rows, rows)),
        _candidates(),
        act.contiguous(), down.raw, fp16_view(down.raw), ids, weights.contiguous(),
        table_arg, lookup_table(act.device), parts, num_tokens, int(host_offset) // unit if has_table else 0,
        down.expert_stride // unit, num_rows, num_cols, down.raw.shape[2],
        QTYPE=int(down.qtype), LANES=gp.ALL_PLANE_LANES[int(down.qtype)], UNIT=unit,
        HAS_TABLE=has_table, use_pdl=use_pdl, **_blocks(top_k, act.dtype),
    )
    return parts


def sum_parts(parts: torch.Tensor, top_k: int, dtype: torch.dtype) -> torch.Tensor:
    """[T*k, H] float32 parts -> [T, H] in dtype: each row's k parts in order (moe_batch)."""
    num_pairs, num_rows = parts.shape
    out = torch.empty(num_pairs // top_k, num_rows, dtype=dtype, device=parts.device)
    block = min(SUM_COLS, triton.next_power_of_2(num_rows))
    _sum_pairs_kernel[(num_pairs // top_k, triton.cdiv(num_rows, block))](
        parts, out, top_k=top_k, num_rows=num_rows, BLOCK_COLS=block, num_warps=4)
    return out


def routed_rows(x: torch.Tensor, gate: QuantizedExperts, up: QuantizedExperts,
                down: QuantizedExperts, ids: torch.Tensor, weights: torch.Tensor,
                table: torch.Tensor | None = None,
                host_offsets: tuple[int, int, int] = (0, 0, 0)) -> torch.Tensor:
    """The routed experts of rows x [T, H] (T <= MAX_ROWS), ids and weights [T, k] ->
    [T, H] in x's dtype; each expert's blocks read once for all its rows (see `supports`)."""
    act = gate_up_rows(x, gate, up, ids, table, host_offsets[:2])  # [T*k, I]
    parts = down_rows(act, down, ids, weights, table, host_offsets[2])  # [T*k, H]
    return sum_parts(parts, ids.shape[1], x.dtype)
