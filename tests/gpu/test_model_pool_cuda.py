"""Two models on a real GPU under a VRAM budget (issue 24): the second loads on its first
request, the first goes down the levels to make room, and NVML sees its engine process give
the VRAM back; asked again, it comes back and the other one makes room."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from strata.engine.core.memory.vram import gpu_processes
from strata.engine.core.model_config import ModelConfig
from strata.engine.protocol import SamplingSpec
from strata.engine.service.facade import GenerationRequest
from strata.engine.service.model_pool import ModelPool
from strata.engine.service.settings import ServeSettings
from strata.units import GIB, MIB

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from random_gguf import write_random_gguf

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

# About 1.1B parameters in f16: 2.2 GB of weights, clearly visible in NVML.
BIG = ModelConfig(model_type="llama", vocab_size=32000, hidden_size=2048,
                  intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                  num_key_value_heads=4, head_dim=64, max_position_embeddings=2048,
                  rope_theta=10000.0)


def engine_vram_bytes(pool: ModelPool, name: str) -> int:
    """What NVML says the model's engine process holds on the GPU."""
    pid = pool.member(name).service.status()["engine_pid"]
    return sum(p.used_bytes or 0 for p in gpu_processes() if p.pid == pid)


async def ask(pool: ModelPool, name: str) -> None:
    member = await pool.resolve(name)
    request = GenerationRequest((1, 2, 3, 4), SamplingSpec(max_tokens=4))
    events = [event async for event in member.generate(request)]
    assert not [e for e in events if hasattr(e, "code")], events


async def test_two_models_take_turns_under_a_budget_and_nvml_sees_the_vram_go(tmp_path):
    models_dir = tmp_path / "models"
    models_dir.mkdir()
    write_random_gguf(BIG, models_dir / "big.gguf")
    # The default model's shape in random weights: the GPU machines cannot fetch the real one.
    small = tmp_path / "small.gguf"
    write_random_gguf("smollm2-135m", small)
    settings = ServeSettings(model=str(small), device="cuda", context_tokens=1024,
                             slots=1, models_dir=str(models_dir), vram_budget_bytes=3 * GIB,
                             snapshot_dir=str(tmp_path / "snapshots"))
    pool = ModelPool(settings)
    await pool.start()
    try:
        default = pool.default_name
        held_before = engine_vram_bytes(pool, default)
        assert held_before > 100 * MIB
        await ask(pool, "big")  # ~3 GiB with its workspace: the default makes room
        rows = {row["name"]: row for row in pool.models()}
        assert rows["big"]["state"] in ("loaded", "session_offloaded")
        assert rows[default]["state"] in ("sleeping", "unloaded"), rows[default]
        # Its weights, KV and workspace left the GPU; a sleeping engine keeps its context.
        assert engine_vram_bytes(pool, default) < held_before - 100 * MIB
        await ask(pool, default)
        rows = {row["name"]: row for row in pool.models()}
        assert rows["big"]["state"] in ("sleeping", "unloaded"), rows["big"]
        assert rows[default]["state"] in ("loaded", "session_offloaded")
    finally:
        await pool.stop()
