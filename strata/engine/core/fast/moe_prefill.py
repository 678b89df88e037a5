"""Many tokens through resident experts: sort (token, slot) rows by expert, then grouped GEMMs.

The reference SparseMoE loops over every expert with `torch.where` and a host sync per layer:
128 small launches per kernel kind per layer for Qwen3-30B-A3B. Here the T*k routed rows are
sorted by expert once; expert e owns the contiguous rows offsets[e-1]:offsets[e]. Then:

- `torch._grouped_mm` (cuBLAS/CUTLASS grouped GEMM; CPU too) multiplies every group by its
  expert's weights in one launch per projection, with the offsets on the device: no host sync.
- Where it is missing or refuses the inputs, a loop over only the experts that got rows, on
  contiguous slices of the sorted rows (one host sync for the counts).
- Quantized experts (GGML blocks), wherever Triton runs (CUDA; the CPU interpreter in
  tests): up to expert_grouped.min_rows routed rows, quant/expert_gemm.py's grouped kernels,
  which decode the blocks inside the K loop; from there on, quant/expert_grouped.py, which
  dequantizes the experts a bounded group at a time and multiplies each group's rows by
  torch._grouped_mm (the row count is a shape: the choice costs no sync). Called, that path
  costs the host more than the GPU; replayed per layer from CUDA graphs (expert_graphs.py,
  PointwiseOps.grouped_experts) or inside a prefill graph, it takes over from fewer rows.

Each row's routing weight scales its activation [R, I] before the down projection (I is
narrower than H: 768 against 2048 for Qwen3-30B-A3B); then each token gathers its k rows
through the inverse of the sort and sums them in float32 (one fused kernel when the ops are
compiled; a scatter back to token order first was slower: docs/benchmarks.md).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F

from strata.engine.core.fast import expert_epilogue
from strata.engine.core.fast.expert_epilogue import Epilogue
from strata.engine.core.fast.pointwise import EAGER_OPS, PointwiseOps, sum_rows
from strata.engine.core.kernels import launch
from strata.engine.core.quant.experts import ExpertMatrices, is_quantized_experts

log = logging.getLogger(__name__)

# None: not tried yet; learned on first use because support depends on the build and the GPU.
_grouped_mm_works: bool | None = None


def grouped_mm_supported(x: torch.Tensor) -> bool:
    """Whether torch._grouped_mm may run for x's device and dtype (CUDA: bf16 only)."""
    if not hasattr(torch, "_grouped_mm") or _grouped_mm_works is False:
        return False
    return x.device.type == "cpu" or x.dtype == torch.bfloat16


def sort_by_expert(ids: torch.Tensor, num_experts: int):
    """(order [T*k], source token [T*k], offsets [E] int32) of the routed rows sorted by expert.

    ids [T, k]; sorted row r is flat row order[r], i.e. token order[r] // k; expert e owns
    sorted rows offsets[e-1]..offsets[e]-1. No host sync: the offsets come from a search in
    the sorted ids (bincount asks the host for the output size, a sync per layer that left the
    GPU idle). Keys are sorted at their narrowest
    integer type: one radix pass for up to 256 experts instead of eight for int64.
    """
    flat = ids.reshape(-1)  # [T*k]
    key_dtype = torch.uint8 if num_experts <= 256 else torch.int32
    keys, order = torch.sort(flat.to(key_dtype), stable=True)  # [T*k] each
    bounds = torch.arange(num_experts, device=ids.device, dtype=key_dtype)
    offsets = torch.searchsorted(keys, bounds, right=True)  # rows with expert <= e
    return order, order // ids.shape[1], offsets.to(torch.int32)


