"""Before any CUDA graph is captured: compile the expert kernels every decode and prefill
variant launches, and size the prefill's dequantization scratch for quantized experts
(resident, or staged from a partial cache). Split from residency.py, which calls both at
load."""

from __future__ import annotations

import torch

from strata.engine.core.models.switch import SparseMoE
from strata.engine.core.quant.experts import QuantizedExperts
from strata.engine.core.slot_experts import SlotExperts


def _resident_quantized(moe: SparseMoE, stage: bool = False) -> tuple[QuantizedExperts, ...]:
    """The layer's (gate, up, down) as prefill multiplies them, when they are blocks: all
    resident, or a partial cache's staging (memory/expert_staging.py; filled first where
    `stage`, for a warm-up that reads real blocks); else ()."""
    from strata.engine.core.fast.moe_grouped import slot_layout

    provider = moe.expert_weights
    if isinstance(provider, SlotExperts):
        if not provider.can_stage or provider.quantized is None:
            return ()
        return provider.staged() if stage else provider.staging_stacks()
    stacks = (moe.experts.gate_proj, moe.experts.up_proj, moe.experts.down_proj)
    if slot_layout(moe) is not None or not isinstance(stacks[0], QuantizedExperts):
        return ()
    return stacks  # type: ignore[return-value]


def _reaches_grouped(moe: SparseMoE, max_prefill_tokens: int | None,
                     stacks: tuple | None = None) -> bool:
    """Whether a prefill chunk of max_prefill_tokens can route enough rows to moe's experts
    (stacks: where prefill reads them, default the module's) for the dequantize-then-grouped
    path (expert_grouped.min_rows, the lower crossover of a path replayed from graphs);
    None: no bound."""
    from strata.engine.core.fast import expert_epilogue
    from strata.engine.core.fast.moe_prefill import decodes_in_gemm
    from strata.engine.core.kernels import launch
    from strata.engine.core.quant import expert_grouped

    if stacks is None:
        stacks = (moe.experts.gate_proj, moe.experts.up_proj, moe.experts.down_proj)
    if launch.is_usable(stacks[0].device) and not decodes_in_gemm(
            *stacks, expert_epilogue.of(moe)):
        return True  # expert_gemm cannot take them (MXFP4, an epilogue): every chunk can
    num_experts = stacks[0].shape[0]
    return (max_prefill_tokens is None or max_prefill_tokens * moe.top_k
            >= expert_grouped.min_rows(num_experts, replayed=True))


def expert_scratch_numel(model: torch.nn.Module, max_prefill_tokens: int | None = None) -> int:
    """The most values a prefill dequantizes at once for quantized experts (resident, or
    staged from a partial cache): one group of experts of one layer
    (quant/expert_grouped.py); 0 where no chunk reaches that path."""
    from strata.engine.core.quant import expert_grouped

    return max((expert_grouped.scratch_numel(*stacks) for m in model.modules()
                if isinstance(m, SparseMoE) and (stacks := _resident_quantized(m))
                and _reaches_grouped(m, max_prefill_tokens, stacks)), default=0)


def warm_up_experts(model: torch.nn.Module, max_prefill_tokens: int | None = None) -> int:
    """Compile the expert kernels for every variant decode and prefill launch, before any
    CUDA graph is captured; returns how many ran."""
    from strata.engine.core.fast.moe_grouped import expert_stacks, slot_layout
    from strata.engine.core.fast.moe_prefill import warm_up_quantized
    from strata.engine.core.quant.expert_kernels import gather_dequantize

    seen: set[tuple] = set()
    for moe in (m for m in model.modules() if isinstance(m, SparseMoE)):
        layout = slot_layout(moe)
        resident = _resident_quantized(moe)
        if resident:
            key = ("prefill", *((w.qtype, w.shape, w.expert_stride) for w in resident))
            if key not in seen:
                seen.add(key)
                resident = _resident_quantized(moe, stage=True)  # real blocks to read
                warm_up_quantized(moe, _reaches_grouped(moe, max_prefill_tokens, resident),
                                  resident)
        stacks = expert_stacks(moe, layout)[:3]
        for p, w in enumerate(stacks):
            key = (w.qtype if isinstance(w, QuantizedExperts) else None, w.shape[1:], layout
                   is None)
            if not isinstance(w, QuantizedExperts) or key in seen:
                continue
            seen.add(key)
            ids = torch.zeros(moe.top_k, dtype=torch.long, device=w.device)
            if layout is None:
                gather_dequantize(w, ids)
            else:
                gather_dequantize(w, ids, layout.table, layout.host_offsets[p])
    return len(seen)
