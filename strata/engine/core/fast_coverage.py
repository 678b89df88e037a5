"""Which models the fast decode and prefill paths cover, read from the model's shape.

The fast paths (forward.py, prefill.py, batch_graph.py and their kernels) reimplement the
shared decoder: pre-norm blocks of Llama's RMSNorm, one RoPE table, causal attention at
1/sqrt(head_dim) over every cached position, SwiGLU or SparseMoE MLPs, plain embeddings and
logits. A model needing more runs the reference forward instead (engine_setup.py): slower,
never wrong.
Its MoE layers route by softmax top-k over routed experts only, without biases, into plain
SwiGLU experts; GLM-4.5's sigmoid routing and shared expert, and GPT-OSS's sinks, router and
expert biases and clamped SwiGLU, run the reference forward too.
"""

from __future__ import annotations

from torch import nn

from strata.engine.core.models.decoder import DecoderLayer, DecoderLM
from strata.engine.core.models.layers import Attention, RMSNorm, SwiGLU
from strata.engine.core.models.switch import SparseMoE


def missing_features(model: nn.Module) -> list[str]:
    """What `model` needs that the fast paths lack, in words; empty where they cover it."""
    if not isinstance(model, DecoderLM):
        return [f"the {type(model).__name__} architecture"]
    layers = list(model.model.layers)
    attentions = [m for m in model.modules() if isinstance(m, Attention)]
    moe_layers = [m for m in model.modules() if isinstance(m, SparseMoE)]
    checks = [
        (any(type(layer) is not DecoderLayer for layer in layers),
         "sandwich norms (post-attention and post-MLP norms)"),
        (any(type(m) is not RMSNorm for m in model.modules() if isinstance(m, RMSNorm)),
         "Gemma's (1 + w) RMSNorm"),
        (any(not isinstance(layer.mlp, (SwiGLU, SparseMoE)) for layer in layers),
         "a GeGLU MLP" if any(type(layer.mlp).__name__ == "GeGLU" for layer in layers)
         else "its MLP"),
        (any(a.sliding_window is not None for a in attentions), "sliding-window attention"),
        (any(a.scale is not None for a in attentions), "an attention scale of its own"),
        (type(model).embed is not DecoderLM.embed, "scaled embeddings"),
        (type(model).layer_ropes is not DecoderLM.layer_ropes, "a RoPE table per layer kind"),
        (bool(model.config.final_logit_softcapping), "final logit soft-capping"),
        (any(m.routing.scoring != "softmax" for m in moe_layers),
         "sigmoid expert routing with a score-correction bias"),
        (any(m.routing.n_group > 1 for m in moe_layers), "grouped top-k routing"),
        (any(m.routing.scaling != 1.0 for m in moe_layers), "routed expert scaling"),
        (any(m.shared_experts is not None for m in moe_layers), "a shared expert"),
        (any(getattr(a, "sinks", None) is not None for a in attentions), "attention sinks"),
        (any(m.router.bias is not None for m in moe_layers), "a router bias"),
        (any(m.softmax_after_topk for m in moe_layers), "softmax over the top-k logits"),
        (any(m.expert_bias is not None for m in moe_layers), "expert biases"),
        (any(m.activation.limit is not None for m in moe_layers), "the clamped SwiGLU"),
    ]
    return [feature for is_missing, feature in checks if is_missing]
