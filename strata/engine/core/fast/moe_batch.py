"""Decode-time MoE for B rows at once (a batch step): route, then only the routed experts.

moe_triton.py runs one token's MoE block as grouped matrix-vector products. A batch step of B
sequences (fast/batch_graph.py, B = 2..16) has B*k (row, expert) pairs. The prefill path
(moe_prefill.py: sort rows by expert, grouped GEMMs) works for any B but costs a dozen
launches and tile shapes made for hundreds of rows. Here, four launches a layer, no host sync,
fixed shapes per batch bucket:

1. `router_topk_rows`: the router's logits for every row (each program reads its router rows
   once for all B rows), then softmax, top-k and renormalisation of every row by whichever
   program finishes last (moe_triton's completion counter): ids [B, k], weights [B, k];
   GPT-OSS's router bias and GLM-4.5's sigmoid routing as moe_triton's RouterKind says.
2. `pairs_gate_up`: silu(gate[e] @ x_b) * (up[e] @ x_b) for every pair (b, e). A pair whose
   expert an earlier pair already has is skipped; the first pair of each expert (its leader)
   computes every row that routed there, so each routed expert's rows are read once.
3. `pairs_down`: weights[b, j] * down[e] @ act[b, j] for every pair, by the leaders likewise,
   into a float32 scratch [B*k, H]. GPT-OSS's expert biases and clamped SwiGLU join 2 and 3
   as an epilogue (expert_epilogue.py).
4. `sum_pairs`: each row's k contributions summed in float32 and rounded once: [B, H].

A leader multiplies its weight tile by all B rows of x (rows that did not route there are
masked to zero) with tl.dot: tensor cores make the zeros free, so a tile is read once for
every row that wants it. Padding rows of a bucket route and compute like real rows and write
only their own pairs and output row.
"""

from __future__ import annotations

import torch

from strata.engine.core.fast import expert_epilogue
from strata.engine.core.fast.expert_epilogue import Epilogue
from strata.engine.core.fast.moe_triton import (
    SOFTMAX,
    RouterKind,
    _check_stacked,
    _check_table,
    _counter,
)
from strata.engine.core.kernels.launch import is_interpreting, launch, tuned

try:
    import triton
    import triton.language as tl

    from strata.engine.core.fast.moe_triton import activate
    from strata.engine.core.kernels.pdl import wait as pdl_wait
except ImportError:  # Triton is optional: the bmm and loop paths need only torch.
    triton = None

# (BLOCK_ROWS, BLOCK_COLS, num_warps, None) candidates; the first is the CPU interpreter's.
# tl.dot needs 16 or more along each side: BLOCK_ROWS >= 16, BLOCK_COLS >= 16.
PAIR_CONFIGS = ((16, 256, 4, None), (32, 128, 4, None), (16, 128, 2, None),
                (64, 128, 4, None))
SUM_COLS = 1024  # output columns per program of the final sum: a few KB, not tuned
ROUTER_ROWS = 2  # router rows per program, as for one token (moe_triton.py)


