"""Embeddings on the GPU: the engine's vectors (arena weights, bf16 compute, eager forward) match
transformers' float32 hidden states on the CPU, and an asleep engine refuses instead of faulting."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from strata.engine import protocol as p
from strata.engine.core import embedding
from strata.engine.core.engine import Engine, EngineConfig, EngineError
from tests.helpers.tiny_models import make_tiny_hf_model

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("variant", ["llama", "qwen3_moe"])
def test_cuda_vectors_match_transformers(tmp_path, variant) -> None:
    path, hf_model = make_tiny_hf_model(variant, tmp_path)
    engine = Engine(EngineConfig(model_path=str(path), device="cuda", context_tokens=256))
    engine.load()
    try:
        ids = tuple(range(3, 60))
        answer = embedding.embed(engine, p.Embed("e", (ids,), "mean"))
        with torch.no_grad():
            hidden = hf_model.model(torch.tensor([list(ids)])).last_hidden_state[0]
        expected = F.normalize(hidden.mean(dim=0), dim=0)
        got = torch.tensor(answer.vectors[0])
        # bf16 compute on the GPU: the direction agrees, not every digit.
        assert F.cosine_similarity(got, expected, dim=0).item() > 0.999
        engine.sleep()
        with pytest.raises(EngineError):
            embedding.embed(engine, p.Embed("e", (ids,), "last"))
        engine.wake()
        again = embedding.embed(engine, p.Embed("e", (ids,), "mean"))
        assert torch.allclose(torch.tensor(again.vectors[0]), got, atol=1e-6)
    finally:
        engine.close()
