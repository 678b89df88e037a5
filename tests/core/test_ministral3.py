"""Ministral 3 / Devstral 2 specifics beyond the shared parity runs (test_models_parity.py,
test_gguf_parity.py): the query temperature is really applied, the multimodal wrapper with a
ministral3 text model, and what `strata info` and the GGUF loader say about mistral3 files."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from strata.engine.core.kv_cache import KVCache
from strata.engine.core.loader import inspect_model, load_model_config
from strata.engine.core.loader.hf import load_hf_config, load_hf_tensors
from strata.engine.core.model_config import ModelFormatError
from strata.engine.core.models.build import build_model
from tests.helpers.gguf_writer import write_gguf_from_hf
from tests.helpers.tiny_models import make_tiny_hf_config, make_tiny_hf_model, save_tiny_mistral3

ATOL = 1e-4


@torch.no_grad()
def test_the_query_temperature_matters_past_its_period_only(tmp_path):
    """Guards the parity runs: without the scale the logits differ from transformers' past
    the original context (8 tokens) and are equal within it, where the scale is exactly 1."""
    directory, hf_model = make_tiny_hf_model("ministral3", tmp_path)
    config = load_hf_config(directory)
    assert (config.llama4_scaling_beta, config.llama4_scaling_period_tokens) == (0.5, 8)
    prompt = torch.arange(30) * 7 % config.vocab_size
    expected = hf_model(prompt[None]).logits[0]
    plain = dataclasses.replace(config, llama4_scaling_beta=0.0, llama4_scaling_period_tokens=0)
    model = build_model(plain, load_hf_tensors(directory, plain))
    logits = model(prompt, 0, KVCache.for_config(plain, 32))
    torch.testing.assert_close(logits[:8], expected[:8], atol=ATOL, rtol=0)
    assert (logits[8:] - expected[8:]).abs().max() > 1e-2


@torch.no_grad()
def test_mistral3_wrapper_with_a_ministral3_text_model_loads_it(tmp_path):
    """Ministral 3's released checkpoints are Mistral3ForConditionalGeneration with a
    ministral3 text_config: its language model loads alone and equals the wrapped one."""

    hf_model = save_tiny_mistral3(tmp_path, "ministral3")
    ours = load_hf_config(tmp_path)
    assert ours.model_type == "ministral3" and ours.llama4_scaling_beta == 0.5
    info = inspect_model(tmp_path)
    assert info.model_type == "ministral3" and info.is_supported
    model = build_model(ours, load_hf_tensors(tmp_path, ours))
    prompt = torch.arange(30) * 3 % ours.vocab_size
    logits = model(prompt, 0, KVCache.for_config(ours, 32))
    torch.testing.assert_close(logits, hf_model(input_ids=prompt[None]).logits[0],
                               atol=ATOL, rtol=0)


def _gguf(tmp_path):
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        make_tiny_hf_config("ministral3"), dtype=torch.float32).eval()
    return write_gguf_from_hf(model, None, tmp_path / "ministral3.gguf", "Q8_0")


def test_strata_info_names_a_mistral3_gguf_runnable(tmp_path):
    info = inspect_model(_gguf(tmp_path))
    assert (info.format, info.model_type, info.is_supported) == ("gguf", "ministral3", True)


def test_a_temperature_without_its_period_is_a_one_line_error(tmp_path, monkeypatch):
    """llama.cpp refuses such a file too (mistral3.cpp: invalid n_ctx_orig_yarn)."""
    import gguf

    original = gguf.GGUFWriter.add_rope_scaling_orig_ctx_len
    monkeypatch.setattr(gguf.GGUFWriter, "add_rope_scaling_orig_ctx_len", lambda *a: None)
    path = _gguf(tmp_path)
    monkeypatch.setattr(gguf.GGUFWriter, "add_rope_scaling_orig_ctx_len", original)
    with pytest.raises(ModelFormatError, match=r"temperature_scale but no rope\.scaling\."
                                               r"original_context_length") as e:
        load_model_config(path)
    assert "\n" not in str(e.value)
