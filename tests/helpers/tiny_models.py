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
    # 6 layers: the 5 local to 1 global pattern once; a window of 8 tokens, far shorter than
    # the tests' prompts; both RoPE bases, the global one scaled; a query scale other than
    # 1/sqrt(head_dim); soft-capped logits.
    "gemma3": (
        "Gemma3TextConfig",
        {
            "num_hidden_layers": 6,
            "head_dim": 16,
            "sliding_window": 8,
            "sliding_window_pattern": 6,
            "query_pre_attn_scalar": 24,
            "final_logit_softcapping": 30.0,
            "rope_parameters": {
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
        },
    ),
    # Phi-4's shape: fused qkv and gate_up in the file, full RoPE, untied head.
    "phi3": ("Phi3Config", {"sliding_window": None}),
    # Phi-4-mini's: 3/4 of each head rotated, LongRoPE, tied embeddings. Prompt and greedy
    # tokens (60) stay within the pre-training context (64): transformers' generate re-encodes
    # its whole cache on crossing it, which Strata does not (test_phi3.py checks the long
    # factors and the crossing against transformers' forward).
    "phi3_partial_longrope": ("Phi3Config", {
        "sliding_window": None, "tie_word_embeddings": True, "partial_rotary_factor": 0.75,
        "original_max_position_embeddings": 64,
        "rope_scaling": {"type": "longrope",
                         "short_factor": [1.0, 1.1, 1.3, 1.7, 2.2, 3.0],
                         "long_factor": [1.5, 2.5, 4.0, 6.5, 9.0, 14.0]}}),
    # head_dim 32 given explicitly, not hidden / heads (16), as in Mistral Small 3.x.
    "mistral": ("MistralConfig", {"head_dim": 32, "sliding_window": None}),
    # Ministral 3's: YaRN whose original context (8) is also the period of Llama 4's query
    # temperature, far shorter than the prompts, so the queries' scale reaches 1 + 0.5 ln 8;
    # mscale over mscale_all_dim as released (a YaRN attention factor of 1).
    "ministral3": ("Ministral3Config", {
        "head_dim": 32, "sliding_window": None,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                            "original_max_position_embeddings": 8, "beta_fast": 32.0,
                            "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                            "llama_4_scaling_beta": 0.5}}),
    # GLM-4.5's shape: layer 0 dense, then sigmoid-routed MoE with a correction bias in 2
    # groups (1 used), routed scaling, a shared expert, q/k/v biases, q/k norm, half-rotary
    # RoPE; 3 layers so two are sparse.
    "glm4_moe": (
        "Glm4MoeConfig",
        {
            "num_hidden_layers": 3,
            "head_dim": 16,
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "n_shared_experts": 1,
            "first_k_dense_replace": 1,
            "n_group": 2,
            "topk_group": 1,
            "routed_scaling_factor": 2.5,
            "norm_topk_prob": True,
            "attention_bias": True,
            "use_qk_norm": True,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                "partial_rotary_factor": 0.5},
        },
    ),
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

# Variants whose norm weights are drawn at random instead of transformers' constant init, so
# a norm applied as w instead of (1 + w) (or a GGUF's 1 + w not undone) changes the logits.
_RANDOM_NORM_VARIANTS = {"gemma3"}


def make_tiny_hf_config(variant: str, overrides: dict | None = None):
    """The transformers config of a tiny model variant (see VARIANTS), with overrides
    (e.g. more layers) on top."""
    import transformers

    if variant not in VARIANTS:
        raise ValueError(f"unknown tiny model variant {variant!r}; known: {', '.join(VARIANTS)}")
    class_name, extra = VARIANTS[variant]
    return getattr(transformers, class_name)(**{**_COMMON, **extra, **(overrides or {})})


def randomize_routing_biases(model) -> None:
    """transformers initialises GLM's e_score_correction_bias to zeros, which would let a
    model that ignores it pass; seeded values as large as the sigmoid scores' spread make it
    change the chosen experts."""
    generator = torch.Generator().manual_seed(99)
    for name, buffer in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buffer.copy_(torch.rand(buffer.shape, generator=generator) * 0.5)


def make_tiny_hf_model(model_type: str, tmp_path: Path, seed: int = 0,
                       overrides: dict | None = None, **save_kwargs):
    """Build a seeded random float32 transformers model, save it (safetensors) under tmp_path.

    `model_type` is a variant name from VARIANTS (a plain model_type or a named variant);
    overrides: config values on top of it. Returns (directory, model in eval mode).
    """
    import transformers

    config = make_tiny_hf_config(model_type, overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_norms(model, model_type)
    randomize_routing_biases(model)
    model.eval()
    directory = Path(tmp_path) / model_type
    model.save_pretrained(directory, **save_kwargs)
    return directory, model


@torch.no_grad()
def randomize_norms(model, variant: str) -> None:
    """Draw a _RANDOM_NORM_VARIANTS model's norm weights at random (seeded by the caller)."""
    if variant not in _RANDOM_NORM_VARIANTS:
        return
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.normal_(0.0, 0.3)


def save_tiny_mistral3(path, text_variant: str):
    """A tiny Mistral3ForConditionalGeneration (Pixtral vision, the text model of
    make_tiny_hf_config(text_variant)) saved to path, as Mistral 3 checkpoints ship; the
    transformers model (eval mode)."""
    import transformers

    text = make_tiny_hf_config(text_variant)
    vision = transformers.PixtralVisionConfig(hidden_size=32, intermediate_size=64,
                                              num_hidden_layers=1, num_attention_heads=2,
                                              image_size=32, patch_size=8, head_dim=16)
    config = transformers.Mistral3Config(text_config=text.to_dict(),
                                         vision_config=vision.to_dict(), image_token_index=10,
                                         tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.Mistral3ForConditionalGeneration(config).eval()
    model.save_pretrained(path)
    return model


@torch.no_grad()
def save_scripted_hf_model(variant: str, directory: Path, next_token: dict[int, int],
                           vocab_size: int) -> None:
    """A tiny model of `variant` whose greedy next token depends on the last token alone:
    next_token[last], for a fixed output script through the real engine. Attention and MLP
    outputs are zero, so each position keeps its own embedding (one-hot for a script token)
    and the head maps it to its successor."""
    import transformers

    config = make_tiny_hf_config(variant, {"vocab_size": vocab_size, "tie_word_embeddings": False,
                                           "max_position_embeddings": 2048})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    tokens = sorted(set(next_token))
    if len(tokens) > config.hidden_size:
        raise ValueError(f"{len(tokens)} script tokens need a hidden size of at least that")
    zeroed = [p for name, p in model.named_parameters()
              if name.endswith(("o_proj.weight", "down_proj.weight"))]
    assert zeroed, f"{variant} has no o_proj / down_proj to silence"
    for param in zeroed:
        param.zero_()
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    head.zero_()
    for dim, token in enumerate(tokens):
        embed[token] = 0.0
        embed[token, dim] = 1.0
        head[next_token[token], dim] = 4.0  # logit 4 * sqrt(hidden) after the final norm
    model.save_pretrained(directory)
