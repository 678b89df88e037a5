"""What a model needs that the fast CUDA paths (this package) do not implement.

The fast decode, prefill and batch paths reimplement the reference model's step for speed;
they know softmax top-k routing over routed experts and RoPE over the whole head. A model
with a part outside that (GLM-4.5: sigmoid routing with a correction bias, groups and scaling;
a shared expert; partial RoPE) runs the reference model instead, with a log line that says
why, rather than a fast step that would silently compute something else.
"""

from __future__ import annotations

from torch import nn

from strata.engine.core.models.switch import SparseMoE


def fast_path_gaps(model: nn.Module) -> list[str]:
    """The parts of `model` the fast paths lack, in words; empty when they cover it all."""
    gaps: list[str] = []
    moe_layers = [m for m in model.modules() if isinstance(m, SparseMoE)]
    if any(m.routing.scoring != "softmax" for m in moe_layers):
        gaps.append("sigmoid expert routing with a score-correction bias")
    if any(m.routing.n_group > 1 for m in moe_layers):
        gaps.append("grouped top-k routing")
    if any(m.routing.scaling != 1.0 for m in moe_layers):
        gaps.append("routed expert scaling")
    if any(m.shared_experts is not None for m in moe_layers):
        gaps.append("a shared expert")
    config = getattr(model, "config", None)
    if config is not None and config.rotary_dim != config.head_dim:
        gaps.append(f"partial RoPE ({config.rotary_dim} of {config.head_dim} dims)")
    return gaps
