"""A prompt alone over a partial expert cache prefills in one chunk of
EngineConfig.partial_cache_solo_chunk_tokens (not prefill_solo_chunk_tokens): every chunk
stages every MoE layer's experts from the host again (memory/expert_staging.py), so one
chunk stages each layer once. The tokens equal the all-resident engine's."""

from __future__ import annotations

import os
from collections import Counter

import pytest
import torch

if not torch.cuda.is_available():  # before the first Triton import (see test_fast_paths.py)
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="Triton CPU interpreter not enabled"
)

from strata.engine.core.engine import Engine, EngineConfig
from strata.engine.core.slot_experts import SlotExperts
from strata.engine.protocol import SamplingSpec
from tests.helpers.tiny_models import make_tiny_hf_model

PROMPT = [(7 * i + 3) % 96 for i in range(100)]  # 100 tokens: 4 solo chunks of 32
GREEDY = SamplingSpec(max_tokens=6, temperature=0.0)


def _generate(path, expert_cache: str, partial_chunk_tokens: int,
              staged: Counter[int] | None = None) -> list[int]:
    # A partial cache takes the fast path on the CPU (the Triton interpreter): the staged
    # prefill is its own. The all-resident reference runs the reference forward (the CPU's
    # compiled all-resident MoE block cannot take float32 grouped GEMMs).
    engine = Engine(EngineConfig(
        model_path=str(path), device="cpu", context_tokens=256, expert_cache=expert_cache,
        fast_compile_pointwise=True if expert_cache != "all" else None,
        prefill_chunk_tokens=16, prefill_solo_chunk_tokens=32,
        partial_cache_solo_chunk_tokens=partial_chunk_tokens,
        snapshot_ram_budget_bytes=1 << 20))
    engine.load()
    try:
        assert (engine.fast is not None) == (expert_cache != "all")
        if staged is not None:
            staged.clear()  # the load's prefill probes staged too: count the prompt's only
        return [t for step in engine.generate(PROMPT, GREEDY) for t in step]
    finally:
        engine.close()


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path, _ = make_tiny_hf_model("qwen3_moe", tmp_path_factory.mktemp("moe"),
                                 overrides={"num_hidden_layers": 4})
    return path


@pytest.mark.parametrize("partial_chunk_tokens, chunks", [(128, 1), (0, 4)])
def test_a_prompt_alone_over_a_partial_cache_stages_each_layer_once(
        model_path, partial_chunk_tokens: int, chunks: int, monkeypatch) -> None:
    resident = _generate(model_path, "all", partial_chunk_tokens)
    staged: Counter[int] = Counter()
    original = SlotExperts.staged

    def counted(self, experts=None):
        staged[self.layer] += 1
        return original(self, experts)

    monkeypatch.setattr(SlotExperts, "staged", counted)
    tokens = _generate(model_path, "12", partial_chunk_tokens, staged)  # 12 slots of 32
    assert tokens == resident and len(tokens) == GREEDY.max_tokens
    # The last layer's MLP runs for the last token only (one token reads slots in place).
    assert [staged[layer] for layer in range(3)] == [chunks] * 3 and staged[3] == 0


def test_partial_cache_solo_chunk_tokens_must_not_be_negative(model_path) -> None:
    with pytest.raises(ValueError, match="partial_cache_solo_chunk_tokens must be >= 0"):
        EngineConfig(model_path=str(model_path), partial_cache_solo_chunk_tokens=-1)
