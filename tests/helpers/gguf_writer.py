"""Write a GGUF file from a tiny transformers model, laid out the way llama.cpp's
convert_hf_to_gguf.py would (permuted llama Q/K, stacked experts, 1-D tensors kept in F32).

Test helper: the oracle for the GGUF loader is "load(write(hf)) == hf".
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT

from strata.engine.core.loader.gguf_rope import llama3_freqs
from tests.helpers.quant_blocks import random_blocks

_ARCH_FOR_MODEL_TYPE = {
    "llama": "llama",
    "mixtral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3moe",
    "gemma3_text": "gemma3",
    "phi3": "phi3",
    "mistral": "llama",  # llama.cpp writes Mistral Small 3.x / Devstral as llama
    "ministral3": "mistral3",
    "glm4_moe": "glm4moe",
    "gpt_oss": "gpt-oss",
}


def permute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's `LlamaModel.permute`: HF half-split RoPE rows -> interleaved pairs."""
    half = weight.shape[0] // num_heads // 2
    return (
        weight.reshape(num_heads, 2, half, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )


def _encode(values: np.ndarray, qtype: QT, rng: np.random.Generator,
            random_scale: float = 0.02) -> tuple[np.ndarray, QT]:
    """Quantize with the gguf package; 1-D tensors stay F32 and rows that do not fill whole
    blocks fall back to F16, as the converter does. Types the gguf package cannot quantize
    (K-quants, IQ*) get random valid blocks (finite scales about random_scale) of the right
    size."""
    if values.ndim == 1 or qtype == QT.F32:
        return values.astype(np.float32), QT.F32
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    if qtype == QT.F16 or values.shape[-1] % block_size:
        return values.astype(np.float16), QT.F16
    try:
        return gguf.quants.quantize(values, qtype), qtype
    except NotImplementedError:
        byte_shape = (*values.shape[:-1], values.shape[-1] // block_size * type_size)
        rows = int(np.prod(values.shape[:-1]))
        blocks = random_blocks(qtype, rows, values.shape[-1], int(rng.integers(1 << 31)),
                               scale=random_scale)
        return blocks.reshape(byte_shape), qtype


def _hf_tensors_in_gguf_order(hf_model: Any, arch: str) -> dict[str, np.ndarray]:
    """HF state dict -> {gguf name: float32 array}, experts split and llama Q/K permuted."""
    cfg = hf_model.config
    name_map = gguf.get_tensor_name_map(
        next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch), cfg.num_hidden_layers
    )
    llama_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg.num_hidden_layers)
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    out: dict[str, np.ndarray] = {}
    for name, tensor in hf_model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        values = tensor.detach().float().numpy().copy()
        if arch == "gpt-oss" and (".mlp.experts." in name or name.endswith(".sinks")):
            out.update(_gpt_oss_tensor(name, values, name_map))
            continue
        if name.endswith("mlp.experts.gate_up_proj"):  # transformers 5 fuses [E, 2I, H]
            base = name[: -len("gate_up_proj")]
            gate, up = np.split(values, 2, axis=1)
            out[name_map.get_name(base + "gate_proj") + ".weight"] = gate
            out[name_map.get_name(base + "up_proj") + ".weight"] = up
            continue
        if name.endswith("mlp.experts.down_proj"):
            out[name_map.get_name(name) + ".weight"] = values
            continue
        if name.endswith("e_score_correction_bias"):  # the converter's own rename
            name = name.replace("e_score_correction_bias", "e_score_correction.bias")
        # mistral3's converter is llama's (conversion/mistral3.py), permutation included.
        if arch in ("llama", "mistral3") and (".q_proj." in name or ".k_proj." in name):
            values = permute_rope_rows(values, heads if ".q_proj." in name else kv_heads)
        suffixes = (".weight", ".bias")
        # Dense layers of a qwen3moe (mlp_only_layers) are missing from its map: generic names.
        gguf_name = name_map.get_name(name, suffixes) or llama_map.get_name(name, suffixes)
        if gguf_name is None:
            raise KeyError(f"no GGUF name for {name}")
        out[gguf_name] = values
    return out


