"""Embeddings on the real Engine: transformers' final hidden states pooled the same way, no cache
slot touched, bad input refused (core/embedding.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from strata.engine import protocol as p
from strata.engine.core import embedding
from strata.engine.core.engine import Engine, EngineConfig, EngineError
from strata.engine.protocol import SamplingSpec
from tests.helpers.tiny_models import make_tiny_hf_model


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def tiny(request, tmp_path_factory):
    path, hf_model = make_tiny_hf_model(request.param, tmp_path_factory.mktemp("models"))
    engine = Engine(EngineConfig(model_path=str(path), device="cpu", context_tokens=256))
    engine.load()
    yield engine, hf_model
    engine.close()


def reference(hf_model, ids: list[int], pooling: str) -> torch.Tensor:
    """transformers' last hidden state (the final norm applied), pooled, L2-normalized."""
    with torch.no_grad():
        hidden = hf_model.model(torch.tensor([ids])).last_hidden_state[0]  # [T, H]
    pooled = hidden[-1] if pooling == "last" else hidden.mean(dim=0)
    return F.normalize(pooled, dim=0)


@pytest.mark.parametrize("pooling", p.POOLINGS)
def test_vectors_equal_transformers_hidden_states_pooled(tiny, pooling) -> None:
    engine, hf_model = tiny
    inputs = ((5, 9, 17, 33, 2), tuple(range(3, 40)))
    answer = embedding.embed(engine, p.Embed(inputs, pooling), command_id=7)
    assert answer.command_id == 7 and answer.num_tokens == 5 + 37
    for ids, vector in zip(inputs, answer.vectors, strict=True):
        got = torch.tensor(vector)
        assert got.shape == (hf_model.config.hidden_size,)
        assert torch.linalg.vector_norm(got).item() == pytest.approx(1.0, abs=1e-5)
        torch.testing.assert_close(got, reference(hf_model, list(ids), pooling),
                                   atol=1e-4, rtol=1e-4)
    assert answer.vectors[0] != answer.vectors[1]


def test_a_long_input_runs_in_chunks_with_the_same_result(tiny, monkeypatch) -> None:
    engine, hf_model = tiny
    ids = tuple((i * 7) % 300 + 3 for i in range(50))
    monkeypatch.setattr(embedding, "CHUNK_TOKENS", 16)  # 4 chunks, the K/V carried across
    answer = embedding.embed(engine, p.Embed((ids,), "mean"), command_id=1)
    torch.testing.assert_close(torch.tensor(answer.vectors[0]),
                               reference(hf_model, list(ids), "mean"), atol=1e-4, rtol=1e-4)


def test_embedding_touches_no_cache_slot(tiny) -> None:
    engine, _ = tiny
    prompt = list(range(3, 30))
    list(engine.generate(prompt, SamplingSpec(max_tokens=4), slot=0))
    before = engine.slots_status()
    embedding.embed(engine, p.Embed((tuple(range(40, 90)),), "last"), command_id=1)
    assert engine.slots_status() == before
    list(engine.generate(prompt, SamplingSpec(max_tokens=4), slot=0))
    assert engine.last_usage.cached_tokens == len(prompt) - 1  # the slot's prefix survived


@pytest.mark.parametrize(("command", "message"), [
    (p.Embed(((1, 2),), "cls"), "pooling must be one of"),
    (p.Embed((), "last"), "at least one sequence"),
    (p.Embed(((),), "last"), "sequence 0 is empty"),
    (p.Embed(((1, 10_000),), "last"), "outside 0..319"),
    (p.Embed((tuple(range(3, 3 + 257)),), "last"), "the context is 256"),
])
def test_bad_input_is_refused(tiny, command, message) -> None:
    engine, _ = tiny
    with pytest.raises(EngineError, match=message):
        embedding.embed(engine, command, command_id=1)
