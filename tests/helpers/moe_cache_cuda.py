"""The small Qwen3-MoE the CUDA expert-cache tests decode over (bf16, wide enough for the
Triton paths): the config, prompt and greedy sampling, with moe_cache_cpu.py's names. Build it
with tests/gpu/gpu_helpers.build_with_expert_cache."""

from __future__ import annotations

import torch

from strata.engine.core.model_config import ModelConfig
from strata.engine.protocol import SamplingSpec

E, TOP_K, NUM_LAYERS = 16, 2, 3
CONFIG = ModelConfig(model_type="qwen3_moe", vocab_size=512, hidden_size=256,
                     intermediate_size=384, num_hidden_layers=NUM_LAYERS, num_attention_heads=8,
                     num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
                     num_experts=E, num_experts_per_tok=TOP_K, moe_intermediate_size=128)
GREEDY = SamplingSpec(max_tokens=64, temperature=0.0)
PROMPT = [(11 * i + 5) % 512 for i in range(40)]


def settle(promotion) -> None:
    """Collect the last step's ids and land every copy (a test's wait, never decode's)."""
    for _ in range(2):
        torch.cuda.synchronize()
        promotion.before_step()
