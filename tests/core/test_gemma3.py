"""Gemma 3 beyond the shared parity tests: its config files as published, multimodal
checkpoints and GGUFs (text part only), norms stored as 1 + w in GGUF, damaged files, and the
fast path it takes.

The parity with transformers itself is in test_models_parity.py (HF) and test_gguf_parity.py
(GGUF of every type, QAT's Q4_0 included, through the engine).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from strata.engine.core.engine import Engine, EngineConfig
from strata.engine.core.fast_coverage import missing_features
from strata.engine.core.kv_cache import KVCache
from strata.engine.core.loader import inspect_model, load_model_config, load_tensors
from strata.engine.core.loader.hf import load_hf_config, load_hf_tensors
from strata.engine.core.model_config import ModelConfig, ModelFormatError
from strata.engine.core.models.build import build_model
from tests.helpers.gguf_writer import write_gguf_from_hf
from tests.helpers.tiny_models import make_tiny_hf_config, make_tiny_hf_model, randomize_norms

PROMPT = torch.arange(40) % 320

# google/gemma-3-4b-it's config.json as published: the text_config lists only what differs
# from Gemma3TextConfig's defaults.
GEMMA3_4B_CONFIG = {
    "architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999,
    "eoi_token_index": 256000, "eos_token_id": [1, 106], "image_token_index": 262144,
    "initializer_range": 0.02, "mm_tokens_per_image": 256, "model_type": "gemma3",
    "text_config": {"hidden_size": 2560, "intermediate_size": 10240,
                    "model_type": "gemma3_text", "num_hidden_layers": 34,
                    "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                    "sliding_window": 1024},
    "torch_dtype": "bfloat16",
    "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                      "model_type": "siglip_vision_model", "num_attention_heads": 16,
                      "num_hidden_layers": 27, "patch_size": 14, "vision_use_head": False},
}


@pytest.fixture(scope="module")
def gguf_model():
    """The tiny Gemma 3 with the query scale llama.cpp derives (1/sqrt(head_dim)), random
    norms: what a GGUF can express."""
    import transformers

    torch.manual_seed(0)
    config = make_tiny_hf_config("gemma3")
    config.query_pre_attn_scalar = config.head_dim
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_norms(model, "gemma3")
    return model.eval()


def _one_line_error(fn, *args) -> str:
    with pytest.raises(ModelFormatError) as info:
        fn(*args)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_published_multimodal_config_reads_like_transformers():
    import transformers

    ours = ModelConfig.from_hf_dict(GEMMA3_4B_CONFIG)
    text = transformers.Gemma3Config(**GEMMA3_4B_CONFIG).text_config
    assert ours.model_type == "gemma3_text"
    assert ours.layer_types == tuple(text.layer_types)
    assert ours.layer_types[:6] == ("sliding_attention",) * 5 + ("full_attention",)
    assert ours.sliding_window == text.sliding_window == 1024
    assert ours.rope_theta == text.rope_parameters["full_attention"]["rope_theta"] == 1e6
    assert ours.rope_local_theta == text.rope_parameters["sliding_attention"]["rope_theta"]
    assert ours.rope_scaling["rope_type"] == "linear" and ours.rope_scaling["factor"] == 8.0
    for ours_key, theirs in [("num_attention_heads", text.num_attention_heads),
                             ("num_key_value_heads", text.num_key_value_heads),
                             ("head_dim", text.head_dim), ("vocab_size", text.vocab_size),
                             ("query_pre_attn_scalar", text.query_pre_attn_scalar),
                             ("rms_norm_eps", text.rms_norm_eps),
                             ("max_position_embeddings", text.max_position_embeddings),
                             ("tie_word_embeddings", True)]:
        assert getattr(ours, ours_key) == theirs, ours_key
    assert ours.eos_token_ids == (1, 106)  # <eos> and <end_of_turn>


def test_attention_softcapping_is_refused_in_one_line():
    config = {**GEMMA3_4B_CONFIG, "text_config": {**GEMMA3_4B_CONFIG["text_config"],
                                                  "attn_logit_softcapping": 50.0}}
    assert "attn_logit_softcapping" in _one_line_error(ModelConfig.from_hf_dict, config)


@torch.no_grad()
def test_multimodal_checkpoint_loads_its_language_model(tmp_path, caplog):
    """A Gemma3ForConditionalGeneration directory (published prefixes, a vision tensor) gives
    the text model's logits; one log line says the vision tensors are not used."""
    directory, hf_model = make_tiny_hf_model("gemma3", tmp_path / "text")
    text_config = json.loads((directory / "config.json").read_text())
    multimodal = tmp_path / "multimodal"
    multimodal.mkdir()
    (multimodal / "config.json").write_text(json.dumps(
        {"model_type": "gemma3", "text_config": text_config, "vision_config": {}}))
    tensors = {("language_model." + name): t
               for name, t in load_file(directory / "model.safetensors").items()}
    tensors["vision_tower.vision_model.embeddings.patch_embedding.weight"] = torch.zeros(4, 3)
    tensors["multi_modal_projector.mm_input_projection_weight"] = torch.zeros(4, 64)
    save_file(tensors, multimodal / "model.safetensors")

    config = load_hf_config(multimodal)
    assert config == load_hf_config(directory)
    with caplog.at_level(logging.INFO):
        model = build_model(config, load_hf_tensors(multimodal, config))
    assert [r for r in caplog.records if "language model only" in r.getMessage()] != []
    logits = model(PROMPT, 0, KVCache.for_config(config, 64))
    torch.testing.assert_close(logits, hf_model(PROMPT[None]).logits[0], atol=1e-4, rtol=0)
    info = inspect_model(multimodal)
    assert info.model_type == "gemma3_text" and info.is_supported


