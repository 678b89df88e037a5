"""Llama 2/3 and SmolLM2: GQA attention, SwiGLU MLP, RoPE (optionally llama3-scaled)."""

from __future__ import annotations

from strata.engine.core.loader.lazy import LazyTensor
from strata.engine.core.model_config import ModelConfig
from strata.engine.core.models.decoder import DecoderLM, drop_unused_tensors
from strata.engine.core.models.layers import Attention, SwiGLU


class Model(DecoderLM):
    def __init__(self, config: ModelConfig):
        super().__init__(
            config,
            # Llama's attention_bias puts a bias on all four projections.
            make_attention=lambda i: Attention(
                config, config.attention_bias, config.attention_bias, qk_norm=False
            ),
            make_mlp=lambda i: SwiGLU(config.hidden_size, config.intermediate_size),
        )


def sanitize(tensors: dict[str, LazyTensor], config: ModelConfig) -> dict[str, LazyTensor]:
    """Hugging Face Llama files already use the canonical names."""
    return drop_unused_tensors(tensors, config)
