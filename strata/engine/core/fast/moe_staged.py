"""Many tokens through a partial expert cache: the layer's experts staged whole, then the
grouped GEMMs the all-resident prefill runs (moe_prefill.experts_sorted).

A chunk of T tokens routes T*k rows. From STAGE_ALL_ROWS_PER_EXPERT rows per expert on,
every expert is staged without asking the host which are routed (no sync; at 4096 tokens x
8 of 128 an expert is left out with probability ~1e-115 under uniform routing, and a skewed
router's rare ones cost a copy at most), and the next MoE layer is staged behind this one's
GEMMs (memory/expert_staging.py). Fewer rows ask the host for the routed experts (one sync)
and stage only those. Nothing is evicted or admitted: the cache keeps decode's experts.
"""

from __future__ import annotations

import torch

from strata.engine.core.fast.moe_prefill import experts_sorted
from strata.engine.core.fast.pointwise import PointwiseOps

# Routed rows per expert from which a chunk stages every expert unasked (see the module
# doc): 16 rows per expert is 256 tokens of Qwen3-30B-A3B (8 of 128), where uniform routing
# leaves an expert out with probability (1 - 8/128) ** 256 ~ 7e-8.
STAGE_ALL_ROWS_PER_EXPERT = 16


def stages(moe, x: torch.Tensor) -> bool:
    """Whether x's rows take the staged path: a partial cache with a staging area, and more
    than one token (one token reads slots and the host copy in place: moe_grouped.py)."""
    provider = moe.expert_weights
    return x.shape[0] > 1 and getattr(provider, "can_stage", False)


def staged_experts(moe, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                   ops: PointwiseOps) -> torch.Tensor:
    """The routed experts of x [T, H] (weights/ids [T, k], routed on the device) over the
    layer's staged experts; [T, H]."""
    provider = moe.expert_weights
    num_experts = provider.store.num_experts
    every = ids.numel() >= STAGE_ALL_ROWS_PER_EXPERT * num_experts
    routed = None if every else torch.unique(ids).tolist()  # the one host sync
    y = experts_sorted(moe, x, weights, ids, ops, stacks=provider.staged(routed))
    if every:  # the next layer's chunk is as long: its experts go in behind these GEMMs
        provider.prefetch_next()
    return y