def test_gguf_config_equals_hf_config(gguf_model, tmp_path):
    path = write_gguf_from_hf(gguf_model, None, tmp_path / "g.gguf", "F16")
    got = load_model_config(path)
    want = ModelConfig.from_hf_dict(gguf_model.config.to_dict())
    assert got.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert {k: want.rope_scaling[k] for k in ("rope_type", "factor")} == got.rope_scaling
    assert dataclasses.replace(got, rope_scaling=None) == dataclasses.replace(
        want, rope_scaling=None)
    info = inspect_model(path)
    assert info.model_type == "gemma3_text" and info.is_supported


def test_gguf_holds_norms_as_one_plus_w_and_loads_them_as_w(gguf_model, tmp_path):
    """Guards the GGUF parity test: the file stores what llama.cpp's converter writes."""
    path = write_gguf_from_hf(gguf_model, None, tmp_path / "g.gguf", "F32")
    raw = {t.name: np.array(t.data) for t in gguf.GGUFReader(path).tensors}
    want = gguf_model.state_dict()
    norm_names = {"blk.0.attn_norm.weight": "model.layers.0.input_layernorm.weight",
                  "blk.5.post_ffw_norm.weight": "model.layers.5.post_feedforward_layernorm.weight",
                  "blk.2.attn_k_norm.weight": "model.layers.2.self_attn.k_norm.weight",
                  "output_norm.weight": "model.norm.weight"}
    loaded = load_tensors(path, load_model_config(path))
    for gguf_name, name in norm_names.items():
        np.testing.assert_allclose(raw[gguf_name], want[name].numpy() + 1.0, rtol=0, atol=1e-7)
        torch.testing.assert_close(loaded[name], want[name], rtol=0, atol=1e-6)


@pytest.mark.parametrize(("edit", "needle"), [
    (lambda t: t.pop("blk.3.ffn_up.weight"), "lacks tensor blk.3.ffn_up.weight"),
    (lambda t: t.pop("blk.1.post_ffw_norm.weight"), "lacks tensor blk.1.post_ffw_norm.weight"),
    (lambda t: t.update({"blk.2.attn_k.weight": t["blk.2.attn_k.weight"][:16]}),
     "(blk.2.attn_k.weight in the file) has shape (16, 64)"),
], ids=["missing", "missing-norm", "misshapen"])
def test_damaged_gguf_is_refused_naming_the_tensor(gguf_model, tmp_path, edit, needle):
    path = write_gguf_from_hf(gguf_model, None, tmp_path / "g.gguf", "F16", edit_tensors=edit)
    engine = Engine(EngineConfig(model_path=str(path), device="cpu", context_tokens=64))
    message = _one_line_error(engine.load)
    assert needle in message
    assert engine.model is None


