"""bench/random_gguf.py's files of issue 52's families (gpt-oss, Gemma 3, GLM-4.5, Phi-4):
the presets and mixes give the published files' sizes, each tensor gets the type the mix
promises (llama.cpp's llama-quant.cpp, or Google's QAT layout), and a tiny file of each
family loads in Strata's GGUF loader to that family's config and runs a forward on the CPU."""

from __future__ import annotations

import sys
from pathlib import Path

import gguf
import pytest
import torch
from gguf import GGMLQuantizationType as QT

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from gguf_mix import use_more_bits
from random_gguf import random_gguf_config, stored_bytes, tensor_types, write_random_gguf

from strata.engine.core.kv_cache import KVCache
from strata.engine.core.loader import load_model_config, load_tensors
from strata.engine.core.models.build import build_model

# (preset, mix): issue 52's four peer files, and the small siblings.
FAMILY_FILES = [("gpt-oss-20b", "MXFP4_MOE"), ("gemma-3-27b", "Q4_0_QAT"),
                ("glm-4.5-air", "Q4_K_M"), ("phi-4", "Q4_K_M"), ("gemma-3-1b", "Q4_0_QAT"),
                ("phi-4-mini", "Q4_K_M")]


@pytest.mark.parametrize(("preset", "mix", "published_gb"), [
    ("gpt-oss-20b", "MXFP4_MOE", 12.1),  # ggml-org/gpt-oss-20b-GGUF gpt-oss-20b-mxfp4.gguf
    ("gemma-3-27b", "Q4_0_QAT", 17.2),  # google/gemma-3-27b-it-qat-q4_0-gguf
    ("gemma-3-1b", "Q4_0_QAT", 1.0),  # google/gemma-3-1b-it-qat-q4_0-gguf
    ("phi-4", "Q4_K_M", 9.05),  # phi-4-Q4_K_M.gguf
    ("phi-4-mini", "Q4_K_M", 2.49),  # Phi-4-mini-instruct-Q4_K_M.gguf
])
def test_sizes_match_the_published_files(preset: str, mix: str, published_gb: float) -> None:
    # Presets written from memory (no hub here): the sizes check dimensions and mix at once.
    assert stored_bytes(random_gguf_config(preset), mix) / 1e9 == pytest.approx(published_gb,
                                                                                 rel=0.01)


@pytest.mark.parametrize(("preset", "published_b"), [
    ("gpt-oss-20b", 21.0), ("phi-4", 14.7), ("phi-4-mini", 3.8), ("glm-4.5-air", 106.0)])
def test_parameter_counts_match_the_model_cards(preset: str, published_b: float) -> None:
    from strata.engine.core.random_weights import parameter_bytes, random_weights_config

    count = parameter_bytes(random_weights_config(preset), torch.bfloat16) / 2
    assert count / 1e9 == pytest.approx(published_b, rel=0.015)


def test_gpt_oss_mxfp4_moe_is_mxfp4_experts_and_q8_0_elsewhere() -> None:
    types = tensor_types(random_gguf_config("gpt-oss-20b"), "MXFP4_MOE")
    assert types["token_embd.weight"] == types["output.weight"] == QT.Q8_0
    for i in range(24):
        p = f"blk.{i}."
        for proj in ("gate", "up", "down"):
            assert types[p + f"ffn_{proj}_exps.weight"] == QT.MXFP4
            assert types[p + f"ffn_{proj}_exps.bias"] == QT.F32  # 2-D, but a bias
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            assert types[p + name + ".weight"] == QT.Q8_0
            assert types[p + name + ".bias"] == QT.F32
        assert types[p + "attn_sinks.weight"] == types[p + "ffn_gate_inp.weight"] == QT.F32


def test_gemma_qat_keeps_the_embedding_f16_and_the_rest_q4_0() -> None:
    types = tensor_types(random_gguf_config("gemma-3-27b"), "Q4_0_QAT")
    assert "output.weight" not in types and types["token_embd.weight"] == QT.F16
    matrices = {t for name, t in types.items() if name.startswith("blk.")
                and not name.endswith("norm.weight")}
    assert matrices == {QT.Q4_0}
    assert types["blk.5.post_ffw_norm.weight"] == QT.F32  # the sandwich norms stay float


def test_glm_q4_k_m_falls_back_where_rows_are_not_whole_k_blocks() -> None:
    types = tensor_types(random_gguf_config("glm-4.5-air"), "Q4_K_M")
    # Layer 0 is dense with rows of 10944; the experts' and shared expert's down rows are
    # 1408 wide: 256-value K blocks do not fit, so Q4_K -> Q5_0 and Q6_K -> Q8_0.
    assert types["blk.0.ffn_down.weight"] == QT.Q8_0  # layer 0 uses more bits
    for i in range(1, 46):
        p, more = f"blk.{i}.", use_more_bits(i, 46)
        assert types[p + "ffn_down_exps.weight"] == types[p + "ffn_down_shexp.weight"] == (
            QT.Q8_0 if more else QT.Q5_0)
        assert types[p + "ffn_gate_exps.weight"] == types[p + "ffn_up_shexp.weight"] == QT.Q4_K
        assert types[p + "attn_v.weight"] == (QT.Q6_K if more else QT.Q4_K)
        assert types[p + "exp_probs_b.bias"] == types[p + "attn_q.bias"] == QT.F32
    assert types["output.weight"] == QT.Q6_K and types["token_embd.weight"] == QT.Q4_K


