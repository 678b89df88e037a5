"""One token's routed experts straight from their GGML blocks: two Triton launches a layer.

1. `gate_up`: act[j] = silu(gate[e_j] @ x) * (up[e_j] @ x) for the k routed experts; each
   program owns a few rows of one expert and reads its gate and up blocks once.
2. `down_sum`: sum_j w_j * down[e_j] @ act[j] -> [H]; each program owns output rows and
   reads them from all k experts at once, then sums the k in registers, so the float32 sum
   is deterministic (no atomics) and the weighted sum and the cast need no extra kernel.

Blocks are decoded by the planes path (gemv_planes.py, also the dense decode GEMV's): whole
groups of packed bytes per load, scales once per group. For bf16/fp16 x, projections of
the dp4a types (dp4a_dots.DP4A_TYPES) multiply by dp4a instead (dp4a_dots.py, as the dense
gemv_dp4a.py): x, and then the k activation rows, are rounded to int8 once per token by one small launch each
(gemv_dp4a.quantize_x), so a layer is four launches; a layer may mix the two (Q4_K gate/up
by dp4a, a Q2_K down by planes). STRATA_DP4A=0 keeps planes. The expert ids stay in device
memory (the router's top-k); a partial expert cache's slot table sends a -1 expert to the host copy,
read in place, as expert_kernels._gather_kernel does. Types outside
gemv_planes.ALL_PLANE_LANES, or layouts whose alignment the planes loads cannot take
(`is_supported`), keep expert_kernels.dequantize_routed.

GPT-OSS: MXFP4 experts and an epilogue (expert biases by the real ids,
the clamped SwiGLU: fast/expert_epilogue.py) are taken where all three projections go by
dp4a (`supports_dp4a`). The epilogue is a few instructions after the dots, so these
kernels apply it rather than expert_tile_gemv reading x rounded: one decoding per type for
dense and routed products, and the dp4a tiles, tuners and PDL chaining are those of every
other dp4a type. Float32 x (the CPU tests of the model, the verify mode) and planes-only
types with an epilogue keep expert_tile_gemv.py.

Imported on first use (like kernels.py): a test must choose the CPU interpreter first.
"""

from __future__ import annotations

import torch

from strata.engine.core.fast import expert_epilogue
from strata.engine.core.fast.expert_epilogue import Epilogue
from strata.engine.core.kernels import launch
from strata.engine.core.quant import gemv_dp4a
from strata.engine.core.quant import gemv_planes as gp
from strata.engine.core.quant.dp4a_dots import DP4A_TYPES, GROUP_VALUES, row_alignment
from strata.engine.core.quant.experts import QuantizedExperts, fp16_view
from strata.engine.core.quant.lookup import lookup_table

try:
    import triton
    import triton.language as tl

    from strata.engine.core.fast.moe_triton import activate
    from strata.engine.core.kernels.pdl import wait as pdl_wait
    from strata.engine.core.quant.dp4a_dots import row_dots as dp4a_row_dots
except ImportError:
    triton = None

# (BLOCK_ROWS, BLOCK_COLS, num_warps, STAGES) candidates, autotuned per shape and type on
# CUDA. Gate/up: k experts x I rows (8 x 768 for Qwen3-30B-A3B) of H = 2048 columns, so few
# rows per program still fill the SMs. Down: H rows of I = 768 columns per expert, and a
# program's tile is BLOCK_ROWS rows of each of the k experts (k x BLOCK_ROWS rows in all);
# a 1024 column tile takes a whole row of every type in one step (masked lanes load nothing).
GATE_UP_CONFIGS = ((2, 1024, 4, 1), (4, 1024, 4, 1), (2, 1024, 4, 3), (4, 1024, 4, 3),
                   (2, 2048, 8, 1), (8, 1024, 8, 3))
DOWN_SUM_CONFIGS = ((1, 1024, 4, 1), (2, 1024, 8, 1), (1, 512, 4, 1), (2, 512, 4, 3),
                    (4, 256, 4, 1))
# The dp4a path: each thread should hold a whole group (64 values; Q6_K 32) of one row
# (gemv_dp4a.py), so fewer threads per row tile. Down's 768 columns take three steps of 256
# or one of 1024 (a quarter of it rereading the last group, counted zero); its rows are per
# expert (x 8 for Qwen3-30B-A3B).
GATE_UP_DP4A_CONFIGS = ((8, 2048, 4, 1), (4, 2048, 2, 1), (2, 2048, 1, 1), (8, 1024, 2, 1),
                        (4, 1024, 1, 1), (16, 1024, 4, 1))
