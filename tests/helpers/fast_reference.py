"""Tiny random models of TINY_CONFIGS and the reference forward's greedy tokens and logits, for
the CPU parity tests of the fast paths (test_fast_paths.py, test_fast_families.py)."""

from __future__ import annotations

import torch

from strata.engine.core.kv_cache import KVCache
from strata.engine.core.model_config import ModelConfig
from strata.engine.core.random_weights import build_random_model
from tests.helpers.fast_configs import TINY_CONFIGS as CONFIGS


def tiny_model(name: str, seed: int = 0):
    # A wide std keeps logits far apart, so greedy picks are not coin flips between paths.
    model = build_random_model(CONFIGS[name], "cpu", torch.float32, seed=seed, std=0.15)
    if name == "gemma3":
        # Gemma's norms apply 1 + w: random w, so a norm applied as w (or 1 + w twice) shows.
        gen = torch.Generator().manual_seed(seed + 100)
        for param_name, param in model.named_parameters():
            if param_name.endswith("norm.weight"):
                param.data.copy_(torch.randn(param.shape, generator=gen) * 0.5)
    return model


def tiny_gpt_oss(seed: int = 0):
    """A tiny GPT-OSS (random weights): sinks large enough to matter, windows of 5 on layers
    0 and 2 (GPT-OSS's alternation), q/k/v/o biases, YaRN."""
    from tests.helpers.fast_configs import _TINY

    config = ModelConfig(
        model_type="gpt_oss", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
        sliding_window=5, attention_bias=True, swiglu_limit=7.0, swiglu_alpha=1.702,
        rope_theta=150000.0,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                      "truncate": False, "original_max_position_embeddings": 64},
        **{**_TINY, "num_hidden_layers": 3})
    model = build_random_model(config, "cpu", torch.float32, seed=seed, std=0.15)
    gen = torch.Generator().manual_seed(seed + 100)
    for layer in model.model.layers:
        layer.self_attn.sinks.data.copy_(torch.randn(4, generator=gen) * 2)
    return model


def reference_greedy(model, prompt: list[int], num_new: int, max_tokens: int):
    """Tokens and per-step logits from the reference forward, one token at a time."""
    kv = KVCache.for_config(model.config, max_tokens)
    with torch.inference_mode():
        logits = model(torch.tensor(prompt), 0, kv)[-1]
        tokens, all_logits = [], [logits]
        for i in range(num_new):
            tokens.append(int(logits.argmax()))
            if i + 1 < num_new:
                logits = model(torch.tensor(tokens[-1:]), len(prompt) + i, kv)[-1]
                all_logits.append(logits)
    return tokens, all_logits