def _add_glm4moe_keys(writer: gguf.GGUFWriter, cfg: Any, head_dim: int, rope: dict,
                      num_mtp_layers: int) -> None:
    """The hyper-parameters llama.cpp's Glm4MoeModel converter writes beyond the common ones."""
    writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 0.5)))
    writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    writer.add_expert_shared_count(cfg.n_shared_experts)
    writer.add_leading_dense_block_count(cfg.first_k_dense_replace)
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    writer.add_expert_weights_scale(cfg.routed_scaling_factor)
    writer.add_expert_weights_norm(bool(cfg.norm_topk_prob))
    if cfg.n_group > 1:  # the converter omits these: every published GLM-4.5 has one group
        writer.add_expert_group_count(cfg.n_group)
        writer.add_expert_group_used_count(cfg.topk_group)
    if num_mtp_layers:
        writer.add_nextn_predict_layers(num_mtp_layers)


def _mtp_block(tensors: dict[str, np.ndarray], block: int, hidden: int,
               rng: np.random.Generator) -> dict[str, np.ndarray]:
    """A GLM next-token-prediction block: a copy of the last decoder block's tensors under
    blk.{block} plus its nextn.* tensors, as the converter writes them from model.layers.L."""
    last = f"blk.{block - 1}."
    out = {f"blk.{block}." + name[len(last):]: values.copy()
           for name, values in tensors.items() if name.startswith(last)}
    nextn = {"eh_proj": (hidden, 2 * hidden), "enorm": (hidden,), "hnorm": (hidden,),
             "shared_head_norm": (hidden,)}
    for name, shape in nextn.items():
        out[f"blk.{block}.nextn.{name}.weight"] = rng.standard_normal(shape).astype(np.float32)
    return out


def gpt_oss_experts_to_gguf(name: str, values: np.ndarray) -> dict[str, np.ndarray]:
    """A gpt-oss expert tensor of transformers' layout -> {canonical stacked name: array} the
    way llama.cpp's converter splits it: gate_up [E, H, 2I] (gate at even columns) -> gate and
    up [E, I, H]; down [E, I, H] -> [E, H, I]; biases split the same way. Names are
    transformers' with gate_proj/up_proj/down_proj[.bias]."""
    base = name[: name.rindex(".") + 1]
    if name.endswith("gate_up_proj"):
        return {base + "gate_proj": np.ascontiguousarray(values[:, :, 0::2].transpose(0, 2, 1)),
                base + "up_proj": np.ascontiguousarray(values[:, :, 1::2].transpose(0, 2, 1))}
    if name.endswith("gate_up_proj_bias"):
        return {base + "gate_proj.bias": np.ascontiguousarray(values[:, 0::2]),
                base + "up_proj.bias": np.ascontiguousarray(values[:, 1::2])}
    if name.endswith("down_proj"):
        return {base + "down_proj": np.ascontiguousarray(values.transpose(0, 2, 1))}
    return {base + "down_proj.bias": values}


def _gpt_oss_tensor(name: str, values: np.ndarray, name_map) -> dict[str, np.ndarray]:
    if name.endswith(".sinks"):
        return {name_map.get_name(name) + ".weight": values}
    out = {}
    for split_name, split in gpt_oss_experts_to_gguf(name, values).items():
        gguf_name = name_map.get_name(split_name, (".weight", ".bias"))
        out[gguf_name if split_name.endswith(".bias") else gguf_name + ".weight"] = split
    return out


