"""Phi-3/4 and Mistral 3 specifics beyond the shared parity runs (test_models_parity.py):
LongRoPE's long factors and the crossing of the pre-training context against transformers'
forward, Mistral 3's multimodal wrapper, and bad fused tensors in a Phi-3 GGUF."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from strata.engine.core.kv_cache import KVCache
from strata.engine.core.loader import inspect_model, load_model_config, load_tensors
from strata.engine.core.loader.hf import load_hf_config, load_hf_tensors
from strata.engine.core.model_config import ModelFormatError
from strata.engine.core.models.build import build_model
from tests.helpers.gguf_writer import write_gguf_from_hf
from tests.helpers.tiny_models import make_tiny_hf_config, make_tiny_hf_model, save_tiny_mistral3

ATOL = 1e-4
ORIGINAL_CONTEXT = 64  # the phi3_partial_longrope variant's pre-training context


@pytest.fixture(scope="module")
def phi3_mini(tmp_path_factory):
    """(our model, config, transformers model) of the Phi-4-mini-shaped variant."""
    directory, hf_model = make_tiny_hf_model("phi3_partial_longrope",
                                             tmp_path_factory.mktemp("phi3"))
    config = load_hf_config(directory)
    return build_model(config, load_hf_tensors(directory, config)), config, hf_model


@torch.no_grad()
def test_longrope_long_factors_in_one_prefill_match_transformers(phi3_mini):
    model, config, hf_model = phi3_mini
    prompt = torch.arange(80) * 7 % config.vocab_size  # past the pre-training context
    logits = model(prompt, 0, KVCache.for_config(config, 96))
    torch.testing.assert_close(logits, hf_model(prompt[None]).logits[0], atol=ATOL, rtol=0)


@torch.no_grad()
def test_longrope_crossing_the_original_context_matches_transformers_forward(phi3_mini):
    """Token by token over the boundary with a cache, as transformers' forward computes it:
    short factors for calls within the pre-training context, long ones past it."""
    from transformers import DynamicCache

    model, config, hf_model = phi3_mini
    prompt = torch.arange(ORIGINAL_CONTEXT - 4) * 5 % config.vocab_size
    kv = KVCache.for_config(config, 96)
    ours = [model(prompt, 0, kv)[-1:]]
    out = hf_model(prompt[None], cache=DynamicCache(config=hf_model.config), use_cache=True)
    theirs = [out.logits[0, -1:]]
    for position in range(prompt.numel(), ORIGINAL_CONTEXT + 6):
        token = torch.tensor([position % 11])
        ours.append(model(token, position, kv))
        out = hf_model(token[None], cache=out.past_key_values, use_cache=True,
                       position_ids=torch.tensor([[position]]))
        theirs.append(out.logits[0])
    torch.testing.assert_close(torch.cat(ours), torch.cat(theirs), atol=ATOL, rtol=0)


@torch.no_grad()
def test_partial_rotary_and_longrope_change_the_result(phi3_mini):
    """Guards the parity tests: a model ignoring either would differ from transformers."""
    model, config, hf_model = phi3_mini
    prompt = torch.arange(80) * 7 % config.vocab_size
    expected = hf_model(prompt[None]).logits[0]
    plain = dataclasses.replace(config, rope_scaling=None)
    full_width = dataclasses.replace(plain, partial_rotary_factor=1.0)
    logits = []
    for changed in (plain, full_width):
        other = build_model(changed, dict(model.state_dict()))
        logits.append(other(prompt, 0, KVCache.for_config(changed, 96)))
    assert (logits[0] - expected).abs().max() > 1e-2  # LongRoPE matters
    assert (logits[1] - logits[0]).abs().max() > 1e-2  # and so does partial RoPE


def test_phi3_config_reads_partial_rotary_longrope_and_the_tied_head(phi3_mini):
    _, config, _ = phi3_mini
    assert config.model_type == "phi3" and config.tie_word_embeddings
    assert (config.head_dim, config.rotary_dim) == (16, 12)
    assert config.rope_scaling["rope_type"] == "longrope"
    assert config.rope_scaling["original_max_position_embeddings"] == ORIGINAL_CONTEXT


@torch.no_grad()
def test_mistral3_multimodal_directory_loads_its_language_model(tmp_path, caplog):
    """A Mistral3ForConditionalGeneration directory (Mistral Small 3.1/3.2, Devstral): the
    text model loads alone, says so in one log line, and equals the wrapped language model."""
    import transformers

    text = make_tiny_hf_config("mistral")
    vision = transformers.PixtralVisionConfig(hidden_size=32, intermediate_size=64,
                                              num_hidden_layers=1, num_attention_heads=2,
                                              image_size=32, patch_size=8, head_dim=16)
    config = transformers.Mistral3Config(text_config=text.to_dict(),
                                         vision_config=vision.to_dict(), image_token_index=10)
    torch.manual_seed(0)
    hf_model = transformers.Mistral3ForConditionalGeneration(config).eval()
    hf_model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "mistral3"
    with caplog.at_level("INFO", logger="strata.engine.core.model_config"):
        ours = load_hf_config(tmp_path)
    assert ours.model_type == "mistral" and ours.head_dim == 32
    info = inspect_model(tmp_path)  # strata info
    assert info.model_type == "mistral" and info.is_supported
    assert [r.getMessage() for r in caplog.records] == [
        "mistral3 is a multimodal model: loading its mistral language model only (no images)"]
    model = build_model(ours, load_hf_tensors(tmp_path, ours))
    prompt = torch.arange(30) * 3 % ours.vocab_size
    logits = model(prompt, 0, KVCache.for_config(ours, 32))
    torch.testing.assert_close(logits, hf_model(input_ids=prompt[None]).logits[0],
                               atol=ATOL, rtol=0)


def _phi3_gguf(tmp_path, qtype: str = "Q8_0", drop: str | None = None,
               reshape: str | None = None):
    """A Phi-3 GGUF; `drop` leaves one tensor out, `reshape` writes one with a row too few."""
    import gguf

    import tests.helpers.gguf_writer as writer

    torch.manual_seed(0)
    import transformers

    model = transformers.AutoModelForCausalLM.from_config(
        make_tiny_hf_config("phi3"), dtype=torch.float32).eval()
    original = writer._hf_tensors_in_gguf_order

    def edited(hf_model, arch):
        tensors = original(hf_model, arch)
        if drop:
            del tensors[drop]
        if reshape:
            tensors[reshape] = tensors[reshape][:-1]
        return tensors

    writer._hf_tensors_in_gguf_order = edited
    try:
        return write_gguf_from_hf(model, None, tmp_path / "phi3.gguf", qtype)
    finally:
        writer._hf_tensors_in_gguf_order = original
        del gguf


def test_phi3_gguf_without_a_fused_tensor_names_it(tmp_path):
    path = _phi3_gguf(tmp_path, drop="blk.1.attn_qkv.weight")
    config = load_model_config(path)
    with pytest.raises(ModelFormatError, match=r"lacks tensor blk\.1\.attn_qkv\.weight") as e:
        load_tensors(path, config)
    assert "\n" not in str(e.value)


def test_phi3_gguf_with_a_misshapen_fused_tensor_names_it(tmp_path):
    path = _phi3_gguf(tmp_path, drop=None, reshape="blk.0.ffn_up.weight")
    config = load_model_config(path)
    with pytest.raises(ModelFormatError,
                       match=r"tensor model\.layers\.0\.mlp\.gate_up_proj\.weight has 191 rows "
                             r"but the config expects 192") as e:
        load_tensors(path, config)
    assert "\n" not in str(e.value)


def test_engine_caps_the_context_at_a_phi3_sliding_window_and_generates(tmp_path, caplog):
    """Phi-3-mini's 2047-token window, in small: full attention is exact within it, so the
    engine's context stops there, says so, and the model still decodes greedily as
    transformers does."""
    import transformers

    from strata.engine.core.engine import Engine, EngineConfig
    from strata.engine.protocol import SamplingSpec

    hf_config = make_tiny_hf_config("phi3")
    hf_config.sliding_window = 48
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).eval()
    path = write_gguf_from_hf(model, None, tmp_path / "phi3-swa.gguf", "F32")
    with caplog.at_level("INFO", logger="strata.engine.core.engine"):
        engine = Engine(EngineConfig(model_path=str(path), device="cpu", context_tokens=128))
        engine.load()
    try:
        assert engine.model_config.sliding_window == 48 and engine.context_tokens == 48
        assert "context capped at the model's sliding window of 48 tokens (asked for 128)" in [
            r.getMessage() for r in caplog.records]
        prompt = [(5 * i + 1) % 320 for i in range(20)]
        tokens = [t for step in engine.generate(prompt, SamplingSpec(max_tokens=10,
                                                                     temperature=0.0))
                  for t in step]
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=10, min_new_tokens=10,
                                 do_sample=False)
        assert tokens == out[0, 20:].tolist()
    finally:
        engine.close()


def test_engine_generates_from_a_mistral3_directory(tmp_path):

    from strata.engine.core.engine import Engine, EngineConfig
    from strata.engine.protocol import SamplingSpec

    hf_model = save_tiny_mistral3(tmp_path, "mistral")
    engine = Engine(EngineConfig(model_path=str(tmp_path), device="cpu", context_tokens=64))
    engine.load()
    try:
        assert engine.info()["model_type"] == "mistral"
        prompt = [(3 * i + 2) % 320 for i in range(16)]
        tokens = [t for step in engine.generate(prompt, SamplingSpec(max_tokens=8,
                                                                     temperature=0.0))
                  for t in step]
        with torch.no_grad():
            out = hf_model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=8,
                                    min_new_tokens=8, do_sample=False)
        assert tokens == out[0, 16:].tolist()
    finally:
        engine.close()
