"""Mistral 7B / Mistral Small 3.x / Devstral: Llama's layout, head_dim given explicitly (Small
3.x: 128 with hidden 5120 over 32 heads). Mistral 3 multimodal checkpoints (`mistral3`) load
their language model only: the vision tower and projector tensors are dropped here."""

from __future__ import annotations

from strata.engine.core.loader.lazy import LazyTensor
from strata.engine.core.model_config import ModelConfig
from strata.engine.core.models.decoder import drop_unused_tensors
from strata.engine.core.models.llama import Model  # Llama's layers; head_dim from the config

__all__ = ["Model", "sanitize"]

# Language-model prefixes of Mistral3ForConditionalGeneration checkpoints: the hub files
# (transformers 4) and what transformers 5 saves.
_TEXT_PREFIXES = (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
                  ("model.language_model.", "model."))
_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                    "model.multi_modal_projector.")


def sanitize(tensors: dict[str, LazyTensor], config: ModelConfig) -> dict[str, LazyTensor]:
    """Mistral files use the canonical names; Mistral 3's multimodal ones nest them."""
    out: dict[str, LazyTensor] = {}
    for name, tensor in tensors.items():
        if name.startswith(_VISION_PREFIXES):
            continue
        for old, new in _TEXT_PREFIXES:
            if name.startswith(old):
                name = new + name[len(old):]
                break
        out[name] = tensor
    return drop_unused_tensors(out, config)
