"""--vram-budget: every arena of an engine maps inside it, as on a smaller card; the expert
cache's auto sizing fits in what the weights leave (CPU backend, the same accounting a GPU's
CudaVmmBackend gets through the same wrapper)."""

from __future__ import annotations

import pytest

from strata.engine.core.engine import Engine, EngineConfig
from strata.engine.core.memory.arena import Arena, ArenaMapError
from strata.engine.core.memory.budget import BudgetedBackend, budget_free_bytes
from strata.engine.core.memory.cpu_mmap import CpuMmapBackend
from strata.engine.core.residency import EXPERT_RESERVE_BYTES
from strata.engine.protocol import SamplingSpec
from strata.units import MIB
from tests.helpers.tiny_models import make_tiny_hf_model


def test_budget_counts_every_arena_and_refuses_past_it() -> None:
    backend = BudgetedBackend(CpuMmapBackend(), 8 * MIB)
    first = Arena("a", 6 * MIB, backend, 2 * MIB)
    second = Arena("b", 4 * MIB, backend, 2 * MIB)
    first.map()
    assert backend.mapped_bytes == 6 * MIB and budget_free_bytes(backend) == 2 * MIB
    with pytest.raises(ArenaMapError, match="VRAM budget of 8 MiB"):
        second.map()
    assert backend.mapped_bytes == 6 * MIB  # the failed map rolled back, nothing counted
    first.release()
    second.map()  # what a release gives back, the other arena may take
    assert backend.mapped_bytes == 4 * MIB
    first.close(), second.close()
    assert budget_free_bytes(CpuMmapBackend()) is None


def _engine(path, budget_bytes: int = 0, expert_cache: str = "auto") -> Engine:
    return Engine(EngineConfig(model_path=str(path), device="cpu", context_tokens=64,
                               expert_cache=expert_cache, vram_budget_bytes=budget_bytes,
                               snapshot_ram_budget_bytes=1 << 20))


def test_auto_expert_cache_sizes_itself_inside_the_budget(tmp_path) -> None:
    # 4 layers x 8 experts: two layers would leave no partial cache beside the staging (one
    # layer's experts) and the minimum of one layer's slots.
    path, _ = make_tiny_hf_model("qwen3_moe", tmp_path, overrides={"num_hidden_layers": 4})
    free = _engine(path)
    free.load()
    weights_bytes = free.memory.weights.resident_bytes
    bytes_per_expert = free.memory.experts.bytes_per_expert
    assert free.memory.expert_mode == "all"  # the CPU keeps every expert without a budget
    free.close()

    # A partial cache also maps the prefill's staging, one layer's 8 experts whole
    # (memory/expert_staging.py), and auto leaves room for it.
    staging_bytes = 8 * bytes_per_expert
    budget = weights_bytes + EXPERT_RESERVE_BYTES + staging_bytes + 12 * bytes_per_expert
    engine = _engine(path, budget)
    engine.load()
    try:
        assert engine.memory.expert_mode == "slots"
        assert engine.memory.experts.num_slots == 12
        assert engine.status()["experts"]["staging_bytes"] == staging_bytes
        spec = SamplingSpec(max_tokens=4)
        tokens = [t for step in engine.generate(list(range(1, 20)), spec) for t in step]
        assert len(tokens) == 4
    finally:
        engine.close()


def test_a_model_larger_than_the_budget_is_refused_with_the_reason(tmp_path) -> None:
    path, _ = make_tiny_hf_model("llama", tmp_path)
    engine = _engine(path, budget_bytes=64 * 1024)
    with pytest.raises(ArenaMapError, match=r"the VRAM budget of 0 MiB has 0 MiB left "
                                            r"\(--vram-budget\)"):
        engine.load()
    assert engine.model is None and engine.memory is None
