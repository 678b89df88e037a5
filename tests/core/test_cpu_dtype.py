"""The compute dtype the engine picks: bf16 on GPUs; on the CPU float32 unless float32
weights would take more than half the RAM (issue 19, item 7; bench/diag_cpu_dtype.py)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from strata.engine.core import engine as engine_module
from strata.engine.core.engine import compute_dtype
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
