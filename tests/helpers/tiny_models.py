"""Tiny random transformers models saved as Hugging Face directories, for parity tests."""

from __future__ import annotations

from pathlib import Path

import torch

# Shared shape: 2 layers, hidden 64, 4 query heads over 2 KV heads (GQA), vocab 320.
_COMMON = {
    "vocab_size": 320,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    # Wider than the default 0.02 so logits are far apart and greedy picks are not coin flips.
    "initializer_range": 0.25,
    "bos_token_id": None,
    "eos_token_id": None,
    "pad_token_id": None,
}

_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # Small, so every band of the llama3 scaling (kept, smoothed, slowed) has frequencies.
    "original_max_position_embeddings": 32,
}

# variant -> (transformers config class name, extra config keys)
VARIANTS: dict[str, tuple[str, dict]] = {
    "llama": ("LlamaConfig", {}),
    "llama_llama3_rope": ("LlamaConfig", {"rope_parameters": _LLAMA3_ROPE}),
    "smollm2": ("LlamaConfig", {"tie_word_embeddings": True}),
    "qwen2": ("Qwen2Config", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}),
    "qwen3": ("Qwen3Config", {"head_dim": 32, "tie_word_embeddings": True}),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        {
            "head_dim": 16,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
        },
    ),
    # Layer 0 dense, layer 1 sparse without renormalised routing.
    "qwen3_moe_mixed": (
        "Qwen3MoeConfig",
        {
            "head_dim": 16,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "norm_topk_prob": False,
            "mlp_only_layers": [0],
        },
    ),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    # Sliding layers (0 and 2) see 8 positions, fewer than the parity prompts; YaRN with a
    # small original context so every band of its ramp has frequencies; sinks and biases.
    "gpt_oss": (
        "GptOssConfig",
        {
            "num_hidden_layers": 3,
            "head_dim": 16,
            "num_local_experts": 8,
            "num_experts_per_tok": 4,
            "intermediate_size": 32,
            "sliding_window": 8,
            "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0,
                                "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                "original_max_position_embeddings": 64},
        },
    ),
}


def make_tiny_hf_config(variant: str):
    """The transformers config of a tiny model variant (see VARIANTS)."""
    import transformers

    if variant not in VARIANTS:
        raise ValueError(f"unknown tiny model variant {variant!r}; known: {', '.join(VARIANTS)}")
    class_name, extra = VARIANTS[variant]
    return getattr(transformers, class_name)(**{**_COMMON, **extra})


def make_tiny_hf_model(model_type: str, tmp_path: Path, seed: int = 0, **save_kwargs):
    """Build a seeded random float32 transformers model, save it (safetensors) under tmp_path.

    `model_type` is a variant name from VARIANTS (a plain model_type or a named variant).
    Returns (directory, model in eval mode).
    """
    import transformers

    config = make_tiny_hf_config(model_type)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval()
    directory = Path(tmp_path) / model_type
    model.save_pretrained(directory, **save_kwargs)
    return directory, model
