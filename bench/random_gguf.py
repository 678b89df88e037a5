"""Write a dense random-weight preset as a GGUF file llama.cpp loads, for its peer rows.

    python bench/random_gguf.py smollm2-135m /tmp/smollm2.gguf

The same shapes as strata's `--random-weights` presets (strata.engine.core.random_weights),
f16 weights normal(0, 0.02) (norms at 1), llama architecture metadata, and a
SentencePiece-style vocabulary of placeholder pieces: llama-bench feeds random token ids, so
only the vocabulary's size and its special and byte tokens matter. Q/K rows are not permuted
into llama.cpp's RoPE layout: with random weights that changes no timing. The weights repeat
one pool of 2^26 drawn values (drawing 8e9 of them took minutes; timing does not depend on
them), and tensors are written one at a time, so an 8B model never sits in RAM whole.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout, for strata

import gguf
import numpy as np

from strata.engine.core.model_config import ModelConfig
from strata.engine.core.random_weights import random_weights_config

WEIGHT_STD = 0.02
POOL_VALUES = 1 << 26
NUM_BYTE_TOKENS = 256
FILE_TYPE_F16 = 1  # llama_ftype MOSTLY_F16


def tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """GGUF tensor name -> [rows, cols] (numpy order) for a dense llama-architecture model."""
    hidden, inter = config.hidden_size, config.intermediate_size
    q_dim = config.num_attention_heads * config.head_dim
    kv_dim = config.num_key_value_heads * config.head_dim
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (config.vocab_size, hidden)}
    for i in range(config.num_hidden_layers):
        shapes |= {
            f"blk.{i}.attn_norm.weight": (hidden,),
            f"blk.{i}.attn_q.weight": (q_dim, hidden),
            f"blk.{i}.attn_k.weight": (kv_dim, hidden),
            f"blk.{i}.attn_v.weight": (kv_dim, hidden),
            f"blk.{i}.attn_output.weight": (hidden, q_dim),
            f"blk.{i}.ffn_norm.weight": (hidden,),
            f"blk.{i}.ffn_gate.weight": (inter, hidden),
            f"blk.{i}.ffn_up.weight": (inter, hidden),
            f"blk.{i}.ffn_down.weight": (hidden, inter),
        }
    shapes["output_norm.weight"] = (hidden,)
    if not config.tie_word_embeddings:
        shapes["output.weight"] = (config.vocab_size, hidden)
    return shapes


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


def _add_metadata(writer: gguf.GGUFWriter, config: ModelConfig, name: str) -> None:
    writer.add_name(name)
    writer.add_file_type(FILE_TYPE_F16)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    tokens, types = _vocabulary(config.vocab_size)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)


def write_random_gguf(preset: str | ModelConfig, path: str | Path, seed: int = 0) -> int:
    """Write `preset` (a dense llama-architecture preset's name, or its config) to `path`;
    returns the bytes of tensor data."""
    config = random_weights_config(preset) if isinstance(preset, str) else preset
    if config.model_type != "llama" or config.is_moe:
        raise ValueError(f"{preset} is a {config.model_type} model: only dense llama presets "
                         "are written as GGUF (llama.cpp peer rows)")
    shapes = tensor_shapes(config)
    writer = gguf.GGUFWriter(str(path), "llama")
    _add_metadata(writer, config, preset if isinstance(preset, str) else "random")
    for name, shape in shapes.items():
        dtype = np.float32 if len(shape) == 1 else np.float16  # norms stay f32, as converted
        writer.add_tensor_info(name, shape, np.dtype(dtype), int(np.prod(shape)) * dtype().itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    pool = np.random.default_rng(seed).standard_normal(POOL_VALUES, dtype=np.float32)
    pool = (pool * WEIGHT_STD).astype(np.float16)
    total = 0
    for shape in shapes.values():
        # Norms are ones; every other tensor is the pool repeated cyclically.
        values = np.ones(shape, dtype=np.float32) if len(shape) == 1 else np.resize(pool, shape)
        writer.write_tensor_data(values)
        total += values.nbytes
    writer.close()
    return total


def main() -> int:
    if len(sys.argv) != 3:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    nbytes = write_random_gguf(sys.argv[1], sys.argv[2])
    print(f"{sys.argv[2]}: {nbytes / 2**30:.2f} GiB of tensors")
    return 0


if __name__ == "__main__":
    sys.exit(main())
