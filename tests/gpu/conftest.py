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
