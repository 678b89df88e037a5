"""Write a random-weight preset as a GGUF file both llama.cpp and Strata load, for peer rows.

    python bench/random_gguf.py PRESET OUT.gguf [--type Q4_K_M|Q8_0|IQ2_XXS|F16|BF16]
                                [--layers N]

The same shapes as strata's `--random-weights` presets (strata.engine.core.random_weights):
dense llama (llama3-8b, smollm2-135m) or qwen3moe (qwen3-30b-a3b), with the metadata keys
llama.cpp and Strata's GGUF loader read. --type picks the mix of GGML types as llama-quantize
makes it (gguf_mix.py): quantized tensors are random valid blocks written directly, no float
weights and no llama-quantize; values have std 0.02, norms are 1. --layers N keeps the first
N layers (a bf16 Qwen3-30B-A3B is 61 GB). The vocabulary is SentencePiece-style placeholder
pieces: llama-bench feeds random token ids, so only its size and its special and byte tokens
matter. Q/K rows are not permuted into llama.cpp's RoPE layout: with random weights that
changes no timing. Each type's tensors repeat one pool of random bytes (gguf_pools.py), and
tensors are written one at a time, so a model never sits in RAM whole.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout, for strata
sys.path.insert(0, str(Path(__file__).resolve().parent))  # gguf_mix.py, gguf_pools.py

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf_mix import FILE_TYPES, ModelShape, tensor_type
from gguf_pools import RepeatedBytes, byte_pool, row_bytes

from strata.engine.core.model_config import ModelConfig
from strata.engine.core.random_weights import random_weights_config

NUM_BYTE_TOKENS = 256
ARCHITECTURES = {"llama": "llama", "qwen3_moe": "qwen3moe"}  # model_type -> GGUF arch


def tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """GGUF tensor name -> shape (numpy order: [rows, cols], experts [E, rows, cols]) for a
    dense llama or a qwen3moe model, in llama.cpp's converter's order."""
    hidden, inter = config.hidden_size, config.intermediate_size
    q_dim = config.num_attention_heads * config.head_dim
    kv_dim = config.num_key_value_heads * config.head_dim
    is_moe = config.model_type == "qwen3_moe"
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (config.vocab_size, hidden)}
    for i in range(config.num_hidden_layers):
        p = f"blk.{i}."
        shapes |= {
            p + "attn_norm.weight": (hidden,),
            p + "attn_q.weight": (q_dim, hidden),
            p + "attn_k.weight": (kv_dim, hidden),
            p + "attn_v.weight": (kv_dim, hidden),
            p + "attn_output.weight": (hidden, q_dim),
        }
        if is_moe:
            experts, expert_inter = config.num_experts, config.moe_intermediate_size
            shapes |= {
                p + "attn_q_norm.weight": (config.head_dim,),
                p + "attn_k_norm.weight": (config.head_dim,),
                p + "ffn_norm.weight": (hidden,),
                p + "ffn_gate_inp.weight": (experts, hidden),
                p + "ffn_gate_exps.weight": (experts, expert_inter, hidden),
                p + "ffn_up_exps.weight": (experts, expert_inter, hidden),
                p + "ffn_down_exps.weight": (experts, hidden, expert_inter),
            }
        else:
            shapes |= {
                p + "ffn_norm.weight": (hidden,),
                p + "ffn_gate.weight": (inter, hidden),
                p + "ffn_up.weight": (inter, hidden),
                p + "ffn_down.weight": (hidden, inter),
            }
    shapes["output_norm.weight"] = (hidden,)
    if not config.tie_word_embeddings:
        shapes["output.weight"] = (config.vocab_size, hidden)
    return shapes


def tensor_types(config: ModelConfig, mix: str) -> dict[str, QT]:
    """GGUF tensor name -> GGML type in a file of `mix` (llama-quantize's choice)."""
    shape = ModelShape(config.num_hidden_layers, config.num_experts,
                       config.num_attention_heads // config.num_key_value_heads,
                       config.tie_word_embeddings)
    return {name: tensor_type(mix, name, len(dims), shape)
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


def _add_metadata(writer: gguf.GGUFWriter, config: ModelConfig, name: str, mix: str) -> None:
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
    if config.model_type == "llama":
        writer.add_rope_dimension_count(config.head_dim)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    if config.is_moe:
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
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


def random_gguf_config(preset: str | ModelConfig, num_layers: int | None = None) -> ModelConfig:
    """The preset's config (a name or a ModelConfig), cut to num_layers when given; refused
    for architectures the writer does not know."""
    config = random_weights_config(preset) if isinstance(preset, str) else preset
    if config.model_type not in ARCHITECTURES or (config.is_moe and config.model_type == "llama"):
        raise ValueError(f"{preset} is a {config.model_type} model: only dense llama and "
                         "qwen3_moe presets are written as GGUF (llama.cpp peer rows)")
    if num_layers:
        config = dataclasses.replace(config, num_hidden_layers=num_layers)
    return config


def write_random_gguf(preset: str | ModelConfig, path: str | Path, seed: int = 0,
                      mix: str = "F16", num_layers: int | None = None) -> int:
    """Write `preset` (a dense llama or qwen3_moe preset's name, or its config) to `path` as a
    file of `mix` (gguf_mix.FILE_TYPES); returns the bytes of tensor data."""
    config = random_gguf_config(preset, num_layers)
    shapes, types = tensor_shapes(config), tensor_types(config, mix)
    arch = ARCHITECTURES[config.model_type]
    writer = gguf.GGUFWriter(str(path), arch)
    _add_metadata(writer, config, preset if isinstance(preset, str) else "random", mix)
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
    pools: dict[QT, np.ndarray] = {}
    float_pool = None
    total = 0
    for name, shape in shapes.items():
        qtype = types[name]
        if qtype == QT.F32 and len(shape) == 1:
            data = np.ones(shape, dtype=np.float32)  # norms
        elif qtype == QT.F32:  # the router: float values of the f16 pool
            if float_pool is None:
                float_pool = byte_pool(QT.F16, seed).view(np.float16)
            data = np.resize(float_pool, shape).astype(np.float32)
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
    parser.add_argument("preset", help="llama3-8b, qwen3-30b-a3b, smollm2-135m, ...")
    parser.add_argument("out", help="the .gguf file to write")
    parser.add_argument("--type", default="F16", choices=sorted(FILE_TYPES),
                        help="the mix of GGML types, as llama-quantize makes it")
    parser.add_argument("--layers", type=int, help="keep only the first N layers")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    nbytes = write_random_gguf(args.preset, args.out, args.seed, args.type, args.layers)
    print(f"{args.out}: {nbytes / 2**30:.2f} GiB of tensors ({args.type})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
