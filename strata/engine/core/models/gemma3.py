"""Gemma 3 (text): 5 sliding-window layers to 1 global, each kind with its own RoPE base,
sandwich norms, q/k norms, GeGLU, embeddings scaled by sqrt(hidden), Gemma's (1 + w) RMSNorm.

A multimodal checkpoint (Gemma3ForConditionalGeneration) holds the same language model under
another prefix beside a vision tower: sanitize keeps the language model and says so.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from strata.engine.core.loader.lazy import LazyTensor
from strata.engine.core.model_config import ModelConfig
from strata.engine.core.models.decoder import (
    DecoderLM,
    SandwichDecoderLayer,
    drop_unused_tensors,
)
from strata.engine.core.models.layers import Attention, GeGLU, GemmaRMSNorm, RotaryEmbedding

log = logging.getLogger(__name__)

# Prefixes of the language model inside multimodal checkpoints: as published (transformers
# 4.50) and as transformers 5 saves them.
_LANGUAGE_MODEL_PREFIXES = (
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.language_model.", "model."),
)
_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                    "model.multi_modal_projector.")


class Model(DecoderLM):
    def __init__(self, config: ModelConfig):
        scalar = config.query_pre_attn_scalar or config.head_dim
        super().__init__(
            config,
            make_attention=lambda i: Attention(
                config, config.attention_bias, config.attention_bias, qk_norm=True,
                norm=GemmaRMSNorm, scale=scalar**-0.5,
                sliding_window=config.sliding_window if config.is_sliding_layer(i) else None,
            ),
            make_mlp=lambda i: GeGLU(config.hidden_size, config.intermediate_size),
            layer_class=SandwichDecoderLayer,
            norm=GemmaRMSNorm,
        )
        # Local layers: plain RoPE at their own base; global ones: rope_theta and its scaling.
        self.local_rope = RotaryEmbedding(dataclasses.replace(
            config, rope_theta=config.rope_local_theta, rope_scaling=None))
        # sqrt(hidden) rounded to the compute dtype first, as transformers does (55.5 in bf16
        # for hidden 3072, not 55.43).
        self.embed_scale = config.hidden_size**0.5

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.model.embed_tokens(input_ids)  # [T, H]
        return h * torch.tensor(self.embed_scale).to(h.dtype).item()

    def layer_ropes(self, positions: torch.Tensor, per_row: bool = False
                    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        global_table = self.rope(positions, per_row=per_row)
        local_table = self.local_rope(positions, per_row=per_row)
        return [local_table if self.config.is_sliding_layer(i) else global_table
                for i in range(len(self.model.layers))]


def sanitize(tensors: dict[str, LazyTensor], config: ModelConfig) -> dict[str, LazyTensor]:
    """Canonical names: a multimodal checkpoint's language model moves to `model.` and its
    vision tower and projector are dropped (one log line); text checkpoints are canonical."""
    renamed: dict[str, LazyTensor] = {}
    num_vision = 0
    for name, tensor in tensors.items():
        if name.startswith(_VISION_PREFIXES):
            num_vision += 1
            continue
        for old, new in _LANGUAGE_MODEL_PREFIXES:
            if name.startswith(old):
                name = new + name[len(old):]
                break
        renamed[name] = tensor
    if num_vision:
        log.info("Gemma 3 multimodal checkpoint: loading its language model only; the %d "
                 "vision tower and projector tensors are not used (Strata reads text)",
                 num_vision)
    return drop_unused_tensors(renamed, config)