if triton is not None:

    @triton.jit
    def _softmax_top_k_rows(z, tokens, experts, ok, slots, num_tokens: tl.constexpr,
                            top_k: tl.constexpr, norm_topk: tl.constexpr,
                            BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                            BLOCK_K: tl.constexpr):
        """(ids, weights) [BLOCK_T, BLOCK_K] of softmax top-k for every token's logits z."""
        # Tokens past num_tokens (BLOCK_T is a power of 2) are all -inf: max 0 for them.
        z_max = tl.where(tokens < num_tokens, tl.max(z, axis=1), 0.0)
        e = tl.where(ok, tl.exp(z - z_max[:, None]), 0.0)
        probs = e / tl.maximum(tl.sum(e, axis=1)[:, None], 1e-30)
        # (probability bits, reversed index) in an int64: one max per pick and token;
        # on a tie the lower index wins, as with torch.topk.
        key = (probs.to(tl.int32, bitcast=True).to(tl.int64) << 32) | (
            BLOCK_E - 1 - experts[None, :]).to(tl.int64)
        key = tl.where(ok, key, -1)
        top_p = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
        top_id = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int64)
        for j in tl.static_range(top_k):  # descending, like torch.topk
            best_key = tl.max(key, axis=1)  # [BLOCK_T]
            best = BLOCK_E - 1 - (best_key & 0xFFFFFFFF)
            prob = (best_key >> 32).to(tl.int32).to(tl.float32, bitcast=True)
            top_p = tl.where(slots[None, :] == j, prob[:, None], top_p)
            top_id = tl.where(slots[None, :] == j, best[:, None], top_id)
            key = tl.where(experts[None, :] == best[:, None], -1, key)
        if norm_topk:
            top_p = top_p / tl.sum(top_p, axis=1)[:, None]
        return top_id, top_p

    @triton.jit
    def _sigmoid_top_k_rows(z, correction_ptr, experts, ok, slots, num_experts: tl.constexpr,
                            top_k: tl.constexpr,
                            norm_topk: tl.constexpr, SCALING: tl.constexpr,
                            BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                            BLOCK_K: tl.constexpr):
        """GLM-4.5's routing of every token (moe_triton.sigmoid_top_k, row by row)."""
        scores = 1.0 / (1.0 + tl.exp(-z))
        correction = tl.load(correction_ptr + experts, mask=experts < num_experts,
                             other=0.0)
        values = scores + correction.to(tl.float32)[None, :]
        # Float order as integers above a 16-bit reversed index (see moe_triton.top_k_ids).
        bits = values.to(tl.int32, bitcast=True)
        ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64) + 2147483648
        key = tl.where(ok, (ordered << 16) | (BLOCK_E - 1 - experts[None, :]).to(tl.int64), -1)
        top_p = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
        top_id = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int64)
        for j in tl.static_range(top_k):
            best = BLOCK_E - 1 - (tl.max(key, axis=1) & 0xFFFF)  # [BLOCK_T]
            picked = experts[None, :] == best[:, None]
            score = tl.sum(tl.where(picked, scores, 0.0), axis=1)
            top_p = tl.where(slots[None, :] == j, score[:, None], top_p)
            top_id = tl.where(slots[None, :] == j, best[:, None], top_id)
            key = tl.where(picked, -1, key)
        if norm_topk:
            top_p = top_p / (tl.sum(top_p, axis=1)[:, None] + 1e-20)
        return top_id, top_p * SCALING

    @triton.jit
    def _router_rows_kernel(
        x_ptr, w_ptr, logits_ptr, counter_ptr, ids_ptr, weights_ptr, bias_ptr, correction_ptr,
        num_tokens: tl.constexpr, num_experts: tl.constexpr, hidden: tl.constexpr,
        top_k: tl.constexpr, norm_topk: tl.constexpr, ROWS: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
        BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr, SIGMOID: tl.constexpr,
        SCALING: tl.constexpr,
    ):
        # Each program: ROWS router logits for every token, rounded to x's dtype as F.linear's
        # output is; its router rows are loaded once for all tokens.
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        row_ok = rows < num_experts
        cols = tl.arange(0, BLOCK_H)
        col_ok = cols < hidden
        w = tl.load(w_ptr + rows[:, None].to(tl.int64) * hidden + cols[None, :],
                    mask=row_ok[:, None] & col_ok[None, :], other=0.0)
        for t in tl.static_range(num_tokens):
            xv = tl.load(x_ptr + t * hidden + cols, mask=col_ok, other=0.0).to(tl.float32)
            acc = tl.sum(w.to(tl.float32) * xv[None, :], axis=1)
            if HAS_BIAS:  # GPT-OSS's router bias, before the rounding as F.linear adds it
                acc += tl.load(bias_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
            tl.store(logits_ptr + t * num_experts + rows, acc.to(x_ptr.dtype.element_ty),
                     mask=row_ok)
        # The last program to finish selects for every token (see moe_triton._router_kernel).
        finished = tl.atomic_add(counter_ptr, 1, sem="acq_rel")
        if finished == tl.num_programs(0) - 1:
            tokens = tl.arange(0, BLOCK_T)
            experts = tl.arange(0, BLOCK_E)
            ok = (tokens < num_tokens)[:, None] & (experts < num_experts)[None, :]
            z = tl.load(logits_ptr + tokens[:, None] * num_experts + experts[None, :], mask=ok,
                        other=float("-inf"), volatile=True).to(tl.float32)
            slots = tl.arange(0, BLOCK_K)
            if SIGMOID:
                top_id, top_p = _sigmoid_top_k_rows(z, correction_ptr, experts, ok, slots,
                                                    num_experts, top_k, norm_topk, SCALING,
                                                    BLOCK_T, BLOCK_E, BLOCK_K)
            else:
                top_id, top_p = _softmax_top_k_rows(z, tokens, experts, ok, slots, num_tokens,
                                                    top_k, norm_topk, BLOCK_T, BLOCK_E,
                                                    BLOCK_K)
            out = tokens[:, None] * top_k + slots[None, :]
            store_ok = (tokens < num_tokens)[:, None] & (slots < top_k)[None, :]
            tl.store(ids_ptr + out, top_id, mask=store_ok)
            tl.store(weights_ptr + out, top_p.to(weights_ptr.dtype.element_ty), mask=store_ok)
            tl.atomic_xchg(counter_ptr, 0)

    @triton.jit
    def _leader_rows(ids_ptr, pair, num_tokens: tl.constexpr, top_k: tl.constexpr,
                     BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr):
        """(expert, earlier pairs with that expert (0: this pair leads), uses [BLOCK_T], pair of
        each token [BLOCK_T]): which tokens routed to the expert of `pair`, at which pair."""
        expert = tl.load(ids_ptr + pair)
        tokens = tl.arange(0, BLOCK_T)
        slots = tl.arange(0, BLOCK_K)
        flat = tokens[:, None] * top_k + slots[None, :]  # [BLOCK_T, BLOCK_K]
        valid = (tokens < num_tokens)[:, None] & (slots < top_k)[None, :]
        ids = tl.load(ids_ptr + flat, mask=valid, other=-1)
        match = valid & (ids == expert)
        num_earlier = tl.sum((match & (flat < pair)).to(tl.int32))
        uses = tl.sum(match.to(tl.int32), axis=1) > 0  # top-k ids are distinct per token
        token_pair = tl.sum(tl.where(match, flat, 0), axis=1)
        return expert.to(tl.int64), num_earlier, uses, token_pair

    @triton.jit
    def _expert_offset(expert, table_ptr, host_offset, stride_expert, HAS_TABLE: tl.constexpr):
        """Element offset of the expert's matrix: its slot's, else the host copy's (table -1)."""
        if HAS_TABLE:
            slot = tl.load(table_ptr + expert).to(tl.int64)
            return tl.where(slot >= 0, slot * stride_expert, host_offset + expert * stride_expert)
        return expert * stride_expert

    @triton.jit
    def _rows_dot(w_ptr, base, rows, row_ok, v_ptr, v_rows, v_ok, num_cols: tl.constexpr,
                  BLOCK_COLS: tl.constexpr, PRECISION: tl.constexpr):
        """v[v_rows] @ w[rows]^T: float32 [BLOCK_T, BLOCK_ROWS]; masked rows read nothing."""
        acc = tl.zeros([v_rows.shape[0], rows.shape[0]], dtype=tl.float32)
        for start in range(0, num_cols, BLOCK_COLS):
            cols = start + tl.arange(0, BLOCK_COLS)
            col_ok = cols < num_cols
            w = tl.load(w_ptr + base + rows[:, None].to(tl.int64) * num_cols + cols[None, :],
                        mask=row_ok[:, None] & col_ok[None, :], other=0.0)
            v = tl.load(v_ptr + v_rows[:, None].to(tl.int64) * num_cols + cols[None, :],
                        mask=v_ok[:, None] & col_ok[None, :], other=0.0)
            if PRECISION == "ieee":  # float32 (and the interpreter: see _precision)
                acc = tl.dot(v.to(tl.float32), tl.trans(w.to(tl.float32)), acc,
                             input_precision="ieee")
            else:
                acc = tl.dot(v.to(w.dtype), tl.trans(w), acc)
        return acc

    @triton.jit
    def _pairs_gate_up_kernel(
        x_ptr, gate_ptr, up_ptr, ids_ptr, out_ptr, table_ptr, gate_host_offset,
        up_host_offset, stride_expert, gate_bias_ptr, up_bias_ptr,
        num_tokens: tl.constexpr, top_k: tl.constexpr, num_cols: tl.constexpr,
        num_rows: tl.constexpr, HAS_TABLE: tl.constexpr, PRECISION: tl.constexpr,
        BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
        HAS_BIAS: tl.constexpr, CLAMP: tl.constexpr, LIMIT: tl.constexpr,
        ALPHA: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr,
    ):
        pdl_wait(USE_PDL)  # launch.launch passes it; launched without PDL
        pair = tl.program_id(0)
        expert, num_earlier, uses, token_pair = _leader_rows(ids_ptr, pair, num_tokens, top_k,
                                                             BLOCK_T, BLOCK_K)
        rows = tl.program_id(1) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        tokens = tl.arange(0, BLOCK_T)
        # Only the leader reads and writes (masks broadcast from the count: the interpreter
        # refuses a 0-d boolean in a mask).
        row_ok = (rows < num_rows) & (rows * 0 + num_earlier == 0)
        uses = uses & (tokens * 0 + num_earlier == 0)
        gate_base = _expert_offset(expert, table_ptr, gate_host_offset, stride_expert,
                                   HAS_TABLE)
        up_base = _expert_offset(expert, table_ptr, up_host_offset, stride_expert, HAS_TABLE)
        acc_gate = _rows_dot(gate_ptr, gate_base, rows, row_ok, x_ptr, tokens, uses, num_cols,
                             BLOCK_COLS, PRECISION)
        acc_up = _rows_dot(up_ptr, up_base, rows, row_ok, x_ptr, tokens, uses, num_cols,
                           BLOCK_COLS, PRECISION)
        if HAS_BIAS:  # the expert's biases, by its id (resident whatever its slot)
            bias_at = expert * num_rows + rows
            acc_gate += tl.load(gate_bias_ptr + bias_at, mask=row_ok, other=0.0).to(
                tl.float32)[None, :]
            acc_up += tl.load(up_bias_ptr + bias_at, mask=row_ok, other=0.0).to(
                tl.float32)[None, :]
        act = activate(acc_gate, acc_up, CLAMP, LIMIT, ALPHA)
        out = out_ptr + token_pair[:, None].to(tl.int64) * num_rows + rows[None, :]
        tl.store(out, act.to(out_ptr.dtype.element_ty), mask=uses[:, None] & row_ok[None, :])

    @triton.jit
    def _pairs_down_kernel(
        act_ptr, down_ptr, ids_ptr, weights_ptr, out_ptr, table_ptr, down_host_offset,
        stride_expert, down_bias_ptr,
        num_tokens: tl.constexpr, top_k: tl.constexpr, num_cols: tl.constexpr,
        num_rows: tl.constexpr, HAS_TABLE: tl.constexpr, PRECISION: tl.constexpr,
        BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
        HAS_BIAS: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr,
    ):
        pdl_wait(USE_PDL)  # launch.launch passes it; launched without PDL
        pair = tl.program_id(0)
        expert, num_earlier, uses, token_pair = _leader_rows(ids_ptr, pair, num_tokens, top_k,
                                                             BLOCK_T, BLOCK_K)
        rows = tl.program_id(1) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        tokens = tl.arange(0, BLOCK_T)
        # Only the leader reads and writes (masks broadcast from the count: the interpreter
        # refuses a 0-d boolean in a mask).
        row_ok = (rows < num_rows) & (rows * 0 + num_earlier == 0)
        uses = uses & (tokens * 0 + num_earlier == 0)
        base = _expert_offset(expert, table_ptr, down_host_offset, stride_expert, HAS_TABLE)
        acc = _rows_dot(down_ptr, base, rows, row_ok, act_ptr, token_pair, uses, num_cols,
                        BLOCK_COLS, PRECISION)  # [BLOCK_T, BLOCK_ROWS]
        if HAS_BIAS:
            acc += tl.load(down_bias_ptr + expert * num_rows + rows, mask=row_ok,
                           other=0.0).to(tl.float32)[None, :]
        weight = tl.load(weights_ptr + token_pair, mask=uses, other=0.0).to(tl.float32)
        out = out_ptr + token_pair[:, None].to(tl.int64) * num_rows + rows[None, :]
        tl.store(out, acc * weight[:, None], mask=uses[:, None] & row_ok[None, :])

    @triton.jit
    def _sum_pairs_kernel(parts_ptr, out_ptr, top_k: tl.constexpr, num_rows: tl.constexpr,
                          BLOCK_COLS: tl.constexpr):
        token = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
        ok = cols < num_rows
        acc = tl.zeros([BLOCK_COLS], dtype=tl.float32)
        for j in tl.static_range(top_k):
            acc += tl.load(parts_ptr + (token * top_k + j) * num_rows + cols, mask=ok,
                           other=0.0)
        tl.store(out_ptr + token * num_rows + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)

    _pairs_key = ("num_tokens", "num_rows", "num_cols")
    _gate_up_tuned = tuned(_pairs_gate_up_kernel, PAIR_CONFIGS, _pairs_key)
    _down_tuned = tuned(_pairs_down_kernel, PAIR_CONFIGS, _pairs_key)


def _precision(dtype: torch.dtype) -> str:
    """How tl.dot multiplies: float32 weights exactly ("ieee", not tf32); bf16/fp16 natively
    on the GPU. The interpreter multiplies bf16 as its raw bits (numpy has no bf16; Triton
    3.9's create_dot), so there everything goes through float32."""
    return "ieee" if dtype == torch.float32 or is_interpreting() else "native"


def _token_blocks(num_tokens: int, top_k: int) -> dict:
    # tl.dot takes 16 rows or more: tokens beyond num_tokens are masked out.
    return {"BLOCK_T": max(16, triton.next_power_of_2(num_tokens)),
            "BLOCK_K": triton.next_power_of_2(top_k)}


def router_topk_rows(x: torch.Tensor, router_weight: torch.Tensor, top_k: int,
                     norm_topk_prob: bool, out_ids: torch.Tensor | None = None,
                     router: RouterKind = SOFTMAX) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] in x's dtype, ids [T, k] int64) for tokens x [T, H], as SparseMoE
    routes each: logits in x's dtype, softmax in float32, top-k descending, optionally
    renormalised. One launch; T is a compile-time constant (a batch bucket).

    out_ids: a persistent contiguous int64 [T, k] buffer to write the ids into (a partial
    expert cache reads them back after the step); default a new tensor. router: what else
    the router does (moe_triton.RouterKind: GPT-OSS's bias, GLM-4.5's sigmoid)."""
    num_tokens = x.shape[0]
    num_experts, hidden = router_weight.shape
    if not 0 < top_k <= num_experts:
        raise ValueError(f"top_k must be in 1..{num_experts}, not {top_k}")
    _check_stacked("router weight", router_weight[None])
    if out_ids is None:
        ids = torch.empty(num_tokens, top_k, dtype=torch.long, device=x.device)
    elif (out_ids.shape != (num_tokens, top_k) or out_ids.dtype != torch.long
          or not out_ids.is_contiguous()):
        raise ValueError(f"out_ids must be a contiguous int64 [{num_tokens}, {top_k}] tensor, "
                         f"got {out_ids.dtype} {tuple(out_ids.shape)}")
    else:
        ids = out_ids
    weights = torch.empty(num_tokens, top_k, dtype=x.dtype, device=x.device)
    logits = torch.empty(num_tokens, num_experts, dtype=x.dtype, device=x.device)
    _router_rows_kernel[(triton.cdiv(num_experts, ROUTER_ROWS),)](
        x.contiguous(), router_weight, logits, _counter(x.device), ids, weights,
        *router.pointers(ids), num_tokens=num_tokens, num_experts=num_experts, hidden=hidden,
        top_k=top_k, norm_topk=norm_topk_prob, ROWS=ROUTER_ROWS,
        BLOCK_H=triton.next_power_of_2(hidden), BLOCK_T=triton.next_power_of_2(num_tokens),
        BLOCK_E=triton.next_power_of_2(num_experts), BLOCK_K=triton.next_power_of_2(top_k),
        num_warps=1, **router.constexprs(),
    )
    return weights, ids


def pairs_gate_up(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, ids: torch.Tensor,
                  table: torch.Tensor | None = None,
                  host_offsets: tuple[int, int] = (0, 0),
                  epilogue: Epilogue | None = None) -> torch.Tensor:
    """silu(gate[ids[t, j]] @ x[t]) * (up[ids[t, j]] @ x[t]): x [T, H], gate/up [E, I, H],
    ids [T, k] -> [T*k, I] (pair t*k + j). table/host_offsets: a partial expert cache's slot
    table, as for moe_triton.grouped_gate_up; an epilogue (GPT-OSS): its biases and
    activation, as there."""
    _check_stacked("gate_proj", gate)
    _check_stacked("up_proj", up)
    table_arg = _check_table(table, ids, 2, host_offsets)
    num_tokens, top_k = ids.shape
    num_rows, num_cols = gate.shape[1], gate.shape[2]
    out = torch.empty(num_tokens * top_k, num_rows, dtype=x.dtype, device=x.device)
    (_, gate_bias, up_bias, _), switches = expert_epilogue.kernel_args(epilogue, ids)
    launch(
        _gate_up_tuned, lambda rows: (num_tokens * top_k, triton.cdiv(num_rows, rows)),
        PAIR_CONFIGS, x.contiguous(), gate, up, ids.contiguous(), out, table_arg,
        int(host_offsets[0]), int(host_offsets[1]), gate.stride(0), gate_bias, up_bias,
        num_tokens=num_tokens, top_k=top_k, num_cols=num_cols, num_rows=num_rows,
        HAS_TABLE=table is not None, PRECISION=_precision(gate.dtype),
        **_token_blocks(num_tokens, top_k), **switches,
    )
    return out


def pairs_down_sum(act: torch.Tensor, down: torch.Tensor, ids: torch.Tensor,
                   weights: torch.Tensor, table: torch.Tensor | None = None,
                   host_offset: int = 0, epilogue: Epilogue | None = None) -> torch.Tensor:
    """sum_j weights[t, j] * (down[ids[t, j]] @ act[t*k + j]): act [T*k, I], down [E, H, I]
    -> [T, H] in act's dtype, summed in float32 and rounded once. An epilogue's down bias of
    each pair's expert joins its product before the weight."""
    _check_stacked("down_proj", down)
    table_arg = _check_table(table, ids, 1, (host_offset,))
    num_tokens, top_k = ids.shape
    num_rows, num_cols = down.shape[1], down.shape[2]
    parts = torch.empty(num_tokens * top_k, num_rows, dtype=torch.float32, device=act.device)
    (_, _, _, down_bias), switches = expert_epilogue.kernel_args(epilogue, ids)
    launch(
        _down_tuned, lambda rows: (num_tokens * top_k, triton.cdiv(num_rows, rows)),
        PAIR_CONFIGS, act.contiguous(), down, ids.contiguous(), weights.contiguous(), parts,
        table_arg, int(host_offset), down.stride(0), down_bias, num_tokens=num_tokens,
        top_k=top_k, num_cols=num_cols, num_rows=num_rows, HAS_TABLE=table is not None,
        PRECISION=_precision(down.dtype), HAS_BIAS=switches["HAS_BIAS"],
        **_token_blocks(num_tokens, top_k),
    )
    out = torch.empty(num_tokens, num_rows, dtype=act.dtype, device=act.device)
    block = min(SUM_COLS, triton.next_power_of_2(num_rows))
    _sum_pairs_kernel[(num_tokens, triton.cdiv(num_rows, block))](
        parts, out, top_k=top_k, num_rows=num_rows, BLOCK_COLS=block, num_warps=4)
    return out