def _split_experts(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """blk.N.ffn_gate_exps.weight [E, I, H] -> blk.N.ffn_gate.{e}.weight [I, H] (old layout)."""
    out: dict[str, np.ndarray] = {}
    for name, values in tensors.items():
        if "_exps." not in name:
            out[name] = values
            continue
        base = name.replace("_exps.weight", "")
        for expert, expert_values in enumerate(values):
            out[f"{base}.{expert}.weight"] = expert_values
    return out


def _add_longrope(writer: gguf.GGUFWriter, tensors: dict[str, np.ndarray], cfg: Any,
                  rope: dict) -> None:
    """Phi-3/4 LongRoPE as llama.cpp's converter stores it: the two factor sets as F32
    tensors, the pre-training context and the attention factor it derives as metadata."""
    import math

    original = rope.get("original_max_position_embeddings") or cfg.original_max_position_embeddings
    factor = cfg.max_position_embeddings / original
    attn_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    writer.add_rope_scaling_orig_ctx_len(original)
    writer.add_rope_scaling_attn_factors(attn_factor)
    tensors["rope_factors_long.weight"] = np.asarray(rope["long_factor"], np.float32)
    tensors["rope_factors_short.weight"] = np.asarray(rope["short_factor"], np.float32)


def _add_tokenizer(writer: gguf.GGUFWriter, tokenizer: Any, vocab_size: int) -> None:
    """gpt2-style BPE vocabulary, padded to the model's vocab size like the converter does."""
    id_to_token = {i: t for t, i in tokenizer.get_vocab().items()}
    special_ids = set(tokenizer.all_special_ids)
    tokens, types = [], []
    for i in range(vocab_size):
        if i in id_to_token:
            tokens.append(id_to_token[i])
            types.append(gguf.TokenType.CONTROL if i in special_ids else gguf.TokenType.NORMAL)
        else:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in merges]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    if tokenizer.bos_token_id is not None:
        writer.add_bos_token_id(tokenizer.bos_token_id)
    if tokenizer.eos_token_id is not None:
        writer.add_eos_token_id(tokenizer.eos_token_id)
    if getattr(tokenizer, "chat_template", None):
        writer.add_chat_template(tokenizer.chat_template)


