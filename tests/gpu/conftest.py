"""GPU tests: every test marked `gpu` is skipped, with the reason, where CUDA is not usable."""

from __future__ import annotations

import pytest

from strata.engine.core.memory.backend import cuda_available


def pytest_collection_modifyitems(config, items):
    if cuda_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU with a working CUDA driver; none here")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def cuda_backend():
    """One CudaVmmBackend on device 0 for the whole session (it shares torch's context)."""
    from strata.engine.core.memory.cuda_vmm import CudaVmmBackend

    return CudaVmmBackend(device_index=0)


@pytest.fixture
def counted_paths(monkeypatch):
    """{"gemm": calls, "grouped": calls} of the two quantized prefill paths."""
    from strata.engine.core.quant import expert_gemm, expert_grouped

    calls = {"gemm": 0, "grouped": 0}
    for name, module in (("gemm", expert_gemm), ("grouped", expert_grouped)):
        def counted(*args, _name=name, _fn=module.experts_mlp, **kwargs):
            calls[_name] += 1
            return _fn(*args, **kwargs)
        monkeypatch.setattr(module, "experts_mlp", counted)
    return calls
