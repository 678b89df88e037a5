"""Mixtral: Llama attention; every layer a sparse MoE with renormalised top-k routing."""

from __future__ import annotations

from strata.engine.core.loader.lazy import LazyTensor
from strata.engine.core.model_config import ModelConfig
from strata.engine.core.models.decoder import DecoderLM, drop_unused_tensors
from strata.engine.core.models.layers import Attention
from strata.engine.core.models.switch import SparseMoE, rename, stack_experts

# On disk: block_sparse_moe.experts.{e}.w1 (gate), w3 (up), w2 (down); router block_sparse_moe.gate.
# transformers 5 in memory: mlp.experts.gate_up_proj / down_proj (stacked), router mlp.gate.
_RENAMES = [
    (r"\.block_sparse_moe\.experts\.(\d+)\.w1\.weight$", r".mlp.experts.\1.gate_proj.weight"),
    (r"\.block_sparse_moe\.experts\.(\d+)\.w3\.weight$", r".mlp.experts.\1.up_proj.weight"),
    (r"\.block_sparse_moe\.experts\.(\d+)\.w2\.weight$", r".mlp.experts.\1.down_proj.weight"),
    (r"\.block_sparse_moe\.gate\.weight$", ".mlp.router.weight"),
    (r"\.mlp\.gate\.weight$", ".mlp.router.weight"),
]


class Model(DecoderLM):
    def __init__(self, config: ModelConfig):
        super().__init__(
            config,
            make_attention=lambda i: Attention(config, False, False, qk_norm=False),
            # Mixtral always renormalises the top-k probabilities; config.json has no switch.
            make_mlp=lambda i: SparseMoE(
                config.hidden_size,
                config.moe_intermediate_size,
                config.num_experts,
                config.num_experts_per_tok,
                norm_topk_prob=True,
            ),
        )


def sanitize(tensors: dict[str, LazyTensor], config: ModelConfig) -> dict[str, LazyTensor]:
    """Mixtral names (w1/w3/w2, block_sparse_moe) -> canonical stacked expert tensors."""
    tensors = rename(tensors, _RENAMES)
    return stack_experts(drop_unused_tensors(tensors, config), config.num_experts)
