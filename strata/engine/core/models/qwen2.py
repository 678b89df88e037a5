"""Qwen2 / Qwen2.5: Llama layout with biases on the q, k and v projections."""

from __future__ import annotations

from strata.engine.core.loader.lazy import LazyTensor
from strata.engine.core.model_config import ModelConfig
from strata.engine.core.models.decoder import DecoderLM, drop_unused_tensors
from strata.engine.core.models.layers import Attention, SwiGLU


class Model(DecoderLM):
    def __init__(self, config: ModelConfig):
        super().__init__(
            config,
            # Qwen2 always has q/k/v biases and never an o_proj bias, whatever config.json says.
            make_attention=lambda i: Attention(config, qkv_bias=True, o_bias=False, qk_norm=False),
            make_mlp=lambda i: SwiGLU(config.hidden_size, config.intermediate_size),
        )


def sanitize(tensors: dict[str, LazyTensor], config: ModelConfig) -> dict[str, LazyTensor]:
    """Hugging Face Qwen2 files already use the canonical names."""
    return drop_unused_tensors(tensors, config)
