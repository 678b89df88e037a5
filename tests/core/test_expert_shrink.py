"""shrink_experts in the engine (CPU backend): fewer expert slots free their memory while the
model keeps answering exactly as before (misses come from the host copy), and it grows back."""

from __future__ import annotations

import pytest

from strata.engine.core import residency
from strata.engine.core.engine import EngineError
from strata.engine.core.engine_errors import LevelNotApplicable
from tests.core.engine_memory_helpers import (
    EXPERT_BYTES,
    MIB,
    NUM_EXPERTS,
    arena,
    make_engine,
    run,
    save_big_expert_moe,
)

PROMPT = list(range(3, 23))


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return save_big_expert_moe(tmp_path_factory.mktemp("moe"))


def test_a_shrunk_cache_answers_like_a_full_one_and_grows_back(moe_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(residency, "EXPERTS_CHUNK_BYTES", 2 * MIB)  # small chunks: visible frees
    engine = make_engine(moe_dir, tmp_path / "a", expert_cache="48")
    reference = make_engine(moe_dir, tmp_path / "b", expert_cache="all")
    try:
        expected = run(reference, PROMPT)
        assert run(engine, PROMPT) == expected
        before_bytes = arena(engine, "experts")["resident_bytes"]
        shrunk = engine.resize_experts(1)  # at least one layer's experts stay: 32 slots
        assert (shrunk["num_slots"], shrunk["max_slots"]) == (NUM_EXPERTS, 48)
        # 16 slots of gate, up and down; chunks that also hold kept slots stay mapped.
        assert 16 * EXPERT_BYTES - 3 * 2 * MIB <= shrunk["freed_bytes"] <= 16 * EXPERT_BYTES
        assert arena(engine, "experts")["resident_bytes"] == before_bytes - shrunk["freed_bytes"]
        assert engine.status()["experts"]["num_slots"] == NUM_EXPERTS
        assert run(engine, PROMPT, slot=1) == expected  # every expert still reachable
        grown = engine.resize_experts(48)
        assert grown["mapped_bytes"] == shrunk["freed_bytes"] and grown["num_slots"] == 48
        assert run(engine, PROMPT, slot=2) == expected
        engine.resize_experts(40)
        engine.release_experts()
        with pytest.raises(EngineError, match="not resident"):
            engine.resize_experts(48)
        engine.refill_experts()  # a refill brings every slot back
        assert engine.status()["experts"]["num_slots"] == 48
        assert arena(engine, "experts")["resident_bytes"] == before_bytes
        assert run(engine, PROMPT, slot=3) == expected
        engine.resize_experts(36)
        engine.refill_experts()  # refill of a shrunk (not released) cache: grow to all
        assert engine.status()["experts"]["num_slots"] == 48
    finally:
        engine.close()
        reference.close()


def test_an_all_resident_cache_shrinks_live_and_grows_back(moe_dir, tmp_path, monkeypatch):
    """Issue 54: every expert fit at load (wired into the model), yet a shrink frees them
    while serving: the model switches to the partial cache, answers as before, grows back."""
    monkeypatch.setattr(residency, "EXPERTS_CHUNK_BYTES", 2 * MIB)
    engine = make_engine(moe_dir, tmp_path, expert_cache="all")
    try:
        expected = run(engine, PROMPT)
        assert engine.status()["experts"]["mode"] == "all"
        before_bytes = arena(engine, "experts")["resident_bytes"]
        unchanged = engine.resize_experts(2 * NUM_EXPERTS)  # all of them: nothing to do
        assert unchanged["freed_bytes"] == 0 and engine.status()["experts"]["mode"] == "all"
        shrunk = engine.resize_experts(40)
        assert shrunk["switched_to_slots"] and shrunk["num_slots"] == 40
        assert 24 * EXPERT_BYTES - 3 * 2 * MIB <= shrunk["freed_bytes"] <= 24 * EXPERT_BYTES
        assert arena(engine, "experts")["resident_bytes"] == before_bytes - shrunk["freed_bytes"]
        # One layer's experts whole for prefill chunks, in an arena of its own.
        assert shrunk["staging_bytes"] == arena(engine, "expert_staging")["resident_bytes"] > 0
        # Now staged a chunk, a lone prompt takes the partial cache's longer chunk.
        assert engine.scheduler.solo_chunk_tokens == engine.config.partial_cache_solo_chunk_tokens
        status = engine.status()["experts"]
        assert (status["mode"], status["num_slots"], status["is_all_resident"]) == (
            "slots", 40, False)
        # The wired stacks are meta placeholders now, as a load into a partial cache leaves
        # them: nothing reads slots that the shrink may have unmapped through them.
        stacks = [mlp.experts for mlp in engine.model.modules() if hasattr(mlp, "expert_weights")]
        assert stacks and all(getattr(s, n).is_meta for s in stacks
                              for n in ("gate_proj", "up_proj", "down_proj"))
        assert run(engine, PROMPT, slot=1) == expected
        assert engine.status()["experts"]["num_misses"] > 0  # the cache served the misses
        grown = engine.resize_experts(2 * NUM_EXPERTS)
        assert grown["mapped_bytes"] == shrunk["freed_bytes"] and grown["num_slots"] == 64
        assert engine.status()["experts"]["mode"] == "slots"  # every slot, through the table
        assert run(engine, PROMPT, slot=2) == expected
        engine.release_experts()  # the staging goes with the slots, and comes back with them
        assert arena(engine, "expert_staging")["resident_bytes"] == 0
        engine.refill_experts()
        assert arena(engine, "expert_staging")["resident_bytes"] == shrunk["staging_bytes"]
        assert run(engine, PROMPT, slot=3) == expected
    finally:
        engine.close()


def test_a_shrink_the_decoder_cannot_read_changes_nothing(moe_dir, tmp_path):
    """A decoder whose MoE kernels cannot read a partial cache (here: bmm) refuses the live
    shrink before anything moves."""
    from strata.engine.core.fast.decode_graph import GraphDecoder

    engine = make_engine(moe_dir, tmp_path, expert_cache="all")
    try:
        engine.fast = GraphDecoder(engine.model, use_cuda_graphs=False, compile_pointwise=False,
                                   moe_impl="bmm")
        before_bytes = arena(engine, "experts")["resident_bytes"]
        with pytest.raises(LevelNotApplicable, match="cannot shrink while serving"):
            engine.resize_experts(40)
        assert engine.status()["experts"]["mode"] == "all"
        assert arena(engine, "experts")["resident_bytes"] == before_bytes
    finally:
        engine.close()


def test_an_auto_expert_cache_without_room_is_out_of_memory_not_a_bad_model(monkeypatch):
    """A load while a game holds the GPU: auto finds too little free VRAM for one layer's
    experts. That is a refusal the host waits out (out_of_memory), not a failed model."""
    import torch

    from strata.engine import protocol as p
    from strata.engine.core.engine_errors import EngineOutOfMemory
    from strata.engine.core.error_codes import error_code
    from strata.engine.core.model_config import ModelConfig

    memory = residency.ModelMemory.__new__(residency.ModelMemory)
    memory.device, memory.dtype = torch.device("cuda", 0), torch.bfloat16  # no GPU touched
    memory.backend = None  # no --vram-budget: only the free VRAM read below counts
    monkeypatch.setattr(residency, "read_free_vram_bytes", lambda index: 512 * MIB)
    config = ModelConfig(model_type="qwen3_moe", vocab_size=10, hidden_size=64,
                         intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=32, num_experts=8,
                         num_experts_per_tok=2, moe_intermediate_size=32)
    names = ("g", "u", "d")
    shapes = {"g": (8, 32, 64), "u": (8, 32, 64), "d": (8, 64, 32)}
    per_expert, num_classes, largest = memory._bytes_per_expert(shapes, {0: names, 1: names},
                                                                {})
    assert (per_expert, num_classes, largest) == (3 * 32 * 64 * 2, 1, per_expert)  # bf16
    with pytest.raises(EngineOutOfMemory) as refused:
        memory._expert_slots("auto", config, 2, per_expert)
    assert error_code(refused.value, p.Load("m")) == "out_of_memory"
    with pytest.raises(ValueError):  # an explicit count below one layer's experts: a setting
        memory._expert_slots("4", config, 2, per_expert)
