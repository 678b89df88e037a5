"""The shape of a model, independent of the file format it came from."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from strata.errors import StrataError

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe", "mixtral", "gemma3_text", "phi3",
                         "mistral", "ministral3", "glm4_moe", "gpt_oss")

# Gemma3TextConfig's defaults: released config.json files (the multimodal ones' text_config
# above all) leave out every value equal to them.
_GEMMA3_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216,
    "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
    "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6,
    "max_position_embeddings": 131_072, "query_pre_attn_scalar": 256, "sliding_window": 4096,
    "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0, "sliding_window_pattern": 6,
    "tie_word_embeddings": True, "bos_token_id": 2, "eos_token_id": 1,
}

# Multimodal wrappers whose text_config is a supported language model: the language model
# loads alone (its sanitize drops the vision tower and projector tensors).
TEXT_CONFIG_WRAPPERS = ("mistral3",)

log = logging.getLogger(__name__)


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
    # GLM-4.5 (glm4_moe): sigmoid routing whose expert choice adds a score-correction bias,
    # grouped top-k, routed weights scaled, shared experts beside the routed ones.
    moe_scoring: str = "softmax"  # softmax | sigmoid
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    n_shared_experts: int = 0
    use_qk_norm: bool = False  # glm4_moe's optional per-head q/k RMSNorm
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # Gemma 3: "sliding_attention" / "full_attention" per layer (empty: all full), the local
    # layers' RoPE base, the attention scale's 1/sqrt(query_pre_attn_scalar) (None:
    # head_dim), tanh soft-capped logits, the MLP's gate.
    layer_types: tuple[str, ...] = field(default_factory=tuple)
    rope_local_theta: float = 10000.0
    query_pre_attn_scalar: float | None = None
    final_logit_softcapping: float | None = None
    hidden_activation: str = "silu"
    # The leading fraction of each head that RoPE rotates (Phi-4-mini 0.75, GLM 0.5). Below 1 the
    # architecture's sanitize() puts the rotated dims in half-split order around the rest
    # (layers.partial_rotary_rows), so every kernel sees a full-width RoPE whose extra
    # frequencies are zero (cos 1, sin 0: those dims pass through unchanged).
    partial_rotary_factor: float = 1.0
    # The window (tokens, the query's own included) attention sees: on the "sliding_attention"
    # layers where layer_types names them (Gemma 3, GPT-OSS), else on every layer (Phi-3,
    # Mistral),
    # where the engine caps its context at the window, in which full attention is exact.
    # None: every position.
    sliding_window: int | None = None
    # gpt_oss's clamped SwiGLU in the experts: gate * sigmoid(alpha * gate) * (up + 1).
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    # Ministral 3 / Devstral 2 (Llama 4's attention temperature): after RoPE the queries at
    # position p are scaled by 1 + beta * ln(1 + floor(p / period)), exactly 1 within the
    # first period (the pre-training context). beta 0: no scaling.
    llama4_scaling_beta: float = 0.0
    llama4_scaling_period_tokens: int = 0

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
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ModelFormatError(
                f"partial_rotary_factor {self.partial_rotary_factor} of head_dim {self.head_dim} "
                "does not give an even number of rotated dims: the config is inconsistent"
            )
        if self.moe_scoring not in ("softmax", "sigmoid"):
            raise ModelFormatError(f"MoE scoring {self.moe_scoring!r} is not softmax or sigmoid")
        if self.num_experts and (self.n_group < 1 or self.num_experts % self.n_group
                                 or not 0 < self.topk_group <= self.n_group):
            raise ModelFormatError(
                f"{self.num_experts} experts cannot be split into n_group {self.n_group} groups "
                f"of which topk_group {self.topk_group} are used: the config is inconsistent"
            )
        if self.layer_types and len(self.layer_types) != self.num_hidden_layers:
            raise ModelFormatError(
                f"layer_types names {len(self.layer_types)} layers but the model has "
                f"{self.num_hidden_layers}: the config is inconsistent"
            )
        if self.llama4_scaling_beta and self.llama4_scaling_period_tokens <= 0:
            raise ModelFormatError(
                f"llama_4_scaling_beta {self.llama4_scaling_beta} needs a positive original "
                "context (original_max_position_embeddings): the config is inconsistent")
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise ModelFormatError("sliding_attention layers need a sliding_window: the config "
                                   "is inconsistent")

    def is_sliding_layer(self, layer: int) -> bool:
        """Whether decoder layer `layer` attends over a sliding window (Gemma 3's local ones)."""
        return bool(self.layer_types) and self.layer_types[layer] == "sliding_attention"

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def rotary_dim(self) -> int:
        """How many leading dims of each head RoPE rotates (head_dim unless partial)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face config.json dict."""
        model_type = d.get("model_type", "")
        if model_type in TEXT_CONFIG_WRAPPERS and isinstance(d.get("text_config"), dict):
            text = d["text_config"]
            log.info("%s is a multimodal model: loading its %s language model only (no "
                     "images)", model_type, text.get("model_type", "mistral"))
            # transformers 5 ties the head by the wrapper's flag where it has one.
            tied = {k: d[k] for k in ("tie_word_embeddings",) if k in d}
            return cls.from_hf_dict({"model_type": "mistral", **text, **tied})
        is_gemma3 = model_type in ("gemma3", "gemma3_text")
        if is_gemma3:
            d = gemma3_text_dict(d)
            model_type = "gemma3_text"
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelFormatError(
                f"unsupported architecture {model_type!r}: Strata runs "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}; pick a model of one of those families"
            )
        heads = d["num_attention_heads"]
        num_experts = d.get("num_experts") or d.get("num_local_experts") or \
            d.get("n_routed_experts") or 0
        mlp_only_layers = tuple(d.get("mlp_only_layers") or ())
        if model_type == "glm4_moe":  # the first layers are dense; the rest all sparse
            mlp_only_layers = tuple(range(d.get("first_k_dense_replace", 1)))
        # transformers 5 writes rope_theta and the scaling inside `rope_parameters`.
        rope_params = d.get("rope_parameters") or {}
        rope_theta = d.get("rope_theta") or rope_params.get("rope_theta") or 10000.0
        rope_scaling = d.get("rope_scaling")
        # Ministral3Config's own default still says "type" (transformers standardizes it).
        if rope_scaling is None and rope_params.get(
                "rope_type", rope_params.get("type", "default")) != "default":
            rope_scaling = dict(rope_params)
        # Ministral 3 keeps its query temperature beside YaRN's parameters.
        llama4_beta = float(rope_params.get("llama_4_scaling_beta") or 0.0) \
            if model_type == "ministral3" else 0.0
        if rope_scaling is not None and rope_scaling.get(
                "rope_type", rope_scaling.get("type")) == "longrope":
            # Phi-3/4 keep the pre-training context beside rope_scaling, not inside it.
            rope_scaling = {"original_max_position_embeddings":
                            d.get("original_max_position_embeddings"), **rope_scaling}
        partial_rotary = d.get("partial_rotary_factor") or rope_params.get(
            "partial_rotary_factor") or (0.5 if model_type == "glm4_moe" else 1.0)
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
            attention_bias=d.get("attention_bias", model_type == "qwen2")
            and model_type != "phi3",
            num_experts=num_experts,
            num_experts_per_tok=d.get("num_experts_per_tok", 0) or 0,
            moe_intermediate_size=d.get("moe_intermediate_size", d.get("intermediate_size", 0))
            if num_experts
            else 0,
            norm_topk_prob=d.get("norm_topk_prob", model_type == "mixtral"),
            decoder_sparse_step=d.get("decoder_sparse_step", 1) or 1,
            mlp_only_layers=mlp_only_layers,
            moe_scoring="sigmoid" if model_type == "glm4_moe" else "softmax",
            routed_scaling_factor=float(d.get("routed_scaling_factor") or 1.0),
            n_group=int(d.get("n_group") or 1),
            topk_group=int(d.get("topk_group") or 1),
            n_shared_experts=int(d.get("n_shared_experts") or 0) if num_experts else 0,
            use_qk_norm=bool(d.get("use_qk_norm", False)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            # Only where the model reads them: Qwen2/3 configs list layer_types and a window
            # too (all full unless use_sliding_window, which Strata's Qwen does not implement).
            layer_types=layer_types if is_gemma3 or (sliding and model_type == "gpt_oss") else (),
            sliding_window=(d.get("sliding_window") or None)
            if is_gemma3 or model_type in ("phi3", "mistral", "ministral3") or (sliding and
            model_type == "gpt_oss") else None,
            rope_local_theta=d.get("rope_local_base_freq", 10000.0),
            query_pre_attn_scalar=d.get("query_pre_attn_scalar"),
            final_logit_softcapping=d.get("final_logit_softcapping"),
            hidden_activation=d.get("hidden_activation") or d.get("hidden_act") or "silu",
            partial_rotary_factor=float(partial_rotary),
            swiglu_alpha=d.get("swiglu_alpha", 1.702),
            swiglu_limit=d.get("swiglu_limit", 7.0),
            llama4_scaling_beta=llama4_beta,
            llama4_scaling_period_tokens=int(
                rope_params.get("original_max_position_embeddings") or 0) if llama4_beta else 0,
        )