def test_phi_q4_k_m_treats_the_fused_qkv_as_attn_v() -> None:
    types = tensor_types(random_gguf_config("phi-4"), "Q4_K_M")
    for i in range(40):
        more = QT.Q6_K if use_more_bits(i, 40) else QT.Q4_K
        assert types[f"blk.{i}.attn_qkv.weight"] == types[f"blk.{i}.ffn_down.weight"] == more
        assert types[f"blk.{i}.ffn_up.weight"] == QT.Q4_K  # gate and up, fused
    mini = tensor_types(random_gguf_config("phi-4-mini"), "Q4_K_M")
    assert "output.weight" not in mini and mini["token_embd.weight"] == QT.Q6_K  # tied


def test_layers_cut_the_layer_pattern_too() -> None:
    gemma = random_gguf_config("gemma-3-27b", 7)
    assert gemma.layer_types == ("sliding_attention",) * 5 + ("full_attention",
                                                              "sliding_attention")
    assert random_gguf_config("glm-4.5-air", 3).mlp_only_layers == (0,)
    assert random_gguf_config("gpt-oss-20b", 2).layer_types == ("sliding_attention",
                                                                "full_attention")


@pytest.mark.parametrize(("preset", "mix"), FAMILY_FILES)
def test_tiny_family_file_loads_in_strata_and_runs_a_forward(tmp_path: Path, preset: str,
                                                             mix: str) -> None:
    config = random_gguf_config(preset, tiny=True)
    path = tmp_path / f"{preset}.gguf"
    assert write_random_gguf(preset, path, mix=mix, tiny=True) == stored_bytes(config, mix)
    reader = gguf.GGUFReader(path)
    written = {t.name: t.tensor_type for t in reader.tensors}
    rope_factors = {n for n in written if n.startswith("rope_factors_")}
    assert rope_factors == ({"rope_factors_long.weight", "rope_factors_short.weight"}
                            if preset == "phi-4-mini" else set())
    assert {n: t for n, t in written.items() if n not in rope_factors} == tensor_types(config,
                                                                                       mix)
    loaded = load_model_config(path)
    for field in ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "head_dim", "num_experts",
                  "num_experts_per_tok", "moe_intermediate_size", "n_shared_experts",
                  "mlp_only_layers", "tie_word_embeddings", "attention_bias", "layer_types",
                  "sliding_window", "partial_rotary_factor", "moe_scoring", "vocab_size"):
        assert getattr(loaded, field) == getattr(config, field), field
    expected_rope = {"gpt-oss-20b": "yarn", "gemma-3-27b": "linear", "phi-4-mini": "longrope"}
    assert (loaded.rope_scaling or {}).get("rope_type") == expected_rope.get(preset)
    model = build_model(loaded, load_tensors(path, loaded))
    prompt = torch.arange(3, 19)
    with torch.no_grad():
        logits = model(prompt, 0, KVCache.for_config(loaded, 64))
    assert logits.shape == (16, config.vocab_size) and torch.isfinite(logits).all()
    assert logits.std() > 0  # random weights give logits that differ


def test_glm_down_projections_in_fallback_types_load_and_run(tmp_path: Path) -> None:
    """GLM-4.5-Air's down projections are Q5_0 and Q8_0 in a Q4_K_M file (rows of 1408 and
    10944): a tiny GLM with rows of 288 and 800 values (whole 32-blocks, not 256-blocks)
    gets the same types, and Strata loads and runs them."""
    import dataclasses

    config = dataclasses.replace(random_gguf_config("glm-4.5-air", tiny=True),
                                 moe_intermediate_size=288, intermediate_size=800)
    path = tmp_path / "glm.gguf"
    write_random_gguf(config, path, mix="Q4_K_M")
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(path).tensors}
    # 2 layers: layer 1 uses more bits (Q6_K -> Q8_0), layer 0 does not (Q4_K -> Q5_0).
    assert types["blk.0.ffn_down.weight"] == QT.Q5_0
    assert types["blk.1.ffn_down_exps.weight"] == types["blk.1.ffn_down_shexp.weight"] == QT.Q8_0
    assert types["blk.1.ffn_up_exps.weight"] == QT.Q4_K  # rows of hidden 256
    loaded = load_model_config(path)
    model = build_model(loaded, load_tensors(path, loaded))
    with torch.no_grad():
        logits = model(torch.arange(3, 19), 0, KVCache.for_config(loaded, 64))
    assert torch.isfinite(logits).all() and logits.std() > 0
