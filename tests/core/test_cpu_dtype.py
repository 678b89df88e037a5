"""The compute dtype the engine picks: bf16 on GPUs; on the CPU float32 unless float32
weights would take more than half the RAM (issue 19, item 7; bench/diag_cpu_dtype.py)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from strata.engine.core import engine_setup as engine_module
from strata.engine.core.engine_setup import compute_dtype
from strata.engine.core.random_weights import parameter_bytes, random_weights_config


def test_cpu_keeps_float32_while_it_fits_in_half_the_ram(monkeypatch) -> None:
    config = random_weights_config("llama3-8b")
    float32_bytes = parameter_bytes(config, torch.float32)  # ~32 GB
    monkeypatch.setattr(engine_module.psutil, "virtual_memory",
                        lambda: SimpleNamespace(total=2 * float32_bytes + 1))
    assert compute_dtype(torch.device("cpu"), config) == torch.float32
    monkeypatch.setattr(engine_module.psutil, "virtual_memory",
                        lambda: SimpleNamespace(total=24 << 30))
    assert compute_dtype(torch.device("cpu"), config) == torch.bfloat16
    assert compute_dtype(torch.device("cuda"), config) == torch.bfloat16
    assert compute_dtype(torch.device("cpu"), random_weights_config("smollm2-135m")) \
        == torch.float32


def test_an_engine_on_a_small_cpu_runs_in_bf16(tmp_path, monkeypatch) -> None:
    """The whole CPU path in bf16 (weights, KV, snapshots' layout), as a model too large for
    float32 gets it, on a tiny model with the RAM made small."""
    from strata.engine.core.engine import Engine, EngineConfig
    from strata.engine.protocol import SamplingSpec
    from tests.helpers.tiny_models import make_tiny_hf_model

    path, _ = make_tiny_hf_model("qwen3", tmp_path)
    monkeypatch.setattr(engine_module.psutil, "virtual_memory",
                        lambda: SimpleNamespace(total=1 << 16))
    engine = Engine(EngineConfig(model_path=str(path), device="cpu", context_tokens=64,
                                 snapshot_ram_budget_bytes=1 << 20))
    info = engine.load()
    try:
        assert info["dtype"] == "bfloat16" and engine.kv_arena is not None
        assert engine.model.model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16
        spec = SamplingSpec(max_tokens=6, temperature=0.0)
        first = [t for step in engine.generate(list(range(3, 30)), spec) for t in step]
        again = [t for step in engine.generate(list(range(3, 30)), spec, slot=1) for t in step]
        assert len(first) == 6 and first == again
    finally:
        engine.close()
