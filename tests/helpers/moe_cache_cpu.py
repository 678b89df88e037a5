"""The tiny Qwen3-MoE the CPU expert-cache tests decode over (float32, random weights): the
config, prompt and greedy sampling, and the build over an --expert-cache setting. The CUDA
tests' model is moe_cache_cuda.py, with the same names."""

from __future__ import annotations

import torch

from strata.engine.core.memory.backend import backend_for
from strata.engine.core.model_config import ModelConfig
from strata.engine.core.residency import ModelMemory
from strata.engine.core.weight_source import RandomWeights
from strata.engine.protocol import SamplingSpec

E, TOP_K, NUM_LAYERS = 8, 2, 3
CONFIG = ModelConfig(model_type="qwen3_moe", vocab_size=96, hidden_size=64, intermediate_size=80,
                     num_hidden_layers=NUM_LAYERS, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=16, max_position_embeddings=256, num_experts=E,
                     num_experts_per_tok=TOP_K, moe_intermediate_size=24)
GREEDY = SamplingSpec(max_tokens=64, temperature=0.0)
PROMPT = [(7 * i + 3) % 96 for i in range(13)]


def build_on_cpu(config: ModelConfig, expert_cache: str):
    """(ModelMemory, model) of random float32 weights on the CPU with that --expert-cache
    setting ("all", or a slot count for a partial cache); close the memory after."""
    memory = ModelMemory(backend_for("cpu"), torch.float32)
    # A wide std keeps greedy picks far from ties between paths.
    model = memory.build(config, RandomWeights(torch.device("cpu"), std=0.15), expert_cache)
    return memory, model