def write_gguf_from_hf(
    hf_model: Any,
    hf_tokenizer: Any | None,
    out_path: str | Path,
    qtype: str = "F16",
    *,
    qtype_overrides: dict[str, str] | None = None,
    architecture: str | None = None,
    per_expert_tensors: bool = False,
    seed: int = 0,
    random_scale: float = 0.02,
    mtp_layers: bool = True,
    edit_tensors: Callable[[dict[str, np.ndarray]], None] | None = None,
) -> Path:
    """Write `hf_model` (a transformers *ForCausalLM) as a GGUF file of quant type `qtype`.

    `qtype_overrides` maps GGUF tensor names to another type (e.g. "IQ2_XXS" written raw);
    `architecture` overrides general.architecture (to test refusal of other archs);
    `per_expert_tensors` writes experts one tensor each, as llama.cpp did before March 2024.
    `mtp_layers`: for glm4_moe, append the multi-token-prediction block the converter writes
    (random values: Strata skips it).
    `edit_tensors` may change the {gguf name: float32 array} dict before it is written (to
    make a damaged file: a tensor dropped or of the wrong shape).
    `random_scale`: the fp16 scales of the random blocks written for K- and I-quants (0.02
    makes large random weights; 1e-4 keeps a wide model's activations moderate).
    `edit_tensors` may change the {gguf name: float32 array} dict before it is written (drop
    or reshape a tensor: damaged files).
    """
    cfg = hf_model.config
    arch = _ARCH_FOR_MODEL_TYPE[cfg.model_type]
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(out_path), architecture or arch)
    writer.arch = arch  # hyper-parameter keys keep the real arch prefix
    writer.add_name(f"tiny-{cfg.model_type}")
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    rope = dict(getattr(cfg, "rope_parameters", None) or {})
    if arch == "gemma3":  # per layer type; the GGUF keeps the global layers' (llama.cpp)
        rope = dict(rope["full_attention"])
    rope_theta = float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))
    # GLM's converter appends its multi-token-prediction layers as extra blocks.
    num_mtp_layers = int(getattr(cfg, "num_nextn_predict_layers", 0) or 0) if mtp_layers else 0
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers + num_mtp_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(rope_theta)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    if arch in ("llama", "mistral3"):
        writer.add_rope_dimension_count(head_dim)
    if arch == "phi3":  # partial RoPE: the rotated dims; LongRoPE: the factor tensors below
        writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
        if getattr(cfg, "sliding_window", None):
            writer.add_sliding_window(cfg.sliding_window)
    if arch == "glm4moe":
        _add_glm4moe_keys(writer, cfg, head_dim, rope, num_mtp_layers)
    num_experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", 0) or 0
    if num_experts:
        writer.add_expert_count(num_experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
        if cfg.model_type == "qwen3_moe":
            writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
            writer.add_expert_weights_norm(bool(cfg.norm_topk_prob))
        if cfg.model_type == "gpt_oss":
            writer.add_expert_feed_forward_length(cfg.intermediate_size)
            writer.add_sliding_window(cfg.sliding_window)
    if rope.get("rope_type") in ("linear", "yarn"):
        writer.add_rope_scaling_type(gguf.RopeScalingType(rope["rope_type"]))
        writer.add_rope_scaling_factor(rope["factor"])
        if "original_max_position_embeddings" in rope:
            writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    if arch == "mistral3":  # conversion/mistral3.py on top of the base converter's YaRN keys
        writer.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        writer.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
        writer.add_rope_scaling_yarn_log_mul(rope["mscale_all_dim"])
        writer.add_attn_temperature_scale(rope["llama_4_scaling_beta"])
    if arch == "gemma3":
        if cfg.sliding_window:
            writer.add_sliding_window(cfg.sliding_window)
        if cfg.final_logit_softcapping:
            writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
    if hf_tokenizer is not None:
        _add_tokenizer(writer, hf_tokenizer, cfg.vocab_size)

    tensors = _hf_tensors_in_gguf_order(hf_model, arch)
    if arch == "gemma3":  # the converter stores Gemma's norms as 1 + w (Gemma3Model.norm_shift)
        tensors = {name: values + 1.0 if name.endswith("norm.weight") else values
                   for name, values in tensors.items()}
    if num_mtp_layers:
        tensors.update(_mtp_block(tensors, cfg.num_hidden_layers, cfg.hidden_size, rng))
    if rope.get("rope_type") == "llama3":
        tensors["rope_freqs.weight"] = llama3_freqs(rope, rope_theta, head_dim)
    if rope.get("rope_type") == "longrope":
        _add_longrope(writer, tensors, cfg, rope)
    if per_expert_tensors:
        tensors = _split_experts(tensors)
    if edit_tensors is not None:
        edit_tensors(tensors)
    overrides = qtype_overrides or {}
    for name, values in tensors.items():
        # Biases stay F32 whatever their rank (gpt-oss's expert biases are [E, N]).
        default = "F32" if name.endswith(".bias") else qtype
        data, written = _encode(values, QT[overrides.get(name, default)], rng, random_scale)
        writer.add_tensor(name, data, raw_dtype=written if data.dtype == np.uint8 else None)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(out_path)


# A Q4_K_M-like mix on a tiny Llama: Q4_K, with Q6_K v, one down and the head, Q8_0 the
# other down (every dp4a type in one file).
Q4_K_M_LIKE_OVERRIDES = {"blk.0.attn_v.weight": "Q6_K", "blk.0.ffn_down.weight": "Q6_K",
                         "blk.1.ffn_down.weight": "Q8_0", "output.weight": "Q6_K"}


def write_tiny_q4_k_m_like_llama(out_path: str | Path, head_dim: int | None = None) -> Path:
    """A tiny random Llama (hidden and intermediate 256: whole K-quant blocks) as a GGUF
    of Q4_K_M_LIKE_OVERRIDES' mix; block scales of 1e-4 keep its activations moderate.
    head_dim 64 (4 heads of 64): o_proj's 256 inputs are whole Q4_K blocks too."""
    import torch
    import transformers

    from tests.helpers.tiny_models import make_tiny_hf_config

    config = make_tiny_hf_config("llama")
    config.hidden_size = config.intermediate_size = 256
    if head_dim is not None:
        config.head_dim = head_dim
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    return write_gguf_from_hf(model, None, out_path, "Q4_K", random_scale=1e-4,
                              qtype_overrides=Q4_K_M_LIKE_OVERRIDES)


def write_tiny_q4_k_m_like_moe(out_path: str | Path):
    """(path, HF config) of a tiny random Qwen3-MoE (hidden and intermediate 256: whole
    K-quant blocks) as a Q8_0 GGUF whose experts take Q4_K_M's types (gate and up Q4_K,
    down Q6_K)."""
    import torch
    import transformers

    from tests.helpers.tiny_models import make_tiny_hf_config

    config = make_tiny_hf_config("qwen3_moe")
    config.hidden_size = config.intermediate_size = config.moe_intermediate_size = 256
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    mix = {f"blk.{i}.ffn_{p}_exps.weight": q for i in range(config.num_hidden_layers)
           for p, q in (("gate", "Q4_K"), ("up", "Q4_K"), ("down", "Q6_K"))}
    return write_gguf_from_hf(model, None, out_path, "Q8_0", qtype_overrides=mix), config
