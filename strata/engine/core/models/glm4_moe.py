"""GLM-4.5 / GLM-4.6 (glm4_moe): the first layers dense, the rest sigmoid-routed MoE with a
shared expert; q/k/v biases, optional q/k norm, RoPE on the first half of each head.

The routing (score-correction bias, groups, routed scaling) and the shared expert live in the
shared MoE layer (switch.py), so the expert cache serves these experts as it does Qwen3-MoE's.
"""

from __future__ import annotations

import logging
import re

from torch import nn

from strata.engine.core.loader.lazy import LazyTensor
from strata.engine.core.model_config import ModelConfig
from strata.engine.core.models.decoder import DecoderLM, drop_unused_tensors
from strata.engine.core.models.layers import Attention, SwiGLU, reorder_partial_rotary
from strata.engine.core.models.switch import Routing, SparseMoE, rename, stack_experts

log = logging.getLogger(__name__)

_RENAMES = [
    (r"\.mlp\.gate\.weight$", ".mlp.router.weight"),
    (r"\.mlp\.gate\.e_score_correction_bias$", ".mlp.e_score_correction_bias"),
]
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")


def _mlp(config: ModelConfig, layer_idx: int) -> nn.Module:
    if layer_idx in config.mlp_only_layers:  # the first first_k_dense_replace layers
        return SwiGLU(config.hidden_size, config.intermediate_size)
    return SparseMoE(
        config.hidden_size,
        config.moe_intermediate_size,
        config.num_experts,
        config.num_experts_per_tok,
        config.norm_topk_prob,
        Routing("sigmoid", config.routed_scaling_factor, config.n_group, config.topk_group),
        shared_intermediate_size=config.moe_intermediate_size * config.n_shared_experts,
    )


class Model(DecoderLM):
    def __init__(self, config: ModelConfig):
        super().__init__(
            config,
            # GLM puts biases on q/k/v only (attention_bias), never on o_proj.
            make_attention=lambda i: Attention(
                config, config.attention_bias, o_bias=False, qk_norm=config.use_qk_norm
            ),
            make_mlp=lambda i: _mlp(config, i),
        )


def drop_mtp_layers(tensors: dict, config: ModelConfig) -> dict:
    """Remove the multi-token-prediction layers published checkpoints carry past
    num_hidden_layers (model.layers.46 of GLM-4.5-Air): Strata does not draft with them."""
    extra = [n for n in tensors
             if (m := _LAYER_RE.match(n)) and int(m.group(1)) >= config.num_hidden_layers]
    if extra:
        layers = sorted({int(_LAYER_RE.match(n).group(1)) for n in extra})  # type: ignore[union-attr]
        log.info("dropping %d tensors of the MTP (next-token prediction) layers %s: "
                 "not used for decoding", len(extra), layers)
        for name in extra:
            del tensors[name]
    return tensors


def sanitize(tensors: dict[str, LazyTensor], config: ModelConfig) -> dict[str, LazyTensor]:
    """MTP layers dropped; router `mlp.gate` -> `mlp.router` and its correction bias; per-expert
    or fused expert tensors -> stacked (the shared expert keeps its own names)."""
    tensors = rename(drop_mtp_layers(tensors, config), _RENAMES)
    tensors = reorder_partial_rotary(drop_unused_tensors(tensors, config), config)
    return stack_experts(tensors, config.num_experts)
