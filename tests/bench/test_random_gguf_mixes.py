"""bench/random_gguf.py's quantized mixes and qwen3moe files: each tensor gets the type
llama-quantize would give it (llama.cpp src/llama-quant.cpp), the sizes match the published
files', and Strata's engine loads every kind of file and generates from it."""

from __future__ import annotations

import sys
from pathlib import Path

import gguf
import pytest
from gguf import GGMLQuantizationType as QT

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from gguf_mix import use_more_bits
from random_gguf import random_gguf_config, stored_bytes, tensor_types, write_random_gguf

from strata.engine.core.model_config import ModelConfig

# Every dimension a multiple of 256, the K- and I-quants' block.
TINY_DENSE = ModelConfig(model_type="llama", vocab_size=512, hidden_size=256,
                         intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=64, max_position_embeddings=512)
TINY_MOE = ModelConfig(model_type="qwen3_moe", vocab_size=512, hidden_size=256,
                       intermediate_size=512, moe_intermediate_size=256, num_experts=4,
                       num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
                       rms_norm_eps=1e-6)


def test_use_more_bits_is_llama_cpps_rule_for_32_layers() -> None:
    # The layers a Llama-3-8B Q4_K_M file has Q6_K attn_v/ffn_down in.
    expected = [0, 1, 2, 3, *range(6, 28, 3), 28, 29, 30, 31]
    assert [i for i in range(32) if use_more_bits(i, 32)] == expected


def test_q4_k_m_of_llama3_8b_types_tensors_as_llama_quantize() -> None:
    types = tensor_types(random_gguf_config("llama3-8b"), "Q4_K_M")
    assert types["output.weight"] == QT.Q6_K and types["token_embd.weight"] == QT.Q4_K
    for i in range(32):
        more = QT.Q6_K if use_more_bits(i, 32) else QT.Q4_K
        assert types[f"blk.{i}.attn_v.weight"] == more
        assert types[f"blk.{i}.ffn_down.weight"] == more
        for name in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up"):
            assert types[f"blk.{i}.{name}.weight"] == QT.Q4_K
        assert types[f"blk.{i}.attn_norm.weight"] == QT.F32
    assert set(tensor_types(random_gguf_config("llama3-8b"), "Q8_0").values()) == {QT.Q8_0,
                                                                                   QT.F32}


def test_a_tied_embedding_takes_the_output_heads_type() -> None:
    import dataclasses

    tied = dataclasses.replace(TINY_DENSE, tie_word_embeddings=True)
    assert "output.weight" not in tensor_types(tied, "Q4_K_M")
    assert tensor_types(tied, "Q4_K_M")["token_embd.weight"] == QT.Q6_K
    assert tensor_types(TINY_DENSE, "Q4_K_M")["token_embd.weight"] == QT.Q4_K


def test_moe_mixes_keep_the_router_float_and_follow_the_layer_rules() -> None:
    config = random_gguf_config("qwen3-30b-a3b")
    q4 = tensor_types(config, "Q4_K_M")
    iq2 = tensor_types(config, "IQ2_XXS")
    for i in range(48):
        assert q4[f"blk.{i}.ffn_gate_inp.weight"] == iq2[f"blk.{i}.ffn_gate_inp.weight"] == QT.F32
        assert q4[f"blk.{i}.attn_q_norm.weight"] == QT.F32
        assert q4[f"blk.{i}.ffn_down_exps.weight"] == (QT.Q6_K if use_more_bits(i, 48)
                                                       else QT.Q4_K)
        assert q4[f"blk.{i}.ffn_gate_exps.weight"] == QT.Q4_K
        assert iq2[f"blk.{i}.ffn_down_exps.weight"] == (QT.Q2_K if i < 6 else QT.IQ2_XXS)
        assert iq2[f"blk.{i}.ffn_up_exps.weight"] == QT.IQ2_XXS
        assert iq2[f"blk.{i}.attn_v.weight"] == QT.Q4_K  # GQA 8 keeps attn_v at 4 bits
    assert (iq2["output.weight"], iq2["token_embd.weight"]) == (QT.Q5_K, QT.Q2_K)


@pytest.mark.parametrize(("preset", "mix", "published_gb"), [
    ("llama3-8b", "Q4_K_M", 4.92), ("llama3-8b", "Q8_0", 8.54),
    ("qwen3-30b-a3b", "Q4_K_M", 18.6),
])
def test_sizes_match_the_published_files(preset: str, mix: str, published_gb: float) -> None:
    # The published files' sizes (tensors + a few MB of vocabulary), within 1%.
    assert stored_bytes(random_gguf_config(preset), mix) / 1e9 == pytest.approx(published_gb,
                                                                                 rel=0.01)


def test_layers_cut_the_model_and_odd_rows_take_llama_quantizes_fallback() -> None:
    assert random_gguf_config("qwen3-30b-a3b", 12).num_hidden_layers == 12
    import dataclasses

    # tensor_type_fallback: rows of 224 values (7 blocks of 32) take Q5_0 for Q4_K and Q8_0
    # for Q6_K (layer 1 of 2 uses more bits); rows of 200 fit no block: F16.
    types = tensor_types(dataclasses.replace(TINY_DENSE, intermediate_size=224), "Q4_K_M")
    assert (types["blk.0.ffn_down.weight"], types["blk.1.ffn_down.weight"]) == (QT.Q5_0,
                                                                                QT.Q8_0)
    assert types["blk.0.ffn_up.weight"] == QT.Q4_K  # rows of hidden 256: whole blocks
    types = tensor_types(dataclasses.replace(TINY_DENSE, intermediate_size=200), "Q4_K_M")
    assert types["blk.0.ffn_down.weight"] == types["blk.1.ffn_down.weight"] == QT.F16


@pytest.mark.parametrize("mix", ["Q4_K_M", "Q8_0", "IQ2_XXS", "BF16"])
@pytest.mark.parametrize("config", [TINY_DENSE, TINY_MOE], ids=["llama", "qwen3moe"])
def test_strata_loads_and_generates_from_every_kind(tmp_path: Path, config: ModelConfig,
                                                    mix: str) -> None:
    import math

    from strata.engine.core.engine import Engine, EngineConfig
    from strata.engine.core.loader.gguf import load_gguf_config
    from strata.engine.protocol import SamplingSpec

    path = tmp_path / "tiny.gguf"
    assert write_random_gguf(config, path, mix=mix) == stored_bytes(config, mix)
    reader = gguf.GGUFReader(path)
    types = tensor_types(config, mix)
    assert {t.name: t.tensor_type for t in reader.tensors} == types
    loaded = load_gguf_config(path)
    for field in ("model_type", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                  "num_hidden_layers", "head_dim", "vocab_size"):
        assert getattr(loaded, field) == getattr(config, field), field
    assert loaded.eos_token_ids == ()  # a timed run never stops early
    engine = Engine(EngineConfig(model_path=str(path), device="cpu", context_tokens=64))
    engine.load()
    try:
        spec = SamplingSpec(max_tokens=4, temperature=0.0)
        tokens = [t for step in engine.generate(list(range(3, 20)), spec) for t in step]
        assert len(tokens) == 4 and all(0 <= t < config.vocab_size for t in tokens)
        # Finite weights: the dequantized values have the std the pools were scaled to.
        down = next(t for t in reader.tensors if "ffn_down" in t.name)
        values = gguf.quants.dequantize(down.data, down.tensor_type)
        assert math.isfinite(float(values.sum())) and 0.01 < float(values.std()) < 0.04
    finally:
        engine.close()
