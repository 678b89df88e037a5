"""Sleep and wake, random interleavings of every level, and the levels through the real engine
process and Service: output after coming back equals the output before."""

from __future__ import annotations

import gc
import random
from types import SimpleNamespace

import pytest

from strata.engine.core.engine import Engine, EngineConfig, EngineError, EngineOutOfMemory
from strata.engine.core.memory.cpu_mmap import CpuMmapBackend
from strata.engine.protocol import Done, SamplingSpec, Tokens
from strata.engine.service.facade import GenerationRequest
from strata.engine.service.service import Service
from strata.engine.service.settings import ServeSettings
from tests.core.engine_memory_helpers import (
    ALL_EXPERTS_BYTES,
    GREEDY,
    MIB,
    anonymous_rss_bytes,
    data_ptrs,
    make_engine,
    pages_return_to_os,
    run,
    save_big_expert_moe,
)
from tests.helpers.tiny_models import make_tiny_hf_model

PROMPT = list(range(3, 60))


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return save_big_expert_moe(tmp_path_factory.mktemp("moe"))


@pytest.fixture(scope="module")
def tiny_moe_dir(tmp_path_factory):
    path, _ = make_tiny_hf_model("qwen3_moe", tmp_path_factory.mktemp("tiny"))
    return path


def test_sleep_frees_weights_experts_and_kv_and_wake_restores_them(moe_dir, tmp_path) -> None:
    engine = make_engine(moe_dir, tmp_path, expert_cache="all")
    try:
        before = run(engine, PROMPT)
        ptrs = data_ptrs(engine)
        resident = {name: a["resident_bytes"] for name, a in engine.status()["arenas"].items()}
        assert resident["kv"] > 0 and resident["experts"] >= ALL_EXPERTS_BYTES
        gc.collect()
        rss_before = anonymous_rss_bytes()
        result = engine.sleep()
        rss_after = anonymous_rss_bytes()
        assert result["freed_bytes"] == sum(resident.values())
        assert result["offloaded_slots"] == [0]
        assert not pages_return_to_os() or rss_before - rss_after > 0.8 * sum(
            resident.values()), (rss_before / MIB, rss_after / MIB)
        status = engine.status()
        assert status["state"] == "sleeping"
        assert all(a["resident_bytes"] == 0 for a in status["arenas"].values())
        assert status["slots"][0]["location"] == "ram"  # the session waits in host RAM
        assert engine.sleep()["freed_bytes"] == 0
        with pytest.raises(EngineError, match="the model is asleep: wake it first"):
            run(engine, PROMPT)
        with pytest.raises(EngineError, match="asleep"):
            engine.refill_experts()

        woken = engine.wake()
        assert woken["copied_bytes"] >= resident["weights"] + ALL_EXPERTS_BYTES - 2 * MIB
        assert engine.status()["state"] == "loaded"
        assert run(engine, PROMPT + before + [9], slot=0)  # the session comes back by itself
        assert engine.last_usage.cached_tokens == len(PROMPT) + len(before) - 1
        assert data_ptrs(engine) == ptrs
        assert run(engine, PROMPT, slot=1) == before
    finally:
        engine.close()


def test_wake_without_memory_stays_asleep_and_succeeds_later(tiny_moe_dir, tmp_path) -> None:
    backend = CpuMmapBackend()
    engine = make_engine(tiny_moe_dir, tmp_path, backend=backend)
    try:
        before = run(engine, PROMPT)
        engine.sleep()
        # Room for the weights but not the experts: wake must undo the weights too.
        weights = engine.memory.weights.reserved_bytes
        backend.max_resident_bytes = backend.resident_bytes + weights
        with pytest.raises(EngineOutOfMemory, match=r"waking the model failed: .* MiB"):
            engine.wake()
        assert engine.status()["state"] == "sleeping"
        assert all(a["resident_bytes"] == 0 for a in engine.status()["arenas"].values())
        backend.max_resident_bytes = None
        engine.wake()
        assert run(engine, PROMPT, slot=2) == before
    finally:
        engine.close()


def _bring_back(engine: Engine) -> None:
    """What the service does before a request: wake, then refill."""
    if engine.status()["state"] == "sleeping":
        engine.wake()
    if engine.status()["arenas"]["experts"]["state"] != "mapped":
        engine.refill_experts()


