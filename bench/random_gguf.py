"""Write a random-weight preset as a GGUF file both llama.cpp and Strata load, for peer rows.

    python bench/random_gguf.py PRESET OUT.gguf [--type Q4_K_M|Q8_0|IQ2_XXS|MXFP4_MOE|Q4_0_QAT
                                                        |F16|BF16] [--layers N] [--tiny]

The same shapes as strata's `--random-weights` presets (strata.engine.core.random_weights):
llama (llama3-8b, smollm2-135m), qwen3moe (qwen3-30b-a3b), gpt-oss (gpt-oss-20b), gemma3
(gemma-3-27b, gemma-3-1b), glm4moe (glm-4.5-air) and phi3 (phi-4, phi-4-mini), with the
tensor names and metadata keys llama.cpp's converter writes: the names are Strata's GGUF
loader's own map (loader/gguf_names.py) run backwards, the shapes those of Strata's model
built on the meta device. --type picks the mix of GGML types as llama-quantize makes it
(gguf_mix.py): quantized tensors are random valid blocks written directly, no float weights
and no llama-quantize; values have std 0.02, norms are 1. --layers N keeps the first N
layers (a bf16 Qwen3-30B-A3B is 61 GB); --tiny keeps the family's structure at a tiny width
(tiny_config), for CPU smoke runs. The vocabulary is SentencePiece-style placeholder pieces:
llama-bench feeds random token ids, so only its size and its special and byte tokens matter.
Q/K rows are not permuted into llama.cpp's RoPE layout: with random weights that changes no
timing. GLM files carry no multi-token-prediction block (nothing decodes with it). Each
type's tensors repeat one pool of random bytes (gguf_pools.py), and tensors are written one
at a time, so a model never sits in RAM whole.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout, for strata
sys.path.insert(0, str(Path(__file__).resolve().parent))  # gguf_mix.py, gguf_pools.py

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf_mix import FILE_TYPES, ModelShape, tensor_type
from gguf_pools import RepeatedBytes, byte_pool, row_bytes

from strata.engine.core.loader.gguf_names import GGUF_ARCHITECTURES, gguf_to_canonical
from strata.engine.core.model_config import ModelConfig
from strata.engine.core.random_weights import random_weights_config
from tests.helpers.gguf_writer import _add_glm4moe_keys, _add_longrope

NUM_BYTE_TOKENS = 256
# model_type -> GGUF arch: the loader's map inverted (mixtral and mistral are llama files with
# other shapes, not written here).
ARCHITECTURES = {model_type: arch for arch, model_type in GGUF_ARCHITECTURES.items()}
# --tiny: the width every family shrinks to (whole 256-value blocks, so every mix's types
# stay as at full size); at most 4 experts (8 is Mixtral's special case in llama-quantize).
_TINY = {"vocab_size": 1024, "hidden_size": 256, "intermediate_size": 512,
         "num_attention_heads": 4, "head_dim": 64, "moe_intermediate_size": 256,
         "max_position_embeddings": 4096}
_TINY_EXPERTS = 4


def tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """GGUF tensor name -> shape (numpy order: [rows, cols], experts [E, rows, cols]) of every
    tensor llama.cpp's converter writes for this config."""
    import torch

    from strata.engine.core.models.registry import model_module

    with torch.device("meta"):
        model = model_module(config.model_type).Model(config)
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    q_rows = config.num_attention_heads * config.head_dim
    kv_rows = config.num_key_value_heads * config.head_dim
    fused = {"self_attn.qkv_proj.weight": (q_rows + 2 * kv_rows, config.hidden_size),  # phi3
             "mlp.gate_up_proj.weight": (2 * config.intermediate_size, config.hidden_size)}
    out = {}
    for gguf_name, canonical in gguf_to_canonical(ARCHITECTURES[config.model_type],
                                                  config).items():
        suffix = canonical.split(".", 3)[-1]
        out[gguf_name] = shapes[canonical] if canonical in shapes else fused[suffix]
    return out


def tensor_types(config: ModelConfig, mix: str) -> dict[str, QT]:
    """GGUF tensor name -> GGML type in a file of `mix` (llama-quantize's choice)."""
    shape = ModelShape(config.num_hidden_layers, config.num_experts,
                       config.num_attention_heads // config.num_key_value_heads,
                       config.tie_word_embeddings)
    return {name: tensor_type(mix, name, dims, shape)
            for name, dims in tensor_shapes(config).items()}


