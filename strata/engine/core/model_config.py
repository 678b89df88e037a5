"""The shape of a model, independent of the file format it came from."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from strata.errors import StrataError

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe", "mixtral", "gpt_oss")


class ModelFormatError(StrataError, ValueError):
    """A model file or directory that Strata cannot use; the message says what to do."""


@dataclass(frozen=True)
class ModelConfig:
    """Architecture hyper-parameters in Hugging Face naming (config.json keys)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # Hugging Face rope_scaling dict (llama3 / linear / yarn ...), None for plain RoPE.
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # qwen2 has q/k/v biases
    # MoE (qwen3_moe, mixtral); zero for dense models.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = field(default_factory=tuple)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # Sliding-window attention (gpt_oss): layer i attends over its last `sliding_window`
    # positions where layer_types[i] == "sliding_attention"; () means every layer is full.
    sliding_window: int = 0
    layer_types: tuple[str, ...] = field(default_factory=tuple)
    # gpt_oss's clamped SwiGLU in the experts: gate * sigmoid(alpha * gate) * (up + 1).
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelFormatError(
                f"unsupported architecture {self.model_type!r}: Strata runs "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}; pick a model of one of those families"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelFormatError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}: the config is inconsistent"
            )

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face config.json dict."""
        model_type = d.get("model_type", "")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelFormatError(
                f"unsupported architecture {model_type!r}: Strata runs "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}; pick a model of one of those families"
            )
        heads = d["num_attention_heads"]
        num_experts = d.get("num_experts", d.get("num_local_experts", 0)) or 0
        # transformers 5 writes rope_theta and the scaling inside `rope_parameters`.
        rope_params = d.get("rope_parameters") or {}
        rope_theta = d.get("rope_theta") or rope_params.get("rope_theta") or 10000.0
        rope_scaling = d.get("rope_scaling")
        if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
            rope_scaling = dict(rope_params)
        layer_types = tuple(d.get("layer_types") or ())
        if model_type == "gpt_oss" and not layer_types:  # transformers' default: even layers
            layer_types = tuple("sliding_attention" if i % 2 == 0 else "full_attention"
                                for i in range(d["num_hidden_layers"]))
        sliding = "sliding_attention" in layer_types
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return cls(
            model_type=model_type,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d.get("intermediate_size", 0),
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            rms_norm_eps=d.get("rms_norm_eps", 1e-5),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            tie_word_embeddings=d.get("tie_word_embeddings", False),
            attention_bias=d.get("attention_bias", model_type == "qwen2"),
            num_experts=num_experts,
            num_experts_per_tok=d.get("num_experts_per_tok", 0) or 0,
            moe_intermediate_size=d.get("moe_intermediate_size", d.get("intermediate_size", 0))
            if num_experts
            else 0,
            norm_topk_prob=d.get("norm_topk_prob", model_type == "mixtral"),
            decoder_sparse_step=d.get("decoder_sparse_step", 1) or 1,
            mlp_only_layers=tuple(d.get("mlp_only_layers") or ()),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            # Kept only where some layer slides: transformers 5 writes all-"full_attention"
            # layer_types (and an unused window) for every model.
            sliding_window=(d.get("sliding_window") or 0) if sliding else 0,
            layer_types=layer_types if sliding else (),
            swiglu_alpha=d.get("swiglu_alpha", 1.702),
            swiglu_limit=d.get("swiglu_limit", 7.0),
        )
