"""Small ModelConfigs the fast-path tests share: TINY_CONFIGS for float32 parity on the CPU,
SMALL_CONFIGS for bf16 on a GPU (wide enough for the Triton and cuBLAS paths to engage)."""

from __future__ import annotations

from strata.engine.core.model_config import ModelConfig

_TINY = {"vocab_size": 96, "hidden_size": 64, "intermediate_size": 80,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 16, "max_position_embeddings": 512}
TINY_CONFIGS = {
    "llama": ModelConfig(model_type="llama", **_TINY),
    "qwen2": ModelConfig(model_type="qwen2", attention_bias=True, **_TINY),
    "qwen3": ModelConfig(model_type="qwen3", tie_word_embeddings=True, **_TINY),
    "qwen3_moe": ModelConfig(model_type="qwen3_moe", num_experts=6, num_experts_per_tok=2,
                             moe_intermediate_size=24, mlp_only_layers=(0,), **_TINY),
    "mixtral": ModelConfig(model_type="mixtral", num_experts=4, num_experts_per_tok=2,
                           moe_intermediate_size=32, **_TINY),
    # Gemma 3's shape: sandwich norms, (1 + w) norms, GeGLU, scaled embeddings, its own query
    # scale and soft-capped logits; local layers (a window of 5, which prompts of 21 cut) at
    # their own RoPE base, the last layer global with linear-scaled RoPE. Untied (Gemma ties):
    # tied, the scaled embedding of the last token wins every random greedy pick.
    "gemma3": ModelConfig(
        model_type="gemma3_text", sliding_window=5, query_pre_attn_scalar=24,
        final_logit_softcapping=30.0, rope_local_theta=10000.0, rope_theta=1e6,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
        hidden_activation="gelu_pytorch_tanh",
        layer_types=("sliding_attention", "sliding_attention", "full_attention"),
        **{**_TINY, "num_hidden_layers": 3}),
    # Ministral 3's: YaRN and Llama 4's query temperature, both over an original context of
    # 8 tokens, so prompts of 21 reach a query scale of 1 + 0.5 ln 3 and decoding past 24 of
    # 1 + 0.5 ln 4.
    "ministral3": ModelConfig(
        model_type="ministral3", rope_theta=1e6,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                      "mscale": 1.0, "mscale_all_dim": 1.0,
                      "original_max_position_embeddings": 8},
        llama4_scaling_beta=0.5, llama4_scaling_period_tokens=8, **_TINY),
    # GLM-4.5's MoE: sigmoid routing with its correction bias in one group (as GLM-4.5,
    # 4.5-Air and 4.6 ship; tiny_models.py's variant has 2), routed scaling, a shared
    # expert; q/k/v biases, q/k norm, half-rotary RoPE.
    "glm4_moe": ModelConfig(model_type="glm4_moe", num_experts=8, num_experts_per_tok=2,
                            moe_intermediate_size=24, mlp_only_layers=(0,),
                            routed_scaling_factor=2.5, n_shared_experts=1,
                            attention_bias=True, use_qk_norm=True, partial_rotary_factor=0.5,
                            **_TINY),
    # GPT-OSS's MoE: a biased router, softmax over the top-4 logits, biased experts with the
    # clamped SwiGLU (a low limit, so the clamp binds at std 0.15), 64 wide so that an MXFP4
    # row of either projection is whole 2-byte words (34 bytes); attention sinks.
    "gpt_oss": ModelConfig(model_type="gpt_oss", num_experts=8, num_experts_per_tok=4,
                           moe_intermediate_size=64, attention_bias=True, swiglu_limit=0.5,
                           **_TINY),
}


_SMALL = {"vocab_size": 512, "hidden_size": 256, "intermediate_size": 384,
          "num_hidden_layers": 3, "num_attention_heads": 8, "num_key_value_heads": 2,
          "head_dim": 32, "max_position_embeddings": 40000}
SMALL_CONFIGS = {
    "llama": ModelConfig(model_type="llama", **_SMALL),
    "qwen3_moe": ModelConfig(model_type="qwen3_moe", num_experts=16, num_experts_per_tok=4,
                             moe_intermediate_size=128, **_SMALL),
}