def stored_bytes(config: ModelConfig, mix: str) -> int:
    """Bytes of tensor data a file of `mix` holds (the file is a few MB more: vocabulary)."""
    types, total = tensor_types(config, mix), 0
    for name, shape in tensor_shapes(config).items():
        block_size, block_bytes = gguf.GGML_QUANT_SIZES[types[name]]
        total += int(np.prod(shape, dtype=np.int64)) // block_size * block_bytes
    return total


def _vocabulary(vocab_size: int) -> tuple[list[str], list[int]]:
    """<unk>, <s>, </s>, the 256 byte tokens, then placeholder pieces up to vocab_size."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(NUM_BYTE_TOKENS)]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    types += [gguf.TokenType.BYTE] * NUM_BYTE_TOKENS
    if vocab_size < len(tokens):
        raise ValueError(f"a vocabulary of {vocab_size} cannot hold the {len(tokens)} special "
                         "and byte tokens")
    tokens += [f"\u2581piece{i}" for i in range(len(tokens), vocab_size)]
    types += [gguf.TokenType.NORMAL] * (vocab_size - len(types))
    return tokens, types


def _add_metadata(writer: gguf.GGUFWriter, config: ModelConfig, name: str,
                  mix: str) -> dict[str, np.ndarray]:
    """The keys llama.cpp's converter writes for this architecture (those its loader and
    Strata's read); returns the float tensors the converter derives from the config (Phi's
    LongRoPE factors), written before the model's own."""
    arch = ARCHITECTURES[config.model_type]
    writer.add_name(name)
    writer.add_file_type(FILE_TYPES[mix])
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    if arch in ("llama", "mistral3", "phi3"):  # phi3: the rotated dims of its partial RoPE
        writer.add_rope_dimension_count(config.rotary_dim)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    if config.is_moe and arch != "glm4moe":
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if arch == "glm4moe":  # the tests' writer's keys (the converter's Glm4MoeModel)
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        glm = SimpleNamespace(
            moe_intermediate_size=config.moe_intermediate_size,
            n_shared_experts=config.n_shared_experts,
            first_k_dense_replace=len(config.mlp_only_layers),
            routed_scaling_factor=config.routed_scaling_factor,
            norm_topk_prob=config.norm_topk_prob, n_group=config.n_group,
            topk_group=config.topk_group)
        _add_glm4moe_keys(writer, glm, config.head_dim,
                          {"partial_rotary_factor": config.partial_rotary_factor}, 0)
    if config.sliding_window and arch in ("gpt-oss", "gemma3", "phi3"):
        writer.add_sliding_window(config.sliding_window)
    if arch == "gemma3" and config.final_logit_softcapping:
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    scaling = dict(config.rope_scaling or {})
    kind = scaling.get("rope_type", scaling.get("type"))
    extra: dict[str, np.ndarray] = {}
    if kind in ("linear", "yarn"):
        writer.add_rope_scaling_type(gguf.RopeScalingType(kind))
        writer.add_rope_scaling_factor(scaling["factor"])
        if "original_max_position_embeddings" in scaling:
            writer.add_rope_scaling_orig_ctx_len(scaling["original_max_position_embeddings"])
    elif kind == "longrope":
        _add_longrope(writer, extra, config, scaling)
    if arch == "mistral3":  # conversion/mistral3.py's keys beside the base YaRN ones
        writer.add_rope_scaling_yarn_beta_fast(scaling["beta_fast"])
        writer.add_rope_scaling_yarn_beta_slow(scaling["beta_slow"])
        writer.add_rope_scaling_yarn_log_mul(scaling["mscale_all_dim"])
        writer.add_attn_temperature_scale(config.llama4_scaling_beta)
    tokens, types = _vocabulary(config.vocab_size)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    # No eos_token_id: greedy decoding of random weights may pick </s> (often, once it locks
    # into a repeat), and Strata would stop a timed run there. llama.cpp's bench tools never
    # stop, and its SentencePiece vocabulary defaults eos to 2 anyway.
    return extra


def tiny_config(config: ModelConfig) -> ModelConfig:
    """The family's structure (its tensors, norms, routing, windows, RoPE kind) at a tiny
    width: hidden 256, 4 heads of 64 over at most 2 KV heads, at most 4 experts (top 2)."""
    kv_heads = min(config.num_key_value_heads, 2)
    fields = dict(_TINY, num_key_value_heads=kv_heads,
                  intermediate_size=_TINY["intermediate_size"] if config.intermediate_size
                  else 0)
    if config.is_moe:
        fields |= {"num_experts": min(config.num_experts, _TINY_EXPERTS),
                   "num_experts_per_tok": min(config.num_experts_per_tok, 2), "n_group": 1,
                   "topk_group": 1}
    else:
        fields["moe_intermediate_size"] = 0
    if config.rope_scaling and "long_factor" in config.rope_scaling:  # one per rotated pair
        pairs = int(_TINY["head_dim"] * config.partial_rotary_factor) // 2
        fields["rope_scaling"] = {**config.rope_scaling, "long_factor": [1.0] * pairs,
                                  "short_factor": [1.0] * pairs}
    if config.sliding_window:
        fields["sliding_window"] = min(config.sliding_window, _TINY["max_position_embeddings"])
    return dataclasses.replace(config, **fields)


