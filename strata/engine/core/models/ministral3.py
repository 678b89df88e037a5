"""Ministral 3 / Devstral 2 (transformers' `ministral3`, GGUF `mistral3`): Llama's layout with
YaRN RoPE, an optional window on every layer, and Llama 4's attention temperature: the rotated
queries at position p are scaled by 1 + beta * ln(1 + floor(p / original context)), so they
stay sharp past the pre-training context (exactly 1 within it). Multimodal checkpoints
(`mistral3` with this text_config) load their language model only, as Mistral's do."""

from __future__ import annotations

from strata.engine.core.model_config import ModelConfig
from strata.engine.core.models.decoder import DecoderLM
from strata.engine.core.models.layers import Attention, SwiGLU
from strata.engine.core.models.mistral import sanitize  # the same names and wrapper prefixes

__all__ = ["Model", "sanitize"]


class Model(DecoderLM):
    def __init__(self, config: ModelConfig):
        scaling = (config.llama4_scaling_beta, config.llama4_scaling_period_tokens) \
            if config.llama4_scaling_beta else None
        super().__init__(
            config,
            make_attention=lambda i: Attention(
                config, config.attention_bias, config.attention_bias, qk_norm=False,
                llama4_scaling=scaling),
            make_mlp=lambda i: SwiGLU(config.hidden_size, config.intermediate_size),
        )