def hf_text_model_type(d: dict[str, Any]) -> str:
    """The model_type Strata builds for a config.json: a multimodal Gemma 3's text model
    ("gemma3" with a text_config) is "gemma3_text", a TEXT_CONFIG_WRAPPERS one's is its
    text_config's; others as written."""
    model_type = str(d.get("model_type", "unknown"))
    if model_type in TEXT_CONFIG_WRAPPERS and isinstance(d.get("text_config"), dict):
        return str(d["text_config"].get("model_type", "mistral"))
    return "gemma3_text" if model_type == "gemma3" else model_type


def gemma3_text_dict(d: dict[str, Any]) -> dict[str, Any]:
    """A Gemma 3 config.json (text, or multimodal: its text_config) as one flat dict of the
    keys from_hf_dict reads, Gemma3TextConfig's defaults filled in and both RoPE layouts
    (transformers 5's rope_parameters per layer type, older rope_theta/rope_local_base_freq/
    rope_scaling) read; layer_types from sliding_window_pattern where absent."""
    if d.get("model_type") == "gemma3":  # the token ids live at the top level
        ids = {key: d[key] for key in ("bos_token_id", "eos_token_id") if key in d}
        d = {**ids, **(d.get("text_config") or {}), "model_type": "gemma3_text"}
    if d.get("attn_logit_softcapping"):
        raise ModelFormatError("attn_logit_softcapping is set: Strata runs Gemma 3, which has "
                               "none (Gemma 2 has it and is not supported)")
    if d.get("use_bidirectional_attention"):
        raise ModelFormatError("use_bidirectional_attention is set: that is an embedding "
                               "model, which Strata does not run")
    out = {**_GEMMA3_TEXT_DEFAULTS, **d}  # an explicit null stays null, as in transformers
    per_type = d.get("rope_parameters") or {}
    full, local = per_type.get("full_attention"), per_type.get("sliding_attention")
    if full is not None:
        out["rope_theta"] = full.get("rope_theta", out["rope_theta"])
        out["rope_scaling"] = full if full.get("rope_type", "default") != "default" else None
    if local is not None:
        if local.get("rope_type", "default") != "default":
            raise ModelFormatError("the sliding layers' RoPE is scaled "
                                   f"({local.get('rope_type')}): Strata runs plain local RoPE")
        out["rope_local_base_freq"] = local.get("rope_theta", out["rope_local_base_freq"])
    out.pop("rope_parameters", None)
    if not d.get("layer_types"):
        period = int(out["sliding_window_pattern"])
        out["layer_types"] = [
            "full_attention" if (i + 1) % period == 0 or not out["sliding_window"]
            else "sliding_attention" for i in range(int(out["num_hidden_layers"]))
        ]
    if out["hidden_activation"] not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ModelFormatError(f"hidden_activation {out['hidden_activation']!r}: Strata runs "
                               "Gemma 3's tanh-approximated GELU only")
    return out
