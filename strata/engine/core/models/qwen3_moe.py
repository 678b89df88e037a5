"""Qwen3-MoE: Qwen3 attention; sparse expert MLPs except on `mlp_only_layers`."""

from __future__ import annotations

from torch import nn

from strata.engine.core.loader.lazy import LazyTensor
from strata.engine.core.model_config import ModelConfig
from strata.engine.core.models.decoder import DecoderLM, drop_unused_tensors
from strata.engine.core.models.layers import Attention, SwiGLU
from strata.engine.core.models.switch import SparseMoE, rename, stack_experts


def is_sparse_layer(config: ModelConfig, layer_idx: int) -> bool:
    """Whether layer `layer_idx` has experts (the rule of the reference implementation)."""
    return (
        layer_idx not in config.mlp_only_layers
        and config.num_experts > 0
        and (layer_idx + 1) % config.decoder_sparse_step == 0
    )


def _mlp(config: ModelConfig, layer_idx: int) -> nn.Module:
    if is_sparse_layer(config, layer_idx):
        return SparseMoE(
            config.hidden_size,
            config.moe_intermediate_size,
            config.num_experts,
            config.num_experts_per_tok,
            config.norm_topk_prob,
        )
    return SwiGLU(config.hidden_size, config.intermediate_size)


class Model(DecoderLM):
    def __init__(self, config: ModelConfig):
        super().__init__(
            config,
            make_attention=lambda i: Attention(
                config, config.attention_bias, config.attention_bias, qk_norm=True
            ),
            make_mlp=lambda i: _mlp(config, i),
        )


def sanitize(tensors: dict[str, LazyTensor], config: ModelConfig) -> dict[str, LazyTensor]:
    """Router `mlp.gate` -> `mlp.router`; per-expert or fused expert tensors -> stacked."""
    tensors = rename(tensors, [(r"\.mlp\.gate\.weight$", ".mlp.router.weight")])
    return stack_experts(drop_unused_tensors(tensors, config), config.num_experts)