def route_logits(
    logits: torch.Tensor, top_k: int, norm_topk: bool, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] in dtype, expert ids [T, k]) from router logits [T, E], as SparseMoE
    routes: softmax in float32, top-k, optionally renormalised."""
    probs = F.softmax(logits.float(), dim=-1)  # [T, E]
    top_probs, top_ids = torch.topk(probs, top_k, dim=-1)  # [T, k]
    if norm_topk:
        top_probs = top_probs / top_probs.sum(dim=-1, keepdim=True)
    return top_probs.to(dtype), top_ids


def _act(gate_rows: torch.Tensor, up_rows: torch.Tensor, row_weights: torch.Tensor,
         ops: PointwiseOps, epilogue: Epilogue | None, row_gate_bias, row_up_bias):
    """The rows' scaled activation [R, I]: SiLU·mul·weight, or an epilogue's (biased gate
    and up rows, then its activation) scaled by the weights."""
    if epilogue is None:
        return ops.silu_mul_scale(gate_rows, up_rows, row_weights)
    if row_gate_bias is not None:
        gate_rows, up_rows = gate_rows + row_gate_bias, up_rows + row_up_bias
    return epilogue.activate(gate_rows, up_rows) * row_weights[:, None]


def _grouped(rows: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
             offsets: torch.Tensor, row_weights: torch.Tensor, ops: PointwiseOps,
             epilogue: Epilogue | None = None, biases: tuple = (None, None)):
    # Weights are [E, out, in] like nn.Linear; the transpose is the column-major B it wants.
    gate_rows = torch._grouped_mm(rows, gate.transpose(-2, -1), offs=offsets)  # [R, I]
    up_rows = torch._grouped_mm(rows, up.transpose(-2, -1), offs=offsets)  # [R, I]
    act = _act(gate_rows, up_rows, row_weights, ops, epilogue, *biases)
    return torch._grouped_mm(act, down.transpose(-2, -1), offs=offsets)  # [R, H]


def _looped(rows: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
            offsets: torch.Tensor, row_weights: torch.Tensor, ops: PointwiseOps,
            epilogue: Epilogue | None = None, biases: tuple = (None, None)):
    out = torch.empty_like(rows)  # [R, H]
    ends = offsets.tolist()  # the one host sync
    begin = 0
    for expert, end in enumerate(ends):
        if end > begin:  # experts without rows cost nothing
            part = rows[begin:end]  # [n, H]
            part_biases = [b if b is None else b[begin:end] for b in biases]
            act = _act(F.linear(part, gate[expert]), F.linear(part, up[expert]),
                       row_weights[begin:end], ops, epilogue, *part_biases)  # [n, I]
            out[begin:end] = F.linear(act, down[expert])
        begin = end
    return out


def decodes_in_gemm(gate, up, down, epilogue: Epilogue | None = None) -> bool:
    """Whether prefill multiplies these quantized experts by expert_gemm.py's kernels,
    which read their blocks as stored (no dequantized copy): Triton runs on their device
    and decodes all three types, and the experts are plain SwiGLU (no epilogue)."""
    if epilogue is not None or not launch.is_usable(gate.device):
        return False
    from strata.engine.core.quant import expert_gemm  # decorates kernels: only where usable

    return expert_gemm.supports(gate, up, down)


def _unless_grouped_mm_refuses(run, what: str) -> torch.Tensor | None:
    """run()'s result, or None the first time torch._grouped_mm refuses it here (a
    capability, remembered in _grouped_mm_works); once it has worked, an error is raised."""
    global _grouped_mm_works
    try:
        y = run()
    except RuntimeError as exc:
        if _grouped_mm_works:  # it worked before: this is a real error, not a capability
            raise
        _grouped_mm_works = False
        log.warning("torch._grouped_mm refused %s (%s); looping over experts", what, exc)
        return None
    _grouped_mm_works = True
    return y


def _quantized_grouped(x: torch.Tensor, source: torch.Tensor, offsets: torch.Tensor,
                       row_weights: torch.Tensor, experts: tuple,
                       replayed: Callable | None = None, epilogue: Epilogue | None = None,
                       row_experts: torch.Tensor | None = None) -> torch.Tensor | None:
    """The sorted rows through quantized experts dequantized a group at a time, then
    torch._grouped_mm (quant/expert_grouped.py), or `replayed` (the same from CUDA graphs:
    PointwiseOps.grouped_experts); None where _grouped_mm refuses them. An epilogue's gate
    and up biases (by row_experts) and activation are applied there."""
    from strata.engine.core.quant import expert_grouped

    run = replayed or expert_grouped.experts_mlp
    extra = {} if epilogue is None else {"epilogue": epilogue, "row_experts": row_experts}
    return _unless_grouped_mm_refuses(
        lambda: run(x, source, offsets, row_weights, *experts, **extra),
        "the quantized MoE prefill")


def mmq_down_by(experts: tuple, epilogue: Epilogue | None = None) -> str | None:
    """How prefill multiplies these quantized experts by expert_mmq.py's int8 products, or
    None where it does not: STRATA_EXPERT_MMQ=1 every projection ("mmq"), =gate_up only
    gate and up, down by expert_gemm ("gemm"); opt-in until a GPU run has measured it,
    plain SwiGLU, and types and layouts the kernels read. Call only where Triton is usable."""
    down_by = {"1": "mmq", "gate_up": "gemm"}.get(os.environ.get("STRATA_EXPERT_MMQ", ""))
    if epilogue is not None or down_by is None:
        return None
    from strata.engine.core.quant import expert_gemm, expert_mmq  # decorate kernels

    gate, up, down = experts
    down_ok = (expert_mmq.is_supported(down) if down_by == "mmq"
               else expert_gemm.is_supported(down))
    ok = expert_mmq.is_supported(gate) and expert_mmq.is_supported(up) and down_ok
    return down_by if ok else None


def _quantized(x: torch.Tensor, source: torch.Tensor, offsets: torch.Tensor,
               row_weights: torch.Tensor, experts: tuple,
               replayed: Callable | None = None, epilogue: Epilogue | None = None,
               row_experts: torch.Tensor | None = None) -> torch.Tensor | None:
    """[R, H] of the sorted rows through quantized experts by whichever Triton path their
    count favours: expert_gemm.py's decode-in-the-K-loop GEMMs for few rows per expert,
    expert_grouped.py's dequantize-then-grouped-GEMM from min_rows on (or for types
    expert_gemm cannot read), replayed from graphs where `replayed` is given (which moves
    the crossover); None where neither runs here (the caller loops). An epilogue (GPT-OSS,
    MXFP4 among its types) takes the grouped path: expert_gemm has no epilogue.
    STRATA_EXPERT_MMQ=1 or gate_up (for an A/B on the GPU): expert_mmq.py's int8 products
    at every row count, for the types it reads (mmq_down_by)."""
    if not launch.is_usable(x.device):
        return None
    down_by = mmq_down_by(experts, epilogue)
    if down_by is not None:
        from strata.engine.core.quant import expert_mmq

        return expert_mmq.experts_mlp(x, *experts, offsets, row_weights, source=source,
                                      down_by=down_by)
    from strata.engine.core.quant import expert_grouped

    in_gemm = decodes_in_gemm(*experts, epilogue)
    grouped = grouped_mm_supported(x)
    # Inside a graph being captured (a prefill graph), the path costs no host time either.
    crossover = expert_grouped.min_rows(offsets.shape[0], replayed=replayed is not None or (
        x.is_cuda and torch.cuda.is_current_stream_capturing()))
    if grouped and (not in_gemm or source.shape[0] >= crossover):
        y = _quantized_grouped(x, source, offsets, row_weights, experts, replayed, epilogue,
                               row_experts)
        if y is not None or not in_gemm:
            return y
    if not in_gemm:
        return None
    from strata.engine.core.quant import expert_gemm

    return expert_gemm.experts_mlp(x.index_select(0, source), *experts, offsets, row_weights)


def _sorted_rows(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, num_experts: int):
    """(order, offsets, rows [T*k, H], row weights [T*k]): each routed (token, slot) row of
    x and its routing weight, grouped by expert (see sort_by_expert)."""
    order, source, offsets = sort_by_expert(ids, num_experts)
    rows = x.index_select(0, source)
    row_weights = weights.reshape(-1).index_select(0, order)
    return order, offsets, rows, row_weights


def _inverse(order: torch.Tensor) -> torch.Tensor:
    """Where each flat row f = token * k + slot sits after the sort: inverse[order[r]] = r."""
    return torch.empty_like(order).index_copy_(
        0, order, torch.arange(order.shape[0], device=order.device))


def grouped_block(
    x: torch.Tensor, router_weight: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
    down: torch.Tensor, top_k: int, norm_topk: bool,
) -> torch.Tensor:
    """A whole MoE block of x [T, H] by grouped GEMMs: route, sort, experts, sum; [T, H].

    Tensors and constants only, so one torch.compile variant serves every layer (a module
    argument would be guarded per layer); compiled, it is one host call a layer."""
    weights, ids = route_logits(F.linear(x, router_weight), top_k, norm_topk, x.dtype)
    order, offsets, rows, row_weights = _sorted_rows(x, weights, ids, gate.shape[0])
    y = _grouped(rows, gate, up, down, offsets, row_weights, EAGER_OPS)
    return sum_rows(y, _inverse(order), top_k)


def experts_sorted(
    moe, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
    ops: PointwiseOps = EAGER_OPS, stacks: tuple | None = None,
) -> torch.Tensor:
    """The routed experts of x [T, H] with weights/ids [T, k]; returns [T, H] in x's dtype.
    stacks: (gate, up, down) [E, ...] to read instead of the module's resident ones (a
    partial cache's staging: fast/moe_staged.py)."""
    top_k = ids.shape[1]
    if stacks is None:
        stacked = moe.experts
        stacks = (stacked.gate_proj, stacked.up_proj, stacked.down_proj)
    experts = stacks
    order, source, offsets = sort_by_expert(ids, experts[0].shape[0])
    row_weights = weights.reshape(-1).index_select(0, order)
    quantized = is_quantized_experts(experts[0])
    epilogue = expert_epilogue.of(moe)  # GPT-OSS's biases and clamp, else None
    row_experts = None if epilogue is None else ids.reshape(-1).index_select(0, order)
    biases = (None, None, None)
    if epilogue is not None:
        biases = expert_epilogue.row_biases(epilogue, row_experts)  # type: ignore[arg-type]
    y = None
    if quantized:
        y = _quantized(x, source, offsets, row_weights, experts, ops.grouped_experts,
                       epilogue, row_experts)
    elif grouped_mm_supported(x):
        y = _unless_grouped_mm_refuses(
            lambda: _grouped(x.index_select(0, source), *experts, offsets, row_weights, ops,
                             epilogue, biases[:2]),
            "the MoE prefill")
    if y is None:
        if quantized:  # one expert's matrix dequantized at a time
            experts = tuple(ExpertMatrices(w) for w in experts)
        y = _looped(x.index_select(0, source), *experts, offsets, row_weights, ops, epilogue,
                    biases[:2])
    if biases[2] is not None:  # each row's down bias, scaled by its weight as its product
        y = y + biases[2] * row_weights[:, None]
    return ops.sum_rows(y, _inverse(order), top_k)


