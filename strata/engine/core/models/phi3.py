"""Phi-3 / Phi-4 / Phi-4-mini: Llama layout stored with fused qkv and gate_up projections,
optionally partial RoPE (Phi-4-mini rotates 3/4 of each head) and LongRoPE scaling.

sanitize() splits the fused tensors into the canonical q/k/v and gate/up, so the engine (the
quantized kernels, the arena's fused views and the fast paths) sees a Llama-shaped model.
"""

from __future__ import annotations

import re

import torch

from strata.engine.core.loader.lazy import LazyTensor, rows_of
from strata.engine.core.model_config import ModelConfig, ModelFormatError
from strata.engine.core.models.decoder import DecoderLM, drop_unused_tensors
from strata.engine.core.models.layers import Attention, SwiGLU, reorder_partial_rotary

_FUSED_QKV = re.compile(r"^(model\.layers\.\d+\.self_attn)\.qkv_proj\.weight$")
_FUSED_GATE_UP = re.compile(r"^(model\.layers\.\d+\.mlp)\.gate_up_proj\.weight$")


class Model(DecoderLM):
    def __init__(self, config: ModelConfig):
        super().__init__(
            config,
            make_attention=lambda i: Attention(config, False, False, qk_norm=False),
            make_mlp=lambda i: SwiGLU(config.hidden_size, config.intermediate_size),
        )


def _split_rows(tensors: dict[str, LazyTensor], name: str, parts: dict[str, int]) -> None:
    """Replace tensors[name] by consecutive row ranges of it, named and sized by `parts`."""
    fused = tensors.pop(name)
    expected = sum(parts.values())
    if fused.shape[0] != expected:
        raise ModelFormatError(
            f"tensor {name} has {fused.shape[0]} rows but the config expects {expected}: "
            "the file is damaged or its config does not match")
    start = 0
    for part, rows in parts.items():
        tensors[part] = rows_of(fused, torch.arange(start, start + rows))
        start += rows


def sanitize(tensors: dict[str, LazyTensor], config: ModelConfig) -> dict[str, LazyTensor]:
    """Fused qkv_proj -> q/k/v_proj and gate_up_proj -> gate/up_proj (the first half is the
    gate, as Phi3MLP chunks it); with partial RoPE, q and k rows in partial_rotary_rows order."""
    q_rows = config.num_attention_heads * config.head_dim
    kv_rows = config.num_key_value_heads * config.head_dim
    for name in [n for n in tensors if _FUSED_QKV.match(n)]:
        prefix = _FUSED_QKV.match(name).group(1)
        _split_rows(tensors, name, {f"{prefix}.q_proj.weight": q_rows,
                                    f"{prefix}.k_proj.weight": kv_rows,
                                    f"{prefix}.v_proj.weight": kv_rows})
    for name in [n for n in tensors if _FUSED_GATE_UP.match(n)]:
        prefix = _FUSED_GATE_UP.match(name).group(1)
        _split_rows(tensors, name, {f"{prefix}.gate_proj.weight": config.intermediate_size,
                                    f"{prefix}.up_proj.weight": config.intermediate_size})
    return drop_unused_tensors(reorder_partial_rotary(tensors, config), config)
