"""Which models the fast decode and prefill paths cover, read from the model's shape.

The fast paths (forward.py, prefill.py, batch_graph.py and their kernels) reimplement the
shared decoder: pre-norm blocks of Llama's RMSNorm, one RoPE table, causal attention at
1/sqrt(head_dim) over every cached position, SwiGLU or SparseMoE MLPs, plain embeddings and
logits. A model needing more runs the reference forward instead (engine_setup.py): slower,
never wrong.
Every MoE layer of models/switch.py is covered: softmax top-k into plain SwiGLU experts
(Qwen3-MoE, Mixtral) by the Triton routers; GLM-4.5's sigmoid routing with its correction
bias, groups and routed scaling, and GPT-OSS's biased router and softmax over the top-k
logits, by the module's own device ops; GPT-OSS's expert biases and clamped SwiGLU as the
expert kernels' epilogue (fast/expert_epilogue.py), its MXFP4 experts dequantized by the
shared tile decoder; GLM's shared expert by the dense path. GPT-OSS's attention (sinks,
sliding windows) still sends it to the reference forward.
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
        (any(getattr(a, "sinks", None) is not None for a in attentions), "attention sinks"),
    ]
    return [feature for is_missing, feature in checks if is_missing]