def warm_up_quantized(moe, grouped: bool = True, stacks: tuple | None = None) -> None:
    """Both quantized prefill paths once over a few rows, so their kernels compile (and on
    CUDA autotune) at load, before any CUDA graph: expert_gemm's (where it decodes these
    types; expert_mmq's too where `mmq_down_by`) and, if `grouped` (a prefill chunk can reach
    it), the grouped one's, every group (whose launches do not depend on the rows). stacks:
    the experts to read instead of the module's resident ones (a partial cache's staging)."""
    if stacks is None:
        stacked = moe.experts
        stacks = (stacked.gate_proj, stacked.up_proj, stacked.down_proj)
    experts = stacks
    gate = experts[0]
    num_experts, _, hidden = gate.shape
    x = torch.zeros(moe.top_k, hidden, dtype=gate.dtype, device=gate.device)
    source = torch.arange(moe.top_k, device=gate.device)
    offsets = torch.full((num_experts,), moe.top_k, dtype=torch.int32, device=gate.device)
    row_weights = torch.zeros(moe.top_k, dtype=gate.dtype, device=gate.device)
    epilogue = expert_epilogue.of(moe)
    if decodes_in_gemm(*experts, epilogue):
        from strata.engine.core.quant import expert_gemm

        expert_gemm.experts_mlp(x, *experts, offsets, row_weights)
        down_by = mmq_down_by(experts, epilogue)
        if down_by is not None:
            from strata.engine.core.quant import expert_mmq

            expert_mmq.experts_mlp(x, *experts, offsets, row_weights, source=source,
                                   down_by=down_by)
    if grouped and launch.is_usable(gate.device) and grouped_mm_supported(x):
        _quantized_grouped(x, source, offsets, row_weights, experts, None, epilogue,
                           source)  # the rows' experts: any valid ids


def moe_block(moe, x: torch.Tensor, ops: PointwiseOps = EAGER_OPS) -> torch.Tensor:
    """The MoE block of many tokens x [T, H] with resident experts: the compiled grouped
    block once grouped GEMMs are known to run here, else route + experts_sorted."""
    stacked = moe.experts
    # Build-time flags: only softmax-routed plain experts (Qwen3-MoE, Mixtral) compile whole.
    if (ops.moe_block is not None and _grouped_mm_works and grouped_mm_supported(x)
            and moe.softmax_routing and moe.plain_experts
            and not is_quantized_experts(stacked.gate_proj)):
        return ops.moe_block(x, moe.router.weight, stacked.gate_proj, stacked.up_proj,
                             stacked.down_proj, moe.top_k, moe.norm_topk_prob)
    if moe.softmax_routing:
        weights, ids = route_logits(moe.router(x), moe.top_k, moe.norm_topk_prob, x.dtype)
    else:  # GLM-4.5's sigmoid or GPT-OSS's routing: the module's own device ops
        weights, ids = moe.route(x)
    return experts_sorted(moe, x, weights, ids, ops)