DOWN_SUM_DP4A_CONFIGS = ((1, 256, 1, 1), (2, 256, 2, 1), (1, 1024, 2, 1), (1, 1024, 4, 1),
                         (2, 1024, 4, 1), (4, 256, 4, 1))
# IQ2_XXS by dp4a: a group is a whole 256-value block, and each thread should hold one (R rows
# x C columns / 256 >= 32 * num_warps); down's 768 columns are three groups of a 1024 tile.
GATE_UP_IQ2_CONFIGS = ((16, 2048, 4, 1), (8, 2048, 2, 1), (4, 2048, 1, 1), (16, 1024, 2, 1),
                       (8, 1024, 1, 1))
DOWN_SUM_IQ2_CONFIGS = ((1, 1024, 1, 1), (2, 1024, 2, 1), (4, 1024, 4, 1), (4, 256, 1, 1))
IQ2_XXS = 16
# The interpreter pays per program and per op, not per value: one wide tile.
INTERPRETER_CONFIG = ((256, 512, 4, 1),)
# Q4_K/Q5_K read their scales as int32 words: every block must start 4-aligned.
WORD_TYPES = frozenset({12, 13})
MAX_UNIT = 16  # bytes: a 16-aligned base lets the packed-byte loads vectorize


def _candidates(configs, num_cols: int = 0, tile_experts: int = 1) -> tuple:
    """The tuned candidates; under the interpreter its one tile, num_cols (given for dp4a,
    whose groups past the row still cost ops there) narrowing it to the row, and its rows
    divided by tile_experts (down_sum's tile holds each of its rows for that many experts)."""
    if launch.is_interpreting():
        rows, cols, warps, stages = INTERPRETER_CONFIG[0]
        rows = max(1, rows // tile_experts)
        if num_cols:
            cols = max(128, min(cols, triton.next_power_of_2(num_cols)))
        configs = ((rows, cols, warps, stages),)
    return tuple((n, k, w, {"STAGES": s}) for n, k, w, s in configs)


if triton is not None:

    @triton.jit
    def _expert_base(ids_ptr, j, table_ptr, host_units, stride_units, UNIT: tl.constexpr,
                     HAS_TABLE: tl.constexpr):
        """Byte offset of the j-th routed expert's blocks from the weights' base pointer.

        Offsets arrive in units of UNIT bytes and are multiplied back by the constexpr, so
        Triton knows the base's alignment (runtime offsets are not specialized: a new layer
        must not compile again). With a table, slot table[e], or (-1) the host copy."""
        expert = tl.load(ids_ptr + j).to(tl.int64)
        if HAS_TABLE:
            slot = tl.load(table_ptr + expert).to(tl.int64)
            units = tl.where(slot >= 0, slot * stride_units, host_units + expert * stride_units)
        else:
            units = expert * stride_units
        return units * UNIT

    @triton.jit
    def _expert_bias(bias_ids_ptr, j, bias_ptr, rows, num_rows):
        """Float32 bias at rows (0 past num_rows) of the j-th routed expert, by its real id:
        the epilogue's biases stay resident beside the router, never in a cache slot."""
        expert = tl.load(bias_ids_ptr + j).to(tl.int64)
        return tl.load(bias_ptr + expert * num_rows + rows, mask=rows < num_rows,
                       other=0.0).to(tl.float32)

    @triton.jit
    def _row_dots(w_ptr, wh_ptr, lut_ptr, row_off, row_ok, v_ptr, num_groups,
                  QTYPE: tl.constexpr,
                  LANES: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr,
                  STAGES: tl.constexpr):
        """W[rows, :] @ v in float32 [BLOCK_ROWS] for rows at byte offsets row_off [R, 1, 1]
        (mask row_ok [R, 1, 1]) of a matrix of num_groups planes groups per row."""
        GROUPS: tl.constexpr = BLOCK_COLS // (2 * LANES)
        lane = tl.arange(0, LANES)[None, None, :]  # [1, 1, L]
        acc = tl.zeros((BLOCK_ROWS, GROUPS, LANES), dtype=tl.float32)
        same_row = tl.zeros((BLOCK_ROWS, 1, 1), dtype=tl.int32)
        for g0 in tl.range(0, num_groups, GROUPS, num_stages=STAGES):
            group = g0 + tl.arange(0, GROUPS)[None, :, None]  # [1, G, 1]
            group_ok = group < num_groups
            w0, cols0, w1, cols1 = gp.planes_lut(w_ptr, wh_ptr, lut_ptr, row_off, group,
                                                 lane, row_ok & group_ok, QTYPE)
            # v read at the weights' [R, G, L] shape: one layout for both (kernels.py).
            v_at = v_ptr + (cols0 + same_row)
            v0 = tl.load(v_at, mask=group_ok, other=0.0).to(tl.float32)
            v1 = tl.load(v_at + (cols1 - cols0), mask=group_ok, other=0.0).to(tl.float32)
            acc += w0 * v0  # two statements: two FMAs
            acc += w1 * v1
        return tl.sum(tl.sum(acc, axis=2), axis=1)

    @triton.jit
    def _dots(w_ptr, wh_ptr, lut_ptr, base, rows, num_rows, row_bytes, v_ptr, xq_ptr, xd_ptr,
              xs_ptr, num_cols, QTYPE: tl.constexpr, LANES: tl.constexpr,
              GROUP: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr,
              STAGES: tl.constexpr, EMULATE: tl.constexpr):
        """[BLOCK_ROWS] float32: rows `rows` of the matrix at byte offset base times v (planes,
        GROUP 0) or times its int8 rounding xq, xd, xs (dp4a: GROUP values a group).
        base is one offset, or [BLOCK_ROWS] offsets (each row its expert's), and the vector
        pointers one for all rows, or [BLOCK_ROWS, 1, 1] (each row its own vector)."""
        if GROUP > 0:  # rows past the matrix reread its last (dp4a_dots reads unmasked)
            read = tl.minimum(rows, num_rows - 1).to(tl.int64)
            return dp4a_row_dots(w_ptr, (base + read * row_bytes)[:, None, None], xq_ptr,
                                 xd_ptr, xs_ptr, lut_ptr, num_cols // GROUP, QTYPE,
                                 GROUP, BLOCK_ROWS, BLOCK_COLS, STAGES, EMULATE)
        else:
            off = (base + rows.to(tl.int64) * row_bytes)[:, None, None]
            return _row_dots(w_ptr, wh_ptr, lut_ptr, off, (rows < num_rows)[:, None, None], v_ptr,
                             num_cols // (2 * LANES), QTYPE, LANES, BLOCK_ROWS, BLOCK_COLS,
                             STAGES)

    @triton.jit(do_not_specialize=["gate_host", "up_host", "gate_stride", "up_stride"])
    def _gate_up_kernel(
        x_ptr, xq_ptr, xd_ptr, xs_ptr, gate_ptr, gate_h_ptr, up_ptr, up_h_ptr,
        ids_ptr, table_ptr, lut_ptr, out_ptr, gate_host, up_host, gate_stride, up_stride,
        num_rows,
        num_cols, gate_row_bytes, up_row_bytes,
        bias_ids_ptr, gate_bias_ptr, up_bias_ptr, down_bias_ptr,
        GATE_QTYPE: tl.constexpr, GATE_LANES: tl.constexpr, GATE_GROUP: tl.constexpr,
        GATE_UNIT: tl.constexpr, UP_QTYPE: tl.constexpr, UP_LANES: tl.constexpr,
        UP_GROUP: tl.constexpr, UP_UNIT: tl.constexpr, HAS_TABLE: tl.constexpr,
        HAS_BIAS: tl.constexpr, CLAMP: tl.constexpr, LIMIT: tl.constexpr,
        ALPHA: tl.constexpr, USE_PDL: tl.constexpr, EMULATE: tl.constexpr,
        BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr, STAGES: tl.constexpr,
    ):
        j = tl.program_id(0)
        rows = tl.program_id(1) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        pdl_wait(USE_PDL)  # the ids come from the router, x's int8 from the kernel before
        gate_base = _expert_base(ids_ptr, j, table_ptr, gate_host, gate_stride, GATE_UNIT,
                                 HAS_TABLE)
        g = _dots(gate_ptr, gate_h_ptr, lut_ptr, gate_base, rows, num_rows, gate_row_bytes, x_ptr,
                  xq_ptr, xd_ptr, xs_ptr, num_cols, GATE_QTYPE, GATE_LANES,
                  GATE_GROUP, BLOCK_ROWS, BLOCK_COLS, STAGES, EMULATE)
        up_base = _expert_base(ids_ptr, j, table_ptr, up_host, up_stride, UP_UNIT, HAS_TABLE)
        u = _dots(up_ptr, up_h_ptr, lut_ptr, up_base, rows, num_rows, up_row_bytes, x_ptr, xq_ptr,
                  xd_ptr, xs_ptr, num_cols, UP_QTYPE, UP_LANES, UP_GROUP,
                  BLOCK_ROWS, BLOCK_COLS, STAGES, EMULATE)
        if HAS_BIAS:  # the epilogue (expert_epilogue.py): biases, then the clamped SwiGLU
            g += _expert_bias(bias_ids_ptr, j, gate_bias_ptr, rows, num_rows)
            u += _expert_bias(bias_ids_ptr, j, up_bias_ptr, rows, num_rows)
        act = activate(g, u, CLAMP, LIMIT, ALPHA)  # silu(gate) * up without CLAMP
        tl.store(out_ptr + j * num_rows + rows, act.to(out_ptr.dtype.element_ty),
                 mask=rows < num_rows)

    @triton.jit(do_not_specialize=["host_units", "stride_units"])
    def _down_sum_kernel(
        act_ptr, xq_ptr, xd_ptr, xs_ptr, w_ptr, wh_ptr, ids_ptr, weights_ptr,
        table_ptr, lut_ptr, out_ptr, host_units, stride_units, num_rows, num_cols, row_bytes,
        bias_ids_ptr, gate_bias_ptr, up_bias_ptr, down_bias_ptr,
        QTYPE: tl.constexpr, LANES: tl.constexpr, GROUP: tl.constexpr, UNIT: tl.constexpr,
        TOP_K: tl.constexpr, TOP_K_P2: tl.constexpr, HAS_TABLE: tl.constexpr,
        HAS_BIAS: tl.constexpr, CLAMP: tl.constexpr, LIMIT: tl.constexpr,
        ALPHA: tl.constexpr, USE_PDL: tl.constexpr, EMULATE: tl.constexpr,
        BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr, STAGES: tl.constexpr,
    ):
        # Every (expert, row) pair of the tile at once, expert-major: the k experts' loads are
        # in flight together (an expert's down matrix is too small to keep the GPU busy alone),
        # and the weighted sum over them is one reduction in registers, the same every run.
        pair = tl.arange(0, TOP_K_P2 * BLOCK_ROWS)
        used = pair // BLOCK_ROWS < TOP_K
        j = tl.minimum(pair // BLOCK_ROWS, TOP_K - 1)  # padding rereads the last, weighted 0
        rows = tl.program_id(0) * BLOCK_ROWS + pair % BLOCK_ROWS
        pdl_wait(USE_PDL)  # for the activations (or their int8), the kernel just before
        base = _expert_base(ids_ptr, j, table_ptr, host_units, stride_units, UNIT, HAS_TABLE)
        jj = j.to(tl.int64)[:, None, None]
        # Row j of act, and of its int8 words (4 a word), scales and sums (per 32).
        dots = _dots(w_ptr, wh_ptr, lut_ptr, base, rows, num_rows, row_bytes,
                     act_ptr + jj * num_cols, xq_ptr + jj * (num_cols // 4),
                     xd_ptr + jj * (num_cols // 32), xs_ptr + jj * (num_cols // 32), num_cols,
                     QTYPE, LANES, GROUP, TOP_K_P2 * BLOCK_ROWS, BLOCK_COLS, STAGES, EMULATE)
        if HAS_BIAS:  # each expert's down bias, weighted with its rows
            dots += _expert_bias(bias_ids_ptr, j, down_bias_ptr, rows, num_rows)
        weight = tl.where(used, tl.load(weights_ptr + j).to(tl.float32), 0.0)
        y = tl.sum(tl.reshape(dots * weight, (TOP_K_P2, BLOCK_ROWS)), axis=0)
        out_rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        tl.store(out_ptr + out_rows, y.to(out_ptr.dtype.element_ty), mask=out_rows < num_rows)

    _GATE_UP_KEY = ("num_rows", "num_cols", "GATE_QTYPE", "UP_QTYPE")
    _DOWN_SUM_KEY = ("num_rows", "num_cols", "QTYPE", "TOP_K")
    _gate_up_tuned = launch.tuned(_gate_up_kernel, _candidates(GATE_UP_CONFIGS), _GATE_UP_KEY)
    _down_sum_tuned = launch.tuned(_down_sum_kernel, _candidates(DOWN_SUM_CONFIGS),
                                   _DOWN_SUM_KEY)
    # dp4a in either projection: other tiles (whole groups a thread), so its own tuners.
    _gate_up_dp4a_tuned = launch.tuned(_gate_up_kernel, _candidates(GATE_UP_DP4A_CONFIGS),
                                       _GATE_UP_KEY)
    _down_sum_dp4a_tuned = launch.tuned(_down_sum_kernel, _candidates(DOWN_SUM_DP4A_CONFIGS),
                                        _DOWN_SUM_KEY)
    _gate_up_iq2_tuned = launch.tuned(_gate_up_kernel, _candidates(GATE_UP_IQ2_CONFIGS),
                                      _GATE_UP_KEY)
    _down_sum_iq2_tuned = launch.tuned(_down_sum_kernel, _candidates(DOWN_SUM_IQ2_CONFIGS),
                                       _DOWN_SUM_KEY)


def alignment_unit(experts: QuantizedExperts, host_offset: int = 0,
                   has_table: bool = False) -> int:
    """The largest power of two <= MAX_UNIT dividing the expert stride (and, with a table,
    the host offset): the alignment kernels may assume for every expert's blocks."""
    unit = MAX_UNIT
    values = (experts.expert_stride, host_offset) if has_table else (experts.expert_stride,)
    while unit > 1 and any(v % unit for v in values):
        unit //= 2
    return unit


def is_supported(experts: QuantizedExperts, host_offset: int = 0,
                 has_table: bool = False) -> bool:
    """Whether the fused kernels can read these experts: a planes type, every block at an
    even byte (its fp16 fields), and 4-aligned for the types read by int32 words."""
    qtype = int(experts.qtype)
    if triton is None or qtype not in gp.ALL_PLANE_LANES:
        return False
    needed = 4 if qtype in WORD_TYPES else 2
    unit = alignment_unit(experts, host_offset, has_table)
    return unit >= needed and experts.raw.data_ptr() % needed == 0


def supports(gate: QuantizedExperts, up: QuantizedExperts, down: QuantizedExperts,
             table: torch.Tensor | None = None,
             host_offsets: tuple[int, int, int] = (0, 0, 0)) -> bool:
    """Whether `routed_mlp` takes these three projections (else dequantize_routed)."""
    has_table = table is not None
    return all(is_supported(w, offset, has_table)
               for w, offset in zip((gate, up, down), host_offsets))


def supports_dp4a(gate: QuantizedExperts, up: QuantizedExperts, down: QuantizedExperts,
                  x: torch.Tensor, table: torch.Tensor | None = None,
                  host_offsets: tuple[int, int, int] = (0, 0, 0)) -> bool:
    """Whether `routed_mlp` multiplies all three projections by dp4a for x: dp4a types
    (`uses_dp4a`) whose experts (and host copy) lie where dp4a_dots can read them
    (row_alignment: MXFP4 anywhere). The path of MXFP4 with half x and of a layer with an
    epilogue: the kernels apply it whatever the decoding, but an epilogue
    layer takes them only here and leaves the rest to expert_tile_gemv as before."""
    has_table = table is not None
    return triton is not None and all(
        uses_dp4a(w, x) and alignment_unit(w, offset, has_table) >= row_alignment(w.qtype)
        for w, offset in zip((gate, up, down), host_offsets))


def takes(gate: QuantizedExperts, up: QuantizedExperts, down: QuantizedExperts,
          x: torch.Tensor, table: torch.Tensor | None = None,
          host_offsets: tuple[int, int, int] = (0, 0, 0),
          epilogue: Epilogue | None = None) -> bool:
    """Whether one token x's experts go through `routed_mlp`: planes or dp4a per projection
    for plain experts (`supports`), or dp4a for all three (`supports_dp4a`), which also takes
    an epilogue and MXFP4; else expert_tile_gemv (MXFP4 or an epilogue in float32, or over
    planes-only types) or the dequantizing path."""
    return ((epilogue is None and supports(gate, up, down, table, host_offsets))
            or supports_dp4a(gate, up, down, x, table, host_offsets))


def uses_dp4a(experts: QuantizedExperts, x: torch.Tensor) -> bool:
    """Whether these experts multiply x by dp4a (else planes): a dp4a type (DP4A_TYPES) at a
    4-aligned base, x bf16/fp16 (gemv_dp4a.is_dtype_enabled). Their offsets are checked by
    `is_supported` (even; 4-aligned for Q4_K and Q5_K) or `supports_dp4a`."""
    return (int(experts.qtype) in DP4A_TYPES and gemv_dp4a.is_dtype_enabled(x)
            and experts.raw.data_ptr() % 4 == 0)


def _group(experts: QuantizedExperts, x: torch.Tensor) -> int:
    """The kernels' GROUP: values per dp4a group, 0 for planes."""
    if uses_dp4a(experts, x):
        return GROUP_VALUES[int(experts.qtype)]
    if int(experts.qtype) not in gp.ALL_PLANE_LANES:
        raise ValueError(f"type {int(experts.qtype)} experts have no planes decoding: they "
                         f"take bf16/fp16 x by dp4a (supports_dp4a), got {x.dtype}")
    return 0


def _quantized(v: torch.Tensor, needed: bool, use_pdl: bool,
               rounded: tuple | None = None) -> tuple[torch.Tensor, ...]:
    """(int8 words, d, s) of v [M, K] by gemv_dp4a.quantize_x (or `rounded`, made with v:
    gemv_dp4a.rounded_words), or v three times (never read) where no projection takes dp4a."""
    if not needed:
        return (v, v, v)
    return gemv_dp4a.rounded_words(v, rounded, use_pdl)


def gate_up(x: torch.Tensor, gate: QuantizedExperts, up: QuantizedExperts, ids: torch.Tensor,
            table: torch.Tensor | None = None, host_offsets: tuple[int, int] = (0, 0),
            use_pdl: bool = False, rounded: tuple | None = None,
            epilogue: Epilogue | None = None) -> torch.Tensor:
    """silu(gate[ids[j]] @ x) * (up[ids[j]] @ x): x [H], ids [k] on the device -> [k, I] in
    x's dtype. With a partial cache, gate/up are the slots' blocks and table [E] int32 holds
    expert e's slot or -1: then its blocks are read host_offsets bytes past the slots' base.
    rounded: x[None]'s int8 rounding made with x (fast/decode_rounded.py), for dp4a.
    epilogue: biases by the real ids and its activation (expert_epilogue.py)."""
    num_used = ids.shape[0]
    _, num_rows, num_cols = gate.shape
    if up.shape[1:] != gate.shape[1:] or x.shape != (num_cols,):
        raise ValueError(f"gate {gate.shape}, up {up.shape} and x {tuple(x.shape)} disagree")
    has_table = table is not None
    table_arg = launch.slot_table_arg(table, ids)
    gate_unit = alignment_unit(gate, host_offsets[0], has_table)
    up_unit = alignment_unit(up, host_offsets[1], has_table)
    x = x.contiguous()
    gate_group, up_group = _group(gate, x), _group(up, x)
    bias_args, switches = expert_epilogue.kernel_args(epilogue, ids)
    dp4a = gate_group > 0 or up_group > 0
    xq = _quantized(x[None], dp4a, use_pdl, rounded)  # once for both projections
    out = torch.empty(num_used, num_rows, dtype=x.dtype, device=x.device)
    iq2 = IQ2_XXS in (int(gate.qtype), int(up.qtype)) and dp4a
    tuned, configs = ((_gate_up_iq2_tuned, GATE_UP_IQ2_CONFIGS) if iq2 else
                      (_gate_up_dp4a_tuned, GATE_UP_DP4A_CONFIGS) if dp4a else
                      (_gate_up_tuned, GATE_UP_CONFIGS))
    launch.launch(
        tuned, lambda rows: (num_used, triton.cdiv(num_rows, rows)),
        _candidates(configs, num_cols if dp4a else 0),
        x, *xq, gate.raw, fp16_view(gate.raw), up.raw,
        fp16_view(up.raw), ids.contiguous(), table_arg, lookup_table(x.device), out,
        int(host_offsets[0]) // gate_unit if has_table else 0,
        int(host_offsets[1]) // up_unit if has_table else 0,
        gate.expert_stride // gate_unit, up.expert_stride // up_unit, num_rows, num_cols,
        gate.raw.shape[2], up.raw.shape[2], *bias_args,
        GATE_QTYPE=int(gate.qtype), GATE_LANES=gp.ALL_PLANE_LANES.get(int(gate.qtype), 0),
        GATE_GROUP=gate_group, GATE_UNIT=gate_unit, UP_QTYPE=int(up.qtype),
        UP_LANES=gp.ALL_PLANE_LANES.get(int(up.qtype), 0), UP_GROUP=up_group, UP_UNIT=up_unit,
        HAS_TABLE=has_table, **switches, EMULATE=launch.is_interpreting(), use_pdl=use_pdl,
    )
    return out


def down_sum(act: torch.Tensor, down: QuantizedExperts, ids: torch.Tensor,
             weights: torch.Tensor, table: torch.Tensor | None = None, host_offset: int = 0,
             use_pdl: bool = False, epilogue: Epilogue | None = None) -> torch.Tensor:
    """sum_j weights[j] * (down[ids[j]] @ act[j] + its down bias): act [k, I] -> [H] in act's
    dtype, summed in float32 over j in order (deterministic). table, host_offset and
    epilogue as for gate_up."""
    _, num_rows, num_cols = down.shape
    if act.shape != (ids.shape[0], num_cols) or weights.shape != ids.shape:
        raise ValueError(f"act {tuple(act.shape)}, weights {tuple(weights.shape)} and ids "
                         f"{tuple(ids.shape)} do not fit down {down.shape}")
    has_table = table is not None
    table_arg = launch.slot_table_arg(table, ids)
    unit = alignment_unit(down, host_offset, has_table)
    act = act.contiguous()
    group = _group(down, act)
    bias_args, switches = expert_epilogue.kernel_args(epilogue, ids)
    xq = _quantized(act, group > 0, use_pdl)  # the k rows at once
    out = torch.empty(num_rows, dtype=act.dtype, device=act.device)
    tuned, configs = ((_down_sum_iq2_tuned, DOWN_SUM_IQ2_CONFIGS) if group and int(down.qtype) == IQ2_XXS else
                      (_down_sum_dp4a_tuned, DOWN_SUM_DP4A_CONFIGS) if group else
                      (_down_sum_tuned, DOWN_SUM_CONFIGS))
    top_k_p2 = triton.next_power_of_2(ids.shape[0])
    launch.launch(
        tuned, lambda rows: (triton.cdiv(num_rows, rows),),
        _candidates(configs, num_cols if group else 0, top_k_p2),
        act, *xq, down.raw, fp16_view(down.raw), ids.contiguous(),
        weights.contiguous(), table_arg, lookup_table(act.device), out,
        int(host_offset) // unit if has_table else 0,
        down.expert_stride // unit, num_rows, num_cols, down.raw.shape[2], *bias_args,
        QTYPE=int(down.qtype), LANES=gp.ALL_PLANE_LANES.get(int(down.qtype), 0), GROUP=group,
        UNIT=unit, TOP_K=ids.shape[0], TOP_K_P2=top_k_p2, HAS_TABLE=has_table, **switches,
        EMULATE=launch.is_interpreting(), use_pdl=use_pdl,
    )
    return out


def routed_mlp(x: torch.Tensor, gate: QuantizedExperts, up: QuantizedExperts,
               down: QuantizedExperts, ids: torch.Tensor, weights: torch.Tensor,
               table: torch.Tensor | None = None,
               host_offsets: tuple[int, int, int] = (0, 0, 0),
               use_pdl: bool = False, rounded: tuple | None = None,
               epilogue: Epilogue | None = None) -> torch.Tensor:
    """One token's routed experts: x [H], ids and weights [k] -> [H] (see `takes`); rounded
    and epilogue as gate_up's."""
    act = gate_up(x, gate, up, ids, table, host_offsets[:2], use_pdl, rounded,
                  epilogue)  # [k, I]
    return down_sum(act, down, ids, weights, table, host_offsets[2], use_pdl, epilogue)
