"""`--random-weights CONFIG`: a model of any supported shape with seeded random weights.

For benchmarks of real-sized models where no weights can be downloaded. Parameters are created
directly on the target device in the target dtype and filled there (normal(0, std), norms at 1),
so a 30B-parameter model never has a host float32 copy. CONFIG is a preset name or the path of
a Hugging Face config.json.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from strata.engine.core.model_config import ModelConfig, ModelFormatError
from strata.engine.core.models.registry import model_module

DEFAULT_STD = 0.02

# Hugging Face config.json values of the published models (shapes only). No model hub is
# reachable where these were written: gpt-oss, Gemma 3 and Phi-4 are from memory of the
# published config.json files (openai/gpt-oss-20b, google/gemma-3-27b-it's and -1b-it's
# text_config, microsoft/phi-4, microsoft/Phi-4-mini-instruct), checked against the published
# GGUF files' sizes (tests/bench/test_random_gguf_families.py). Phi-4-mini's LongRoPE factors
# are placeholders (1.0): they change its RoPE frequencies, not its work.
PRESETS: dict[str, dict[str, Any]] = {
    "smollm2-135m": {
        "model_type": "llama", "vocab_size": 49152, "hidden_size": 576,
        "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
        "num_key_value_heads": 3, "head_dim": 64, "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0},
        "max_position_embeddings": 8192, "tie_word_embeddings": True,
    },
    "llama3-8b": {
        "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-5,
        "rope_parameters": {
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "max_position_embeddings": 131072, "tie_word_embeddings": False,
    },
    "qwen3-30b-a3b": {
        "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048,
        "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
        "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
        "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
        "rms_norm_eps": 1e-6, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
        "max_position_embeddings": 40960, "tie_word_embeddings": False,
    },
    "glm-4.5-air": {
        "model_type": "glm4_moe", "vocab_size": 151552, "hidden_size": 4096,
        "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_hidden_layers": 46,
        "num_attention_heads": 96, "num_key_value_heads": 8, "head_dim": 128,
        "n_routed_experts": 128, "num_experts_per_tok": 8, "n_shared_experts": 1,
        "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
        "routed_scaling_factor": 1.0, "attention_bias": True, "use_qk_norm": False,
        "rms_norm_eps": 1e-5, "max_position_embeddings": 131072, "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6,
                            "partial_rotary_factor": 0.5},
    },
    "gpt-oss-20b": {
        "model_type": "gpt_oss", "vocab_size": 201088, "hidden_size": 2880,
        "intermediate_size": 2880, "num_hidden_layers": 24, "num_attention_heads": 64,
        "num_key_value_heads": 8, "head_dim": 64, "num_local_experts": 32,
        "num_experts_per_tok": 4, "attention_bias": True, "sliding_window": 128,
        "rms_norm_eps": 1e-5, "swiglu_limit": 7.0, "max_position_embeddings": 131072,
        "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                            "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                            "original_max_position_embeddings": 4096},
    },
    "gemma-3-27b": {  # the text model of the multimodal checkpoint
        "model_type": "gemma3_text", "vocab_size": 262208, "hidden_size": 5376,
        "intermediate_size": 21504, "num_hidden_layers": 62, "num_attention_heads": 32,
        "num_key_value_heads": 16, "head_dim": 128, "query_pre_attn_scalar": 168,
        "sliding_window": 1024, "sliding_window_pattern": 6, "rope_theta": 1e6,
        "rope_local_base_freq": 10000.0, "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        "rms_norm_eps": 1e-6, "max_position_embeddings": 131072, "tie_word_embeddings": True,
    },
    "gemma-3-1b": {
        "model_type": "gemma3_text", "vocab_size": 262144, "hidden_size": 1152,
        "intermediate_size": 6912, "num_hidden_layers": 26, "num_attention_heads": 4,
        "num_key_value_heads": 1, "head_dim": 256, "query_pre_attn_scalar": 256,
        "sliding_window": 512, "sliding_window_pattern": 6, "rope_theta": 1e6,
        "rope_local_base_freq": 10000.0, "rope_scaling": None, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 32768, "tie_word_embeddings": True,
    },
    # transformers' Ministral3Config defaults, which are mistralai/Ministral-3-8B-Base-2512's
    # text model (8.4B parameters by its model card).
    "ministral-3-8b": {
        "model_type": "ministral3", "vocab_size": 131072, "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 34, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 262144, "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 16.0,
                            "original_max_position_embeddings": 16384, "beta_fast": 32.0,
                            "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                            "llama_4_scaling_beta": 0.1},
    },
    "phi-4": {
        "model_type": "phi3", "vocab_size": 100352, "hidden_size": 5120,
        "intermediate_size": 17920, "num_hidden_layers": 40, "num_attention_heads": 40,
        "num_key_value_heads": 10, "rms_norm_eps": 1e-5, "rope_theta": 250000.0,
        "max_position_embeddings": 16384, "original_max_position_embeddings": 16384,
        "rope_scaling": None, "tie_word_embeddings": False,
    },
    "phi-4-mini": {
        "model_type": "phi3", "vocab_size": 200064, "hidden_size": 3072,
        "intermediate_size": 8192, "num_hidden_layers": 32, "num_attention_heads": 24,
        "num_key_value_heads": 8, "partial_rotary_factor": 0.75, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "max_position_embeddings": 131072,
        "original_max_position_embeddings": 4096, "sliding_window": 262144,
        "rope_scaling": {"type": "longrope", "long_factor": [1.0] * 48,
                         "short_factor": [1.0] * 48},
        "tie_word_embeddings": True,
    },
}


def random_weights_hf_config(name_or_path: str) -> dict[str, Any]:
    """The Hugging Face config dict of a preset name or a config.json path."""
    if name_or_path in PRESETS:
        return dict(PRESETS[name_or_path])
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ModelFormatError(
            f"--random-weights {name_or_path!r} is neither a preset ({', '.join(PRESETS)}) nor "
            "a config.json file: pass one of those"
        )
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelFormatError(f"cannot read {path}: {exc}; pass a valid config.json") from exc


def random_weights_config(name_or_path: str) -> ModelConfig:
    """The ModelConfig of a preset name or a config.json path."""
    return ModelConfig.from_hf_dict(random_weights_hf_config(name_or_path))


def parameter_bytes(config: ModelConfig, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes the model's parameters take in `dtype` (computed on the meta device, no memory)."""
    with torch.device("meta"):
        model = model_module(config.model_type).Model(config)
    element_bytes = torch.empty((), dtype=dtype).element_size()
    return sum(p.numel() for p in model.parameters()) * element_bytes


def build_random_model(
    config: ModelConfig,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    std: float = DEFAULT_STD,
) -> torch.nn.Module:
    """The architecture's Model with seeded random weights made on `device` in `dtype`.

    Same seed, device and dtype give the same weights. Norm weights are 1, everything else is
    normal(0, std), which keeps a deep random model's activations finite in bf16.
    """
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ModelFormatError("random weights on cuda were asked for but no CUDA GPU is here; "
                               "use --device cpu")
    with torch.device("meta"):
        model = model_module(config.model_type).Model(config)
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    state = {}
    for name, meta_param in model.named_parameters():
        tensor = torch.empty(meta_param.shape, dtype=dtype, device=device)
        if name.endswith("norm.weight"):
            tensor.fill_(1.0)
        else:
            tensor.normal_(0.0, std, generator=generator)
        state[name] = tensor
    model.load_state_dict(state, strict=True, assign=True)
    model.to(device)  # the non-persistent RoPE buffer, built on the CPU
    model.requires_grad_(False)
    model.eval()
    return model
