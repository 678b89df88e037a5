"""A batch step's MoE block: moe_batch.py's pair kernels for float experts, quant/
expert_batch.py's for quantized ones from QUANT_BATCHED_MIN_ROWS rows, else the one-token
kernels row by row. A module of its own because expert_batch.py builds on moe_batch.py's
router and sum (the dispatch in moe_batch.py made an import cycle)."""

from __future__ import annotations

import torch

from strata.engine.core.fast import expert_epilogue
from strata.engine.core.fast.moe_batch import pairs_down_sum, pairs_gate_up, router_topk_rows
from strata.engine.core.fast.moe_grouped import (
    expert_stacks,
    routed_experts,
    routed_norm,
    router_kind,
)
from strata.engine.core.fast.shared_expert import shared_expert
from strata.engine.core.models.switch import SlotLayout
from strata.engine.core.quant.experts import is_quantized_experts

# Rows from which quantized experts take expert_batch's kernels; fewer go row by row through
# the one-token kernels (dp4a). On the H200 (bench/diag_quant_batch.py, Qwen3-30B-A3B's
# layer, Q4_K/Q4_K/Q6_K, twelfth session, both on planes decoding) the batched kernels took
# 100.9 / 195.7 / 352.4 / 589.0 us at 2 / 4 / 8 / 16 rows against 87.6 / 173.5 / 345.6 /
# 689.3 row by row: 128 experts and top-8 share few experts between rows, and the
# one-token kernels have since gained dp4a (29.0 against 34.6 us a row).
QUANT_BATCHED_MIN_ROWS = 16


def experts_rows(moe, x: torch.Tensor, layout: SlotLayout | None = None) -> torch.Tensor:
    """The MoE block of a batch step's rows x [T, H] (1 < T <= 16): route, gate/up, down and
    sum by moe_batch.py's pair kernels, or for quantized experts by quant/expert_batch.py's (each routed
    expert's blocks decoded once for all its rows) from QUANT_BATCHED_MIN_ROWS rows; fewer
    rows, and types those cannot read, go row by row through the one-token kernels. Over the
    resident stacked experts, or a partial cache's layout: its slot table, the host copy for
    the rest, ids left in layout.step_ids[:T] for the cache. [T, H] in x's dtype.

    GLM-4.5's and GPT-OSS's routing run as the module's device ops, GPT-OSS's expert biases
    and clamp in the pair kernels (quantized: dequantized row by row), GLM's shared expert
    by the dense path; each chosen by the layer's build-time flags."""
    if moe.forced is not None:
        raise ValueError("forced routing (a benchmark's) imposes one row a step: decode one "
                         "sequence at a time")
    gate, up, down, table, offsets = expert_stacks(moe, layout)
    out_ids = layout.step_ids[: x.shape[0]] if layout is not None else None
    kind = router_kind(moe)
    if kind is not None:
        weights, ids = router_topk_rows(x, moe.router.weight, moe.top_k, routed_norm(moe),
                                        out_ids, kind)
    else:  # groups of experts: the module's own routing, by device ops
        weights, ids = moe.route(x)
        if out_ids is not None:
            ids = out_ids.copy_(ids)
    out = _routed_rows(moe, x, gate, up, down, ids, weights, table, offsets)
    if moe.shared_experts is None:
        return out
    return out + shared_expert(moe.shared_experts, x)


def _routed_rows(moe, x: torch.Tensor, gate, up, down, ids: torch.Tensor,
                 weights: torch.Tensor, table, offsets) -> torch.Tensor:
    """The routed experts' weighted sum of the rows x [T, H] (experts_rows without routing
    and the shared expert)."""
    epilogue = expert_epilogue.of(moe)
    if is_quantized_experts(gate):
        from strata.engine.core.quant import expert_batch

        if (epilogue is None and x.shape[0] >= QUANT_BATCHED_MIN_ROWS
                and expert_batch.supports(gate, up, down, table, offsets)):
            return expert_batch.routed_rows(x, gate, up, down, ids, weights, table,
                                            offsets)  # [T, H]
        return torch.cat([routed_experts(x[b : b + 1], gate, up, down, ids[b], weights[b],
                                         table, offsets, epilogue=epilogue)
                          for b in range(x.shape[0])])  # [T, H]
    act = pairs_gate_up(x, gate, up, ids, table, offsets[:2], epilogue)  # [T*k, I]
    return pairs_down_sum(act, down, ids, weights, table, offsets[2], epilogue)  # [T, H]
