"""Qwen3 dense: Llama layout plus a per-head RMSNorm on q and k before RoPE."""

from __future__ import annotations

from strata.engine.core.loader.lazy import LazyTensor
from strata.engine.core.model_config import ModelConfig
from strata.engine.core.models.decoder import DecoderLM, drop_unused_tensors
from strata.engine.core.models.layers import Attention, SwiGLU


class Model(DecoderLM):
    def __init__(self, config: ModelConfig):
        super().__init__(
            config,
            make_attention=lambda i: Attention(
                config, config.attention_bias, config.attention_bias, qk_norm=True
            ),
            make_mlp=lambda i: SwiGLU(config.hidden_size, config.intermediate_size),
        )


def sanitize(tensors: dict[str, LazyTensor], config: ModelConfig) -> dict[str, LazyTensor]:
    """Hugging Face Qwen3 files already use the canonical names."""
    return drop_unused_tensors(tensors, config)