def random_gguf_config(preset: str | ModelConfig, num_layers: int | None = None,
                       tiny: bool = False) -> ModelConfig:
    """The preset's config (a name, a config.json path or a ModelConfig), tiny_config when
    asked, cut to num_layers when given (--tiny alone keeps 2); refused for architectures
    the writer does not know."""
    config = random_weights_config(preset) if isinstance(preset, str) else preset
    if config.model_type not in ARCHITECTURES or (config.is_moe and config.model_type == "llama"):
        label = preset if isinstance(preset, str) else "this config"
        raise ValueError(f"{label} is a {config.model_type} model: random GGUFs are written "
                         f"for {', '.join(ARCHITECTURES)} models only (llama.cpp peer rows)")
    if tiny:
        config = tiny_config(config)
        num_layers = num_layers or 2
    if num_layers:
        config = dataclasses.replace(
            config, num_hidden_layers=num_layers, layer_types=config.layer_types[:num_layers],
            mlp_only_layers=tuple(i for i in config.mlp_only_layers if i < num_layers))
    return config


def _float_values(name: str, shape: tuple[int, ...], pool: np.ndarray) -> np.ndarray:
    """An F32 tensor's values: norms 1 (Gemma's stored 1 + w: its w is 0), the rest (router,
    biases, attention sinks) values of the f16 pool, std 0.02."""
    if name.endswith("norm.weight"):
        return np.ones(shape, dtype=np.float32)
    return np.resize(pool, shape).astype(np.float32)


def write_random_gguf(preset: str | ModelConfig, path: str | Path, seed: int = 0,
                      mix: str = "F16", num_layers: int | None = None,
                      tiny: bool = False) -> int:
    """Write `preset` (a preset's name, a config.json path or a ModelConfig) to `path` as a
    file of `mix` (gguf_mix.FILE_TYPES); returns the bytes of tensor data."""
    config = random_gguf_config(preset, num_layers, tiny)
    shapes, types = tensor_shapes(config), tensor_types(config, mix)
    arch = ARCHITECTURES[config.model_type]
    writer = gguf.GGUFWriter(str(path), arch)
    extra = _add_metadata(writer, config, preset if isinstance(preset, str) else "random", mix)
    for name, values in extra.items():
        writer.add_tensor_info(name, values.shape, values.dtype, values.nbytes)
    for name, shape in shapes.items():
        qtype = types[name]
        if qtype == QT.F32:
            writer.add_tensor_info(name, shape, np.dtype(np.float32), int(np.prod(shape)) * 4)
        else:
            row = row_bytes(qtype, shape[-1])
            writer.add_tensor_info(name, (*shape[:-1], row), np.dtype(np.uint8),
                                   int(np.prod(shape[:-1])) * row, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for values in extra.values():
        writer.write_tensor_data(values)
    pools: dict[QT, np.ndarray] = {}
    float_pool = byte_pool(QT.F16, seed).view(np.float16)
    total = 0
    for name, shape in shapes.items():
        qtype = types[name]
        if qtype == QT.F32:
            data = _float_values(name, shape, float_pool)
        else:
            if qtype not in pools:
                pools[qtype] = byte_pool(qtype, seed)
            data = RepeatedBytes(pools[qtype], qtype, shape)
        writer.write_tensor_data(data)
        total += data.nbytes
    writer.close()
    return total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("preset", help="llama3-8b, gpt-oss-20b, gemma-3-27b, glm-4.5-air, phi-4, ...")
    parser.add_argument("out", help="the .gguf file to write")
    parser.add_argument("--type", default="F16", choices=sorted(FILE_TYPES),
                        help="the mix of GGML types, as llama-quantize makes it")
    parser.add_argument("--layers", type=int, help="keep only the first N layers")
    parser.add_argument("--tiny", action="store_true",
                        help="the family's structure at a tiny width (2 layers unless --layers)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    nbytes = write_random_gguf(args.preset, args.out, args.seed, args.type, args.layers,
                               args.tiny)
    print(f"{args.out}: {nbytes / 2**30:.2f} GiB of tensors ({args.type})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
