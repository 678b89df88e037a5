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
    monkeypatch.setattr(residency, "WEIGHTS_CHUNK_BYTES", 2 * MIB)  # small chunks: visible frees
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


def test_a_cache_wired_whole_into_the_model_cannot_shrink(moe_dir, tmp_path):
    engine = make_engine(moe_dir, tmp_path, expert_cache="all")
    try:
        with pytest.raises(LevelNotApplicable, match="--expert-cache N"):
            engine.resize_experts(40)
    finally:
        engine.close()
