"""The guard sized to the need: what a load, wake or refill maps, computed on the host, and a
refusal for want of VRAM that is a state (waiting_for_vram), never a crash."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
from fakes.services import EXPERT_BYTES, WEIGHTS_BYTES, answer, make_service, moe
from safetensors.numpy import save_file

from strata.engine import protocol as p
from strata.engine.core.error_codes import error_code
from strata.engine.core.memory.arena import ArenaMapError
from strata.engine.service.facade import ServiceError
from strata.engine.service.load_size import (
    AUTO_EXPERT_RESERVE_BYTES,
    COME_BACK_WORKSPACE_BYTES,
    LOAD_WORKSPACE_BYTES,
    StoredSize,
    load_bytes,
    random_weights_size,
    stored_size,
)
from strata.engine.service.vram_guard import VramGuard
from strata.units import GIB, MIB

pytestmark = pytest.mark.timeout(120)


def write_moe_gguf(path, num_layers=2, num_experts=4) -> tuple[int, int]:
    """A GGUF with dense and stacked expert tensors; returns (dense, expert) bytes stored."""
    writer = gguf.GGUFWriter(str(path), "qwen3moe")
    writer.add_expert_count(num_experts)
    dense = experts = 0
    tensors = {"token_embd.weight": np.zeros((64, 32), np.float16)}
    for layer in range(num_layers):
        tensors[f"blk.{layer}.attn_q.weight"] = np.zeros((32, 32), np.float16)
        for proj in ("gate", "up", "down"):
            tensors[f"blk.{layer}.ffn_{proj}_exps.weight"] = np.zeros((num_experts, 16, 32),
                                                                      np.float16)
    for name, array in tensors.items():
        writer.add_tensor(name, array)
        if "_exps." in name:
            experts += array.nbytes
        else:
            dense += array.nbytes
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dense, experts


def test_a_gguf_is_sized_as_stored_with_its_experts_apart(tmp_path):
    dense, experts = write_moe_gguf(tmp_path / "m.gguf")
    size = stored_size(str(tmp_path / "m.gguf"))
    assert size == StoredSize(dense, experts, num_sparse_layers=2, num_experts=4)


def test_a_hf_directory_counts_float32_as_the_bf16_it_becomes(tmp_path):
    save_file({"model.embed_tokens.weight": np.zeros((10, 8), np.float32),
               "model.layers.0.mlp.experts.0.up_proj.weight": np.zeros((4, 8), np.float16),
               "model.layers.0.mlp.experts.1.up_proj.weight": np.zeros((4, 8), np.float16)},
              str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text('{"num_experts": 2}')
    assert stored_size(str(tmp_path)) == StoredSize(10 * 8 * 2, 2 * 4 * 8 * 2, 1, 2)


def test_the_expert_cache_policy_sets_the_expert_bytes_of_a_load():
    size = StoredSize(dense_bytes=GIB, expert_bytes=48 * GIB, num_sparse_layers=48,
                      num_experts=128)
    one_layer = GIB  # 48 GiB over 48 layers
    assert size.expert_cache_bytes("all") == 48 * GIB
    assert size.expert_cache_bytes("off") == 0
    assert size.expert_cache_bytes("auto") == one_layer + AUTO_EXPERT_RESERVE_BYTES
    assert size.expert_cache_bytes("256") == 2 * GIB  # 256 slots of 8 MiB
    assert size.expert_cache_bytes("8GiB") == 8 * GIB
    assert StoredSize(GIB, 0).expert_cache_bytes("all") == 0  # dense


def test_load_bytes_of_a_gpu_load_and_nothing_for_random_weights(tmp_path):
    dense, experts = write_moe_gguf(tmp_path / "m.gguf")

    class Config:
        model_path = str(tmp_path / "m.gguf")
        device = "auto"
        expert_cache = "all"
        random_weights = None

    assert load_bytes(Config()) == dense + experts + LOAD_WORKSPACE_BYTES
    Config.random_weights = "qwen3-30b-a3b"  # a preset name: its shape lives with torch
    assert load_bytes(Config()) == 0


def test_random_weights_are_sized_from_their_config_like_the_real_parameter_count(tmp_path):
    from strata.engine.core.random_weights import PRESETS  # tests may import torch

    path = tmp_path / "config.json"
    path.write_text(json.dumps({**PRESETS["qwen3-30b-a3b"], "num_hidden_layers": 48}))
    size = random_weights_size(str(path))
    params = (size.dense_bytes + size.expert_bytes) / 2
    assert abs(params - 30.5e9) / 30.5e9 < 0.02  # Qwen3-30B-A3B: 30.5B parameters
    assert size.expert_bytes == 2 * 48 * 128 * 3 * 2048 * 768
    assert (size.num_sparse_layers, size.num_experts) == (48, 128)


async def test_the_guard_counts_the_step_and_the_reserve_and_looks_once_when_asked():
    reads = []

    def reader():
        reads.append(1)
        return 1000 * MIB

    guard = VramGuard(200, 30.0, reader=reader)
    assert await guard.wait_for_room("wake", 800 * MIB) == 1000 * MIB  # 800 + 200 fit
    with pytest.raises(ServiceError) as refused:
        await guard.wait_for_room("wake the model", 801 * MIB, wait_s=0)
    assert len(reads) == 2  # wait_s=0: one look, no 30 s wait
    assert refused.value.message.startswith(
        "cannot wake the model yet: needs 1001 MiB free (801 MiB to map + 200 MiB reserve), "
        "1000 MiB free: 1 MiB missing")
    assert refused.value.retry_after_s > 0
    assert await VramGuard(0, 1.0, reader=reader).wait_for_room("load", 0) is None


def test_a_load_whose_arenas_cannot_be_mapped_is_out_of_memory_not_a_failed_model():
    exc = ArenaMapError("cannot map 512 MiB", "weights", 512 * MIB)
    assert error_code(exc, p.Load("x")) == "out_of_memory"


async def test_a_load_refused_for_vram_is_waiting_not_a_crash(tiny_model_dir, tmp_path):
    oom_file = tmp_path / "no-vram"
    oom_file.touch()
    service = make_service(tiny_model_dir, engine={"oom_file": str(oom_file)})
    await service.start()
    try:
        status = service.status()
        assert status["state"] == "waiting_for_vram" and status["engine_crashes"] == 0
        assert status["last_error"] is None and status["waiting_for_vram"]["what"] == \
            "load the model"
        with pytest.raises(ServiceError) as refused:
            await answer(service, (5, 6))
        assert refused.value.code == "insufficient_vram" and refused.value.retry_after_s
        assert service.status()["engine_crashes"] == 0
        assert service.status()["engine"]["state"] == "unloaded"  # no backoff to sit out
        oom_file.unlink()
        ids, _ = await answer(service, (5, 6))
        assert ids and service.status()["state"] == "loaded"
        assert service.status()["waiting_for_vram"] is None
    finally:
        await service.stop()


async def test_a_wake_is_sized_to_what_it_maps_back(tiny_model_dir):
    free = {"bytes": 8 * GIB}
    service = make_service(tiny_model_dir, engine=moe(), vram_reader=lambda: free["bytes"])
    await service.start()
    try:
        await service.control("sleep")
        need_bytes = WEIGHTS_BYTES + EXPERT_BYTES + COME_BACK_WORKSPACE_BYTES
        free["bytes"] = need_bytes - MIB
        with pytest.raises(ServiceError) as refused:
            await service.control("wake", vram_wait_s=0)
        assert f"needs {need_bytes // MIB} MiB free" in refused.value.message
        assert service.status()["state"] == "sleeping"
        assert service.status()["waiting_for_vram"]["what"] == "wake the model"
        free["bytes"] = need_bytes
        assert (await service.control("wake", vram_wait_s=0))["changed"]
        assert service.status()["state"] == "loaded"
        with pytest.raises(ServiceError) as bad:
            await service.control("sleep", vram_wait_s=0)
        assert bad.value.status == 400 and "vram_wait_s" in bad.value.message
    finally:
        await service.stop()


async def test_a_rule_unload_keeps_the_sessions_for_the_next_load(tiny_model_dir, tmp_path):
    service = make_service(tiny_model_dir, engine={"snapshot_dir": str(tmp_path)})
    await service.start()
    try:
        prompt = tuple(range(10, 40))
        ids, _ = await answer(service, prompt, max_tokens=4)
        await service.control("unload", keep_sessions=True)
        assert service.status()["state"] == "unloaded"
        await service.control("load")
        _, usage = await answer(service, prompt + tuple(ids) + (7, 8), max_tokens=2)
        assert usage.cached_tokens >= len(prompt)
        # A plain unload keeps nothing (sessions are temporary unless persisted).
        await service.control("unload")
        await service.control("load")
        _, usage = await answer(service, prompt + tuple(ids) + (7, 8), max_tokens=2)
        assert usage.cached_tokens == 0
    finally:
        await service.stop()


def test_glm_mtp_layers_are_not_sized_and_its_experts_are_counted(tmp_path):
    """GLM files carry a multi-token-prediction layer past the decoder's, which the engine
    skips: neither a GGUF block nor a HF layer of it counts toward the VRAM a load needs."""
    writer = gguf.GGUFWriter(str(tmp_path / "g.gguf"), "glm4moe")
    writer.add_block_count(2)
    writer.add_nextn_predict_layers(1)
    writer.add_expert_count(4)
    for name, shape in (("blk.0.ffn_gate_exps.weight", (4, 16, 32)),
                        ("blk.1.ffn_gate_exps.weight", (4, 16, 32)),
                        ("blk.0.attn_q.weight", (32, 32)), ("blk.1.attn_q.weight", (32, 32))):
        writer.add_tensor(name, np.zeros(shape, np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert stored_size(str(tmp_path / "g.gguf")) == StoredSize(32 * 32 * 2, 4 * 16 * 32 * 2, 1, 4)

    directory = tmp_path / "hf"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(
        {"model_type": "glm4_moe", "num_hidden_layers": 1, "n_routed_experts": 4}))
    save_file({"model.layers.0.mlp.experts.0.up_proj.weight": np.zeros((16, 32), np.float16),
               "model.layers.0.mlp.shared_experts.up_proj.weight": np.zeros((16, 32), np.float16),
               "model.layers.1.eh_proj.weight": np.zeros((32, 64), np.float16)},
              str(directory / "model.safetensors"))
    assert stored_size(str(directory)) == StoredSize(16 * 32 * 2, 16 * 32 * 2, 1, 4)
