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


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_vectors_equal_transformers_hidden_states_pooled(tiny, pooling) -> None:
    engine, hf_model = tiny
    inputs = ((5, 9, 17, 33, 2), tuple(range(3, 40)))
    answer = embedding.embed(engine, p.Embed("e", inputs, pooling))
    assert answer.request_id == "e" and answer.num_tokens == 5 + 37
    for ids, vector in zip(inputs, answer.vectors, strict=True):
        got = torch.tensor(vector)
        assert got.shape == (hf_model.config.hidden_size,)
        assert torch.linalg.vector_norm(got).item() == pytest.approx(1.0, abs=1e-5)
        torch.testing.assert_close(got, reference(hf_model, list(ids), pooling),
                                   atol=1e-4, rtol=1e-4)
    assert answer.vectors[0] != answer.vectors[1]


def test_pooling_none_is_every_tokens_hidden_state_in_order(tiny, monkeypatch) -> None:
    """llama.cpp's pooling none: a vector per token of each sequence, not normalized; a long
    one over several chunks gives the same rows."""
    engine, hf_model = tiny
    monkeypatch.setattr(embedding, "CHUNK_TOKENS", 16)
    inputs = ((5, 9, 17), tuple((i * 7) % 300 + 3 for i in range(40)))
    answer = embedding.embed(engine, p.Embed("e", inputs, "none"))
    assert len(answer.vectors) == 3 + 40 and answer.num_tokens == 43
    rows = torch.tensor(answer.vectors)
    for ids, got in zip(inputs, rows.split([3, 40]), strict=True):
        with torch.no_grad():
            want = hf_model.model(torch.tensor([ids])).last_hidden_state[0]  # [T, H]
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    norms = torch.linalg.vector_norm(rows, dim=1)
    assert not torch.allclose(norms, torch.ones_like(norms))  # not normalized


def test_a_long_input_runs_in_chunks_with_the_same_result(tiny, monkeypatch) -> None:
    engine, hf_model = tiny
    ids = tuple((i * 7) % 300 + 3 for i in range(50))
    monkeypatch.setattr(embedding, "CHUNK_TOKENS", 16)  # 4 chunks, the K/V carried across
    answer = embedding.embed(engine, p.Embed("e", (ids,), "mean"))
    torch.testing.assert_close(torch.tensor(answer.vectors[0]),
                               reference(hf_model, list(ids), "mean"), atol=1e-4, rtol=1e-4)


def test_embedding_touches_no_cache_slot(tiny) -> None:
    engine, _ = tiny
    prompt = list(range(3, 30))
    list(engine.generate(prompt, SamplingSpec(max_tokens=4), slot=0))
    before = engine.slots_status()
    embedding.embed(engine, p.Embed("e", (tuple(range(40, 90)),), "last"))
    assert engine.slots_status() == before
    list(engine.generate(prompt, SamplingSpec(max_tokens=4), slot=0))
    assert engine.last_usage.cached_tokens == len(prompt) - 1  # the slot's prefix survived


def test_a_job_runs_a_step_of_sequences_at_a_time(tiny, monkeypatch) -> None:
    """The engine loop reads the pipe between steps (chat tokens, Cancel): a job of many
    sequences takes several steps of at most STEP_TOKENS tokens, in order, same vectors."""
    engine, _ = tiny
    monkeypatch.setattr(embedding, "STEP_TOKENS", 20)
    inputs = tuple(tuple(range(3 + i, 10 + i)) for i in range(9))  # 7 tokens each
    inputs += (tuple(range(3, 60)),)  # one longer than a step runs alone
    job = embedding.EmbedJob(engine, p.Embed("e", inputs, "mean"))
    steps = []
    while not job.is_done:
        steps.append(job.step(engine))
    assert [len(s.vectors) for s in steps] == [2, 2, 2, 2, 1, 1]
    assert [s.num_tokens for s in steps] == [14, 14, 14, 14, 7, 57]
    whole = embedding.embed(engine, p.Embed("e", inputs, "mean"))
    assert [v for s in steps for v in s.vectors] == list(whole.vectors)
    assert job.num_tokens == whole.num_tokens == 9 * 7 + 57


@pytest.mark.parametrize(("command", "message"), [
    (p.Embed("e", ((1, 2),), "cls"), "pooling must be one of"),
    (p.Embed("e", (), "last"), "at least one sequence"),
    (p.Embed("e", ((),), "last"), "sequence 0 is empty"),
    (p.Embed("e", ((1, 10_000),), "last"), "outside 0..319"),
    (p.Embed("e", (tuple(range(3, 3 + 257)),), "last"), "the context is 256"),
])
def test_bad_input_is_refused(tiny, command, message) -> None:
    engine, _ = tiny
    with pytest.raises(EngineError, match=message):
        embedding.embed(engine, command)
