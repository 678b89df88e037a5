"""Grouped matrix-vector Triton kernels for one token's MoE block: three launches a layer.

1. `router_topk`: the router's logits (64 programs), then softmax, top-k and renormalisation
   by whichever program finishes last (a completion counter): one launch where a cuBLAS
   product and a selection kernel took two, with a gap between them. A `RouterKind` adds
   GPT-OSS's router bias, or GLM-4.5's sigmoid choice with its correction bias and scaling.
2. `grouped_gate_up`: silu(gate[e] @ x) * (up[e] @ x) for the k experts; gate and up rows are
   read in the same program. An epilogue (expert_epilogue.py: GPT-OSS) adds the experts'
   biases and takes the clamped SwiGLU instead.
3. `grouped_down_sum`: sum_j w_j * down[e_j] @ act_j (+ the epilogue's down bias); every
   program owns output rows and loops over the k experts, so the weighted sum and the cast
   need no extra kernels.

Those extras are compile-time switches: Qwen3-MoE and Mixtral run the variants they ran.

The expert ids stay in device memory: each program loads its expert id and reads only that
expert's rows of the stacked [E, I, H] / [E, H, I] weights, so the k experts cost exactly
their bytes and no host sync. On CUDA the block shapes are autotuned once per matrix shape
(the candidates include the first pass's fixed choice); under TRITON_INTERPRET=1 (the CPU
tests) the first candidate's shape over 64 rows runs (launch.interpreter_rows).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from strata.engine.core.fast import expert_epilogue
from strata.engine.core.fast.expert_epilogue import Epilogue
from strata.engine.core.kernels import pdl
from strata.engine.core.kernels.launch import interpreter_rows, launch, slot_table_arg, tuned

try:
    import triton
    import triton.language as tl

    from strata.engine.core.kernels.pdl import wait as pdl_wait
except ImportError:  # Triton is optional: the bmm and loop paths need only torch.
    triton = None

# (BLOCK_ROWS, BLOCK_COLS, num_warps, UNROLL) candidates, autotuned on CUDA. The first of
# each is the fastest of a cold-L2 sweep for Qwen3-30B-A3B (each replay reads other
# experts, as a decode step does; docs/benchmarks.md, "Figures behind the fast path").
# Unrolling the column loop changed nothing measurable; at these sizes a launch's fixed
# ramp-up and tail weigh as much as the bytes. The runners-up stay as candidates for other
# shapes; autotuning picks per shape.
GATE_UP_CONFIGS = ((1, 2048, 4, False), (2, 1024, 2, False), (2, 512, 2, False),
                   (4, 512, 2, True))
DOWN_SUM_CONFIGS = ((1, 1024, 4, False), (4, 1024, 4, False), (2, 1024, 4, False),
                    (4, 256, 4, False))
# What `launch` runs under the CPU interpreter (made once: CUDA never reads them).
GATE_UP_INTERPRETED = interpreter_rows(GATE_UP_CONFIGS)
DOWN_SUM_INTERPRETED = interpreter_rows(DOWN_SUM_CONFIGS)
# Matrix sizes are constexpr: fixed per model, they give static loop bounds (and the CPU
# interpreter cannot take a runtime loop bound with numpy 2).


if triton is not None:

    @triton.jit
    def _top_k(probs, experts, ok, slots, top_k: tl.constexpr, BLOCK_E: tl.constexpr,
               BLOCK_K: tl.constexpr):
        """(ids, probabilities) [BLOCK_K] of the top_k probs, descending (slots past top_k:
        0)."""
        # One max per pick over (probability bits, reversed index) packed in an int64:
        # non-negative floats order like their bits, and on a tie the lower index wins,
        # as with argmax. Half the reductions of an argmax and a max per pick.
        key = (probs.to(tl.int32, bitcast=True).to(tl.int64) << 32) | (
            BLOCK_E - 1 - experts).to(tl.int64)
        key = tl.where(ok, key, -1)  # padding never wins
        top_p = tl.zeros([BLOCK_K], dtype=tl.float32)
        top_id = tl.zeros([BLOCK_K], dtype=tl.int64)
        for j in tl.static_range(top_k):  # descending, like torch.topk
            best_key = tl.max(key, axis=0)
            best = BLOCK_E - 1 - (best_key & 0xFFFFFFFF)
            prob = (best_key >> 32).to(tl.int32).to(tl.float32, bitcast=True)
            top_p = tl.where(slots == j, prob, top_p)
            top_id = tl.where(slots == j, best, top_id)
            key = tl.where(experts == best, -1, key)
        return top_id, top_p

    @triton.jit
    def top_k_ids(values, experts, ok, slots, top_k: tl.constexpr, BLOCK_E: tl.constexpr,
                  BLOCK_K: tl.constexpr):
        """ids [BLOCK_K] of the top_k of float32 values of any sign, descending, the lower
        index first on a tie (as torch.topk); slots past top_k: 0. Sigmoid routing chooses
        by scores plus a correction bias, which may be negative."""
        # Float order as integers: negative floats' magnitude bits flipped, then made
        # non-negative (< 2**32) and packed above a 16-bit reversed index.
        bits = values.to(tl.int32, bitcast=True)
        ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64) + 2147483648
        key = tl.where(ok, (ordered << 16) | (BLOCK_E - 1 - experts).to(tl.int64), -1)
        top_id = tl.zeros([BLOCK_K], dtype=tl.int64)
        for j in tl.static_range(top_k):
            best = BLOCK_E - 1 - (tl.max(key, axis=0) & 0xFFFF)
            top_id = tl.where(slots == j, best, top_id)
            key = tl.where(experts == best, -1, key)
        return top_id

    @triton.jit
    def sigmoid_top_k(z, correction_ptr, experts, ok, slots, top_k: tl.constexpr,
                      norm_topk: tl.constexpr, SCALING: tl.constexpr, BLOCK_E: tl.constexpr,
                      BLOCK_K: tl.constexpr):
        """(ids, weights) [BLOCK_K] of GLM-4.5's routing (SparseMoE._sigmoid_top_ids, one
        group): top-k of sigmoid(z) + correction, weighted by their sigmoid scores,
        renormalised (with the reference's epsilon) and scaled."""
        scores = 1.0 / (1.0 + tl.exp(-z))
        correction = tl.load(correction_ptr + experts, mask=ok, other=0.0).to(tl.float32)
        top_id = top_k_ids(scores + correction, experts, ok, slots, top_k, BLOCK_E, BLOCK_K)
        picked = (experts[None, :] == top_id[:, None]) & (slots < top_k)[:, None]
        top_p = tl.sum(tl.where(picked, scores[None, :], 0.0), axis=1)
        if norm_topk:
            top_p = top_p / (tl.sum(top_p, axis=0) + 1e-20)
        return top_id, top_p * SCALING

    @triton.jit
    def _router_kernel(
        x_ptr, w_ptr, logits_ptr, counter_ptr, ids_ptr, weights_ptr, forced_ptr, bias_ptr,
        correction_ptr,
        num_experts: tl.constexpr, hidden: tl.constexpr, top_k: tl.constexpr,
        norm_topk: tl.constexpr, ROWS: tl.constexpr, BLOCK_H: tl.constexpr,
        BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
        FORCED: tl.constexpr, HAS_BIAS: tl.constexpr, SIGMOID: tl.constexpr,
        SCALING: tl.constexpr,
    ):
        # Each program: ROWS router logits (w[rows] @ x), rounded to x's dtype as F.linear's
        # output is, so the selection sees the values the reference module sees. The router
        # weights are read before waiting for x (pdl.py); BLOCK_H covers the hidden size.
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        row_ok = rows < num_experts
        cols = tl.arange(0, BLOCK_H)
        col_ok = cols < hidden
        w = tl.load(w_ptr + rows[:, None].to(tl.int64) * hidden + cols[None, :],
                    mask=row_ok[:, None] & col_ok[None, :], other=0.0)
        pdl_wait(USE_PDL)
        xv = tl.load(x_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        acc = tl.sum(w.to(tl.float32) * xv[None, :], axis=1)
        if HAS_BIAS:  # GPT-OSS's router bias, added before the rounding as F.linear does
            acc += tl.load(bias_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
        tl.store(logits_ptr + rows, acc.to(x_ptr.dtype.element_ty), mask=row_ok)
        # The last program to finish selects: acq_rel orders every program's logits before
        # its count, and the counter goes back to 0 for the next launch (or graph replay).
        finished = tl.atomic_add(counter_ptr, 1, sem="acq_rel")
        if finished == tl.num_programs(0) - 1:
            experts = tl.arange(0, BLOCK_E)
            ok = experts < num_experts
            z = tl.load(logits_ptr + experts, mask=ok, other=float("-inf"), volatile=True)
            z = z.to(tl.float32)
            slots = tl.arange(0, BLOCK_K)
            if SIGMOID:
                top_id, top_p = sigmoid_top_k(z, correction_ptr, experts, ok, slots, top_k,
                                              norm_topk, SCALING, BLOCK_E, BLOCK_K)
            else:
                e = tl.exp(z - tl.max(z, axis=0))
                probs = e / tl.sum(e, axis=0)
                if FORCED:  # a benchmark's trace (models/forced_routing.py): its ids, now
                    top_id = tl.load(forced_ptr + slots, mask=slots < top_k,
                                     other=0).to(tl.int64)
                    picked = (experts[None, :] == top_id[:, None]) & (slots < top_k)[:, None]
                    top_p = tl.sum(tl.where(picked, probs[None, :], 0.0), axis=1)
                else:
                    top_id, top_p = _top_k(probs, experts, ok, slots, top_k, BLOCK_E, BLOCK_K)
                if norm_topk:
                    top_p = top_p / tl.sum(top_p, axis=0)
            tl.store(ids_ptr + slots, top_id, mask=slots < top_k)
            tl.store(weights_ptr + slots, top_p.to(weights_ptr.dtype.element_ty),
                     mask=slots < top_k)
            tl.atomic_xchg(counter_ptr, 0)

    @triton.jit
    def tile_dot(w_ptr, base, v_ptr, start, row_ok, num_cols: tl.constexpr,
                  BLOCK_COLS: tl.constexpr):
        """sum over one column tile of w[rows, cols] * v[cols], float32 [BLOCK_ROWS]."""
        cols = start + tl.arange(0, BLOCK_COLS)
        col_ok = cols < num_cols
        v = tl.load(v_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        ok = row_ok[:, None] & col_ok[None, :]
        w = tl.load(w_ptr + base + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        return tl.sum(w * v[None, :], axis=1)

    @triton.jit
    def _row_dots(w_ptr, base, v_ptr, row_ok, num_cols: tl.constexpr,
                  BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr, UNROLL: tl.constexpr):
        """w[rows, :] @ v for one block of rows, float32 [BLOCK_ROWS].

        UNROLL writes out every column tile, so all of a program's loads can be in flight at
        once: a matrix-vector product is bound by how many bytes each SM keeps requested.
        """
        acc = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
        if UNROLL:
            for start in tl.static_range(0, num_cols, BLOCK_COLS):
                acc += tile_dot(w_ptr, base, v_ptr, start, row_ok, num_cols, BLOCK_COLS)
        else:
            for start in range(0, num_cols, BLOCK_COLS):
                acc += tile_dot(w_ptr, base, v_ptr, start, row_ok, num_cols, BLOCK_COLS)
        return acc

    @triton.jit
    def _expert_base(ids_ptr, j, table_ptr, host_offset, stride_expert, HAS_TABLE: tl.constexpr):
        """Element offset of the j-th routed expert's matrix from the weights' base pointer.

        With a table (a partial expert cache), table[e] is the slot holding expert e, or -1:
        then its rows are read host_offset elements past the base, in the host copy."""
        expert = tl.load(ids_ptr + j).to(tl.int64)
        if HAS_TABLE:
            slot = tl.load(table_ptr + expert).to(tl.int64)
            return tl.where(slot >= 0, slot * stride_expert, host_offset + expert * stride_expert)
        return expert * stride_expert

    @triton.jit
    def activate(g, u, CLAMP: tl.constexpr, LIMIT: tl.constexpr, ALPHA: tl.constexpr):
        """The experts' gated activation of float32 gate and up values: silu(g) * u, or
        GPT-OSS's clamped SwiGLU (models/switch.py, ExpertActivation)."""
        if CLAMP:
            g = tl.minimum(g, LIMIT)
            u = tl.minimum(tl.maximum(u, -LIMIT), LIMIT)
            return g / (1.0 + tl.exp(-ALPHA * g)) * (u + 1.0)
        return g / (1.0 + tl.exp(-g)) * u

    @triton.jit
    def expert_bias(bias_ids_ptr, j, bias_ptr, rows, row_ok, num_rows: tl.constexpr):
        """Float32 bias [BLOCK_ROWS] of the j-th routed expert (by its real id) at rows."""
        expert = tl.load(bias_ids_ptr + j).to(tl.int64)
        return tl.load(bias_ptr + expert * num_rows + rows, mask=row_ok,
                       other=0.0).to(tl.float32)

    @triton.jit
    def _gate_up_kernel(
        x_ptr, gate_ptr, up_ptr, ids_ptr, out_ptr, table_ptr, gate_host_offset, up_host_offset,
        stride_expert, stride_row, bias_ids_ptr, gate_bias_ptr, up_bias_ptr, down_bias_ptr,
        num_cols: tl.constexpr, num_rows: tl.constexpr, HAS_TABLE: tl.constexpr,
        USE_PDL: tl.constexpr, HAS_BIAS: tl.constexpr, CLAMP: tl.constexpr,
        LIMIT: tl.constexpr, ALPHA: tl.constexpr,
        BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr, UNROLL: tl.constexpr,
    ):
        slot = tl.program_id(0)
        rows = tl.program_id(1) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        pdl_wait(USE_PDL)  # the ids come from the router, the kernel just before
        row_ok = rows < num_rows
        row_offset = rows[:, None].to(tl.int64) * stride_row
        gate_base = _expert_base(ids_ptr, slot, table_ptr, gate_host_offset, stride_expert,
                                 HAS_TABLE) + row_offset
        up_base = _expert_base(ids_ptr, slot, table_ptr, up_host_offset, stride_expert,
                               HAS_TABLE) + row_offset
        acc_gate = _row_dots(gate_ptr, gate_base, x_ptr, row_ok, num_cols, BLOCK_ROWS,
                             BLOCK_COLS, UNROLL)
        acc_up = _row_dots(up_ptr, up_base, x_ptr, row_ok, num_cols, BLOCK_ROWS, BLOCK_COLS,
                           UNROLL)
        if HAS_BIAS:
            acc_gate += expert_bias(bias_ids_ptr, slot, gate_bias_ptr, rows, row_ok, num_rows)
            acc_up += expert_bias(bias_ids_ptr, slot, up_bias_ptr, rows, row_ok, num_rows)
        act = activate(acc_gate, acc_up, CLAMP, LIMIT, ALPHA)
        out = out_ptr + slot * num_rows + rows
        tl.store(out, act.to(out_ptr.dtype.element_ty), mask=row_ok)

    @triton.jit
    def _down_sum_kernel(
        act_ptr, down_ptr, ids_ptr, weights_ptr, out_ptr, table_ptr, down_host_offset,
        stride_expert, stride_row, bias_ids_ptr, gate_bias_ptr, up_bias_ptr, down_bias_ptr,
        num_cols: tl.constexpr, num_rows: tl.constexpr, top_k: tl.constexpr,
        HAS_TABLE: tl.constexpr, USE_PDL: tl.constexpr, HAS_BIAS: tl.constexpr,
        CLAMP: tl.constexpr, LIMIT: tl.constexpr, ALPHA: tl.constexpr,
        BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr, UNROLL: tl.constexpr,
    ):
        rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        row_ok = rows < num_rows
        pdl_wait(USE_PDL)  # for the activations of grouped_gate_up, the kernel just before
        acc = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
        for slot in tl.static_range(top_k):
            weight = tl.load(weights_ptr + slot).to(tl.float32)
            base = _expert_base(ids_ptr, slot, table_ptr, down_host_offset, stride_expert,
                                HAS_TABLE) + rows[:, None].to(tl.int64) * stride_row
            dot = _row_dots(down_ptr, base, act_ptr + slot * num_cols, row_ok, num_cols,
                            BLOCK_ROWS, BLOCK_COLS, UNROLL)
            if HAS_BIAS:
                dot += expert_bias(bias_ids_ptr, slot, down_bias_ptr, rows, row_ok, num_rows)
            acc += weight * dot
        tl.store(out_ptr + rows, acc.to(out_ptr.dtype.element_ty), mask=row_ok)

    _gate_up_tuned = tuned(_gate_up_kernel, GATE_UP_CONFIGS)
    _down_sum_tuned = tuned(_down_sum_kernel, DOWN_SUM_CONFIGS)


def _check_stacked(name: str, weight: torch.Tensor) -> None:
    if weight.dim() != 3 or weight.stride(-1) != 1 or weight.stride(-2) != weight.shape[-1]:
        raise ValueError(
            f"{name} must be a stacked [E, rows, cols] tensor with contiguous rows, got shape "
            f"{tuple(weight.shape)} strides {weight.stride()}: use the loop or bmm MoE path"
        )


@dataclass(frozen=True, eq=False)
class RouterKind:
    """What a router kernel does beyond softmax top-k: GPT-OSS adds a bias to the logits
    (and takes softmax over the top-k logits, which is softmax top-k renormalised); GLM-4.5
    chooses by sigmoid scores plus a correction bias and scales the weights (one group of
    experts: more groups take the module's own routing)."""

    bias: torch.Tensor | None = None  # [E], added to the logits
    correction: torch.Tensor | None = None  # [E] float32: sigmoid routing when given
    scaling: float = 1.0

    def pointers(self, stand_in: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(bias, correction) to pass; stand_in where absent (never read)."""
        return (self.bias if self.bias is not None else stand_in,
                self.correction if self.correction is not None else stand_in)

    def constexprs(self) -> dict:
        return {"HAS_BIAS": self.bias is not None, "SIGMOID": self.correction is not None,
                "SCALING": float(self.scaling)}


SOFTMAX = RouterKind()  # Qwen3-MoE, Mixtral


# Router rows per program: 128 experts over 64 one-warp programs put a 2048-wide router's
# 512 KB in flight on 64 SMs; the last program to finish then selects the top k. One warp:
# the selection's reductions are then register shuffles, without shared-memory barriers
# (with 4 warps most of the kernel's time went to the selection). Each program
# loads its rows whole, so that with PDL they are in flight before x is ready.
ROUTER_ROWS = 2
_counters: dict[torch.device, torch.Tensor] = {}


def _counter(device: torch.device) -> torch.Tensor:
    """The router kernel's completion counter: one per device, always 0 between launches
    (launches on one stream never overlap), allocated once so CUDA graphs keep its address."""
    if device not in _counters:
        _counters[device] = torch.zeros(1, dtype=torch.int32, device=device)
    return _counters[device]


def router_topk(
    x: torch.Tensor, router_weight: torch.Tensor, top_k: int, norm_topk_prob: bool,
    out_ids: torch.Tensor | None = None, use_pdl: bool = False,
    forced_ids: torch.Tensor | None = None, router: RouterKind = SOFTMAX,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [k] in x's dtype, ids [k] int64) for one token x [H], as SparseMoE routes:
    logits router_weight [E, H] @ x in x's dtype, softmax in float32, top-k descending,
    optionally renormalised. One launch: the router product and the selection together.

    out_ids: a persistent int64 [k] buffer to write the ids into (an expert cache reads them
    back after the step to learn which experts ran); default a new tensor.
    forced_ids: benchmarks only (models/forced_routing.py), a persistent int32 [k] device
    buffer whose ids replace the top-k, read when the kernel runs (a CUDA graph replay reads
    what was written before it); their probabilities are the weights, renormalised alike.
    router: what else the router does (RouterKind: GPT-OSS's bias, GLM-4.5's sigmoid)."""
    num_experts, hidden = router_weight.shape
    if not 0 < top_k <= num_experts:
        raise ValueError(f"top_k must be in 1..{num_experts}, not {top_k}")
    _check_stacked("router weight", router_weight[None])
    if out_ids is None:
        ids = torch.empty(top_k, dtype=torch.long, device=x.device)
    elif out_ids.shape != (top_k,) or out_ids.dtype != torch.long or not out_ids.is_contiguous():
        raise ValueError(f"out_ids must be a contiguous int64 [{top_k}] tensor, got "
                         f"{out_ids.dtype} {tuple(out_ids.shape)}")
    else:
        ids = out_ids
    if forced_ids is not None and (
            forced_ids.shape != (top_k,) or forced_ids.dtype != torch.int32
            or not forced_ids.is_contiguous() or forced_ids.device != x.device):
        raise ValueError(f"forced_ids must be a contiguous int32 [{top_k}] tensor on "
                         f"{x.device}, got {forced_ids.dtype} {tuple(forced_ids.shape)} on "
                         f"{forced_ids.device}")
    weights = torch.empty(top_k, dtype=x.dtype, device=x.device)
    logits = torch.empty(num_experts, dtype=x.dtype, device=x.device)
    _router_kernel[(triton.cdiv(num_experts, ROUTER_ROWS),)](
        x.contiguous(), router_weight, logits, _counter(x.device), ids, weights,
        forced_ids if forced_ids is not None else ids,  # never read unless FORCED
        *router.pointers(ids), num_experts=num_experts, hidden=hidden, top_k=top_k,
        norm_topk=norm_topk_prob, ROWS=ROUTER_ROWS, BLOCK_H=triton.next_power_of_2(hidden),
        BLOCK_E=triton.next_power_of_2(num_experts), BLOCK_K=triton.next_power_of_2(top_k),
        num_warps=1, FORCED=forced_ids is not None, **router.constexprs(),
        **pdl.launch_options(use_pdl),
    )
    return weights, ids


def _check_table(table: torch.Tensor | None, ids: torch.Tensor, num_offsets: int,
                 host_offsets: tuple[int, ...]) -> torch.Tensor:
    """The table to pass (slot_table_arg: checked, or an int32 stand-in over ids), on ids'
    device with a host offset for each weight the kernel reads."""
    table_arg = slot_table_arg(table, ids)
    if table is not None and (table.device != ids.device or len(host_offsets) != num_offsets):
        raise ValueError(f"the slot table must be on {ids.device} with {num_offsets} host "
                         f"offsets, got {table.device} and {len(host_offsets)}")
    return table_arg


def grouped_gate_up(
    x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, ids: torch.Tensor,
    table: torch.Tensor | None = None, host_offsets: tuple[int, int] = (0, 0),
    use_pdl: bool = False, epilogue: Epilogue | None = None,
    bias_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """silu(gate[ids[j]] @ x) * (up[ids[j]] @ x) for each j: x [H], gate/up [E, I, H] -> [k, I].
    With an epilogue (GPT-OSS), gate and up add the biases of experts bias_ids[j] (default
    ids[j]) and the epilogue's activation joins them.

    With a partial expert cache, gate/up are the slot weights [N, I, H] and table [E] int32
    says where expert e is: slot table[e], or (-1) the host copy's [E, I, H] rows, which start
    host_offsets (gate, up) elements past gate's and up's base (mapped for the device)."""
    _check_stacked("gate_proj", gate)
    _check_stacked("up_proj", up)
    table_arg = _check_table(table, ids, 2, host_offsets)
    num_experts_used = ids.shape[0]
    num_rows, num_cols = gate.shape[1], gate.shape[2]
    bias_args, switches = expert_epilogue.kernel_args(epilogue, ids, bias_ids)
    out = torch.empty(num_experts_used, num_rows, dtype=x.dtype, device=x.device)
    launch(
        _gate_up_tuned, lambda rows: (num_experts_used, triton.cdiv(num_rows, rows)),
        GATE_UP_INTERPRETED, x.contiguous(), gate, up, ids.contiguous(), out,
        table_arg,
        int(host_offsets[0]), int(host_offsets[1]), gate.stride(0), gate.stride(1),
        *bias_args, num_cols=num_cols, num_rows=num_rows, HAS_TABLE=table is not None,
        use_pdl=use_pdl, **switches,
    )
    return out


def grouped_down_sum(
    act: torch.Tensor, down: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
    table: torch.Tensor | None = None, host_offset: int = 0, use_pdl: bool = False,
    epilogue: Epilogue | None = None, bias_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """sum_j weights[j] * (down[ids[j]] @ act[j]): act [k, I], down [E, H, I] -> [H] in act's dtype.

    The sum runs in float32 inside the kernel; one rounding at the end. table and host_offset
    as for grouped_gate_up, with down the slot weights [N, H, I]; an epilogue's down bias of
    expert bias_ids[j] joins each product before its weight.
    """
    _check_stacked("down_proj", down)
    table_arg = _check_table(table, ids, 1, (host_offset,))
    num_rows, num_cols = down.shape[1], down.shape[2]
    out = torch.empty(num_rows, dtype=act.dtype, device=act.device)
    bias_args, switches = expert_epilogue.kernel_args(epilogue, ids, bias_ids)
    launch(
        _down_sum_tuned, lambda rows: (triton.cdiv(num_rows, rows),),
        DOWN_SUM_INTERPRETED,
        act.contiguous(), down, ids.contiguous(), weights.contiguous(), out, table_arg,
        int(host_offset), down.stride(0), down.stride(1), *bias_args, num_cols=num_cols,
        num_rows=num_rows, top_k=ids.shape[0], HAS_TABLE=table is not None, use_pdl=use_pdl,
        **switches,
    )
    return out
