"""Helpers for the GPU tests (a uniquely named module: conftest is not importable)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from strata.engine.core.fast.side_stream import side_stream

MIB = 1 << 20
GIB = 1 << 30


def nvml_used_bytes() -> int:
    """Device-wide used VRAM from NVML after letting torch's cache go; fails if NVML is absent."""
    import torch

    from strata.engine.core.memory.vram import read_vram_info

    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    info = read_vram_info(0)
    assert info is not None, "NVML is not usable (pynvml / libnvidia-ml missing): cannot measure"
    return info.used_bytes


def wait_for_free_vram(min_free_bytes: int, timeout_s: float = 20.0) -> int:
    """Poll NVML until at least min_free_bytes are free (another process exiting); returns free."""
    from strata.engine.core.memory.vram import read_free_vram_bytes

    deadline = time.monotonic() + timeout_s
    while True:
        free_bytes = read_free_vram_bytes(0) or 0
        if free_bytes >= min_free_bytes or time.monotonic() > deadline:
            return free_bytes
        time.sleep(0.1)


def build_with_expert_cache(config, expert_cache: str):
    """(ModelMemory, model) of random bf16 weights on CUDA with that --expert-cache setting
    ("all", or a slot count for a partial cache); close the memory after."""
    import torch

    from strata.engine.core.memory.backend import backend_for
    from strata.engine.core.residency import ModelMemory
    from strata.engine.core.weight_source import RandomWeights

    backend = backend_for("cuda")
    memory = ModelMemory(backend, torch.bfloat16)
    model = memory.build(config, RandomWeights(backend.device, std=0.1), expert_cache)
    return memory, model


def captured(fn: Callable[[], Any]) -> tuple[torch.cuda.CUDAGraph, Any]:
    """(graph, what fn returned inside it): fn run once on a side stream, as torch asks
    before a capture, then captured. Callers run fn once before, outside, to compile and
    tune its kernels."""
    with side_stream():
        fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out