def test_projector_beside_a_gguf_is_named_in_one_log_line(gguf_model, tmp_path, caplog):
    path = write_gguf_from_hf(gguf_model, None, tmp_path / "gemma-3-tiny-Q8_0.gguf", "Q8_0")
    plain = Engine(EngineConfig(model_path=str(path), device="cpu", context_tokens=64))
    with caplog.at_level(logging.INFO):
        plain.load()
    plain.close()
    assert not [r for r in caplog.records if "vision projector" in r.getMessage()]
    shutil.copy(path, tmp_path / "mmproj-gemma-3-tiny-F16.gguf")  # any bytes: never read
    caplog.clear()
    engine = Engine(EngineConfig(model_path=str(path), device="cpu", context_tokens=64))
    with caplog.at_level(logging.INFO):
        engine.load()
    try:
        lines = [r.getMessage() for r in caplog.records if "vision projector" in r.getMessage()]
        assert len(lines) == 1 and "mmproj-gemma-3-tiny-F16.gguf" in lines[0]
        assert "text model only" in lines[0]
        spec_tokens = list(engine.generate(PROMPT.tolist(), _greedy(4)))
        assert len([t for ids in spec_tokens for t in ids]) == 4
    finally:
        engine.close()


def _greedy(num_tokens: int):
    from strata.engine.protocol import SamplingSpec

    return SamplingSpec(max_tokens=num_tokens, temperature=0.0)


def test_engine_takes_the_fast_path_and_generates_like_transformers(gguf_model, tmp_path,
                                                                    caplog):
    """On the CPU, fast_compile_pointwise=True builds the fast decoder as CUDA would: Gemma 3
    (sandwich and (1 + w) norms, GeGLU, windows cut by the 40-token prompt, its query scale,
    scaled embeddings, two RoPE tables, soft-capped logits) now takes it, with compiled
    element-wise groups, and generates transformers' greedy tokens."""
    gemma_path = write_gguf_from_hf(gguf_model, None, tmp_path / "gemma.gguf", "F32")
    engine = Engine(EngineConfig(model_path=str(gemma_path), device="cpu", context_tokens=64,
                                 fast_compile_pointwise=True))
    with caplog.at_level(logging.INFO):
        engine.load()
    try:
        assert missing_features(engine.model) == []
        assert engine.fast is not None
        assert not [r for r in caplog.records if "fast path lacks" in r.getMessage()]
        tokens = [t for ids in engine.generate(PROMPT.tolist(), _greedy(6)) for t in ids]
        with torch.no_grad():
            expected = gguf_model.generate(PROMPT[None], max_new_tokens=6, min_new_tokens=6,
                                           do_sample=False)[0, len(PROMPT):].tolist()
        assert tokens == expected
    finally:
        engine.close()


def test_embeddings_run_gemma_as_its_forward_does():
    """The embeddings endpoint's hidden states (embedding.py) are the forward's: Gemma's
    scaled embedding and its local layers' own RoPE table, not the shared defaults."""
    from strata.engine.core.embedding import final_hidden_states
    from strata.engine.core.random_weights import build_random_model
    from tests.helpers.fast_configs import TINY_CONFIGS

    model = build_random_model(TINY_CONFIGS["gemma3"], "cpu", torch.float32, seed=0, std=0.15)
    ids = torch.arange(12) % 96
    with torch.inference_mode():
        logits = model(ids, 0, KVCache.for_config(model.config, 16))
        hidden = final_hidden_states(model, ids, 0, KVCache.for_config(model.config, 16))
        cap = model.config.final_logit_softcapping
        got = torch.tanh(torch.nn.functional.linear(hidden, model.lm_head.weight) / cap) * cap
    torch.testing.assert_close(got, logits, rtol=1e-5, atol=1e-5)
