"""Which models the fast decode and prefill paths cover, read from the model's shape.

The fast paths (forward.py, prefill.py, batch_graph.py and their kernels) reimplement the
shared decoder: pre-norm blocks, or Gemma's sandwich blocks (each sublayer's output normed
too); Llama's RMSNorm or Gemma's (1 + w) one; the model's own embedding (Gemma scales it)
and RoPE tables (one, or Gemma's per layer kind); causal attention at the layer's scale
(1/sqrt(head_dim) or Gemma's query_pre_attn_scalar), over every cached position or a
sliding window, with GPT-OSS's per-head sinks where the layer has them, queries scaled
by position where the layer says (Ministral 3's temperature, Attention.scale_queries);
SwiGLU, GeGLU or SparseMoE MLPs; logits soft-capped where the config says. A model needing more runs the
reference forward instead (engine_setup.py): slower, never wrong.
Every MoE layer of models/switch.py is covered: softmax top-k into plain SwiGLU experts
(Qwen3-MoE, Mixtral) by the Triton routers; GLM-4.5's sigmoid routing with its correction
bias, groups and routed scaling, and GPT-OSS's biased router and softmax over the top-k
logits, by the module's own device ops; GPT-OSS's expert biases and clamped SwiGLU as the
expert kernels' epilogue (fast/expert_epilogue.py), its MXFP4 experts dequantized by the
shared tile decoder; GLM's shared expert by the dense path.
"""

from __future__ import annotations

from torch import nn

from strata.engine.core.models.decoder import DecoderLayer, DecoderLM, SandwichDecoderLayer
from strata.engine.core.models.gpt_oss import GptOssAttention
from strata.engine.core.models.layers import (
    Attention,
    GeGLU,
    GemmaRMSNorm,
    RMSNorm,
    SwiGLU,
)
from strata.engine.core.models.switch import SparseMoE


def missing_features(model: nn.Module) -> list[str]:
    """What `model` needs that the fast paths lack, in words; empty where they cover it."""
    if not isinstance(model, DecoderLM):
        return [f"the {type(model).__name__} architecture"]
    layers = list(model.model.layers)
    attentions = [m for m in model.modules() if isinstance(m, Attention)]
    checks = [
        (any(type(layer) not in (DecoderLayer, SandwichDecoderLayer) for layer in layers),
         "its decoder block"),
        (any(type(m) not in (RMSNorm, GemmaRMSNorm) for m in model.modules()
             if isinstance(m, RMSNorm)), "its norm"),
        (any(not isinstance(layer.mlp, (SwiGLU, GeGLU, SparseMoE)) for layer in layers),
         "its MLP"),
        (any(type(a) not in (Attention, GptOssAttention) for a in attentions), "its attention"),
    ]
    return [feature for is_missing, feature in checks if is_missing]
