"""Whether the CUDA fast paths can run a model, and if not, why: they select kernels by the
model's shape and implement plain softmax GQA attention over every cached position, and plain
MoE (softmax, top-k, optional renormalisation, silu(gate) * up, no biases). A model needing
more runs on the reference path (models/), which computes everything it declares.
"""

from __future__ import annotations

from torch import nn

from strata.engine.core.models.switch import SparseMoE


def fast_path_gaps(model: nn.Module) -> list[str]:
    """What the model needs that the fast paths lack, in words; [] where they can run it."""
    gaps: dict[str, None] = {}  # ordered, no repeats
    for module in model.modules():
        if getattr(module, "sinks", None) is not None:
            gaps["attention sinks"] = None
        if getattr(module, "window", 0):
            gaps["sliding-window attention"] = None
        if isinstance(module, SparseMoE):
            if module.router.bias is not None:
                gaps["a router bias"] = None
            if module.softmax_after_topk:
                gaps["softmax over the top-k logits"] = None
            if module.expert_bias is not None:
                gaps["expert biases"] = None
            if not module.is_plain and module.activation.limit is not None:
                gaps["the clamped SwiGLU"] = None
    return list(gaps)
