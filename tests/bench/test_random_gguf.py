"""bench/random_gguf.py writes the GGUF the llama.cpp peer loads: strata's own GGUF loader
must read back the same config and every tensor of the model, in its shape."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from random_gguf import write_random_gguf

from strata.engine.core.loader.gguf import load_gguf_config, open_gguf_tensors
from strata.engine.core.model_config import ModelConfig
from strata.engine.core.models.registry import model_module

TINY = ModelConfig(model_type="llama", vocab_size=300, hidden_size=64, intermediate_size=96,
                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=16, max_position_embeddings=512, rope_theta=10000.0)


@pytest.mark.parametrize("tied", [True, False])
def test_written_gguf_loads_back_as_the_same_model(tmp_path: Path, tied: bool) -> None:
    import dataclasses

    import torch

    config = dataclasses.replace(TINY, tie_word_embeddings=tied)
    path = tmp_path / "tiny.gguf"
    nbytes = write_random_gguf(config, path)
    loaded = load_gguf_config(path)
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "head_dim", "rope_theta",
                  "tie_word_embeddings", "max_position_embeddings"):
        assert getattr(loaded, field) == getattr(config, field), field
    with torch.device("meta"):
        expected = {n: tuple(p.shape)
                    for n, p in model_module("llama").Model(loaded).named_parameters()}
    tensors = open_gguf_tensors(path, loaded)
    assert {n: tuple(t.shape) for n, t in tensors.items()} == expected
    assert nbytes == sum(math.prod(t.shape) * (4 if len(t.shape) == 1 else 2)
                         for t in tensors.values())
    # Values as the presets draw them: normal(0, 0.02) weights, norms at 1.
    weight = tensors["model.layers.1.mlp.down_proj.weight"].read().float()
    assert abs(weight.std().item() - 0.02) < 0.002 and abs(weight.mean().item()) < 0.002
    assert torch.equal(tensors["model.norm.weight"].read().float(), torch.ones(64))


def test_mixtral_is_refused_by_name(tmp_path: Path) -> None:
    import dataclasses

    mixtral = dataclasses.replace(TINY, model_type="mixtral", num_experts=4,
                                  num_experts_per_tok=2, moe_intermediate_size=96)
    with pytest.raises(ValueError, match=r"this config is a mixtral model: .* for llama, "):
        write_random_gguf(mixtral, tmp_path / "moe.gguf")
    assert not (tmp_path / "moe.gguf").exists()