def test_random_interleavings_keep_every_answer(tiny_moe_dir, tmp_path) -> None:
    # An N-slot cache (10 of 16 experts) under test, an untouched all-resident reference.
    engine = make_engine(tiny_moe_dir, tmp_path / "a", expert_cache="10")
    reference = make_engine(tiny_moe_dir, tmp_path / "b", expert_cache="all")
    rng = random.Random(1234)
    history: dict[int, list[int]] = {}
    num_brought_back = num_reused = 0
    ops = ["generate"] * 4 + ["release", "release", "refill", "sleep", "wake", "offload",
                              "restore"]
    try:
        for step in range(50):
            op = rng.choice(ops)
            if op == "release":
                engine.release_experts()
            elif op == "refill":
                if engine.status()["state"] == "sleeping":
                    with pytest.raises(EngineError, match="asleep"):
                        engine.refill_experts()
                else:
                    engine.refill_experts()
            elif op == "sleep":
                engine.sleep()
            elif op == "wake":
                engine.wake()
            elif op == "offload":
                engine.offload_session()
            elif op == "restore" and engine.status()["state"] != "sleeping":
                engine.restore_session()
            elif op == "generate":
                slot = rng.randrange(4)
                if slot in history and rng.random() < 0.6:
                    prompt = history[slot] + [rng.randrange(320) for _ in range(3)]
                else:
                    prompt = [rng.randrange(320) for _ in range(rng.randrange(2, 30))]
                if len(prompt) > 200:
                    prompt = prompt[-20:]
                try:
                    got = run(engine, prompt, slot=slot)
                except EngineError as exc:
                    assert "wake it first" in str(exc) or "refill it first" in str(exc)
                    _bring_back(engine)
                    num_brought_back += 1
                    got = run(engine, prompt, slot=slot)
                want = run(reference, prompt, slot=slot)
                assert got == want, (step, slot, prompt)
                assert engine.last_usage == reference.last_usage, step
                history[slot] = prompt + got
                num_reused += engine.last_usage.cached_tokens > 0
            totals = engine.status()["arena_totals"]
            assert totals["resident_bytes"] == sum(
                a.resident_bytes for a in engine.memory.arenas)
        # The sequence must have crossed the interesting paths, or it proves little.
        assert num_brought_back >= 3 and num_reused >= 3, (num_brought_back, num_reused)
        assert engine.status()["experts"]["num_evictions"] > 0
    finally:
        engine.close(), reference.close()


# ---- through the engine process and the Service ------------------------------------------


async def _answer(service: Service, prompt: list[int], slot: int = 0) -> list[int]:
    spec = SamplingSpec(max_tokens=GREEDY.max_tokens, temperature=0.0)
    events = [e async for e in service.generate(GenerationRequest(tuple(prompt), spec, slot))]
    assert isinstance(events[-1], Done), events[-1]
    return [t for e in events if isinstance(e, Tokens) for t in e.token_ids]


@pytest.mark.timeout(180)
async def test_service_brings_released_levels_back_for_a_request(tiny_moe_dir, tmp_path):
    config = EngineConfig(model_path=str(tiny_moe_dir), device="cpu",
                          snapshot_dir=str(tmp_path / "snapshots"), context_tokens=256)
    service = Service(ServeSettings(model=str(tiny_moe_dir), device="cpu"),
                      engine_config=config, text_assets=SimpleNamespace(),
                      engine_factory="strata.engine.core.engine:Engine",
                      vram_reader=lambda device_index=0: None, keep_standby=False)
    await service.start()
    try:
        before = await _answer(service, PROMPT, slot=1)
        released = await service.control("release_experts")
        assert released["levels"]["experts"] == "released"
        assert released["vram"]["experts"]["resident_bytes"] == 0
        assert await _answer(service, PROMPT, slot=2) == before
        assert service.status()["levels"]["experts"] == "resident"

        slept = await service.control("sleep")
        assert slept["state"] == "sleeping"
        assert all(a["resident_bytes"] == 0 for a in slept["vram"].values())
        assert await _answer(service, PROMPT, slot=3) == before
        assert service.status()["state"] == "loaded"
    finally:
        await service.stop()
