"""Weights, experts and KV in arenas: release gives pages back, refill restores every byte at
the same addresses, the N-slot expert cache answers like all-resident, bad levels are refused."""

from __future__ import annotations

import gc

import pytest
import torch

from strata.engine.core.engine import Engine, EngineError, EngineOutOfMemory, LevelNotApplicable
from strata.engine.core.error_codes import error_code
from strata.engine.core.kv_cache import KVCache
from strata.engine.core.memory.cpu_mmap import CpuMmapBackend
from strata.engine.protocol import ReleaseExperts
from tests.core.engine_memory_helpers import (
    ALL_EXPERTS_BYTES,
    GREEDY,
    MIB,
    NUM_EXPERTS,
    anonymous_rss_bytes,
    arena,
    data_ptrs,
    make_engine,
    pages_return_to_os,
    run,
    save_big_expert_moe,
)
from tests.helpers.tiny_models import make_tiny_hf_model

PROMPTS = [list(range(3, 40)), list(range(100, 120)), [7, 300, 12, 9, 250, 18, 44]]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return save_big_expert_moe(tmp_path_factory.mktemp("moe"))


@pytest.fixture(scope="module")
def moe(moe_dir, tmp_path_factory) -> Engine:
    engine = make_engine(moe_dir, tmp_path_factory.mktemp("snapshots"), expert_cache="all")
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def reference(moe, tmp_path_factory) -> dict[int, list[int]]:
    """Greedy answers of the all-resident engine before any level was touched, by prompt."""
    return {i: run(moe, prompt, slot=3) for i, prompt in enumerate(PROMPTS)}


def expert_bytes(engine: Engine) -> torch.Tensor:
    """The experts arena's whole content, copied."""
    store = engine.memory.experts
    return torch.cat([w.flatten().view(torch.uint8) for w in store.slot_weights]).clone()


def test_every_parameter_lives_in_an_arena(moe) -> None:
    status = moe.status()
    assert set(status["arenas"]) == {"weights", "experts", "kv"}
    assert status["experts"]["mode"] == "all" and status["experts"]["is_all_resident"]
    assert arena(moe, "experts")["resident_bytes"] >= ALL_EXPERTS_BYTES
    ranges = [(a.base_address, a.base_address + a.reserved_bytes) for a in moe.memory.arenas]
    for name, param in moe.model.named_parameters():
        start, end = param.data_ptr(), param.data_ptr() + param.nbytes
        assert any(lo <= start and end <= hi for lo, hi in ranges), name


def test_release_returns_pages_and_refill_restores_every_byte(moe, reference) -> None:
    before_bytes, before_ptrs = expert_bytes(moe), data_ptrs(moe)
    gc.collect()
    rss_before = anonymous_rss_bytes()
    result = moe.release_experts()
    rss_after = anonymous_rss_bytes()
    assert result["freed_bytes"] >= ALL_EXPERTS_BYTES
    assert not pages_return_to_os() or rss_before - rss_after > 0.8 * ALL_EXPERTS_BYTES, (
        rss_before / MIB, rss_after / MIB)
    released = arena(moe, "experts")
    assert released["state"] == "released" and released["resident_bytes"] == 0
    assert released["released_bytes"] >= ALL_EXPERTS_BYTES

    refill = moe.refill_experts()
    assert refill["copied_bytes"] == ALL_EXPERTS_BYTES
    assert not pages_return_to_os() or anonymous_rss_bytes() - rss_after > 0.8 * ALL_EXPERTS_BYTES
    assert torch.equal(expert_bytes(moe), before_bytes)
    assert data_ptrs(moe) == before_ptrs  # CUDA graphs captured before stay valid
    for i, prompt in enumerate(PROMPTS):
        assert run(moe, prompt, slot=2) == reference[i]


def test_touching_released_experts_is_a_python_error(moe, reference) -> None:
    moe.release_experts()
    try:
        with pytest.raises(EngineError, match="the expert cache is released: refill it first"):
            run(moe, PROMPTS[0])
        # A direct forward over the released arena is refused too, not read as zeros.
        kv = KVCache.for_config(moe.model_config, 16, torch.float32, "cpu")
        with pytest.raises(EngineError, match="refill it first"), torch.inference_mode():
            moe.model(torch.tensor([1, 2, 3]), 0, kv)
        assert moe.release_experts()["freed_bytes"] == 0  # already released: nothing to do
    finally:
        moe.refill_experts()
    assert run(moe, PROMPTS[0], slot=1) == reference[0]


def test_slot_cache_answers_like_all_resident(moe_dir, reference, tmp_path) -> None:
    slots = make_engine(moe_dir, tmp_path, expert_cache=str(NUM_EXPERTS + 8))
    try:
        status = slots.status()["experts"]
        assert status["mode"] == "slots" and status["num_slots"] == NUM_EXPERTS + 8
        # The slots hold less than every expert; the prefill's staging (one layer's experts,
        # memory/expert_staging.py) lies in the same arena and is counted apart.
        slot_bytes = arena(slots, "experts")["resident_bytes"] - status["staging_bytes"]
        assert status["staging_bytes"] > 0 and slot_bytes < ALL_EXPERTS_BYTES
        for i, prompt in enumerate(PROMPTS):
            assert run(slots, prompt) == reference[i]
        counters = slots.status()["experts"]
        assert counters["num_hits"] > 0 and counters["num_misses"] > 0
        assert counters["num_evictions"] > 0

        slots.release_experts()
        with pytest.raises(EngineError, match="refill it first"):
            run(slots, PROMPTS[1])
        resident_before = counters["num_resident"]
        slots.refill_experts()
        assert slots.status()["experts"]["num_resident"] == resident_before
        assert slots.memory.experts.verify_slots() == 0
        assert run(slots, PROMPTS[1], slot=1) == reference[1]
    finally:
        slots.close()


def test_too_few_slots_for_one_layer_is_refused(moe_dir, tmp_path) -> None:
    with pytest.raises(ValueError, match="fewer than the 32 needed"):
        make_engine(moe_dir, tmp_path, expert_cache="8")


def test_refill_without_memory_is_out_of_memory_and_recovers(moe_dir, reference, tmp_path):
    backend = CpuMmapBackend()
    engine = make_engine(moe_dir, tmp_path, backend=backend, expert_cache="all")
    try:
        engine.release_experts()
        # Another process takes the memory: only 16 MiB stay free under the budget.
        backend.max_resident_bytes = backend.resident_bytes + 16 * MIB
        with pytest.raises(EngineOutOfMemory, match=r"MiB of VRAM missing") as caught:
            engine.refill_experts()
        assert error_code(caught.value, ReleaseExperts()) == "out_of_memory"
        assert caught.value.missing_bytes > 0
        assert arena(engine, "experts")["state"] == "released"  # rolled back, nothing lost
        assert engine.status()["experts"]["is_released"]
        backend.max_resident_bytes = None
        assert engine.refill_experts()["copied_bytes"] == ALL_EXPERTS_BYTES
        assert run(engine, PROMPTS[2]) == reference[2]
    finally:
        engine.close()


def test_verify_refill_reports_differing_slots(moe, monkeypatch) -> None:
    monkeypatch.setenv("STRATA_VERIFY_REFILL", "1")
    moe.release_experts()
    assert moe.refill_experts()["differing_slots"] == 0


def test_levels_that_do_not_apply_say_why(moe_dir, tmp_path) -> None:
    dense_dir, _ = make_tiny_hf_model("llama", tmp_path / "dense")
    dense = make_engine(dense_dir, tmp_path / "a")
    off = make_engine(moe_dir, tmp_path / "b", expert_cache="off")
    try:
        with pytest.raises(LevelNotApplicable, match="a dense model has no expert cache"):
            dense.release_experts()
        with pytest.raises(LevelNotApplicable, match="dense model"):
            dense.refill_experts()
        with pytest.raises(LevelNotApplicable, match="expert cache is off"):
            off.release_experts()
        assert error_code(LevelNotApplicable("x"), ReleaseExperts()) == "not_applicable"
        assert dense.status()["experts"] is None and off.status()["experts"] is None
        assert "experts" not in off.status()["arenas"]  # off: the experts are in "weights"
        assert arena(off, "weights")["resident_bytes"] >= ALL_EXPERTS_BYTES
    finally:
        dense.close(), off.close()


def test_kv_pages_follow_tokens_and_come_back_at_the_same_addresses(tmp_path) -> None:
    model_dir, _ = make_tiny_hf_model("llama", tmp_path / "dense")
    # 128 B of K per token and layer: a 1 MiB region per layer, mapped an eighth at a time
    # (a finer page size than CUDA's 2 MiB keeps the prompts short).
    engine = make_engine(model_dir, tmp_path / "snapshots", context_tokens=8192,
                         backend=CpuMmapBackend(granularity_bytes=64 * 1024))
    try:
        kv = engine.kv_arena
        assert arena(engine, "kv")["resident_bytes"] == 0
        prompt = list(range(3, 40))
        answer = run(engine, prompt, slot=0)
        grown = arena(engine, "kv")["resident_bytes"]
        assert grown == kv.num_regions * kv.chunk_bytes == 4 * MIB // 8  # a chunk per region
        assert kv.mapped_tokens(0) == 1024
        ptrs = data_ptrs(engine)
        gc.collect()
        rss_before = anonymous_rss_bytes()
        assert engine.offload_session()["offloaded_slots"] == [0]
        assert arena(engine, "kv")["resident_bytes"] == 0
        assert not pages_return_to_os() or rss_before - anonymous_rss_bytes() > 0.8 * grown
        follow = prompt + answer + [5]
        again = run(engine, follow, slot=0)
        assert engine.last_usage.cached_tokens == len(prompt) + len(answer) - 1
        assert data_ptrs(engine) == ptrs  # restored at the same addresses
        assert arena(engine, "kv")["resident_bytes"] == grown
        # Past the first chunk, the next pages are mapped (and zeroed) as the tokens grow.
        long_prompt = follow + again + list(range(1, 250)) * 5
        run(engine, long_prompt[: kv.mapped_tokens(0) + 100], slot=0)
        assert arena(engine, "kv")["resident_bytes"] == 2 * grown
    finally:
        engine.close()


def test_random_weights_load_into_the_same_arenas(tmp_path) -> None:
    import json

    hf_config = {
        "model_type": "qwen3_moe", "vocab_size": 500, "hidden_size": 64,
        "intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True,
        "max_position_embeddings": 512, "tie_word_embeddings": False,
    }
    (tmp_path / "config.json").write_text(json.dumps(hf_config))
    answers = []
    for name in ("a", "b"):  # seeded: two loads give the same model
        engine = make_engine(tmp_path, tmp_path / name, random_weights=str(tmp_path))
        assert set(engine.status()["arenas"]) == {"weights", "experts", "kv"}
        answers.append(run(engine, PROMPTS[1]))
        engine.release_experts(), engine.refill_experts()
        assert run(engine, PROMPTS[1], slot=1) == answers[0]
        norm = engine.model.model.norm.weight
        assert torch.all(norm == 1) and engine.model.lm_head.weight.std() > 0.01
        engine.close()
    assert answers[0] == answers[1]


def test_release_between_decode_steps_stops_cleanly(moe, reference) -> None:
    # The service refuses a release while a request runs; the engine must still stay
    # consistent if one lands between two steps: the next step refuses, the slot is free.
    steps = moe.generate(PROMPTS[2], GREEDY, slot=1)
    first = next(steps)
    moe.release_experts()
    with pytest.raises(EngineError, match="refill it first"):
        next(steps)
    assert not moe.slots.in_use and moe.last_usage.completion_tokens == 1
    moe.refill_experts()
    assert first == reference[2][:1]
    assert run(moe, PROMPTS[2], slot=1) == reference[2]
