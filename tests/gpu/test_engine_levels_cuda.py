"""The engine's memory levels on a real GPU: NVML sees the VRAM go and come back, CUDA graphs
captured before a release replay identically after it, a refill against a full GPU answers
out_of_memory and succeeds later, and unload returns VRAM to the pre-start baseline."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch

from strata.engine.core.engine import Engine, EngineConfig, EngineOutOfMemory
from strata.engine.protocol import Done, SamplingSpec, Tokens
from tests.gpu.gpu_helpers import GIB, MIB, captured, nvml_used_bytes, wait_for_free_vram

pytestmark = pytest.mark.gpu

GREEDY = SamplingSpec(max_tokens=12, temperature=0.0)
PROMPT = list(range(5, 69))
_COMMON = {
    "vocab_size": 32000, "hidden_size": 1024, "intermediate_size": 2048,
    "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
    "head_dim": 128, "rms_norm_eps": 1e-6, "max_position_embeddings": 4096,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}, "tie_word_embeddings": False,
}
# 4 layers x 64 experts x 3 x 1024 x 1024 x 2 bytes = 1.5 GiB of experts: plain in NVML.
MOE = {**_COMMON, "model_type": "qwen3_moe", "moe_intermediate_size": 1024, "num_experts": 64,
       "num_experts_per_tok": 4, "norm_topk_prob": True}
DENSE = {**_COMMON, "model_type": "llama"}
EXPERTS_BYTES = 4 * 64 * 3 * 1024 * 1024 * 2


def random_engine(tmp_path, hf_config: dict, **options) -> Engine:
    path = tmp_path / f"{hf_config['model_type']}.json"
    path.write_text(json.dumps(hf_config))
    engine = Engine(EngineConfig(model_path=f"random:{path.name}", random_weights=str(path),
                                 device="cuda", context_tokens=1024,
                                 snapshot_dir=str(tmp_path / "snapshots"), **options))
    engine.load()
    return engine


def run(engine: Engine, prompt, slot: int = 0) -> list[int]:
    return [t for ids in engine.generate(prompt, GREEDY, slot=slot) for t in ids]


def data_ptrs(engine: Engine) -> dict[str, int]:
    return {name: p.data_ptr() for name, p in engine.model.named_parameters()}


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    engine = random_engine(tmp_path_factory.mktemp("moe"), MOE, expert_cache="all")
    yield engine
    engine.close()


def cold_run(engine, slot: int) -> list[int]:
    """PROMPT's greedy answer from an empty slot. Before/after comparisons use cold runs on one
    slot: a warm slot reuses a prefix whose K/V came from decode steps, and in bf16 that can
    flip a near-tie (docs/benchmarks.md), which says nothing about the weights coming back."""
    engine.erase_slot(slot)
    return run(engine, PROMPT, slot=slot)


def test_nvml_sees_experts_go_and_come_back(moe) -> None:
    before, ptrs = cold_run(moe, 1), data_ptrs(moe)
    used = nvml_used_bytes()
    result = moe.release_experts()
    released = nvml_used_bytes()
    assert result["freed_bytes"] >= EXPERTS_BYTES
    assert used - released >= 0.95 * EXPERTS_BYTES, ((used - released) / MIB)
    refill = moe.refill_experts()
    assert refill["copied_bytes"] == EXPERTS_BYTES
    assert nvml_used_bytes() - released >= 0.95 * EXPERTS_BYTES
    assert data_ptrs(moe) == ptrs
    assert cold_run(moe, 1) == before


def test_nvml_sees_sleep_and_wake(moe, monkeypatch) -> None:
    before = cold_run(moe, 2)
    run(moe, PROMPT)  # slot 0 holds a session for sleep to offload
    arenas = moe.status()["arenas"]
    resident = sum(a["resident_bytes"] for a in arenas.values())
    weights_and_experts = arenas["weights"]["resident_bytes"] + arenas["experts"]["resident_bytes"]
    used = nvml_used_bytes()
    moe.sleep()
    slept = nvml_used_bytes()
    assert used - slept >= 0.95 * resident, ((used - slept) / MIB, resident / MIB)
    monkeypatch.setenv("STRATA_VERIFY_REFILL", "1")
    woken = moe.wake()
    assert nvml_used_bytes() - slept >= 0.95 * weights_and_experts  # KV: with the next request
    assert woken["copied_bytes"] >= EXPERTS_BYTES
    assert moe.memory.experts.verify_slots() == 0
    assert cold_run(moe, 2) == before


def test_decode_graph_captured_before_a_release_replays_after_the_refill(moe) -> None:
    from strata.engine.core.fast.decode_graph import GraphDecoder

    decoder = GraphDecoder(moe.model, compile_pointwise=False)
    if not decoder.use_cuda_graphs:
        pytest.skip(f"no CUDA graph for this MoE decode: {decoder.note}")
    kv = moe.kv_arena.make_kv(3, 512)  # slot 3 is not used by the other tests
    spec = SamplingSpec(max_tokens=16, temperature=0.0)
    before = list(decoder.generate(kv, PROMPT, spec, 16))
    num_graphs = len(decoder.runner.graphs)
    moe.release_experts()
    moe.refill_experts()
    after = list(decoder.generate(kv, PROMPT, spec, 16))
    assert after == before
    assert len(decoder.runner.graphs) == num_graphs  # the same graphs replayed, none captured anew
    moe.kv_arena.release_slot(3)


def test_model_graph_captured_before_sleep_replays_after_wake(tmp_path) -> None:
    engine = random_engine(tmp_path, DENSE)
    try:
        kv = engine.kv_arena.make_kv(3, 128)
        device = engine.device
        prompt = torch.tensor(PROMPT[:32], device=device)
        static_ids = torch.tensor([7], device=device)
        with torch.inference_mode():
            engine.model(prompt, 0, kv)
            engine.model(static_ids, 32, kv)  # warm-ups: this one and captured's
            graph, static_logits = captured(lambda: engine.model(static_ids, 32, kv))
            graph.replay()
            expected = static_logits.clone()
            engine.sleep()  # unmaps weights and this KV: a replay now would fault
            engine.wake()
            engine.kv_arena.ensure_tokens(3, 128)  # same addresses, fresh pages
            engine.model(prompt, 0, kv)  # rebuild positions 0..31 eagerly
            static_logits.zero_()
            graph.replay()
            torch.cuda.synchronize()
        assert torch.equal(static_logits, expected)
    finally:
        engine.close()


def test_prefill_graphs_replay_in_a_slot_and_go_with_each_release(tmp_path) -> None:
    engine = random_engine(tmp_path, DENSE)
    try:
        engine.fast.enable_prefill_graphs(1024)  # whatever the load measured
        graphs = engine.fast.prefill_graphs
        other = [p + 1 for p in PROMPT]  # no common prefix: prefilled from position 0 again
        first = run(engine, PROMPT, slot=1)  # runs called, then captures bucket 64
        replayed = run(engine, other, slot=1)
        assert len(graphs) == 1
        engine.erase_slot(1)
        assert len(graphs) == 0  # its pool went back with the slot's KV
        assert run(engine, other, slot=1) == replayed  # called again, captured again
        engine.sleep()
        assert len(graphs) == 0
        engine.wake()
        engine.erase_slot(1)
        assert run(engine, PROMPT, slot=1) == first
    finally:
        engine.close()


_HOLDER = """
import sys, torch
free, _ = torch.cuda.mem_get_info()
keep = int(sys.argv[1])
block = torch.empty(max(free - keep, 0), dtype=torch.uint8, device="cuda")
print("ready", flush=True)
sys.stdin.readline()
"""


def test_refill_against_a_full_gpu_is_out_of_memory_then_succeeds(moe) -> None:
    before = run(moe, PROMPT)
    moe.release_experts()
    # Another process takes all but 256 MiB of what is free; the experts need 1.5 GiB.
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(256 * MIB)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ready"
        with pytest.raises(EngineOutOfMemory, match="MiB"):
            moe.refill_experts()
        assert moe.status()["arenas"]["experts"]["state"] == "released"
    finally:
        holder.stdin.write("\n")
        holder.stdin.flush()
        holder.wait(timeout=30)
    wait_for_free_vram(EXPERTS_BYTES + GIB)
    moe.refill_experts()
    assert run(moe, PROMPT, slot=1) == before


@pytest.mark.timeout(240)
async def test_unload_returns_vram_to_the_baseline(tmp_path) -> None:
    from strata.engine.service.facade import GenerationRequest
    from strata.engine.service.service import Service
    from strata.engine.service.settings import ServeSettings
    from tests.helpers.tiny_models import make_tiny_hf_model

    model_dir, _ = make_tiny_hf_model("qwen3_moe", tmp_path)
    baseline = nvml_used_bytes()
    config = EngineConfig(model_path=str(model_dir), device="cuda",
                          snapshot_dir=str(tmp_path / "snapshots"), context_tokens=256)
    service = Service(ServeSettings(model=str(model_dir), device="cuda"), engine_config=config,
                      text_assets=SimpleNamespace(), keep_standby=False,
                      engine_factory="strata.engine.core.engine:Engine")
    await service.start()
    try:
        request = GenerationRequest(tuple(PROMPT[:20]), GREEDY, 0)
        events = [e async for e in service.generate(request)]
        assert isinstance(events[-1], Done) and any(isinstance(e, Tokens) for e in events)
        assert nvml_used_bytes() > baseline + 64 * MIB  # a CUDA context and the model
        await service.control("unload")
        deadline = time.monotonic() + 10
        # A poll: NVML has no event for freed memory.
        while nvml_used_bytes() > baseline + 16 * MIB and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
        assert nvml_used_bytes() <= baseline + 16 * MIB, (nvml_used_bytes() - baseline) / MIB
    finally:
        await service.stop()


@pytest.mark.timeout(240)
async def test_a_rule_unload_frees_vram_exits_cleanly_and_keeps_the_session(tmp_path) -> None:
    """issue 18: the engine wrote the sessions before it gave VRAM back (491 ms) and then
    aborted at exit ("CUDA error: context is destroyed"); the session must survive."""
    from strata.engine.service.facade import GenerationRequest
    from strata.engine.service.service import Service
    from strata.engine.service.settings import ServeSettings
    from tests.helpers.tiny_models import make_tiny_hf_model

    model_dir, _ = make_tiny_hf_model("qwen3_moe", tmp_path)
    baseline = nvml_used_bytes()
    config = EngineConfig(model_path=str(model_dir), device="cuda",
                          snapshot_dir=str(tmp_path / "snapshots"), context_tokens=512)
    service = Service(ServeSettings(model=str(model_dir), device="cuda"), engine_config=config,
                      text_assets=SimpleNamespace(), keep_standby=False,
                      engine_factory="strata.engine.core.engine:Engine")
    await service.start()
    try:
        prompt = tuple(PROMPT[:200])
        events = [e async for e in service.generate(GenerationRequest(prompt, GREEDY, 0))]
        out = [t for e in events if isinstance(e, Tokens) for t in e.token_ids]
        await service.control("unload", keep_sessions=True)
        assert service.supervisor.last_exit_code == 0
        deadline = time.monotonic() + 10
        while nvml_used_bytes() > baseline + 16 * MIB and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
        assert nvml_used_bytes() <= baseline + 16 * MIB, (nvml_used_bytes() - baseline) / MIB
        assert sorted(p.name for p in (tmp_path / "snapshots").glob("strata-kept-slot*"))
        await service.control("load")
        follow_up = GenerationRequest(prompt + tuple(out) + (5, 6), GREEDY, 0)
        events = [e async for e in service.generate(follow_up)]
        assert isinstance(events[-1], Done)
        assert events[-1].usage.cached_tokens >= len(prompt)
    finally:
        await service.stop()


@pytest.mark.timeout(240)
async def test_the_standby_imports_the_compiler_without_a_cuda_context(tmp_path) -> None:
    """issue 18 item 6: the standby has torch.compile's compiler and the kernels imported, so
    a load from it pays for the model, not for imports; it still holds no VRAM."""
    from strata.engine.service.service import Service
    from strata.engine.service.settings import ServeSettings
    from tests.helpers.tiny_models import make_tiny_hf_model

    model_dir, _ = make_tiny_hf_model("llama", tmp_path)
    config = EngineConfig(model_path=str(model_dir), device="cuda",
                          snapshot_dir=str(tmp_path / "snapshots"), context_tokens=256)
    service = Service(ServeSettings(model=str(model_dir), device="cuda"), engine_config=config,
                      text_assets=SimpleNamespace(), keep_standby=True,
                      engine_factory="strata.engine.core.engine:Engine")
    await service.start()
    try:
        await service.control("unload")
        standby = None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            standby = await service.supervisor.standby_status()
            if standby.engine.standby.get("is_compiler_imported"):
                break
            await asyncio.sleep(0.5)
        assert standby.engine.standby["is_compiler_imported"], standby.engine
        assert not standby.engine.standby["is_cuda_initialized"]
    finally:
        await service.stop()
