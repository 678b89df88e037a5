"""GGUF tensor names -> Strata's canonical (Hugging Face) names, and llama's Q/K un-permute.

The GGUF names are not hand-written here: each canonical name is pushed through the `gguf`
package's own HF->GGUF map (the one llama.cpp's converter uses) and the result is inverted.
"""

from __future__ import annotations

import re

import gguf
import numpy as np

from strata.engine.core.model_config import ModelConfig

# general.architecture -> model_type (llama with experts is mixtral; see load_gguf_config).
GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3moe": "qwen3_moe",
                      "gemma3": "gemma3_text",
                      "phi3": "phi3",
                      "mistral3": "ministral3",
                      "glm4moe": "glm4_moe",
                      "gpt-oss": "gpt_oss"}

# The canonical MoE names differ from every HF checkpoint, so they are looked up in the gguf map
# through a name it knows; the dict says which (canonical suffix -> name the map understands).
_MOE_PROBE_NAMES = {
    "mlp.router.weight": "mlp.gate.weight",
    "mlp.experts.gate_proj": "mlp.experts.gate_proj",
    "mlp.experts.up_proj": "mlp.experts.up_proj",
    "mlp.experts.down_proj": "mlp.experts.down_proj",
    # The converter renames HF's e_score_correction_bias to e_score_correction.bias first.
    "mlp.e_score_correction_bias": "mlp.gate.e_score_correction.bias",
}
_SHARED_EXPERT = [f"mlp.shared_experts.{x}_proj.weight" for x in ("gate", "up", "down")]
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.")
# gpt-oss's router and expert biases (ffn_gate_inp.bias, ffn_{gate,up,down}_exps.bias).
_BIAS_PROBE_NAMES = {
    "mlp.router.bias": "mlp.gate.bias",
    "mlp.expert_bias.gate": "mlp.experts.gate_proj.bias",
    "mlp.expert_bias.up": "mlp.experts.up_proj.bias",
    "mlp.expert_bias.down": "mlp.experts.down_proj.bias",
}
# Canonical names whose GGUF tensor the converter gives a ".weight" the map does not know.
_WEIGHT_ADDED = ("self_attn.sinks",)

# Old Mixtral GGUFs (before llama.cpp stacked experts) store one tensor per expert.
_PER_EXPERT_RE = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)\.(\d+)\.weight$")
_PER_EXPERT_PROJ = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}

# Tensors a GGUF may carry that are folded into the config instead (llama3 rope factors).
# Phi-3/4's LongRoPE factors likewise (load_gguf_config reads them).
IGNORED_GGUF_TENSORS = frozenset({"rope_freqs.weight", "rope_factors_long.weight",
                                  "rope_factors_short.weight"})


def is_moe_layer(config: ModelConfig, layer: int) -> bool:
    """Whether decoder layer `layer` has a sparse MoE block (HF's qwen3_moe rule)."""
    if not config.is_moe or layer in config.mlp_only_layers:
        return False
    return (layer + 1) % config.decoder_sparse_step == 0


def canonical_names(config: ModelConfig) -> list[str]:
    """Every tensor name a GGUF of this config holds, in canonical names before the
    architecture's sanitize() (phi3's fused ones), in a stable order."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not config.tie_word_embeddings:
        names.append("lm_head.weight")
    has_qk_norm = config.model_type in ("qwen3", "qwen3_moe", "gemma3_text") or config.use_qk_norm
    has_sandwich_norms = config.model_type == "gemma3_text"
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        if has_sandwich_norms:
            names += [p + "pre_feedforward_layernorm.weight",
                      p + "post_feedforward_layernorm.weight"]
        if config.model_type == "phi3":  # stored fused; phi3.sanitize splits them
            names += [p + "self_attn.qkv_proj.weight", p + "self_attn.o_proj.weight"]
        else:
            names += [p + f"self_attn.{x}_proj.weight" for x in "qkvo"]
        if config.attention_bias:
            names += [p + f"self_attn.{x}_proj.bias" for x in "qkv"]
        if has_qk_norm:
            names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
        if config.model_type == "gpt_oss":
            names += [p + "self_attn.o_proj.bias", p + "self_attn.sinks", p + "mlp.router.bias"]
            names += [p + f"mlp.expert_bias.{x}" for x in ("gate", "up", "down")]
        if is_moe_layer(config, i):
            names += [p + suffix for suffix in _MOE_PROBE_NAMES
                      if config.moe_scoring == "sigmoid" or "e_score" not in suffix]
            if config.n_shared_experts:
                names += [p + suffix for suffix in _SHARED_EXPERT]
        elif config.model_type == "phi3":
            names += [p + "mlp.gate_up_proj.weight", p + "mlp.down_proj.weight"]
        else:
            names += [p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
    return names


def gguf_arch_enum(arch_name: str) -> gguf.MODEL_ARCH:
    """The gguf package's MODEL_ARCH for a `general.architecture` string."""
    for arch, name in gguf.MODEL_ARCH_NAMES.items():
        if name == arch_name:
            return arch
    raise KeyError(arch_name)


def gguf_to_canonical(arch_name: str, config: ModelConfig) -> dict[str, str]:
    """Map GGUF tensor name -> canonical name for every tensor this config needs."""
    name_map = gguf.get_tensor_name_map(gguf_arch_enum(arch_name), config.num_hidden_layers)
    # qwen3moe's map lists no dense FFN (released models have none), but HF's mlp_only_layers
    # can make some layers dense; their tensors use the generic llama names.
    fallback_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    result: dict[str, str] = {}
    for canonical in canonical_names(config):
        probe = canonical
        for suffix, probe_suffix in {**_MOE_PROBE_NAMES, **_BIAS_PROBE_NAMES}.items():
            if canonical.endswith(suffix):
                probe = canonical[: -len(suffix)] + probe_suffix
        # The map keys have no .weight/.bias; try_suffixes carries the suffix across.
        gguf_name = name_map.get_name(probe, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            gguf_name = fallback_map.get_name(probe, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise KeyError(f"the gguf name map has no entry for {probe}")
        if canonical.startswith("model.layers.") and ".mlp.experts." in canonical:
            gguf_name += ".weight"  # stacked experts: the GGUF keeps .weight, canonical drops it
        if canonical.endswith(_WEIGHT_ADDED):
            gguf_name += ".weight"
        result[gguf_name] = canonical
    return result


def block_index(gguf_name: str) -> int | None:
    """The decoder block a GGUF tensor belongs to (blk.N.*), or None for the others."""
    m = _BLOCK_RE.match(gguf_name)
    return int(m.group(1)) if m else None


def per_expert_target(gguf_name: str) -> tuple[str, int] | None:
    """For an old-style per-expert tensor: (canonical stacked name, expert index), else None."""
    m = _PER_EXPERT_RE.match(gguf_name)
    if m is None:
        return None
    layer, proj, expert = m.groups()
    return f"model.layers.{layer}.mlp.experts.{_PER_EXPERT_PROJ[proj]}", int(expert)


def unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (convert_hf_to_gguf.py `LlamaModel.permute`).

    The converter turns each head's rows from HF's half-split RoPE order [x0..x(d/2-1),
    x(d/2)..] into interleaved pairs; this is the inverse, so the result equals the HF tensor.
    Works for weights [rows, in] and biases [rows].
    """
    rows = weight.shape[0]
    if rows % (2 * num_heads):
        raise ValueError(f"{rows} rows cannot be split into {num_heads} heads of pairs")
    half = rows // num_heads // 2
    return (
        weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )
