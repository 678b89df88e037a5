"""A stand-in for models/switch.SparseMoE holding only what the MoE kernels' entry points
read (the expert stacks, top_k, the router), for kernel tests that build no model."""

from __future__ import annotations

import torch


def moe_stub(gate, up, down, top_k: int | None = None, router: torch.nn.Module | None = None,
             norm_topk_prob: bool = True) -> torch.nn.Module:
    """moe.experts.{gate,up,down}_proj = the stacks (float or QuantizedExperts); top_k,
    router, norm_topk_prob, forced and the routing and expert flags as SparseMoE names them,
    where given."""
    moe = torch.nn.Module()
    moe.experts = torch.nn.Module()
    moe.experts.gate_proj, moe.experts.up_proj, moe.experts.down_proj = gate, up, down
    if top_k is not None:
        moe.top_k = top_k
    if router is not None:
        moe.router = router
    moe.norm_topk_prob = norm_topk_prob
    moe.forced = None  # as SparseMoE has it: no benchmark's forced routing
    # Qwen3-MoE's kind of layer, as SparseMoE's build-time flags say it: softmax top-k into
    # plain SwiGLU experts, no shared expert.
    moe.softmax_routing, moe.plain_experts, moe.shared_experts = True, True, None
    return moe
